"""Pool several `limelight eval` runs of one model on one dataset into one report.

A standard error shrinks with the square root of the inputs, and one run of LIME or SHAP over
hundreds of inputs takes hours, so a claim like "the head is 0.01 above SHAP" is built from
several runs with different sampling seeds. Their samples overlap; pooling counts every input
once. Only what a run keeps per input can be pooled — deletion and sufficiency AOPC — so the
pooled report carries those, per method and as paired differences, not the games or overlaps.

An input is identified by its position in the dataset (``inputs`` in ``eval.json``; runs
written before that field existed are mapped back through the sampling seed that their notes
record). An input measured by several runs contributes the mean of its measurements: a
deterministic method gives the same number each time (a difference means the runs did not
measure the same thing, e.g. two builds of a head, and is reported), a sampling method
(LIME, SHAP's sampler, random) gives independent draws.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from limelight.errors import InvalidArgument
from limelight.evaluation.figures import decimals, flat_note, plus_minus
from limelight.evaluation.runner import paired_difference

#: Numbers the runs must agree on to be pooled (what was measured and how).
_SAME = ("fractions", "replace", "max_tokens")
#: Two measurements of one input by one method further apart than this are reported.
DISAGREEMENT = 1e-6

_DATASET = re.compile(r"^(?P<name>.*), (?P<n>\d+) of (?P<total>\d+)$")
_SAMPLED = re.compile(r"^(?P<n>\d+) of (?P<total>\d+) examples sampled with seed (?P<seed>-?\d+)$")

InputKey = tuple[int, int | None]
"""(position in the dataset, explained class; the class only for multi-label items)."""


@dataclass
class RunInputs:
    """One run as the pool reads it."""

    path: Path
    model: str
    dataset: str
    """The dataset's name without the sample size, e.g. ``rotten_tomatoes (test)``."""
    config: dict[str, Any]
    keys: list[InputKey]
    methods: dict[str, tuple[list[float], list[float]]]
    """Method -> (deletion, sufficiency) per input, in the order of ``keys``."""


@dataclass
class PooledMethod:
    name: str
    n: int
    aopc_deletion: float
    aopc_deletion_se: float
    aopc_sufficiency: float
    aopc_sufficiency_se: float
    repeated: int = 0
    """Inputs this method measured more than once (their measurements averaged)."""
    disagreeing: int = 0
    """Of those, inputs whose measurements differ."""
    largest_disagreement: float = 0.0
    """Largest difference between two measurements of one input's deletion AOPC."""


@dataclass
class Paired:
    reference: str
    other: str
    n: int
    deletion: float
    deletion_se: float
    sufficiency: float
    sufficiency_se: float


@dataclass
class PooledReport:
    model: str
    dataset: str
    config: dict[str, Any]
    runs: list[str]
    inputs: int
    """Distinct inputs over all runs."""
    methods: list[PooledMethod]
    paired: list[Paired]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # every field, the methods and pairs as dicts

    def markdown(self) -> str:
        lines = [
            f"**Model** `{self.model}` · **data** {self.dataset} · "
            f"**replacement** {self.config.get('replace')} · **{self.inputs} distinct inputs** "
            f"from {len(self.runs)} runs",
            "",
            "| method | inputs | AOPC deletion ↑ | AOPC sufficiency ↓ | measured twice or more "
            "(of them differing) |",
            "|---|---|---|---|---|",
        ]
        deletion = decimals(x for m in self.methods for x in (m.aopc_deletion, m.aopc_deletion_se))
        sufficiency = decimals(
            x for m in self.methods for x in (m.aopc_sufficiency, m.aopc_sufficiency_se)
        )
        for m in self.methods:
            lines.append(
                f"| {m.name} | {m.n} | {plus_minus(m.aopc_deletion, m.aopc_deletion_se, deletion)} "
                f"| {plus_minus(m.aopc_sufficiency, m.aopc_sufficiency_se, sufficiency, True)} "
                f"| {m.repeated} ({m.disagreeing}) |"
            )
        if self.paired:
            lines += [
                "",
                f"Paired differences, `{self.paired[0].reference}` minus each method, over the "
                "inputs both measured (± standard error of the difference):",
                "",
                "| method | inputs | Δ AOPC deletion | Δ AOPC sufficiency |",
                "|---|---|---|---|",
            ]
            d_places = decimals(x for p in self.paired for x in (p.deletion, p.deletion_se))
            s_places = decimals(x for p in self.paired for x in (p.sufficiency, p.sufficiency_se))
            lines += [
                f"| {p.other} | {p.n} | {plus_minus(p.deletion, p.deletion_se, d_places, True)} "
                f"| {plus_minus(p.sufficiency, p.sufficiency_se, s_places, True)} |"
                for p in self.paired
            ]
        lines += ["", "Runs:", *[f"- {r}" for r in self.runs]]
        notes = list(self.notes)
        flat = flat_note((m.aopc_deletion for m in self.methods), self.config.get("fractions", ()))
        if flat:
            notes.append(flat)
        if notes:
            lines += ["", "Notes:", *[f"- {note}" for note in notes]]
        return "\n".join(lines) + "\n"


def eval_json(path: Path) -> Path:
    """The ``eval.json`` of a run given as its ``--out`` folder or as the file itself."""
    return path / "eval.json" if path.is_dir() else path


def _legacy_keys(raw: Mapping[str, Any], where: Path) -> list[InputKey]:
    """Positions of a run written before ``inputs``: re-drawn from its recorded sampling."""
    found = _DATASET.match(str(raw.get("dataset", "")))
    if found is None:
        raise InvalidArgument(f"{where}: no per-input positions and no sample size recorded")
    n, total = int(found["n"]), int(found["total"])
    if any("multi-label" in str(note) for note in raw.get("notes", [])):
        raise InvalidArgument(
            f"{where}: a multi-label run written before eval.json recorded its inputs; "
            "re-run it with this version to pool it"
        )
    if n == total:
        return [(i, None) for i in range(total)]
    for note in raw.get("notes", []):
        sampled = _SAMPLED.match(str(note))
        if sampled is not None and int(sampled["n"]) == n and int(sampled["total"]) == total:
            # load_examples draws random.Random(seed).sample(rows, n); sample() picks by
            # position, so the same draw over range(total) gives the rows' positions.
            return [(i, None) for i in random.Random(int(sampled["seed"])).sample(range(total), n)]
    raise InvalidArgument(f"{where}: {n} of {total} inputs, but no sampling seed recorded")


def read_run(path: Path) -> RunInputs:
    """One ``eval.json`` (or the folder holding it) as the pool reads it."""
    file = eval_json(Path(path))
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidArgument(
            f"{file}: no such file (an --out folder of `limelight eval`?)"
        ) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{file}: not JSON ({exc})") from None
    if "inputs" in raw:
        keys: list[InputKey] = [(int(i["index"]), i.get("target")) for i in raw["inputs"]]
    else:
        keys = _legacy_keys(raw, file)
    found = _DATASET.match(str(raw.get("dataset", "")))
    dataset = found["name"] if found else str(raw.get("dataset", ""))
    methods: dict[str, tuple[list[float], list[float]]] = {}
    for m in raw.get("methods", []):
        if m.get("status") != "ok":
            continue
        deletion = list(m.get("aopc_deletion_per_input") or [])
        sufficiency = list(m.get("aopc_sufficiency_per_input") or [])
        if len(deletion) != len(keys) or len(sufficiency) != len(keys):
            raise InvalidArgument(
                f"{file}: {m['name']} has {len(deletion)} per-input figures for {len(keys)} inputs"
            )
        methods[m["name"]] = (deletion, sufficiency)
    config = {k: raw.get("config", {}).get(k) for k in _SAME}
    return RunInputs(file, str(raw.get("model", "")), dataset, config, keys, methods)


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def pool(runs: Sequence[RunInputs], reference: str | None = None) -> PooledReport:
    """Every input once, every method's AOPC over its inputs, and paired differences of
    ``reference`` (default: the first run's first method) against every other method."""
    if not runs:
        raise InvalidArgument("nothing to pool: name at least one run")
    first = runs[0]
    for run in runs[1:]:
        for what, a, b in (
            ("model", first.model, run.model),
            ("dataset", first.dataset, run.dataset),
            ("configuration", first.config, run.config),
        ):
            if a != b:
                raise InvalidArgument(
                    f"{run.path} measured another {what} than {first.path} ({b!r} against {a!r})"
                )
    # method -> input -> [(deletion, sufficiency), ...]
    seen: dict[str, dict[InputKey, list[tuple[float, float]]]] = {}
    order: list[str] = []
    for run in runs:
        for name, (deletion, sufficiency) in run.methods.items():
            if name not in seen:
                seen[name] = {}
                order.append(name)
            for key, d, s in zip(run.keys, deletion, sufficiency, strict=True):
                seen[name].setdefault(key, []).append((d, s))
    if not order:
        raise InvalidArgument("none of the runs has a method that finished")
    reference = reference or order[0]
    if reference not in seen:
        raise InvalidArgument(f"no run measured {reference!r} (measured: {', '.join(order)})")
    per_input: dict[str, dict[InputKey, tuple[float, float]]] = {}
    methods = []
    for name in order:
        values = seen[name]
        averaged = {
            key: (sum(d for d, _ in v) / len(v), sum(s for _, s in v) / len(v))
            for key, v in values.items()
        }
        per_input[name] = averaged
        spreads = [
            max(d for d, _ in v) - min(d for d, _ in v) for v in values.values() if len(v) > 1
        ]
        d_mean, d_se = _mean_se([d for d, _ in averaged.values()])
        s_mean, s_se = _mean_se([s for _, s in averaged.values()])
        methods.append(
            PooledMethod(
                name=name,
                n=len(averaged),
                aopc_deletion=d_mean,
                aopc_deletion_se=d_se,
                aopc_sufficiency=s_mean,
                aopc_sufficiency_se=s_se,
                repeated=len(spreads),
                disagreeing=sum(spread > DISAGREEMENT for spread in spreads),
                largest_disagreement=max(spreads, default=0.0),
            )
        )
    paired = []
    ref = per_input[reference]
    for name in order:
        if name == reference:
            continue
        common = [key for key in ref if key in per_input[name]]
        if not common:
            continue
        other = per_input[name]
        d, d_se = paired_difference([ref[k][0] for k in common], [other[k][0] for k in common])
        s, s_se = paired_difference([ref[k][1] for k in common], [other[k][1] for k in common])
        paired.append(Paired(reference, name, len(common), d, d_se, s, s_se))
    distinct = {key for values in seen.values() for key in values}
    notes = [
        "an input measured by several runs counts once, with the mean of its measurements",
    ]
    for m in methods:
        if m.disagreeing:
            notes.append(
                f"{m.name}: {m.disagreeing} of {m.repeated} inputs measured more than once "
                f"differ (deletion by up to {m.largest_disagreement:.3f}) — expected for a "
                "sampling method; for a deterministic one the runs measured different things "
                "(another build or other parameters)"
            )
    return PooledReport(
        model=first.model,
        dataset=first.dataset,
        config=first.config,
        runs=[str(r.path) for r in runs],
        inputs=len(distinct),
        methods=methods,
        paired=paired,
        notes=notes,
    )


def write(report: PooledReport, out: Path, stem: str = "pooled") -> dict[str, Path]:
    """Write ``<stem>.md`` and ``<stem>.json`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / f"{stem}.md", "json": out / f"{stem}.json"}
    paths["markdown"].write_text(report.markdown(), encoding="utf-8")
    paths["json"].write_text(json.dumps(report.to_json(), indent=2), encoding="utf-8")
    return paths
