"""`limelight eval` end to end on the trigger model and a JSONL file with evidence."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from limelight.cli import eval as eval_cli
from limelight.cli.eval import parse_label_map, parse_params
from limelight.errors import InvalidArgument
from tests.evaluation.conftest import TriggerSetup


def test_parse_params_and_label_map() -> None:
    assert parse_params(["integrated_gradients.steps=8", "lrp.use_mask=false", "x.s=abc"]) == {
        "integrated_gradients": {"steps": 8},
        "lrp": {"use_mask": False},
        "x": {"s": "abc"},
    }
    assert parse_label_map("negative=neg, neutral=none") == {"negative": "neg", "neutral": "none"}
    with pytest.raises(InvalidArgument, match=r"METHOD\.KEY=VALUE"):
        parse_params(["steps=8"])


def test_eval_command_writes_table_json_and_plot(
    trigger_setup: TriggerSetup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data.jsonl"
    with data.open("w", encoding="utf-8") as handle:
        for ex in trigger_setup.examples[:12]:
            assert ex.evidence is not None
            record = {"text": ex.text, "label": ex.gold, "evidence": [list(ex.evidence[0])]}
            handle.write(json.dumps(record) + "\n")
    out = tmp_path / "out"
    # the command's own parser: independent of the other commands' modules
    parser = argparse.ArgumentParser(prog="limelight")
    eval_cli.register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "eval",
            "--model",
            str(trigger_setup.directory),
            "--data",
            str(data),
            "--methods",
            "normxlogit,grad_x_input,decoded_gradcam,random",
            "--n",
            "8",
            "--fractions",
            "0.2,0.4",
            "--game-steps",
            "4",
            "--params",
            "random.seed=5",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    # decoded_gradcam was named but the model has no LM head: the report is written, and the
    # status says that the run is not complete.
    assert args.func(args) == 1
    report = json.loads((out / "eval.json").read_text())
    methods = {m["name"]: m for m in report["methods"]}
    assert methods["decoded_gradcam"]["status"] == "skipped"
    assert "LM head" in methods["decoded_gradcam"]["reason"]
    assert report["accuracy"] == 1.0
    for name in ("normxlogit", "grad_x_input", "random"):
        m = methods[name]
        assert m["status"] == "ok", m["reason"]
        assert m["n"] == 8 and m["n_gold"] == 8 and m["n_evidence"] == 8
        assert len(m["deletion_curve"]) == 2 and len(m["hide_accuracy"]) == 5
        assert m["hide_accuracy"][0] == 1.0  # nothing hidden: the model's accuracy
        assert 0.0 <= m["evidence_ap"] <= 1.0
        assert len(m["seconds"]) == 8
    assert report["config"]["game_fractions"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    table = (out / "eval.md").read_text()
    assert "| normxlogit |" in table and "decoded_gradcam" in table
    assert (out / "eval.png").stat().st_size > 10_000
    captured = capsys.readouterr()
    assert "wrote" in captured.out
    assert captured.err.strip().endswith(  # this parser has no command name
        f"error: not evaluated: decoded_gradcam (skipped); the reasons are in {out / 'eval.md'}"
    )


def test_eval_fails_when_every_named_method_was_skipped(
    trigger_setup: TriggerSetup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--methods decoded_gradcam` on a model without an LM head evaluated nothing, and the
    command exited 0."""
    from limelight.cli.main import main

    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": e.text}) + "\n" for e in trigger_setup.examples[:3])
    )
    out = tmp_path / "out"
    model = ["--model", str(trigger_setup.directory), "--data", str(data), "--n", "0"]
    status = main(["eval", *model, "--methods", "decoded_gradcam", "--out", str(out)])
    assert status == 1
    assert (out / "eval.json").is_file() and (out / "eval.md").is_file()
    err = capsys.readouterr().err
    assert "limelight eval: error: not evaluated: decoded_gradcam (skipped)" in err, err


def test_a_missing_lm_head_folder_stops_eval_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from limelight.cli.main import main

    missing = tmp_path / "no-model-here"  # loading it would fail with another message
    head = tmp_path / "nonexistent"
    argv = ["eval", "--model", str(missing), "--methods", "decoded_gradcam", "--lm-head", str(head)]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"limelight eval: error: --lm-head {head}: no such directory", err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--methods", "normxlogit,nosuch"], "--methods: unknown 'nosuch' (known: "),
        (["--methods", " , "], "--methods: give at least one method"),
        (
            ["--methods", "normxlogit", "--params", "integrated_gradients.steps=8"],
            "--params for 'integrated_gradients', which --methods does not evaluate",
        ),
        (["--params", "steps=8"], "--params expects METHOD.KEY=VALUE"),
    ],
)
def test_eval_refuses_unknown_methods_before_the_model_loads(
    flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from limelight.cli.main import main

    # No model is at --model: a command that got as far as loading one would say so instead.
    missing = tmp_path / "no-model-here"
    assert main(["eval", "--model", str(missing), *flags, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("limelight eval: error: ") and said in err, err
    assert not (tmp_path / "o").exists()


def test_an_unwritable_out_folder_stops_eval_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from limelight.cli.main import main

    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    out = blocker / "results"  # a folder cannot be made under a file
    missing = tmp_path / "no-model-here"  # loading it would fail with another message
    status = main(["eval", "--model", str(missing), "--methods", "normxlogit", "--out", str(out)])
    assert status == 2  # a path that names a file: an argument error, as a bad --data is
    err = capsys.readouterr().err
    assert f"limelight eval: error: --out {out}: {blocker} is a file, not a directory" in err, err


def test_a_multi_label_run_records_its_thresholds_and_no_gold_label_notes(
    bert_tiny_multilabel_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thresholds in force decide which (text, label) items are evaluated: eval.json's
    config and eval.md say them. The demo's own data (drugsCom) is not said to have gold labels
    that need --label-map: a multi-label run uses none."""
    from limelight.cli.main import main
    from limelight.evaluation.report import load

    monkeypatch.setenv("LIMELIGHT_LABEL_THRESHOLDS", '{"negative": 0.3}')
    cache = str(bert_tiny_multilabel_dir.parent.parent)
    out = tmp_path / "out"
    demo = ["--demo", "bert-tiny-multilabel", "--cache-dir", cache, "--methods", "random"]
    quick = ["--n", "4", "--fractions", "0.5", "--game-steps", "2", "--no-progress"]
    assert main(["eval", *demo, *quick, "--out", str(out)]) == 0
    capsys.readouterr()
    thresholds = {"negative": 0.3, "side_effects": 0.5, "mental_health": 0.5, "birth_control": 0.5}
    report = json.loads((out / "eval.json").read_text())
    assert report["config"]["label_thresholds"] == thresholds
    assert load(out / "eval.json").config.label_thresholds == thresholds
    table = (out / "eval.md").read_text()
    assert "Label thresholds in force" in table and "negative 0.3, side_effects 0.5" in table
    assert not any("gold label" in note for note in report["notes"])
    assert "--label-map" not in table


def test_a_multi_label_text_agrees_with_each_of_its_labels_when_untouched(
    bert_tiny_multilabel_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The games measure agreement with the model's own prediction: with nothing hidden, or
    everything revealed, that is every item's. A text with several labels is one item per label,
    and the arg-max is only one of them (the other items read as disagreeing: 0.667)."""
    from limelight.cli.main import main

    cache = str(bert_tiny_multilabel_dir.parent.parent)
    out = tmp_path / "out"
    demo = ["--demo", "bert-tiny-multilabel", "--cache-dir", cache, "--methods", "random"]
    quick = ["--n", "8", "--fractions", "0.5", "--game-steps", "2", "--no-progress"]
    assert main(["eval", *demo, *quick, "--out", str(out)]) == 0
    capsys.readouterr()
    report = json.loads((out / "eval.json").read_text())
    assert report["config"]["game_fractions"][0] == 0.0
    assert report["config"]["game_fractions"][-1] == 1.0
    (method,) = (
        report["methods"] if isinstance(report["methods"], list) else report["methods"].values()
    )
    assert method["n"] > 8, "the sample has texts with several labels"
    assert method["hide_agreement"][0] == 1.0
    assert method["reveal_agreement"][-1] == 1.0


@pytest.mark.parametrize("limit", [1, 2])
def test_a_token_limit_without_room_for_text_is_refused_as_the_sidecar_refuses_it(
    limit: int, trigger_setup: TriggerSetup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--max-tokens 2` evaluated "[CLS] [SEP]" alone (every figure 0); 1 was ignored."""
    from limelight.cli.main import main

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": trigger_setup.examples[0].text}) + "\n")
    model = ["--model", str(trigger_setup.directory), "--data", str(data)]
    argv = ["eval", *model, "--methods", "random", "--max-tokens", str(limit)]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert (
        f"limelight eval: error: max_tokens {limit} leaves no room for text: the model adds 2 "
        "special tokens to a text and 3 to a text pair; set it to at least 5"
    ) in err, err
    assert not (tmp_path / "o" / "eval.json").exists()
