"""JSON-safe dicts for job specs and explanations (what the journals store).

Arrays become nested lists of floats; float32 values survive the round trip exactly because
every float32 is representable as a Python float and JSON keeps the shortest repr.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from limelight.core.jobs import InputPolicy, JobSpec
from limelight.core.types import Attribution, Explanation, TargetSpec, Timings, TokenInfo


def jsonable(value: Any) -> Any:
    """Recursively convert numpy arrays/scalars, tuples and non-finite floats to JSON values."""
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        # JSON has no NaN/Infinity; keep them readable and reversible.
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _array(value: Any) -> np.ndarray:
    def num(x: Any) -> Any:
        if isinstance(x, list):
            return [num(v) for v in x]
        return float(x)  # float("nan"), float("inf") parse the encoded non-finite values

    return np.asarray(num(value), dtype=np.float32)


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    target = None
    if spec.target is not None:
        target = {"label": spec.target.label, "index": spec.target.index}
    return {
        "method": spec.method,
        "text": spec.text,
        "text_pair": spec.text_pair,
        "target": target,
        "params": jsonable(spec.params),
        "idempotency_key": spec.idempotency_key,
        "timeout_s": spec.timeout_s,
        "owner": spec.owner,
        "trace_context": dict(spec.trace_context),
        "model_name": spec.model_name,
        "model_version": spec.model_version,
        "policy": _policy_to_dict(spec.policy),
    }


def _policy_to_dict(policy: InputPolicy | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    return {
        "truncation": policy.truncation,
        "max_tokens": policy.max_tokens,
        "window_stride": policy.window_stride,
        "window_aggregation": policy.window_aggregation,
    }


def _policy_from_dict(data: Any) -> InputPolicy | None:
    """Absent (a job stored by an earlier version): None, the runner's own settings apply."""
    if not data:
        return None
    # A field missing (a newer writer) reads as a value the runner refuses, saying why: the job
    # fails rather than run under settings it was not accepted under.
    return InputPolicy(
        truncation=str(data.get("truncation", "")),
        max_tokens=int(data.get("max_tokens", 0)),
        window_stride=int(data.get("window_stride", -1)),
        window_aggregation=str(data.get("window_aggregation", "")),
    )


def spec_from_dict(data: dict[str, Any]) -> JobSpec:
    target = data.get("target")
    return JobSpec(
        method=str(data["method"]),
        text=str(data["text"]),
        text_pair=data.get("text_pair"),
        target=TargetSpec(label=target.get("label"), index=target.get("index")) if target else None,
        params=dict(data.get("params") or {}),
        idempotency_key=str(data.get("idempotency_key") or ""),
        timeout_s=float(data.get("timeout_s") or 0.0),
        owner=str(data.get("owner") or ""),
        trace_context={str(k): str(v) for k, v in (data.get("trace_context") or {}).items()},
        model_name=str(data.get("model_name") or ""),
        model_version=str(data.get("model_version") or ""),
        policy=_policy_from_dict(data.get("policy")),
    )


def explanation_to_dict(expl: Explanation) -> dict[str, Any]:
    attr = expl.attribution
    return {
        "request_id": expl.request_id,
        "label_index": expl.label_index,
        "label": expl.label,
        "probabilities": jsonable(list(expl.probabilities)),
        "labels": list(expl.labels),
        "tokens": [
            {
                "text": t.text,
                "id": t.id,
                "start": t.start,
                "end": t.end,
                "special": t.special,
                "segment": t.segment,
            }
            for t in expl.tokens
        ],
        "attribution": {
            "method": attr.method,
            "parameters": jsonable(attr.parameters),
            "target_index": attr.target_index,
            "target_label": attr.target_label,
            "scores": jsonable(attr.scores),
            "class_scores": jsonable(attr.class_scores) if attr.class_scores is not None else None,
            "extra_scores": {k: jsonable(v) for k, v in attr.extra_scores.items()},
            "details": jsonable(attr.details),
        },
        "model_name": expl.model_name,
        "model_version": expl.model_version,
        "truncated": expl.truncated,
        "predicted_labels": list(expl.predicted_labels),
        "multi_label": expl.multi_label,
        "thresholds": [float(t) for t in expl.thresholds],
        "windows": expl.windows,
        "timings": {
            "queue_seconds": expl.timings.queue_seconds,
            "tokenize_seconds": expl.timings.tokenize_seconds,
            "forward_seconds": expl.timings.forward_seconds,
            "attribute_seconds": expl.timings.attribute_seconds,
            "total_seconds": expl.timings.total_seconds,
            "batch_size": expl.timings.batch_size,
        },
    }


def explanation_from_dict(data: dict[str, Any]) -> Explanation:
    a = data["attribution"]
    class_scores = a.get("class_scores")
    return Explanation(
        request_id=str(data["request_id"]),
        label_index=int(data["label_index"]),
        label=str(data["label"]),
        probabilities=[float(p) for p in data["probabilities"]],
        labels=[str(x) for x in data["labels"]],
        tokens=[TokenInfo(**t) for t in data["tokens"]],
        attribution=Attribution(
            method=str(a["method"]),
            parameters=dict(a["parameters"]),
            target_index=int(a["target_index"]),
            target_label=str(a["target_label"]),
            scores=_array(a["scores"]),
            class_scores=_array(class_scores) if class_scores is not None else None,
            extra_scores={k: _array(v) for k, v in a.get("extra_scores", {}).items()},
            details=dict(a.get("details") or {}),
        ),
        model_name=str(data["model_name"]),
        model_version=str(data["model_version"]),
        truncated=bool(data["truncated"]),
        timings=Timings(**data["timings"]),
        # Absent in results journalled before multi-label support.
        predicted_labels=[str(x) for x in data.get("predicted_labels", [data["label"]])],
        multi_label=bool(data.get("multi_label", False)),
        thresholds=[float(t) for t in data.get("thresholds", [])],
        windows=int(data.get("windows", 0)),
    )
