"""How faithfulness figures are written: the digits they need, never "-0.000", and a caveat
when the model hardly responds to masking."""

from __future__ import annotations

from pathlib import Path

import pytest

from limelight.evaluation.figures import FLAT_AOPC, decimals, flat_note, number, plus_minus
from limelight.evaluation.report import EvalReport, markdown
from limelight.evaluation.runner import EvalConfig, MethodResult


@pytest.mark.parametrize(
    ("values", "places"),
    [
        ([0.33, 0.02], 3),  # an ordinary table keeps its three decimals
        ([0.012, 0.0004], 3),
        ([0.0099, 0.0002], 4),  # under 0.01: two significant digits of the largest
        ([-5.84e-05, 2.4e-06], 6),
        ([1e-12], 8),  # at most eight
        ([0.0, None, float("nan")], 3),  # nothing measured: the default
    ],
)
def test_decimals_show_the_largest_figure_with_two_significant_digits(
    values: list[float | None], places: int
) -> None:
    assert decimals(values) == places


def test_a_negative_figure_that_rounds_to_zero_reads_as_zero() -> None:
    assert number(-0.00001) == "0.000"
    assert number(-0.00001, signed=True) == "+0.000"
    assert number(-0.0004, 4) == "-0.0004"
    assert plus_minus(0.25, None) == "0.250 ± 0.000"
    assert plus_minus(-0.05, 0.004, signed=True) == "-0.050 ± 0.004"


def test_the_flat_note_needs_every_method_under_the_threshold() -> None:
    assert flat_note([0.33, 0.005], (0.1, 0.5)) is None
    assert flat_note([], (0.1, 0.5)) is None
    note = flat_note([FLAT_AOPC / 2, -FLAT_AOPC / 3, None], (0.1, 0.2, 0.3))
    assert note is not None and "up to 30% of the tokens" in note


def _result(name: str, deletion: list[float], sufficiency: list[float]) -> MethodResult:
    n = len(deletion)
    mean_d, mean_s = sum(deletion) / n, sum(sufficiency) / n
    return MethodResult(
        name=name, n=n, aopc_deletion=mean_d, aopc_deletion_se=1e-6, aopc_sufficiency=mean_s,
        aopc_sufficiency_se=2e-6, aopc_deletion_per_input=deletion,
        aopc_sufficiency_per_input=sufficiency,
    )  # fmt: skip


def test_an_eval_table_of_a_model_that_hardly_responds_has_digits_and_a_note() -> None:
    """The report of `limelight eval` on an untrained model read "-0.000 ± 0.000" in every
    AOPC cell and every paired difference."""
    results = [
        _result("normxlogit", [-5.0e-5, -6.0e-5, -6.5e-5], [1.0e-5, 2.0e-5, 1.5e-5]),
        _result("distilled", [-4.0e-5, -4.5e-5, -3.5e-5], [0.5e-5, 1.0e-5, 0.5e-5]),
    ]
    text = markdown(EvalReport(model="m", dataset="d", config=EvalConfig(), results=results))
    assert "| normxlogit | -0.000058 ± 0.000001 | 0.000015 ± 0.000002 |" in text
    assert "| distilled | -0.000018 ± 0.000006 | +0.0000083 ± 0.0000017 |" in text  # paired
    assert "-0.000 ±" not in text
    assert "every method's deletion AOPC is under 0.01" in text


def test_an_ordinary_eval_table_is_written_as_before() -> None:
    results = [
        _result("normxlogit", [0.30, 0.36], [0.09, 0.08]),
        _result("random", [0.10, 0.16], [0.20, 0.30]),
    ]
    text = markdown(EvalReport(model="m", dataset="d", config=EvalConfig(), results=results))
    assert "| normxlogit | 0.330 ± 0.000 | 0.085 ± 0.000 |" in text
    assert "| random | +0.200 ± 0.000 | -0.165 ± 0.055 |" in text
    assert "hardly moves" not in text


def test_a_plot_without_any_evaluated_method_has_no_empty_legend(tmp_path: Path) -> None:
    """Every method skipped: matplotlib warned "No artists with labels found to put in
    legend" on the command's stderr."""
    import warnings

    from limelight.evaluation.report import plot

    skipped = MethodResult(name="decoded_gradcam", status="skipped", reason="no LM head")
    report = EvalReport(model="m", dataset="d", config=EvalConfig(), results=[skipped])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot(report, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 0
