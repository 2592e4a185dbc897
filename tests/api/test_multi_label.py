"""Multi-label classifiers end to end: a tiny random BERT with a sigmoid head, served by a real
sidecar, checked against transformers' own logits and a direct NormXLogit computation."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertForSequenceClassification

from limelight.core.prediction import label_thresholds, predict, sigmoid
from limelight.errors import InvalidArgument
from limelight_client import Client
from limelight_client.errors import InvalidArgument as InvalidArgumentError
from tests.tiny_bert import save_tiny_bert

LABELS = ["toxic", "insult", "threat", "spam"]
#: Head biases that put the labels clearly above or below 0.5 whatever the random weights say.
BIASES = [3.0, 1.0, -3.0, -1.0]
TEXT = "you are a dreadful person and this is a terrible, awful idea"


@pytest.fixture(scope="module")
def multi_label_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny randomly initialised 4-label BERT (problem_type multi_label_classification)."""
    out = tmp_path_factory.mktemp("multi-label-bert")
    return save_tiny_bert(
        out, tokenizer_dir, LABELS, seed=1, problem_type="multi_label_classification", biases=BIASES
    )


def _reference(model_dir: Path, text: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """transformers' sigmoid probabilities [C], NormXLogit [n, C] computed by hand, token ids."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    enc = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
        probs = torch.sigmoid(out.logits[0]).numpy()
        h0, h_last = out.hidden_states[0][0], out.hidden_states[-1][0]
        pooled = model.bert.pooler.activation(model.bert.pooler.dense(h_last))
        token_logits = model.classifier(pooled)  # the head applied to every token [n, C]
        normx = (h0.norm(dim=-1, keepdim=True) * token_logits).numpy()
    return probs, normx, enc["input_ids"][0].tolist()


def test_prediction_rule() -> None:
    logits = np.array([2.0, 0.1, -4.0, 0.0], dtype=np.float32)
    p = predict(logits, "multi_label_classification", [0.5, 0.5, 0.5, 0.6])
    np.testing.assert_allclose(p.probabilities, 1 / (1 + np.exp(-logits)), rtol=1e-6)
    assert p.active == [0, 1]  # sigmoid(0) = 0.5 < 0.6: label 3 stays out
    assert p.index == 0
    low = np.array([-2.0, -1.0], dtype=np.float32)
    none = predict(low, "multi_label_classification", [0.5, 0.5])
    assert none.active == [] and none.index == 1
    single = predict(logits, "single_label_classification", [])
    assert single.active == [0] and abs(float(single.probabilities.sum()) - 1) < 1e-6
    assert sigmoid(np.array([-1000.0, 1000.0], dtype=np.float32)).tolist() == [0.0, 1.0]
    assert label_thresholds(["a", "b"], 0.5, {"b": 0.3}) == [0.5, 0.3]
    with pytest.raises(InvalidArgument, match="unknown labels 'c'"):
        label_thresholds(["a", "b"], 0.5, {"c": 0.3})
    with pytest.raises(InvalidArgument, match="not in"):
        label_thresholds(["a", "b"], 1.5, {})


def test_multi_label_explain_job_drift_and_metrics(
    start_sidecar: Callable[..., Any], multi_label_dir: Path
) -> None:
    running = start_sidecar(
        model_dir=multi_label_dir, drift_bootstrap_n=4, drift_window=10, drift_min_count=1
    )
    probs, normx, ids = _reference(multi_label_dir, TEXT)
    expected = [LABELS[i] for i in np.argsort(-probs) if probs[i] >= 0.5]
    assert expected == ["toxic", "insult"]  # the fixture's biases
    with Client(running.target, timeout=60) as client:
        info = client.model()
        assert info.problem_type == "multi_label_classification"
        assert info.thresholds == dict.fromkeys(LABELS, 0.5)

        result = client.explain(TEXT, method="normxlogit")
        assert result.multi_label
        assert [t.id for t in result.tokens] == ids
        np.testing.assert_allclose(
            [result.probabilities[name] for name in LABELS], probs, rtol=1e-4, atol=1e-6
        )
        assert result.predicted_labels == expected
        assert result.label == "toxic" and result.label_index == 0  # the most probable label
        # Every predicted label is explained, each with NormXLogit for its own column.
        explained = result.explained()
        assert [e.target_label for e in explained] == expected
        for one in explained:
            assert one.tokens == result.tokens
            column = normx[:, LABELS.index(one.target_label)]
            np.testing.assert_allclose(one.scores, column, rtol=1e-4, atol=1e-5)
        assert result.explanation_for("insult") is explained[1]

        # A requested target (here a label not predicted) is explained alone.
        threat = client.explain(TEXT, target="threat", method="normxlogit")
        assert threat.target_label == "threat" and threat.label_explanations == []
        assert threat.predicted_labels == expected
        np.testing.assert_allclose(threat.scores, normx[:, 2], rtol=1e-4, atol=1e-5)

        # Jobs take any label as their target, and report the multi-label prediction.
        job = client.submit(TEXT, "grad_x_input", target="spam")
        done = job.result(timeout=120)
        assert done.target_label == "spam" and done.multi_label
        assert done.predicted_labels == expected
        np.testing.assert_allclose(
            [done.probabilities[name] for name in LABELS], probs, rtol=1e-4, atol=1e-6
        )

        # Drift and metrics count each predicted label.
        for _ in range(4):
            client.explain(TEXT)
        report = client.drift(top_k=3)
    assert report.reference_state == "ready"
    # Six inline requests, two predicted labels each: the first two make the reference
    # (bootstrap 4 observations), the other four fill the window, four per label.
    counts = {d.label: d.window_count for d in report.labels}
    assert counts.get("toxic") == counts.get("insult") == 4
    assert report.reference_count == 4 and report.window_count == 8
    assert not counts.get("threat") and not counts.get("spam")
    with urllib.request.urlopen(running.metrics_url, timeout=10) as response:
        exposition = response.read().decode()
    assert 'limelight_predictions_total{label="toxic"} 6.0' in exposition
    assert 'limelight_predictions_total{label="insult"} 6.0' in exposition
    assert 'limelight_predictions_total{label="threat"}' not in exposition


def test_per_label_thresholds_and_rendering(
    start_sidecar: Callable[..., Any], multi_label_dir: Path, tmp_path: Path
) -> None:
    running = start_sidecar(
        model_dir=multi_label_dir, label_thresholds={"insult": 0.999, "spam": 0.01}
    )
    _, normx, _ = _reference(multi_label_dir, TEXT)
    with Client(running.target, timeout=60) as client:
        result = client.explain(TEXT, method="normxlogit")
        with pytest.raises(InvalidArgumentError):
            client.explain(TEXT, target="no-such-label")
    assert result.thresholds["insult"] == pytest.approx(0.999)
    assert result.predicted_labels == ["toxic", "spam"]  # spam's 0.01 lets it in
    assert [e.target_label for e in result.explained()] == ["toxic", "spam"]
    np.testing.assert_allclose(
        result.label_explanations[0].scores, normx[:, 3], rtol=1e-4, atol=1e-5
    )
    text = result.to_terminal(color=False)
    assert "prediction: {toxic, spam}" in text
    assert "── explaining toxic ──" in text and "── explaining spam ──" in text
    assert "(threshold 1.00)" in text  # insult's 0.999, two decimals
    page = result.to_html(tmp_path / "out.html")
    assert "<h2>toxic</h2>" in page and "<h2>spam</h2>" in page
    data = result.to_dict()
    assert [e["target_label"] for e in data["label_explanations"]] == ["spam"]

    # Open Inference Protocol (REST): sigmoid probabilities and the predicted labels' mask.
    name = result.model_name
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [TEXT]}]}
    request = urllib.request.Request(
        running.metrics_url.replace("/metrics", f"/v2/models/{name}/infer"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        outputs = {o["name"]: o for o in json.loads(response.read())["outputs"]}
    assert outputs["predicted"]["datatype"] == "BOOL"
    assert outputs["predicted"]["data"] == [True, False, False, True]
    np.testing.assert_allclose(
        outputs["probabilities"]["data"], [result.probabilities[n] for n in LABELS], rtol=1e-5
    )
    # KServe v1: the predicted labels beside the most probable one.
    request = urllib.request.Request(
        running.metrics_url.replace("/metrics", f"/v1/models/{name}:predict"),
        data=json.dumps({"instances": [TEXT]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        prediction = json.loads(response.read())["predictions"][0]
    assert prediction["predicted_labels"] == ["toxic", "spam"] and prediction["label"] == "toxic"


def test_unknown_threshold_label_is_a_startup_error(
    start_sidecar: Callable[..., Any], multi_label_dir: Path
) -> None:
    with pytest.raises(Exception, match="unknown labels 'toxicity'"):
        start_sidecar(model_dir=multi_label_dir, label_thresholds={"toxicity": 0.3})


def test_search_jobs_play_each_labels_own_log_odds(multi_label_dir: Path) -> None:
    """Shapley values add up (efficiency) to the label's logit on the full text minus on the
    all-masked text: a sigmoid label's log-odds, not a softmax one-vs-rest."""
    from limelight.core.jobs import JobSpec
    from limelight.core.types import TargetSpec
    from limelight.jobs.runner import JobRunner
    from limelight.methods.base import MethodRegistry
    from limelight.models.loaded import load_model
    from limelight.settings import Settings

    settings = Settings(jobs="off")
    model = load_model(multi_label_dir)
    runner = JobRunner(model, MethodRegistry.load(settings), settings)
    spec = JobSpec(
        method="shapley",
        text=TEXT,
        target=TargetSpec(label="threat"),
        params={"permutations": 2, "replace": "mask"},
    )
    result = runner.run(spec)
    assert result.attribution.target_label == "threat" and result.multi_label
    enc = model.tokenizer(TEXT, return_tensors="pt")
    masked = enc["input_ids"].clone()
    special = torch.tensor(
        model.tokenizer.get_special_tokens_mask(
            enc["input_ids"][0].tolist(), already_has_special_tokens=True
        )
    ).bool()
    masked[0, ~special] = model.tokenizer.mask_token_id
    with torch.no_grad():
        full = model.model(input_ids=enc["input_ids"]).logits[0, 2]
        empty = model.model(input_ids=masked).logits[0, 2]
    total = float(np.sum(result.attribution.scores))
    assert total == pytest.approx(float(full - empty), rel=1e-3, abs=1e-4)


def test_eval_scores_each_predicted_label(
    multi_label_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``limelight eval`` on a multi-label model: one item per (text, predicted label)."""
    import argparse

    from limelight.cli import eval as eval_cli

    texts = [TEXT, "what a lovely day", "buy cheap watches now"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    expected = 0
    for text in texts:
        probs, _, _ = _reference(multi_label_dir, text)
        expected += max(1, int((probs >= 0.5).sum()))
    parser = argparse.ArgumentParser(prog="limelight")
    eval_cli.register(parser.add_subparsers())
    source = ["--model", str(multi_label_dir), "--data", str(data), "--n", "0"]
    methods = ["--methods", "normxlogit,random", "--fractions", "0.5", "--game-steps", "2"]
    out = ["--out", str(tmp_path / "out"), "--no-progress"]
    args = parser.parse_args(["eval", *source, *methods, *out])
    assert args.func(args) == 0
    capsys.readouterr()
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["accuracy"] is None
    assert any("multi-label: one item per (text, predicted label)" in n for n in report["notes"])
    for m in report["methods"]:
        assert m["status"] == "ok", m["reason"]
        assert m["n"] == expected and len(m["aopc_deletion_per_input"]) == expected


def test_drift_reference_build_observes_each_predicted_label(multi_label_dir: Path) -> None:
    from limelight.drift.build import explain_texts
    from limelight.models.loaded import load_model

    model = load_model(multi_label_dir)
    _, normx, ids = _reference(multi_label_dir, TEXT)
    special = np.array(
        model.tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True), dtype=bool
    )
    observations = explain_texts(model, [TEXT])
    assert [o.label for o in observations] == ["toxic", "insult"]
    for obs in observations:
        column = normx[~special, LABELS.index(obs.label)]
        np.testing.assert_allclose(obs.scores, column, rtol=1e-4, atol=1e-5)
    strict = explain_texts(model, [TEXT], thresholds=[0.5, 0.99, 0.5, 0.5])
    assert [o.label for o in strict] == ["toxic"]
