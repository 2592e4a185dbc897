"""`limelight eval-pool`: runs pooled per input, against figures computed here directly."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from limelight.cli.main import main
from limelight.errors import InvalidArgument
from limelight.evaluation.data import load_examples
from limelight.evaluation.pool import pool, read_run
from tests.evaluation.conftest import TriggerSetup

CONFIG = {"fractions": [0.1, 0.2], "replace": "mask", "max_tokens": 64}


def _run(
    path: Path, indices: list[int], methods: dict[str, list[tuple[float, float]]], **extra: Any
) -> Path:
    raw: dict[str, Any] = {
        "model": "m",
        "dataset": f"d (test), {len(indices)} of 50",
        "config": CONFIG,
        "inputs": [{"index": i, "target": None} for i in indices],
        "methods": [
            {
                "name": name,
                "status": "ok",
                "aopc_deletion_per_input": [d for d, _ in values],
                "aopc_sufficiency_per_input": [s for _, s in values],
            }
            for name, values in methods.items()
        ],
    }
    raw.update(extra)
    path.mkdir(parents=True)
    (path / "eval.json").write_text(json.dumps(raw), encoding="utf-8")
    return path


def _mean_se(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def test_every_input_counts_once_with_the_mean_of_its_measurements(tmp_path: Path) -> None:
    rng = random.Random(1)
    head = {i: (rng.random(), rng.random() - 0.5) for i in range(50)}
    a_idx, b_idx = [0, 1, 2, 3, 4, 5], [4, 5, 6, 7]
    # "lime" samples: the two runs measure inputs 4 and 5 differently
    lime_a = {i: (rng.random(), rng.random()) for i in a_idx}
    lime_b = {i: (rng.random(), rng.random()) for i in b_idx}
    a = _run(
        tmp_path / "a",
        a_idx,
        {"head": [head[i] for i in a_idx], "lime": [lime_a[i] for i in a_idx]},
    )
    b = _run(
        tmp_path / "b",
        b_idx,
        {
            "lime": [lime_b[i] for i in b_idx],
            "head": [head[i] for i in b_idx],
            "ig": [(0.1, 0.2)] * 4,
        },
    )
    report = pool([read_run(a), read_run(b / "eval.json")])
    assert report.inputs == 8
    methods = {m.name: m for m in report.methods}
    assert [m.name for m in report.methods] == ["head", "lime", "ig"]
    union = sorted(set(a_idx) | set(b_idx))
    mean, se = _mean_se([head[i][0] for i in union])
    assert methods["head"].n == 8
    assert methods["head"].aopc_deletion == pytest.approx(mean)
    assert methods["head"].aopc_deletion_se == pytest.approx(se)
    assert (methods["head"].repeated, methods["head"].disagreeing) == (2, 0)
    lime: dict[int, tuple[float, float]] = {**lime_b, **lime_a}
    for i in (4, 5):
        lime[i] = ((lime_a[i][0] + lime_b[i][0]) / 2, (lime_a[i][1] + lime_b[i][1]) / 2)
    assert methods["lime"].aopc_sufficiency == pytest.approx(
        sum(lime[i][1] for i in union) / len(union)
    )
    assert (methods["lime"].repeated, methods["lime"].disagreeing) == (2, 2)
    assert methods["lime"].largest_disagreement == pytest.approx(
        max(abs(lime_a[i][0] - lime_b[i][0]) for i in (4, 5))
    )
    paired = {p.other: p for p in report.paired}
    diffs = [head[i][0] - lime[i][0] for i in union]
    assert paired["lime"].n == 8
    assert paired["lime"].deletion == pytest.approx(_mean_se(diffs)[0])
    assert paired["lime"].deletion_se == pytest.approx(_mean_se(diffs)[1])
    assert paired["ig"].n == 4  # only the inputs both measured
    assert "lime: 2 of 2 inputs" in report.markdown()
    assert {p.other for p in pool([read_run(a), read_run(b)], reference="lime").paired} == {
        "head",
        "ig",
    }


def test_runs_of_other_models_settings_or_methods_are_refused(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", [0, 1], {"head": [(0.1, 0.0), (0.2, 0.0)]})
    other = _run(
        tmp_path / "b",
        [2, 3],
        {"head": [(0.1, 0.0), (0.2, 0.0)]},
        config={**CONFIG, "replace": "delete"},
    )
    with pytest.raises(InvalidArgument, match="configuration"):
        pool([read_run(a), read_run(other)])
    with pytest.raises(InvalidArgument, match="no run measured 'shap'"):
        pool([read_run(a)], reference="shap")
    with pytest.raises(InvalidArgument, match="no such file"):
        read_run(tmp_path / "missing")
    broken = _run(tmp_path / "c", [0, 1, 2], {"head": [(0.1, 0.0), (0.2, 0.0)]})
    with pytest.raises(InvalidArgument, match="2 per-input figures for 3 inputs"):
        read_run(broken)


def test_the_same_run_given_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given twice (as its folder and as its eval.json), a run would agree with itself on
    every input: "measured twice or more (of them differing)" would read as reproduced."""
    a = _run(tmp_path / "a", [0, 1], {"head": [(0.1, 0.0), (0.2, 0.0)]})
    assert main(["eval-pool", str(a), str(a / "eval.json")]) == 2
    err = capsys.readouterr().err
    assert f"limelight eval-pool: error: {a / 'eval.json'} and {a} are the same run" in err


def test_a_run_without_recorded_inputs_is_mapped_through_its_sampling_seed(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"review {i}", "label": i % 2}) + "\n" for i in range(40)),
        encoding="utf-8",
    )
    loaded = load_examples(str(data), ["neg", "pos"], n=7, seed=3)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "eval.json").write_text(
        json.dumps(
            {
                "model": "m",
                "dataset": f"{loaded.name}, 7 of 40",
                "config": CONFIG,
                "notes": loaded.notes,
                "methods": [
                    {
                        "name": "head",
                        "status": "ok",
                        "aopc_deletion_per_input": [0.0] * 7,
                        "aopc_sufficiency_per_input": [0.0] * 7,
                    }
                ],
            }
        ),
        encoding="utf-8",
    )
    assert read_run(legacy).keys == [(e.source_index, None) for e in loaded.examples]
    assert [e.text for e in loaded.examples] == [
        f"review {e.source_index}" for e in loaded.examples
    ]


def test_eval_then_eval_pool_end_to_end(
    trigger_setup: TriggerSetup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": ex.text, "label": ex.gold}) + "\n"
            for ex in trigger_setup.examples[:16]
        ),
        encoding="utf-8",
    )
    runs = []
    for seed in (0, 1):
        out = tmp_path / f"seed{seed}"
        options = f"--methods normxlogit,random --n 10 --seed {seed} --fractions 0.2,0.4"
        model = ["--model", str(trigger_setup.directory), "--data", str(data)]
        code = main(["eval", *model, *options.split(), "--out", str(out), "--no-progress"])
        assert code == 0
        runs.append(json.loads((out / "eval.json").read_text()))
    capsys.readouterr()
    assert (
        main(
            [
                "eval-pool",
                str(tmp_path / "seed0"),
                str(tmp_path / "seed1"),
                "--out",
                str(tmp_path / "pooled"),
            ]
        )
        == 0
    )
    assert "distinct inputs" in capsys.readouterr().out
    pooled = json.loads((tmp_path / "pooled" / "pooled.json").read_text())
    # the two runs' own records of which inputs they drew
    per_input: dict[int, list[float]] = {}
    for raw in runs:
        normx = next(m for m in raw["methods"] if m["name"] == "normxlogit")
        for item, value in zip(raw["inputs"], normx["aopc_deletion_per_input"], strict=True):
            per_input.setdefault(item["index"], []).append(value)
    assert len(per_input) < 20  # the samples overlap
    assert pooled["inputs"] == len(per_input)
    normx = next(m for m in pooled["methods"] if m["name"] == "normxlogit")
    assert normx["n"] == len(per_input)
    assert normx["disagreeing"] == 0  # a deterministic method measures an input the same twice
    assert normx["aopc_deletion"] == pytest.approx(
        sum(sum(v) / len(v) for v in per_input.values()) / len(per_input)
    )
    assert pooled["paired"][0]["reference"] == "normxlogit"
    assert pooled["paired"][0]["other"] == "random"
