"""KServe v1 ``:explain`` on multi-label models: every predicted label's explanation comes back
(``label_explanations``, as ``Explain`` and the CLI's JSON carry them), against a real sidecar."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from limelight_client import Client
from tests.conftest import RunningSidecar

#: The multi-label demo predicts several labels for this review (side effects, birth control...).
TEXT = "I gained weight and had mood swings on this birth control"


def _v1_explain(running: RunningSidecar, body: dict[str, Any]) -> dict[str, Any]:
    assert running.settings.model_dir is not None
    url = (
        f"http://127.0.0.1:{running.server.metrics_port}"
        f"/v1/models/{running.settings.model_dir.name}:explain"
    )
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def test_v1_explain_carries_every_predicted_label(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_multilabel_dir: Path
) -> None:
    running = start_sidecar(model_dir=bert_tiny_multilabel_dir)
    with Client(running.target, timeout=60) as client:
        expected = client.explain(TEXT)
    assert len(expected.predicted_labels) >= 2, expected.predicted_labels  # the case at issue

    (got,) = _v1_explain(running, {"instances": [TEXT]})["explanations"]
    assert got["predicted_labels"] == expected.predicted_labels
    explained = [
        (
            got["target_label"],
            got["target_index"],
            got["method"],
            [t["score"] for t in got["tokens"]],
        ),
        *(
            (o["target_label"], o["target_index"], o["method"], o["scores"])
            for o in got["label_explanations"]
        ),
    ]
    assert [x[0] for x in explained] == [e.target_label for e in expected.explained()]
    assert [x[0] for x in explained] == expected.predicted_labels
    for (label, index, method, scores), e in zip(explained, expected.explained(), strict=True):
        assert (label, index, method) == (e.target_label, e.target_index, e.method)
        assert scores == pytest.approx(e.scores, rel=1e-4, abs=1e-5)
    # The CLI's JSON (``to_dict``) names the per-label fields the same way.
    cli = expected.to_dict()["label_explanations"]
    for mine, theirs in zip(got["label_explanations"], cli, strict=True):
        assert set(mine) <= set(theirs)
        assert theirs["scores"] == pytest.approx(mine["scores"], rel=1e-4, abs=1e-5)
        assert {k: theirs[k] for k in mine if k != "scores"} == {
            k: v for k, v in mine.items() if k != "scores"
        }

    # An explicit target explains that label only: the list is there, empty.
    (one,) = _v1_explain(
        running, {"instances": [TEXT], "parameters": {"target": expected.predicted_labels[1]}}
    )["explanations"]
    assert one["target_label"] == expected.predicted_labels[1]
    assert one["label_explanations"] == []


def test_v1_explain_single_label_answer_unchanged(
    start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path
) -> None:
    running = start_sidecar(model_dir=random_bert_dir)
    (got,) = _v1_explain(running, {"instances": ["a fine movie"]})["explanations"]
    assert "label_explanations" not in got
    assert set(got) == {
        "label",
        "label_index",
        "probabilities",
        "predicted_labels",
        "truncated",
        "windows",
        "method",
        "target_label",
        "target_index",
        "tokens",
    }
