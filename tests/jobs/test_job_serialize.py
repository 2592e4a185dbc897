"""Round trips of job specs and explanations through their JSON form."""

from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from limelight.core.jobs import JobSpec
from limelight.core.types import Attribution, Explanation, TargetSpec, Timings, TokenInfo
from limelight.jobs.serialize import (
    explanation_from_dict,
    explanation_to_dict,
    jsonable,
    spec_from_dict,
    spec_to_dict,
)


def _explanation(scores: np.ndarray, class_scores: np.ndarray | None) -> Explanation:
    n = scores.shape[0]
    tokens = [TokenInfo(f"t{i}", i, i, i + 1, i == 0, 0) for i in range(n)]
    return Explanation(
        request_id="job-1",
        label_index=1,
        label="positive",
        probabilities=[0.25, 0.75],
        labels=["negative", "positive"],
        tokens=tokens,
        attribution=Attribution(
            method="steps",
            parameters={"steps": 3, "variant": "sum"},
            target_index=1,
            target_label="positive",
            scores=scores,
            class_scores=class_scores,
            extra_scores={"value": -scores},
            details={"layer": np.int64(2), "curve": np.linspace(0, 1, 3)},
        ),
        model_name="tiny",
        model_version="abc",
        truncated=True,
        timings=Timings(0.1, 0.2, 0.3, 0.4, 1.0, 1),
    )


floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, st.integers(1, 12), elements=floats32), st.booleans())
def test_explanation_round_trip_is_exact(scores: np.ndarray, with_classes: bool) -> None:
    class_scores = np.stack([scores, -scores], axis=1) if with_classes else None
    original = _explanation(scores, class_scores)
    wire = json.dumps(explanation_to_dict(original), allow_nan=False)  # strict JSON
    back = explanation_from_dict(json.loads(wire))
    np.testing.assert_array_equal(back.attribution.scores, scores)
    assert back.attribution.scores.dtype == np.float32
    if with_classes:
        assert back.attribution.class_scores is not None
        np.testing.assert_array_equal(back.attribution.class_scores, class_scores)
    else:
        assert back.attribution.class_scores is None
    np.testing.assert_array_equal(back.attribution.extra_scores["value"], -scores)
    assert back.tokens == original.tokens
    assert back.timings == original.timings
    assert back.attribution.details == {"layer": 2, "curve": [0.0, 0.5, 1.0]}
    assert back.attribution.parameters == original.attribution.parameters
    assert (back.label, back.label_index, back.labels) == ("positive", 1, original.labels)
    assert back.truncated is True and back.model_version == "abc"


def test_spec_round_trip() -> None:
    for spec in (
        JobSpec(method="gradient", text="hi"),
        JobSpec(
            method="integrated_gradients",
            text="premise",
            text_pair="hypothesis",
            target=TargetSpec(label="positive"),
            params={"steps": 16, "baseline": "pad"},
            idempotency_key="k1",
            timeout_s=2.5,
        ),
        JobSpec(method="random", text="x", target=TargetSpec(index=0)),
        JobSpec(method="shapley", text="x", model_name="m", model_version="0123456789abcdef"),
    ):
        assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))) == spec


def test_a_spec_journalled_before_models_were_recorded_reads_as_for_any_model() -> None:
    legacy = spec_to_dict(JobSpec(method="random", text="x"))
    del legacy["model_name"], legacy["model_version"]
    assert spec_from_dict(legacy) == JobSpec(method="random", text="x", model_version="")


def test_jsonable_non_finite() -> None:
    out = jsonable({"a": np.array([1.0, np.nan, -np.inf], dtype=np.float32), "b": (1, 2)})
    assert out == {"a": [1.0, "nan", "-inf"], "b": [1, 2]}
    assert math.isnan(float(out["a"][1]))
