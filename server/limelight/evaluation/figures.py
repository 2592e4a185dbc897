"""How faithfulness figures are written in reports: to as many decimals as they need, and with a
caveat where the model hardly responds to the perturbation.

Three decimals suit a model whose class probability falls by tenths when its top tokens are
masked. An untrained model, or one so sure that masking half of a text leaves its probability
near 1, moves it by thousandths or less: at three decimals every method reads "0.000 ± 0.000"
and the table says nothing, not even that the run measured anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

#: Below this deletion AOPC for every method, the model's probability hardly moves when its
#: tokens are masked, and the report says so.
FLAT_AOPC = 0.01


def decimals(values: Iterable[float | None], least: int = 3, most: int = 8) -> int:
    """Decimal places for a column of figures: ``least``, or more where its largest magnitude is
    under 10^-(least - 1), so that it shows two significant digits (at most ``most``)."""
    sizes = [abs(v) for v in values if v is not None and math.isfinite(v) and v != 0.0]
    if not sizes:
        return least
    wanted = 1 - math.floor(math.log10(max(sizes)))
    return min(most, max(least, wanted))


def number(value: float, places: int = 3, signed: bool = False) -> str:
    """``value`` to ``places`` decimals, never as "-0.000" (a negative value that rounds to
    zero reads as zero)."""
    rounded = round(value, places) + 0.0  # -0.0 + 0.0 is 0.0
    return f"{rounded:+.{places}f}" if signed else f"{rounded:.{places}f}"


def plus_minus(value: float, se: float | None, places: int = 3, signed: bool = False) -> str:
    """``value ± se``, both to ``places`` decimals."""
    return f"{number(value, places, signed)} ± {number(se or 0.0, places)}"


def flat_note(deletion_aopcs: Iterable[float | None], fractions: Iterable[float]) -> str | None:
    """The report's caveat when every method's deletion AOPC is under :data:`FLAT_AOPC`, else
    None."""
    found = [v for v in deletion_aopcs if v is not None and math.isfinite(v)]
    if not found or max(abs(v) for v in found) >= FLAT_AOPC:
        return None
    most = max(fractions, default=0.5)
    return (
        f"every method's deletion AOPC is under {FLAT_AOPC:g}: the explained class's probability "
        f"hardly moves when up to {most:.0%} of the tokens are masked (an untrained model, or "
        "one so sure of its answer that the probability stays near 1), so the figures are "
        "written to more decimals and separate the methods little; compare them with their "
        "standard errors"
    )
