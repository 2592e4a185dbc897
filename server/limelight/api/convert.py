"""Conversion between protobuf messages and domain types. No logic beyond that."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import struct_pb2, timestamp_pb2
from google.protobuf.json_format import MessageToDict

from limelight.core.jobs import JobRecord, JobState
from limelight.core.types import (
    Attribution,
    ExplainInput,
    Explanation,
    ModelInfo,
    TargetSpec,
    TokenColumns,
    TokenInfo,
)
from limelight.errors import InvalidArgument
from limelight_client.proto import explainer_pb2 as pb


def _plain(value: Any) -> Any:
    """JSON-able Python values for a Struct (numpy scalars/arrays, tuples, nested dicts)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_struct(values: Mapping[str, Any] | None) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    if values:
        struct.update(_plain(dict(values)))
    return struct


def from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    if not struct.fields:
        return {}
    try:
        return dict(MessageToDict(struct))
    except ValueError:  # NaN or Infinity in a number value (JSON has neither)
        bad = sorted(_not_finite(struct))
        raise InvalidArgument(
            f"parameter(s) {', '.join(bad) or '?'} must be finite numbers (not NaN or infinity)"
        ) from None


def _not_finite(struct: struct_pb2.Struct, prefix: str = "") -> Iterator[str]:
    """The dotted names of the number values in ``struct`` that are NaN or infinite."""
    for key, value in struct.fields.items():
        yield from _not_finite_value(value, f"{prefix}{key}")


def _not_finite_value(value: struct_pb2.Value, name: str) -> Iterator[str]:
    kind = value.WhichOneof("kind")
    if kind == "number_value" and not math.isfinite(value.number_value):
        yield name
    elif kind == "struct_value":
        yield from _not_finite(value.struct_value, f"{name}.")
    elif kind == "list_value":
        for i, item in enumerate(value.list_value.values):
            yield from _not_finite_value(item, f"{name}[{i}]")


def target_from_proto(request: Any) -> TargetSpec | None:
    if not request.HasField("target"):
        return None
    kind = request.target.WhichOneof("kind")
    if kind == "label":
        return TargetSpec(label=request.target.label)
    if kind == "index":
        return TargetSpec(index=request.target.index)
    return None


def target_to_proto(target: TargetSpec | None) -> pb.Target | None:
    if target is None:
        return None
    if target.label is not None:
        return pb.Target(label=target.label)
    if target.index is not None:
        return pb.Target(index=target.index)
    return None


def input_deadline(request: pb.ExplainRequest, deadline: float | None) -> float | None:
    """The earlier of the call's ``deadline`` and the input's own ``timeout_seconds`` from
    now (absolute ``time.monotonic()``; None: neither)."""
    budget = request.timeout_seconds
    if budget == 0:
        return deadline
    if not math.isfinite(budget) or budget < 0:
        raise InvalidArgument(
            f"timeout_seconds must be a finite number >= 0 (0: none), not {budget!r}"
        )
    own = time.monotonic() + budget
    return own if deadline is None else min(own, deadline)


def explain_input(request: pb.ExplainRequest, deadline: float | None) -> ExplainInput:
    return ExplainInput(
        text=request.text,
        text_pair=request.text_pair if request.HasField("text_pair") else None,
        target=target_from_proto(request),
        all_classes=request.all_classes,
        method=request.method,
        request_id=request.request_id,
        deadline=input_deadline(request, deadline),
        continue_on_error=request.continue_on_error,
        trace_context=dict(request.trace_context) if request.trace_context else {},
    )


def _fill_attribution(attribution: pb.Explanation, a: Attribution) -> None:
    """Everything of ``a`` but the tokens into ``attribution``."""
    attribution.method = a.method
    attribution.target_index = a.target_index
    attribution.target_label = a.target_label
    attribution.scores.extend(a.scores.tolist())
    if a.parameters:
        attribution.parameters.CopyFrom(to_struct(a.parameters))
    if a.details:
        attribution.details.CopyFrom(to_struct(a.details))
    if a.class_scores is not None:
        attribution.class_scores.extend(
            pb.ClassScores(scores=row) for row in a.class_scores.tolist()
        )
    for name, values in a.extra_scores.items():
        attribution.extra_scores[name].values.extend(np.asarray(values).tolist())


def _fill_tokens(attribution: pb.Explanation, tokens: Sequence[TokenInfo], layout: int) -> None:
    table = TokenColumns.of(tokens)
    starts = [start for start, _ in table.offsets]
    ends = [end for _, end in table.offsets]
    if layout == pb.TOKEN_LAYOUT_COLUMNS:
        # One C-level extend per field instead of a message per token (a third of the time).
        columns = attribution.token_columns
        columns.text.extend(table.texts)
        columns.id.extend(table.ids)
        columns.start.extend(starts)
        columns.end.extend(ends)
        columns.special.extend(map(bool, table.special))
        columns.segment.extend(table.segments)
        return
    add = attribution.tokens.add  # in place: no intermediate Token messages to copy
    for text, tid, start, end, special, segment in zip(
        table.texts, table.ids, starts, ends, table.special, table.segments, strict=True
    ):
        add(text=text, id=tid, start=start, end=end, special=bool(special), segment=segment)


def explanation_to_proto(
    e: Explanation, token_layout: int = pb.TOKEN_LAYOUT_MESSAGES
) -> pb.ExplainResponse:
    """The answer to one input; ``token_layout`` is the request's ``TokenLayout``."""
    t = e.timings
    response = pb.ExplainResponse(
        request_id=e.request_id,
        label_index=e.label_index,
        label=e.label,
        probabilities=e.probabilities,
        labels=e.labels,
        model_name=e.model_name,
        model_version=e.model_version,
        truncated=e.truncated,
        predicted_labels=e.predicted_labels,
        multi_label=e.multi_label,
        thresholds=e.thresholds,
        windows=e.windows,
    )
    # Filled in place: a message passed to a constructor is copied, tokens and all.
    timings = response.timings
    timings.queue_seconds = t.queue_seconds
    timings.tokenize_seconds = t.tokenize_seconds
    timings.forward_seconds = t.forward_seconds
    timings.attribute_seconds = t.attribute_seconds
    timings.total_seconds = t.total_seconds
    timings.batch_size = t.batch_size
    attribution = response.explanation
    _fill_attribution(attribution, e.attribution)
    _fill_tokens(attribution, e.tokens, token_layout)
    for extra in e.label_attributions:  # tokens omitted: the same as the first explanation's
        _fill_attribution(response.label_explanations.add(), extra)
    return response


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=info.name,
        version=info.version,
        architecture=info.architecture,
        labels=info.labels,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        hidden_size=info.hidden_size,
        methods=[
            pb.MethodInfo(
                name=m.name,
                cost=m.cost.value,
                description=m.description,
                defaults=to_struct(m.defaults),
                unavailable_reason=m.unavailable_reason,
            )
            for m in info.methods
        ],
        default_method=info.default_method,
        max_tokens=info.max_tokens,
        max_text_chars=info.max_text_chars,
        runtime=info.runtime,
        supports_text_pair=info.supports_text_pair,
        problem_type=info.problem_type,
        thresholds=info.thresholds,
    )


_STATE_TO_PROTO = {
    JobState.QUEUED: pb.JOB_STATE_QUEUED,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    JobState.FAILED: pb.JOB_STATE_FAILED,
    JobState.CANCELLED: pb.JOB_STATE_CANCELLED,
}
_STATE_FROM_PROTO: dict[int, JobState] = {int(v): k for k, v in _STATE_TO_PROTO.items()}


def job_state_from_proto(value: int) -> JobState | None:
    return _STATE_FROM_PROTO.get(int(value))


def _timestamp(seconds: float | None) -> timestamp_pb2.Timestamp | None:
    if seconds is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def job_to_proto(job: JobRecord, token_layout: int = pb.TOKEN_LAYOUT_MESSAGES) -> pb.Job:
    """A job; a succeeded job's result lists its tokens in ``token_layout`` (the request's)."""
    message = pb.Job(
        id=job.id,
        state=_STATE_TO_PROTO[job.state],
        method=job.spec.method,
        parameters=to_struct(job.spec.params),
        progress=job.progress,
        message=job.message,
        created_at=_timestamp(job.created_at),
        started_at=_timestamp(job.started_at),
        finished_at=_timestamp(job.finished_at),
        attempts=job.attempts,
        # "Set when FAILED or CANCELLED": the stores keep a cancellation's word in message.
        error=job.error or (job.message or "cancelled" if job.state is JobState.CANCELLED else ""),
        idempotency_key=job.spec.idempotency_key,
        model_name=job.spec.model_name,
        model_version=job.spec.model_version,
        no_worker=job.no_worker,
    )
    if job.result is not None:
        message.result.CopyFrom(explanation_to_proto(job.result, token_layout))
    return message


def _shifts(shifts: Any) -> list[pb.TokenShift]:
    return [
        pb.TokenShift(
            token=s.token, reference_share=s.reference_share, current_share=s.current_share
        )
        for s in shifts
    ]


def drift_to_proto(report: Any) -> pb.DriftReport:
    """From ``limelight.drift.report.DriftReport`` (fields mirror the proto)."""
    return pb.DriftReport(
        reference_state=report.reference_state,
        reference_count=report.reference_count,
        window_count=report.window_count,
        alert_threshold=report.alert_threshold,
        labels=[
            pb.LabelDrift(
                label=d.label,
                divergence=d.divergence,
                alert=d.alert,
                window_count=d.window_count,
                risers=_shifts(d.risers),
                fallers=_shifts(d.fallers),
                reference_count=d.reference_count,
            )
            for d in report.labels
        ],
        label_mix_divergence=report.label_mix_divergence,
        reference_entropy=report.reference_entropy,
        current_entropy=report.current_entropy,
        generated_at=_timestamp(report.generated_at),
        sample_rate=report.sample_rate,
        reference_target=report.reference_target,
        min_count=report.min_count,
    )
