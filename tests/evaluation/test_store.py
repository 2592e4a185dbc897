"""Stored attributions: what an evaluation reuses, what it recomputes, and what the report says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from limelight.cli import eval as eval_cli
from limelight.core.types import Encoded, FloatArray
from limelight.evaluation.runner import EvalConfig, Evaluator
from limelight.evaluation.store import FOLDER, AttributionStore, StoredExplainer, input_key
from tests.evaluation.conftest import TriggerSetup


class Counting:
    """An explainer that counts its calls; its answer depends on the text and the class."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, enc: Encoded, target: int) -> FloatArray:
        self.calls += 1
        ids = np.asarray(enc.input_ids, dtype=np.float32)
        return np.sin(ids * 0.37 + target).astype(np.float32) / 3.0


def _encoded(setup: TriggerSetup, n: int = 6) -> list[Encoded]:
    return [setup.model.encode(e.text) for e in setup.examples[:n]]


def _answers(explainer: StoredExplainer, encoded: list[Encoded]) -> list[tuple[FloatArray, float]]:
    return [explainer.timed(enc, i % 2) for i, enc in enumerate(encoded)]


def test_answers_are_kept_and_read_back_exactly(
    trigger_setup: TriggerSetup, tmp_path: Path
) -> None:
    encoded = _encoded(trigger_setup)
    store = AttributionStore(tmp_path, trigger_setup.model.version)
    first = Counting()
    stored = store.wrap("m", {"steps": 8}, first)
    computed = _answers(stored, encoded)
    assert first.calls == len(encoded) and stored.computed == len(encoded) and not stored.reused
    assert stored.summary("m") is None  # nothing reused: no note
    lines = stored.path.read_text().splitlines()
    assert len(lines) == 1 + len(encoded)  # a header with the key, then one line per text
    assert json.loads(lines[0])["key"]["params"] == {"steps": 8}

    # A later run (a new store on the same folder) reads every answer back, bit for bit, with
    # the time it took when it was computed.
    again = Counting()
    reread = AttributionStore(tmp_path, trigger_setup.model.version).wrap("m", {"steps": 8}, again)
    read = _answers(reread, encoded)
    assert again.calls == 0 and reread.reused == len(encoded)
    for (a, seconds_a), (b, seconds_b) in zip(computed, read, strict=True):
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
        assert seconds_a == seconds_b
    note = reread.summary("m")
    assert note is not None and f"{len(encoded)} of {len(encoded)}" in note

    # Another class of the same text is another attribution.
    other = reread.timed(encoded[0], 1)  # explained for class 0 above
    assert again.calls == 1
    np.testing.assert_array_equal(other[0], Counting()(encoded[0], 1))


def test_a_text_repeated_in_the_run_is_not_said_to_come_from_an_earlier_run(
    trigger_setup: TriggerSetup, tmp_path: Path
) -> None:
    # A dataset with one text twice (Rotten Tomatoes' test split has such duplicates).
    encoded = _encoded(trigger_setup, 3)
    texts = [*encoded, encoded[1]]
    counting = Counting()
    stored = AttributionStore(tmp_path, "v").wrap("m", {}, counting)
    answers = [stored.timed(enc, 0) for enc in texts]
    assert counting.calls == 3 and stored.computed == 3
    np.testing.assert_array_equal(answers[3][0], answers[1][0])
    assert answers[3][1] == answers[1][1]  # the first occurrence's time
    note = stored.summary("m")
    assert note is not None and "earlier run" not in note and str(stored.path) not in note
    assert note.startswith("m: 1 of 4 attribution") and "occurs again in this run" in note
    assert stored.repeated == 1 and stored.reused == 0

    # A later run reads all of them back: those, and only those, are an earlier run's.
    later = AttributionStore(tmp_path, "v").wrap("m", {}, Counting())
    for enc in [*texts, encoded[0]]:
        later.timed(enc, 0)
    note = later.summary("m")
    assert later.reused == 5 and later.repeated == 0
    assert note is not None and "5 of 5 attributions read from" in note
    assert "earlier run" in note and "occurs again" not in note

    # Both in one run: a new text computed, then met again, beside answers read back.
    mixed = AttributionStore(tmp_path, "v").wrap("m", {}, Counting())
    new = _encoded(trigger_setup, 4)[3]
    for enc in [encoded[0], new, new]:
        mixed.timed(enc, 0)
    assert (mixed.reused, mixed.computed, mixed.repeated) == (1, 1, 1)
    note = mixed.summary("m")
    assert note is not None
    assert "1 of 3 attributions read from" in note and "1 attribution of a text" in note


@pytest.mark.parametrize(
    "change",
    ["params", "model", "method"],
)
def test_a_different_key_recomputes(
    trigger_setup: TriggerSetup, tmp_path: Path, change: str
) -> None:
    encoded = _encoded(trigger_setup, 3)
    _answers(AttributionStore(tmp_path, "v1").wrap("m", {"steps": 8}, Counting()), encoded)
    counting = Counting()
    version, method, params = "v1", "m", {"steps": 8}
    if change == "params":
        params = {"steps": 16}
    elif change == "model":
        version = "v2"
    else:
        method = "n"
    stored = AttributionStore(tmp_path, version).wrap(method, params, counting)
    _answers(stored, encoded)
    assert counting.calls == len(encoded) and not stored.reused
    assert len(list(tmp_path.glob("*.jsonl"))) == 2


def test_other_token_ids_are_another_text(trigger_setup: TriggerSetup) -> None:
    enc = _encoded(trigger_setup, 1)[0]
    changed = Encoded(
        [*enc.input_ids[:-2], enc.input_ids[1], enc.input_ids[-1]],
        enc.token_type_ids,
        enc.tokens,
        enc.truncated,
    )
    assert input_key(enc, 0) != input_key(changed, 0)
    assert input_key(enc, 0) != input_key(enc, 1)
    assert input_key(enc, 0) == input_key(_encoded(trigger_setup, 1)[0], 0)


def test_an_interrupted_run_resumes(trigger_setup: TriggerSetup, tmp_path: Path) -> None:
    encoded = _encoded(trigger_setup)
    stored = AttributionStore(tmp_path, "v").wrap("m", {}, Counting())
    _answers(stored, encoded[:4])
    # The run is killed while writing its fifth line: half a line is left at the end.
    with stored.path.open("a") as handle:
        handle.write('{"input": "abc", "scores": [0.1, ')
    resumed = Counting()
    again = AttributionStore(tmp_path, "v").wrap("m", {}, resumed)
    _answers(again, encoded)
    assert again.reused == 4 and resumed.calls == len(encoded) - 4
    # The cut line was ended before the first new answer: that answer is not joined to it and
    # lost, and a third run recomputes nothing.
    third = Counting()
    last = AttributionStore(tmp_path, "v").wrap("m", {}, third)
    _answers(last, encoded)
    assert third.calls == 0 and last.reused == len(encoded)


def test_fresh_recomputes_and_replaces(trigger_setup: TriggerSetup, tmp_path: Path) -> None:
    encoded = _encoded(trigger_setup, 3)
    _answers(AttributionStore(tmp_path, "v").wrap("m", {}, Counting()), encoded)
    counting = Counting()
    fresh = AttributionStore(tmp_path, "v", reuse=False).wrap("m", {}, counting)
    _answers(fresh, encoded)
    assert counting.calls == len(encoded) and not fresh.reused
    assert len(fresh.path.read_text().splitlines()) == 1 + len(encoded)  # replaced, not appended


def test_the_evaluator_reports_the_recorded_times(
    trigger_setup: TriggerSetup, tmp_path: Path
) -> None:
    examples = trigger_setup.examples[:5]
    evaluator = Evaluator(trigger_setup.model, EvalConfig(fractions=(0.2, 0.4)))
    first = evaluator.evaluate_method(
        "m", AttributionStore(tmp_path, "v").wrap("m", {}, Counting()), examples
    )
    reread = AttributionStore(tmp_path, "v").wrap("m", {}, Counting())
    second = evaluator.evaluate_method("m", reread, examples)
    assert reread.reused == len(examples)
    assert second.seconds == first.seconds
    assert second.aopc_deletion_per_input == first.aopc_deletion_per_input
    assert second.aopc_sufficiency_per_input == first.aopc_sufficiency_per_input


def _run_eval(setup: TriggerSetup, out: Path, *extra: str) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="limelight")
    eval_cli.register(parser.add_subparsers())
    data = out.parent / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": e.text, "label": e.gold}) + "\n" for e in setup.examples[:8])
    )
    args = parser.parse_args(
        [
            "eval",
            "--model",
            str(setup.directory),
            "--data",
            str(data),
            "--methods",
            "normxlogit,grad_x_input",
            "--fractions",
            "0.2,0.4",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
    )
    assert args.func(args) == 0
    report: dict[str, object] = json.loads((out / "eval.json").read_text())
    return report


def test_eval_command_reuses_its_attributions(trigger_setup: TriggerSetup, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _run_eval(trigger_setup, out)
    files = list((out / FOLDER).glob("*.jsonl"))
    # Only the job method is stored: the inline one costs a forward pass.
    assert [f.name.split("-")[0] for f in files] == ["grad_x_input"]
    assert not any("read from" in n for n in first["notes"])  # type: ignore[attr-defined]

    second = _run_eval(trigger_setup, out)
    notes = [n for n in second["notes"] if "read from" in n]  # type: ignore[attr-defined]
    assert len(notes) == 1 and notes[0].startswith("grad_x_input: 8 of 8 attributions")
    methods = [{m["name"]: m for m in r["methods"]} for r in (first, second)]  # type: ignore[attr-defined]
    for key in ("aopc_deletion_per_input", "aopc_sufficiency_per_input", "seconds"):
        assert methods[0]["grad_x_input"][key] == methods[1]["grad_x_input"][key]

    third = _run_eval(trigger_setup, out, "--fresh")
    assert not any("read from" in n for n in third["notes"])  # type: ignore[attr-defined]
    per_input = [{m["name"]: m for m in r["methods"]} for r in (first, third)]  # type: ignore[attr-defined]
    assert (
        per_input[0]["grad_x_input"]["aopc_deletion_per_input"]
        == per_input[1]["grad_x_input"]["aopc_deletion_per_input"]
    )
