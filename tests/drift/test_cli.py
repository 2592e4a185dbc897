"""`limelight drift-reference build` and the `limelight drift` table and plot."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from limelight.cli.drift import drift_figure, format_report, plot_report
from limelight.cli.main import main
from limelight.drift import DriftMonitor, ReferenceFile
from limelight.drift.build import explain_texts, profile_of
from limelight.models.lexicon_table import cached_lexicon_dir
from limelight.models.loaded import load_model
from limelight.settings import Settings


def synthetic_report() -> object:
    settings = Settings(
        drift_bootstrap_n=100, drift_window=100, drift_sketch_size=32, drift_min_count=1
    )
    monitor = DriftMonitor(settings, ["rotten", "fresh"], None)
    rng = random.Random(0)
    words = ["film", "plot", "actors", "the", "story"]
    for i in range(200):
        tokens = rng.choices(words, k=5)
        scores = [1.0] * 5
        if i >= 100 and i % 2:
            tokens.append("brilliant")
            scores.append(5.0)
        monitor.observe(["rotten", "fresh"][i % 2], tokens, scores)
    return monitor.report(top_k=3)


def test_table_names_labels_alerts_and_shares() -> None:
    text = format_report(synthetic_report())
    lines = text.splitlines()
    assert lines[0].startswith("reference: ready (100 explanations)")
    fresh = next(line for line in lines if line.startswith("fresh "))
    assert "ALERT" in fresh
    rotten = next(line for line in lines if line.startswith("rotten "))
    assert " ok " in rotten + " "
    riser = next(line for line in lines if line.strip().startswith("brilliant"))
    assert " 0.00% -> 50.00%" in riser  # half the positive mass of every "fresh" text


def test_an_empty_window_prints_no_divergence() -> None:
    """Building (or a label no recent answer was predicted as): nothing to compare, so no
    JSD of 0 and no "ok" that reads as healthy."""
    settings = Settings(
        drift_bootstrap_n=10, drift_window=100, drift_sketch_size=32, drift_min_count=1
    )
    monitor = DriftMonitor(settings, ["rotten", "fresh"], None)
    monitor.observe("fresh", ["a", "gorgeous", "film"], [0.1, 2.0, 0.3])
    first = format_report(monitor.report(top_k=3)).splitlines()[0]
    # how far along the reference is, and that nothing is compared before it is ready
    assert first.startswith(
        "reference: building (1 of 10 explanations; drift is compared once it has them)   "
        "window: 0 explanations"
    )
    for _ in range(2):
        monitor.observe("fresh", ["a", "gorgeous", "film"], [0.1, 2.0, 0.3])
    lines = format_report(monitor.report(top_k=3)).splitlines()
    assert lines[0].startswith("reference: building (3 of 10 explanations; ")
    assert lines[1].startswith("label mix JSD -   attribution entropy ")
    assert lines[1].endswith(" -> - bits")
    for label in ("rotten", "fresh"):
        row = next(line for line in lines if line.startswith(f"{label} "))
        assert row.split() == [label, "-", "-", "0"]
    # Ready, with answers of one label only: the other has nothing to compare.
    for _ in range(10):
        monitor.observe("fresh", ["a", "gorgeous", "film"], [0.1, 2.0, 0.3])
    lines = format_report(monitor.report(top_k=3)).splitlines()
    assert lines[0].startswith("reference: ready (10 explanations)   window: 3 explanations")
    assert next(line for line in lines if line.startswith("rotten ")).split() == [
        "rotten", "-", "-", "0"
    ]  # fmt: skip
    fresh = next(line for line in lines if line.startswith("fresh ")).split()
    assert fresh[2] == "ok" and float(fresh[1]) < 0.02 and fresh[3] == "3"


def test_the_plot_says_what_the_table_says_of_labels_not_compared() -> None:
    import matplotlib.pyplot as plt

    settings = Settings(
        drift_bootstrap_n=10, drift_window=100, drift_sketch_size=32, drift_min_count=1
    )
    monitor = DriftMonitor(settings, ["rotten", "fresh"], None)
    monitor.observe("fresh", ["a", "film"], [0.1, 2.0])
    building = drift_figure(monitor.report(top_k=3))
    titles = [ax.get_title() for ax in building.axes]
    assert titles[1:] == ["rotten: JSD -, n=0", "fresh: JSD -, n=0"]
    said = [t.get_text() for ax in building.axes[1:] for t in ax.texts]
    assert said == ["reference building:\n1 of 10 explanations"] * 2
    plt.close(building)
    for _ in range(12):
        monitor.observe("fresh", ["a", "film"], [0.1, 2.0])
    ready = drift_figure(monitor.report(top_k=3))
    assert ready.axes[1].get_title() == "rotten: JSD -, n=0"
    assert [t.get_text() for t in ready.axes[1].texts] == ["no recent answer\npredicted this label"]
    assert ready.axes[2].get_title().startswith("fresh: JSD 0.0") and not ready.axes[2].texts
    plt.close(ready)


def test_a_label_panel_with_too_few_in_the_window_says_so() -> None:
    """A label with answers in the window, but fewer than it needs, is not compared: its panel
    says so, as the table does, rather than showing empty axes."""
    import matplotlib.pyplot as plt

    settings = Settings(
        drift_bootstrap_n=20, drift_window=100, drift_sketch_size=32, drift_min_count=5
    )
    monitor = DriftMonitor(settings, ["rotten", "fresh"], None)
    for label in ["rotten", "fresh"] * 10:  # the reference: ten of each
        monitor.observe(label, ["a", "film"], [0.1, 2.0])
    for label in ["rotten"] * 2 + ["fresh"] * 10:
        monitor.observe(label, ["a", "dull", "film"], [0.1, 2.0, 0.5])
    figure = drift_figure(monitor.report(top_k=3))
    assert figure.axes[1].get_title() == "rotten: JSD -, n=2"
    said = [t.get_text() for t in figure.axes[1].texts]
    assert said == ["not compared yet:\n2 in the window,\n5 needed"]
    assert figure.axes[2].get_title().startswith("fresh: JSD ")
    plt.close(figure)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "drift.png"
    plot_report(synthetic_report(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5_000


def test_build_reference_command(tmp_path: Path, random_bert_dir: Path) -> None:
    texts = [f"review number {i}: the plot was {w}" for i, w in enumerate(["good", "bad"] * 15)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "ref.json"
    rc = main(
        [
            "drift-reference", "build", "--model", str(random_bert_dir), "--data", str(data),
            "--n", "25", "--batch-size", "4", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    ref = ReferenceFile.load(out)
    model = load_model(random_bert_dir)
    assert ref.labels == model.labels
    assert ref.model_version == model.version
    assert ref.profile.count == 25
    assert ref.source == {"data": str(data), "n": 25, "truncation": "truncate"}
    assert ref.method == "normxlogit"  # what this model serves: no distilled head beside it
    # Independent recomputation: one text at a time, no batching or length sorting.
    expected = profile_of(
        [explain_texts(model, [t], batch_size=1)[0] for t in texts[:25]],
        model.labels,
        ref.profile.capacity,
    )
    assert ref.profile.label_counts == expected.label_counts
    for label in model.labels:
        got, want = ref.profile.sketches[label], expected.sketches[label]
        assert set(got.counts) == set(want.counts)
        for token, count in want.counts.items():
            assert got.counts[token] == pytest.approx(count, rel=1e-4, abs=1e-6)
    assert ref.profile.entropy_sum == pytest.approx(expected.entropy_sum, rel=1e-4)


def test_build_reference_as_a_server_that_builds_its_lexicon(
    tmp_path: Path, random_bert_dir: Path
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"the plot was {w}"}) + "\n" for w in "ab"))
    out, cache = tmp_path / "ref.json", tmp_path / "cache"
    rc = main(
        [
            "drift-reference", "build", "--model", str(random_bert_dir), "--data", str(data),
            "--out", str(out), "--no-progress", "--default-method", "auto", "--lexicon-build",
            "--cache-dir", str(cache),
        ]
    )  # fmt: skip
    assert rc == 0
    # The server with the same settings serves the lookup from the table built in its cache.
    assert ReferenceFile.load(out).method == "lexicon_lookup"
    assert (cached_lexicon_dir(load_model(random_bert_dir), cache) / "card.json").exists()


def test_explain_texts_matches_the_inline_method(random_bert_dir: Path) -> None:
    """Scores are NormXLogit of the predicted class on non-special tokens (checked by hand)."""
    import torch

    model = load_model(random_bert_dir)
    text = "a surprisingly tender film"
    obs = explain_texts(model, [text, "short", "another much longer text than the others"])[0]
    enc = model.encode(text)
    ids = torch.tensor([enc.input_ids])
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True)
        norms = out.hidden_states[0][0].norm(dim=-1)
        logits = model.model.classifier(model.model.bert.pooler(out.hidden_states[-1]))
        per_token = model.model.classifier(
            torch.tanh(model.model.bert.pooler.dense(out.hidden_states[-1][0]))
        )
    predicted = int(out.logits[0].argmax())
    assert torch.allclose(logits, out.logits, atol=1e-5)
    assert obs.label == model.labels[predicted]
    expected = (norms * per_token[:, predicted]).numpy()[~enc.special_mask]
    assert obs.tokens == [t.text for t in enc.tokens if not t.special]
    np.testing.assert_allclose(obs.scores, expected, rtol=1e-4, atol=1e-5)


def test_a_report_names_the_labels_the_reference_never_saw() -> None:
    settings = Settings(
        drift_bootstrap_n=2, drift_window=100, drift_sketch_size=32, drift_min_count=1
    )
    monitor = DriftMonitor(settings, ["rotten", "fresh"], None)
    for _ in range(2):
        monitor.observe("fresh", ["a", "gorgeous", "film"], [0.1, 2.0, 0.3])
    monitor.observe("rotten", ["a", "dull", "film"], [0.1, 2.0, 0.3])
    lines = format_report(monitor.report(top_k=3)).splitlines()
    rotten = next(line for line in lines if line.startswith("rotten "))
    assert rotten.split()[1:3] == ["-", "-"]  # no JSD, no "ok"
    assert any("no explanation in the reference was predicted as rotten" in x for x in lines)


def test_a_reference_is_built_at_the_servers_token_limit_and_says_so(
    tmp_path: Path, random_bert_dir: Path
) -> None:
    """LIMELIGHT_MAX_TOKENS was ignored by the build: a sidecar that cuts texts at 32 tokens
    compared its answers with attributions of whole texts, and alerted on the reference's own
    texts. The limit is applied, recorded, and checked by the sidecar."""
    from limelight.drift.served import served_identity

    texts = ["short and good", " ".join(["a long review that goes on"] * 20)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = ["drift-reference", "build", "--model", str(random_bert_dir), "--data", str(data)]
    out = tmp_path / "ref.json"
    assert main([*argv, "--max-tokens", "12", "--out", str(out), "--no-progress"]) == 0
    ref = ReferenceFile.load(out)
    model = load_model(random_bert_dir)
    cut = explain_texts(model, texts, max_tokens=12)
    assert max(len(o.tokens) for o in cut) == 10  # 12 with [CLS] and [SEP]
    assert ref.profile.label_counts == profile_of(cut, model.labels, 8).label_counts
    assert ref.served is not None and ref.served.max_tokens == 12
    at_12 = served_identity(Settings(max_tokens=12), model, "normxlogit")
    assert ref.differences(at_12) == []
    whole = served_identity(Settings(), model, "normxlogit")
    assert ref.differences(whole) == [f"max_tokens 12 (serving {model.max_tokens})"]
    # reject: a sidecar refuses the long text, so the reference leaves it out
    assert main([*argv, "--max-tokens", "12", "--truncation", "reject", "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    assert ReferenceFile.load(out).profile.count == 1


def test_a_reference_with_nothing_in_it_is_not_written(
    tmp_path: Path, random_bert_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One text: a reference with one label only is written with a warning naming the other;
    # texts that give no explanation at all write nothing and exit 2.
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "the plot was good"}) + "\n")
    out = tmp_path / "ref.json"
    argv = ["drift-reference", "build", "--model", str(random_bert_dir), "--data", str(data)]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    counts = ReferenceFile.load(out).profile.label_counts
    err = capsys.readouterr().err
    # Every label has fewer than the 150 explanations a label needs to be compared: each
    # is named, the one with none ("0 text(s)") among them.
    assert 0 in counts.values()
    for label, n in counts.items():
        assert f"warning: {n} text(s) predicted as {label}, fewer than the 150" in err


def test_a_reference_without_any_explanation_is_not_written(
    tmp_path: Path,
    bert_tiny_multilabel_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A multi-label model predicts no label for a text under its thresholds: such texts give
    # a reference of 0 explanations, which compared as "no drift" for every label.
    monkeypatch.setenv("LIMELIGHT_LABEL_THRESHOLD", "1.0")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "the plot was good"}) + "\n")
    out = tmp_path / "ref.json"
    argv = ["drift-reference", "build", "--model", str(bert_tiny_multilabel_dir)]
    assert main([*argv, "--data", str(data), "--out", str(out), "--no-progress"]) == 2
    assert "no explanation went into the reference" in capsys.readouterr().err
    assert not out.exists()


def test_the_table_says_which_labels_are_not_compared_yet_and_why() -> None:
    settings = Settings(drift_bootstrap_n=40, drift_window=100, drift_min_count=15)
    monitor = DriftMonitor(settings, ["rotten", "fresh"], None)
    for i in range(40):
        monitor.observe(["rotten", "fresh"][i % 2], ["a", "film"], [1.0, 2.0])
    for _ in range(20):
        monitor.observe("fresh", ["a", "film"], [1.0, 2.0])
    monitor.observe("rotten", ["a", "film"], [1.0, 2.0])
    lines = format_report(monitor.report()).splitlines()
    rotten = next(line for line in lines if line.startswith("rotten "))
    assert rotten.split() == ["rotten", "-", "-", "1"]
    fresh = next(line for line in lines if line.startswith("fresh "))
    assert fresh.split()[2] == "ok"
    assert (
        "not compared yet: rotten (fewer than 15 explanations in the window, the least a label "
        "needs there and in the reference; fewer read as drift on unchanged traffic. A label "
        "that stays rarer than that in the window is compared only with a larger "
        "LIMELIGHT_DRIFT_WINDOW)" in lines
    )
    assert not any("reference:" in line and "never" in line for line in lines)


def test_a_label_too_rare_in_a_ready_reference_is_never_compared_not_yet() -> None:
    """The reference is ready and no longer grows: a label it holds too few of will not be
    compared whatever the window holds, and the table says so (it said "not compared yet")."""
    settings = Settings(drift_bootstrap_n=40, drift_window=100, drift_min_count=15)
    monitor = DriftMonitor(settings, ["rotten", "fresh"], None)
    for i in range(40):  # 5 rotten, 35 fresh
        monitor.observe("rotten" if i % 8 == 0 else "fresh", ["a", "film"], [1.0, 2.0])
    for label in ("rotten", "fresh"):
        for _ in range(50):  # plenty of both in the window
            monitor.observe(label, ["a", "film"], [1.0, 2.0])
    report = monitor.report()
    lines = format_report(report).splitlines()
    assert next(line for line in lines if line.startswith("rotten ")).split() == [
        "rotten", "-", "-", "50"
    ]  # fmt: skip
    assert next(line for line in lines if line.startswith("fresh ")).split()[2] == "ok"
    assert (
        "never compared against this reference: rotten (fewer than 15 explanations in the "
        "reference, the least a label needs there and in the window; rebuild the reference "
        "from more texts of it with `limelight drift-reference build`, or from more requests: "
        "LIMELIGHT_DRIFT_BOOTSTRAP_N)" in lines
    )
    assert not any("not compared yet" in line for line in lines)
    # With none of it in the window either, the reason is the same.
    monitor = DriftMonitor(settings, ["rotten", "fresh"], None)
    for i in range(140):
        monitor.observe("rotten" if i < 40 and i % 8 == 0 else "fresh", ["a", "film"], [1.0, 2.0])
    lines = format_report(monitor.report()).splitlines()
    assert any(line.startswith("never compared against this reference: rotten") for line in lines)
