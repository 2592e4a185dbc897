"""Executes one job synchronously: encode, classify, attribute, wrap into an Explanation."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, cast, get_args

import numpy as np
import torch

from limelight.core.jobs import InputPolicy, JobSpec
from limelight.core.prediction import label_thresholds, predict
from limelight.core.redaction import PathRedactor
from limelight.core.types import Attribution, Encoded, Explanation, FloatArray, Timings
from limelight.core.windows import (
    Aggregation,
    WindowLayout,
    aggregate_logits,
    check_stride,
    encode_windows,
)
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.jobs.budget import ESTIMATES, check_cost, check_memory, check_timeout
from limelight.methods.base import (
    JobContext,
    JobMethod,
    MethodOutput,
    MethodRegistry,
    model_shape,
)
from limelight.models.loaded import LoadedModel
from limelight.models.tokenize import check_has_tokens
from limelight.settings import Settings

log = logging.getLogger(__name__)

ProgressFn = Callable[[float, str], None]
StopFn = Callable[[], bool]
Truncation = Literal["truncate", "reject", "window"]


class JobRunner:
    """Runs job specs against one loaded model in the calling thread.

    ``methods`` comes configured from ``MethodRegistry.load(settings)``; the runner does not
    change it."""

    def __init__(self, model: LoadedModel, methods: MethodRegistry, settings: Settings) -> None:
        self.model = model
        self.methods = methods
        self.settings = settings
        #: What a client reads of a failed job's error (the server's paths named).
        self.redact = PathRedactor.of(settings, model)
        self._throughput: float | None = None
        #: Multi-label: one threshold per label, as the sidecar uses them.
        self.thresholds = (
            label_thresholds(model.labels, settings.label_threshold, settings.label_thresholds)
            if model.is_multi_label
            else []
        )

    def job_method(self, name: str) -> JobMethod:
        """The named job method, or InvalidArgument/FailedPrecondition saying why not."""
        method = self.methods.get(name)
        if not isinstance(method, JobMethod):
            raise InvalidArgument(f"method {name!r} runs inline; submit it with Explain instead")
        reason = method.unavailable_reason(self.model)
        if reason:
            raise FailedPrecondition(f"method {name!r} cannot run on this model: {reason}")
        return method

    def validate(self, spec: JobSpec) -> dict[str, Any]:
        """Check a spec before it is queued: method, parameters, target label, timeout, and
        that the job fits the memory budget and can finish within its timeout."""
        check_timeout(spec.timeout_s, self.settings.job_timeout_max_s)
        method = self.job_method(spec.method)
        params = method.validate_params(spec.params)
        method.validate_for_model(self.model, params)
        if spec.target is not None:
            self._resolve_target(spec, None)
        encoded = self._encode(spec)
        check_has_tokens(encoded)
        windows = self._windows(spec, encoded)
        if len(windows) == 1:  # windows are checked as they run
            method.validate_for_input(self.model, encoded, params)
        tokens = len(encoded)  # the longest row the method runs on (a window's, windowed)
        check_memory(spec.method, model_shape(self.model), tokens, self.settings.job_memory_mb)
        timeout = spec.timeout_s if spec.timeout_s > 0 else self.settings.job_timeout_s
        timeout = min(timeout, self.settings.job_timeout_max_s)
        if spec.method in ESTIMATES:
            if len(windows) == 1:
                check_cost(spec.method, params, tokens, self.tokens_per_second(), timeout)
            else:  # truncation=window: the method runs on every window in turn
                document = len(WindowLayout.of(windows).tokens)
                lengths = [len(w) for w in windows]
                check_cost(
                    spec.method, params, document, self.tokens_per_second(), timeout, lengths
                )
        return params

    def tokens_per_second(self) -> float:
        """Forward throughput of the model (tokens per second), measured once."""
        if self._throughput is None:
            rows, length = 8, max(2, min(64, self.settings.max_tokens))
            ids = torch.full((rows, length), 1, dtype=torch.long, device=self.model.device)
            mask = torch.ones_like(ids)
            with torch.inference_mode():
                # The logits as the job methods compute them (the base, then the head): the
                # classifier's own forward refuses several rows without a pad_token_id.
                self.model.adapter.logits(ids, mask)  # warm-up
                started = time.perf_counter()
                self.model.adapter.logits(ids, mask)
                elapsed = time.perf_counter() - started
            self._throughput = rows * length / max(elapsed, 1e-6)
        return self._throughput

    def _resolve_target(self, spec: JobSpec, predicted: int | None) -> int:
        target = spec.target
        if target is not None and target.label:
            return self.model.label_index(target.label)
        if target is not None and target.index is not None:
            if not 0 <= target.index < self.model.num_labels:
                raise InvalidArgument(
                    f"target index {target.index} out of range [0, {self.model.num_labels})"
                )
            return int(target.index)
        return predicted if predicted is not None else 0

    def policy(self, spec: JobSpec) -> InputPolicy:
        """The over-long input policy ``spec`` was accepted under; this runner's own settings
        for a spec that recorded none (journalled by an earlier version, or from an in-process
        caller). FailedPrecondition when the recorded one cannot be applied here."""
        policy = spec.policy
        if policy is None:
            return InputPolicy.of(self.settings)
        accepted = (
            f"this job was accepted under truncation={policy.truncation!r}, max_tokens="
            f"{policy.max_tokens}, window_stride={policy.window_stride}, window_aggregation="
            f"{policy.window_aggregation!r}"
        )
        # A newer sidecar may record what this (older) worker cannot do: failing the job says
        # so, where running it under this worker's own settings would answer something else.
        if policy.truncation not in get_args(Truncation):
            raise FailedPrecondition(
                f"{accepted}; this worker does not know that truncation policy (an older "
                "version?), so it was not run: upgrade the workers, then submit it again"
            )
        if policy.window_aggregation not in get_args(Aggregation) or policy.max_tokens < 1:
            raise FailedPrecondition(
                f"{accepted}; this worker cannot apply those settings (an older version?), so "
                "it was not run: upgrade the workers, then submit it again"
            )
        if policy.truncation == "window":
            try:
                check_stride(policy.window_stride, min(policy.max_tokens, self.model.max_tokens))
            except InvalidArgument as exc:
                raise FailedPrecondition(f"{accepted}; {exc.message}") from None
        return policy

    def _encode(self, spec: JobSpec) -> Encoded:
        """``spec``'s text within the token limit it was accepted under (truncated, or the
        first window's worth under ``window``: ``_windows`` then cuts the rest)."""
        policy = self.policy(spec)
        truncation = cast(Truncation, policy.truncation)  # checked by policy()
        return self.model.encode(spec.text, spec.text_pair, policy.max_tokens, truncation)

    def _windows(self, spec: JobSpec, encoded: Encoded) -> list[Encoded]:
        """``[encoded]``, or under ``truncation=window`` a long text's overlapping windows (the
        policy ``spec`` was accepted under, not necessarily this runner's settings)."""
        policy = self.policy(spec)
        if not (encoded.truncated and policy.truncation == "window" and spec.text_pair is None):
            return [encoded]
        limit = min(policy.max_tokens, self.model.max_tokens)
        return encode_windows(self.model, spec.text, limit, policy.window_stride)

    def _classify(self, encoded: Encoded) -> FloatArray:
        device = self.model.device
        ids = torch.tensor([encoded.input_ids], dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        types = (
            torch.tensor([encoded.token_type_ids], dtype=torch.long, device=device)
            if encoded.token_type_ids is not None
            else None
        )
        with torch.inference_mode():
            kwargs = self.model.adapter.base_inputs(ids, mask, types)
            logits = self.model.model(**kwargs).logits
        return np.asarray(logits[0].float().cpu().numpy(), dtype=np.float32)

    def run(
        self,
        spec: JobSpec,
        job_id: str = "",
        report: ProgressFn | None = None,
        should_stop: StopFn | None = None,
        queue_seconds: float = 0.0,
    ) -> Explanation:
        """Compute the explanation of ``spec``; raises JobCancelled when ``should_stop`` says so."""
        started = time.perf_counter()
        if spec.model_version and spec.model_version != self.model.version:
            raise FailedPrecondition(
                f"this job was submitted to model {spec.model_name or '?'} version "
                f"{spec.model_version}; it was picked up where {self.model.name} version "
                f"{self.model.version} is served (the model changed since: a restart on another "
                "model, a rollout), so it was not run: submit it again"
            )
        method = self.job_method(spec.method)
        params: Mapping[str, Any] = method.validate_params(spec.params)
        encoded = self._encode(spec)
        check_has_tokens(encoded)
        windows = self._windows(spec, encoded)
        tokenized = time.perf_counter()
        if len(windows) == 1:
            logits = self._classify(encoded)
        else:  # the prediction the sidecar makes of the whole text
            aggregation = cast(Aggregation, self.policy(spec).window_aggregation)
            logits = aggregate_logits([self._classify(w) for w in windows], aggregation)
        forwarded = time.perf_counter()
        prediction = predict(logits, self.model.problem_type, self.thresholds)
        probabilities = [float(p) for p in prediction.probabilities]
        predicted = prediction.index
        target = self._resolve_target(spec, predicted)
        ctx = JobContext(
            model=self.model,
            settings=self.settings,
            report=report or (lambda fraction, message: None),
            should_stop=should_stop or (lambda: False),
        )
        if len(windows) == 1:
            output = method.run(ctx, encoded, target, params)
        else:
            output, encoded = _run_windows(method, ctx, windows, target, params)
        done = time.perf_counter()
        scores = np.asarray(output.scores, dtype=np.float32)
        if scores.shape != (len(encoded),):
            raise RuntimeError(
                f"method {spec.method} returned {scores.shape} scores for {len(encoded)} tokens"
            )
        attribution = Attribution(
            method=spec.method,
            parameters=dict(params),
            target_index=target,
            target_label=self.model.labels[target],
            scores=scores,
            class_scores=np.asarray(output.class_scores, dtype=np.float32)
            if output.class_scores is not None
            else None,
            extra_scores={
                k: np.asarray(v, dtype=np.float32) for k, v in output.extra_scores.items()
            },
            details=dict(output.details),
        )
        _check_finite(spec.method, attribution)
        return Explanation(
            request_id=job_id,
            label_index=predicted,
            label=self.model.labels[predicted],
            probabilities=probabilities,
            labels=list(self.model.labels),
            tokens=list(encoded.tokens),
            attribution=attribution,
            model_name=self.model.name,
            model_version=self.model.version,
            truncated=encoded.truncated,
            predicted_labels=[]
            if self.model.is_regression
            else [self.model.labels[i] for i in prediction.active],
            multi_label=self.model.is_multi_label,
            thresholds=list(self.thresholds),
            windows=len(windows) if len(windows) > 1 else 0,
            timings=Timings(
                queue_seconds=queue_seconds,
                tokenize_seconds=tokenized - started,
                forward_seconds=forwarded - tokenized,
                attribute_seconds=done - forwarded,
                total_seconds=done - started,
                batch_size=1,
            ),
        )


def _check_finite(method: str, attribution: Attribution) -> None:
    """A result with NaN or infinite scores is no explanation (and no JSON): the job fails,
    saying which arrays and, where the method knows, why."""
    arrays = {"scores": attribution.scores, **attribution.extra_scores}
    if attribution.class_scores is not None:
        arrays["class_scores"] = attribution.class_scores
    bad = [name for name, values in arrays.items() if not np.isfinite(values).all()]
    if bad:
        why = attribution.details.get("warning") or "its parameters took it out of range"
        raise InvalidArgument(
            f"{method} produced scores that are not finite numbers ({', '.join(bad)}): {why}"
        )


def _run_windows(
    method: JobMethod,
    ctx: JobContext,
    windows: list[Encoded],
    target: int,
    params: Mapping[str, Any],
) -> tuple[MethodOutput, Encoded]:
    """The method on every window in turn, its arrays stitched back onto the whole text the way
    the inline path stitches them (``limelight.core.windows``)."""
    count = len(windows)
    outputs = []
    for index, window in enumerate(windows):

        def report(fraction: float, message: str, index: int = index) -> None:
            ctx.report((index + fraction) / count, f"window {index + 1}/{count}: {message}")

        part = JobContext(ctx.model, ctx.settings, report=report, should_stop=ctx.should_stop)
        outputs.append(method.run(part, window, target, params))
    layout = WindowLayout.of(windows)

    def stitched(arrays: list[Any]) -> FloatArray:
        return layout.stitch([np.asarray(a, dtype=np.float32) for a in arrays])

    class_scores = (
        stitched([o.class_scores for o in outputs])
        if all(o.class_scores is not None for o in outputs)
        else None
    )
    names = [k for k in outputs[0].extra_scores if all(k in o.extra_scores for o in outputs)]
    output = MethodOutput(
        scores=stitched([o.scores for o in outputs]),
        class_scores=class_scores,
        extra_scores={k: stitched([o.extra_scores[k] for o in outputs]) for k in names},
        details={"windows": count, "per_window": [dict(o.details) for o in outputs]},
    )
    document = Encoded(layout.tokens.ids, None, layout.tokens, truncated=False)
    return output, document
