"""The explanation service: validation, tokenisation, micro-batched inline explanations, and
the doors to jobs and drift. It knows nothing about gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from limelight import tracing
from limelight.batching import MicroBatcher
from limelight.core.caller_shares import CallerShares
from limelight.core.jobs import (
    InputPolicy,
    JobBackend,
    JobCursor,
    JobRecord,
    JobSpec,
    JobState,
)
from limelight.core.prediction import (
    MULTI_LABEL,
    Prediction,
    label_thresholds,
    predict,
    predict_rows,
    softmax,  # noqa: F401  (re-exported: older imports of limelight.core.service.softmax)
)
from limelight.core.redaction import PathRedactor
from limelight.core.types import (
    Attribution,
    Cost,
    Encoded,
    ExplainInput,
    Explanation,
    Failed,
    FloatArray,
    MethodInfo,
    ModelInfo,
    TargetSpec,
    Timings,
    TokenColumns,
    TokenInfo,
)
from limelight.core.windows import (
    aggregate_logits,
    check_stride,
    check_token_limit,
    encode_document,
)
from limelight.drift.feeder import DriftFeeder
from limelight.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LimelightError,
    Unavailable,
    Unimplemented,
)
from limelight.methods.base import (
    AttributionMethod,
    ExtraOutputMethod,
    InlineMethod,
    JobMethod,
    MethodRegistry,
)
from limelight.methods.normxlogit import NormXLogit
from limelight.metrics import Metrics
from limelight.models.tokenize import backend, check_has_tokens, to_encoded
from limelight.runtimes.base import InlineBatch, Runtime

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel
    from limelight.settings import Settings

log = logging.getLogger(__name__)
#: Most jobs ``list_jobs`` returns in one page.
MAX_LIST_JOBS = 1000
#: Longest idempotency key a job may carry (it is stored with the job and indexed).
MAX_IDEMPOTENCY_KEY_CHARS = 256


class InferenceGate(Protocol):
    """Told when inline forward passes run, so job workers can yield the CPU to them."""

    def enter(self) -> None: ...

    def exit(self) -> None: ...


class DriftSink(Protocol):
    def sampled(self) -> bool:
        """Whether to observe the explanation at hand (asked first: a skipped one costs
        nothing more)."""
        ...

    def observe(self, label: str, tokens: list[str], scores: Sequence[float]) -> None: ...

    def report(self, top_k: int) -> Any: ...


@dataclass
class _InlineItem:
    encoded: Encoded
    method: InlineMethod
    runtime: Runtime
    """The runtime served when the request was admitted: a hot reload swaps in a new one for
    the requests after it, while every window of a long document admitted before is still
    computed by the same model and head."""
    submitted: float
    trace: Any = None
    """The request's span context, to link its micro-batch to it (tracing on)."""

    def size(self) -> int:
        """Tokens, for the batcher's length policy."""
        return len(self.encoded.input_ids)


def abandon(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel work whose answer no one will read, and take its outcome when it ends (asyncio
    logs a task's exception that was never retrieved as an error: a deadline that passed under
    a stream the client had already left is not one)."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(_take_outcome)


def _take_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass
class _InlineResult:
    logits: FloatArray  # [C]
    matrix: FloatArray  # [n, C]
    normxlogit: FloatArray | None  # [n, C] when the method is another one
    queue_s: float
    forward_s: float
    attribute_s: float
    batch_size: int
    prediction: Prediction | None = None
    """Computed with the batch's (one numpy pass); None: from ``logits`` when assembled."""


def validate_text(text: str, text_pair: str | None, max_chars: int) -> None:
    if not text or not text.strip():
        raise InvalidArgument("text is empty")
    if text_pair is not None and not text_pair.strip():
        raise InvalidArgument("text_pair is empty (omit it for single-text input)")
    size = len(text) + len(text_pair or "")
    if size > max_chars:
        raise InvalidArgument(f"text has {size} characters; the limit is {max_chars}")
    for what, value in (("text", text), ("text_pair", text_pair or "")):
        try:
            # JSON can escape half a surrogate pair ("\ud800"); Python decodes it into a
            # string that no tokenizer or UTF-8 encoder takes.
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(
                f"{what} is not valid Unicode: a lone surrogate (U+{ord(value[exc.start]):04X}) "
                f"at character {exc.start}"
            ) from None


_TOKENIZE_BUCKET_CHARS = 512
_INLINE_TOKENIZE_CHARS = 1_000
_PREFIX_CHARS_PER_TOKEN = 8
_PREFIX_MARGIN_CHARS = 256
_TOKENIZE_BATCH_CHARS = 32_768


def _chars(item: tuple[str, str | None]) -> int:
    return len(item[0]) + len(item[1] or "")


def encode_batch(
    model: LoadedModel,
    inputs: Sequence[tuple[str, str | None]],
    max_tokens: int | None = None,
    truncation: Literal["truncate", "reject", "window"] = "truncate",
) -> list[Encoded | LimelightError]:
    """Tokenise many inputs with one call of the fast tokenizer.

    Same result as ``LoadedModel.encode`` for each input; an input the truncation policy
    rejects gets its error in its place instead of failing the others."""
    limit = min(max_tokens or model.max_tokens, model.max_tokens)
    cutting = backend(model.tokenizer, limit)
    # A single text far longer than the limit is tokenised from a prefix: the tokens kept are
    # the same as long as they end well before the cut (checked below; else the whole text).
    cut = limit * _PREFIX_CHARS_PER_TOKEN
    batch = [
        (text[:cut] if len(text) > cut else text) if pair is None else (text, pair)
        for text, pair in inputs
    ]
    if len(batch) == 1:
        # One input (every request on an idle server): the single-input call, without the
        # backend's parallel batch machinery, which one input has no use for.
        text, pair = inputs[0]
        first = text[:cut] if pair is None and len(text) > cut else text
        encodings = [cutting.encode(first, pair, add_special_tokens=True)]
    else:
        encodings = cutting.encode_batch(batch, add_special_tokens=True)
    for index, (enc, (text, pair)) in enumerate(zip(encodings, inputs, strict=True)):
        if pair is None and len(text) > cut:
            ends = [
                end
                for (_, end), special in zip(enc.offsets, enc.special_tokens_mask, strict=True)
                if not special
            ]
            if not enc.overflowing or not ends or max(ends) > cut - _PREFIX_MARGIN_CHARS:
                encodings[index] = cutting.encode(text, add_special_tokens=True)
    with_types = model.adapter.uses_token_type_ids
    results: list[Encoded | LimelightError] = []
    for index, enc in enumerate(encodings):
        truncated = bool(enc.overflowing)
        if truncated and truncation == "reject":
            try:  # the exact error message (token count) from the one-by-one path
                results.append(model.encode(*inputs[index], max_tokens, truncation))
            except LimelightError as exc:
                results.append(exc)
            continue
        paired = inputs[index][1] is not None
        try:
            check_has_tokens(enc)
        except LimelightError as exc:
            results.append(exc)
            continue
        results.append(to_encoded(enc, paired, with_types, truncated))
    return results


NORMXLOGIT = "normxlogit"
DRIFT_FLUSH_S = 2.0
"""A drift report waits this long at most for the answers still queued for the monitor."""


def resolve_default_method(name: str, runtime: Runtime) -> str:
    """``auto`` is the distilled head when the runtime computes one, else the lexicon lookup
    when it reads a lexicon table, else NormXLogit: the most faithful inline method there is."""
    if name != "auto":
        return name
    from limelight.models.explainer_head import OUTPUT_NAME  # torch and safetensors: on use
    from limelight.models.lexicon_table import OUTPUT_NAME as LEXICON

    if OUTPUT_NAME in runtime.head_names:
        return "distilled"
    return "lexicon_lookup" if LEXICON in runtime.head_names else NORMXLOGIT


def served_inline_method(
    settings: Settings, runtime: Runtime, methods: MethodRegistry
) -> InlineMethod:
    """The inline method of a request that names none: ``settings.default_method``, with
    ``auto`` resolved against the outputs ``runtime`` computes (FailedPrecondition when it names
    a job method)."""
    method = methods.get(resolve_default_method(settings.default_method, runtime))
    if not isinstance(method, InlineMethod):
        raise FailedPrecondition(
            f"default method {settings.default_method!r} is not an inline method"
        )
    return method


def explained_targets(
    model: LoadedModel, target: TargetSpec | None, prediction: Prediction
) -> list[int]:
    """The labels an inline explanation explains: the requested one; else, multi-label, every
    predicted label (most probable first), or the most probable label when none passed its
    threshold; else the predicted class."""
    if target is not None and (target.label is not None or target.index is not None):
        return [resolve_target(model, target, prediction.index)]
    if model.problem_type == MULTI_LABEL and prediction.active:
        return list(prediction.active)
    return [prediction.index]


def resolve_target(model: LoadedModel, target: TargetSpec | None, predicted: int) -> int:
    """The class index to explain: the named or numbered class, else the predicted one."""
    if target is None or (target.label is None and target.index is None):
        return predicted
    if target.label is not None:
        return model.label_index(target.label)
    assert target.index is not None
    if not 0 <= target.index < model.num_labels:
        raise InvalidArgument(
            f"target index {target.index} is out of range; the model has {model.num_labels} classes"
        )
    return target.index


def _observe_drift(
    drift: DriftSink,
    labels: Sequence[str],
    tokens: Sequence[TokenInfo],
    matrix: FloatArray,
    indices: Sequence[int],
) -> None:
    """Feed one answer to ``drift`` (in the feeder's thread): its text tokens and, for each
    predicted label (``labels``, at ``indices`` of the matrix's columns), their scores."""
    columns = TokenColumns.of(tokens)
    keep = [i for i, special in enumerate(columns.special) if not special]
    texts = [columns.texts[i] for i in keep]
    rows = matrix[keep]  # one numpy call, not one scalar read per token
    for label, index in zip(labels, indices, strict=True):
        drift.observe(label, texts, rows[:, index].tolist())


class ExplanationService:
    """Serves inline explanations and fronts the job backend and the drift monitor."""

    def __init__(
        self,
        settings: Settings,
        model: LoadedModel,
        runtime: Runtime,
        methods: MethodRegistry,
        metrics: Metrics,
        *,
        jobs: JobBackend | None = None,
        drift: DriftSink | None = None,
        gate: InferenceGate | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        #: What a client reads of a message (the server's paths named, not spelled out).
        self.redact = PathRedactor.of(settings, model)
        self.runtime = runtime
        self.methods = methods
        self.metrics = metrics
        self.jobs = jobs
        self.drift = drift
        # Observing an answer for drift is O(tokens) of Python: its own thread does it, after
        # the answer has gone (limelight.drift.feeder); started with the first observation.
        self._drift_feeder: DriftFeeder | None = None
        self._gate = gate
        # One inference thread: torch parallelises inside the op; batches run one at a time.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inline")
        self._batcher: MicroBatcher[_InlineItem, _InlineResult] | None = None
        # One tokenizer thread: requests that arrive together are tokenised with one call of
        # the fast tokenizer, off the event loop, while the inference thread runs a batch.
        self._tokenize_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._tokenizer: MicroBatcher[tuple[str, str | None], Encoded | LimelightError] | None
        self._tokenizer = None
        self._stage = {
            name: metrics.stage_duration.labels(name)
            for name in ("tokenize", "queue", "forward", "attribute", "total")
        }
        self._ready = False
        # Inline requests admitted (past the readiness check) and not yet answered: draining
        # waits for these, so a request accepted before SIGTERM is never refused half-way
        # (say between the tokenizer and the batcher).
        self._admitted = 0
        self._shares = CallerShares(settings.max_pending_per_caller)
        self._all_answered = asyncio.Event()
        self._all_answered.set()
        self.default_method = served_inline_method(settings, runtime, methods)
        self._normxlogit = NormXLogit()
        # Read once: the model's config answers these through transformers' attribute
        # machinery, which costs more per request than the rest of the answer's bookkeeping.
        self._problem = model.problem_type
        self._multi_label = model.is_multi_label
        self._regression = model.is_regression
        self._labels = list(model.labels)
        #: Label index -> its predictions counter, made on first use (as ``labels()`` would).
        self._predicted_counter: dict[int, Any] = {}
        limit = min(settings.max_tokens, model.max_tokens)
        single = model.tokenizer.num_special_tokens_to_add(pair=False)
        check_token_limit(limit, single, model.tokenizer.num_special_tokens_to_add(pair=True))
        if settings.truncation == "window":
            check_stride(settings.window_stride, limit, single)
        #: Multi-label: one threshold per label (an unknown label in the settings fails here).
        self.thresholds = (
            label_thresholds(model.labels, settings.label_threshold, settings.label_thresholds)
            if model.is_multi_label
            else []
        )
        ignored = sorted({"label_threshold", "label_thresholds"} & settings.model_fields_set)
        if ignored and not model.is_multi_label:
            # Not an error (one configuration may serve several models), but never silent.
            log.warning(
                "%s: %s is a %s model, thresholds apply to multi-label models only; ignored",
                " and ".join(ignored),
                model.name,
                model.problem_type.replace("_", " "),
            )

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Started, not draining, and able to answer a request that names no method (what a
        readiness probe asks: a default method named in the settings whose head or table is
        not loaded would fail every such request)."""
        return self._ready and not self.default_unavailable

    @property
    def default_unavailable(self) -> str:
        """Why the default inline method cannot be served now ("" when it can)."""
        method = self.default_method
        if not isinstance(method, ExtraOutputMethod) or method.output in self.runtime.head_names:
            return ""
        return (
            method.unavailable_reason(self.model)
            or f"this server has not loaded {method.needs} yet"
        )

    def _unavailable(self, method: AttributionMethod) -> str:
        """Why ``method`` cannot be served now ("" when it can), by what is served: an extra
        output the runtime computes is served though its files changed since (a head the
        reloader keeps serving), and one whose files are there is not until it is loaded."""
        if isinstance(method, ExtraOutputMethod):
            if method.output in self.runtime.head_names:
                return ""
            return (
                method.unavailable_reason(self.model)
                or f"this server has not loaded {method.needs} yet"
            )
        return method.unavailable_reason(self.model)

    async def start(self) -> None:
        """Create the batcher in the running loop, warm up, start jobs; then ready."""
        settings = self.settings
        self._batcher = MicroBatcher(
            self._process,
            executor=self._executor,
            max_batch_size=settings.max_batch_size,
            max_wait_s=settings.max_batch_wait_ms / 1000.0,
            max_pending=settings.max_pending,
            max_batch_tokens=settings.max_batch_tokens,
            bucket_floor=settings.batch_bucket_floor,
            length_penalty=settings.batch_length_penalty,
            anticipate_s=settings.batch_anticipate_ms / 1000.0,
            size=_InlineItem.size,
            on_batch=self._record_batch,
            on_anticipation=self._record_anticipation,
            on_pending=self.metrics.inline_pending.set,
        )
        await self._batcher.start()
        # Length-aware too (by characters): a short text is not tokenised in the same call
        # as, nor queued behind, a backlog of 20,000-character ones.
        self._tokenizer = MicroBatcher(
            self._encode_many,
            executor=self._tokenize_executor,
            max_batch_size=max(64, settings.max_batch_size),
            max_pending=settings.max_pending,
            max_batch_tokens=_TOKENIZE_BATCH_CHARS,
            bucket_floor=_TOKENIZE_BUCKET_CHARS,
            length_penalty=settings.batch_length_penalty,
            size=_chars,
        )
        await self._tokenizer.start()
        if self.settings.warmup:
            warm = self.model.encode("Limelight warm-up.", None, self.settings.max_tokens)
            batch = InlineBatch.from_encoded([warm], self.model.pad_id)
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self.runtime.warmup, batch
            )
        if self.jobs is not None:
            await self.jobs.start()
        self._ready = True
        self.metrics.ready.set(1 if self.ready else 0)

    async def drain(self, grace_s: float) -> None:
        """Stop accepting work; let in-flight inline requests and running jobs finish."""
        self._ready = False
        self.metrics.ready.set(0)
        end = time.monotonic() + grace_s
        # Every admitted request first: each goes through the tokenizer and then the batcher,
        # and neither may close while one is between the two.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_answered.wait(), grace_s)
        if self._tokenizer is not None:  # requests being tokenised still go on to a batch
            await self._tokenizer.drain(grace_s)
        if self._batcher is not None:
            await self._batcher.drain(max(0.0, end - time.monotonic()))
        if self.jobs is not None:  # what is left of the same budget
            await self.jobs.stop(max(0.0, end - time.monotonic()))

    async def close(self) -> None:
        if self._tokenizer is not None:
            await self._tokenizer.stop()
        if self._batcher is not None:
            await self._batcher.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._tokenize_executor.shutdown(wait=False, cancel_futures=True)
        if self._drift_feeder is not None:  # what was answered is observed, briefly
            await asyncio.get_running_loop().run_in_executor(
                None, self._drift_feeder.close, DRIFT_FLUSH_S
            )

    def _require_ready(self) -> None:
        if not self._ready:
            raise Unavailable("the model is not loaded yet or the server is draining")

    @contextlib.contextmanager
    def _admit(self) -> Iterator[None]:
        """Admit one inline request (refused once draining) and count it until answered."""
        self._require_ready()
        self._admitted += 1
        self._all_answered.clear()
        try:
            yield
        finally:
            self._admitted -= 1
            if self._admitted == 0:
                self._all_answered.set()

    # --- inline explanations -------------------------------------------------------------------

    def _inline_method(self, name: str) -> InlineMethod:
        method = self.methods.get(name) if name else self.default_method
        if not isinstance(method, InlineMethod):
            raise InvalidArgument(
                f"{method.name!r} is a job method, not served inline: submit it as a job (gRPC "
                f"SubmitJob, the SDK's submit(), `limelight explain --method {method.name}`)"
            )
        if isinstance(method, ExtraOutputMethod) and method.output in self.runtime.head_names:
            # Checked when the runtime was built from it; the files on disk may have changed
            # since (to a head the reloader refused), but this is what is served.
            return method
        reason = method.unavailable_reason(self.model)
        if reason:
            raise FailedPrecondition(reason)
        if isinstance(method, ExtraOutputMethod):
            # Written beside the model after this server loaded it, not picked up yet.
            raise FailedPrecondition(
                f"{method.name}: this server has not loaded {method.needs} yet; it serves new "
                "ones from beside the model within LIMELIGHT_RELOAD_INTERVAL_S"
            )
        return method

    async def swap_runtime(
        self, runtime: Runtime, drift: DriftSink | None, default_method: str | None = None
    ) -> None:
        """Serve the inline requests admitted from now on with ``runtime`` (warmed up first, in
        the inference thread, between two batches), its default method (or ``default_method``)
        and ``drift`` with it. A request admitted before keeps the method and the runtime it was
        admitted with, so that every window of a long document is computed by one model and
        head. A ``default_method`` whose output the runtime served lacks is refused (that would
        take the sidecar out of rotation); one never served (not ready since the start) may stay
        unserved: the new runtime may bring other outputs."""
        loop = asyncio.get_running_loop()
        if self.settings.warmup:
            warm = self.model.encode("Limelight warm-up.", None, self.settings.max_tokens)
            batch = InlineBatch.from_encoded([warm], self.model.pad_id)
            await loop.run_in_executor(self._executor, runtime.warmup, batch)
        if default_method is None:
            default = served_inline_method(self.settings, runtime, self.methods)
        else:
            kept = self.methods.get(default_method)
            if not isinstance(kept, InlineMethod) or (
                isinstance(kept, ExtraOutputMethod)
                and kept.output not in runtime.head_names
                and (kept is not self.default_method or kept.output in self.runtime.head_names)
            ):
                raise FailedPrecondition(f"the new runtime cannot serve {default_method}")
            default = kept

        def swap() -> None:
            for method in self.methods:  # they read their files again
                if isinstance(method, ExtraOutputMethod):
                    method.forget_reasons()
            self.runtime = runtime
            self.default_method = default
            self.drift = drift

        await loop.run_in_executor(self._executor, swap)
        if self._ready:  # a head that came may make the default method servable, or go
            self.metrics.ready.set(1 if self.ready else 0)

    def encode(self, text: str, text_pair: str | None) -> Encoded:
        validate_text(text, text_pair, self.settings.max_text_chars)
        encoded = self.model.encode(
            text, text_pair, self.settings.max_tokens, self.settings.truncation
        )
        check_has_tokens(encoded)
        return encoded

    def _encode_many(self, inputs: list[tuple[str, str | None]]) -> list[Encoded | LimelightError]:
        """Runs in the tokenizer thread: one call of the fast tokenizer for all waiting inputs."""
        return encode_batch(self.model, inputs, self.settings.max_tokens, self.settings.truncation)

    async def encode_async(
        self, text: str, text_pair: str | None, tokenize_here: bool = True, paced: bool = False
    ) -> Encoded:
        """``encode`` off the event loop, batched with whatever else is being tokenised.

        On an idle server (nothing being tokenised, no batch running or waiting) a short text
        is tokenised right here: the loop has nothing else to do, and the two thread
        hand-offs would cost more than the ~0.1 ms of tokenising. Not with ``tokenize_here``
        false (an input of a call that brought others): tokenised here, it would reach the
        idle inference thread alone and take a forward pass of its own, ahead of the rest.
        ``paced``: wait for room in the tokenizer's backlog rather than be refused."""
        validate_text(text, text_pair, self.settings.max_text_chars)
        assert self._tokenizer is not None and self._batcher is not None
        item = (text, text_pair)
        if (
            tokenize_here
            and self._tokenizer.idle
            and self._batcher.idle
            and _chars(item) <= _INLINE_TOKENIZE_CHARS
        ):
            encoded = self._encode_many([item])[0]
        else:
            encoded = await self._tokenizer.submit(item, wait=paced)
        if isinstance(encoded, LimelightError):
            raise encoded
        return encoded

    def _process(self, items: list[_InlineItem]) -> list[_InlineResult]:
        """Runs in the inference thread: one forward pass for the whole batch (one per runtime
        in the batch, which is only ever more than one right after a hot reload)."""
        runtime = items[0].runtime
        if all(item.runtime is runtime for item in items):
            return self._process_on(runtime, items)
        results: dict[int, _InlineResult] = {}
        for served in {id(item.runtime): item.runtime for item in items}.values():
            rows = [row for row, item in enumerate(items) if item.runtime is served]
            answers = self._process_on(served, [items[row] for row in rows])
            results.update(zip(rows, answers, strict=True))
        return [results[row] for row in range(len(items))]

    def _process_on(self, runtime: Runtime, items: list[_InlineItem]) -> list[_InlineResult]:
        start = time.monotonic()
        batch = InlineBatch.from_encoded([i.encoded for i in items], self.model.pad_id)
        if self._gate is not None:
            self._gate.enter()
        try:
            with tracing.inline_batch([i.trace for i in items], batch.input_ids.size):
                outputs = runtime.run_inline(batch)
        finally:
            if self._gate is not None:
                self._gate.exit()
        forwarded = time.monotonic()
        matrices = [
            item.method.attribute(outputs, row, len(item.encoded)) for row, item in enumerate(items)
        ]
        # NormXLogit rides along on every response whatever the method (no extra model call).
        normx = [
            None
            if item.method.name == NORMXLOGIT
            else self._normxlogit.attribute(outputs, row, len(item.encoded))
            for row, item in enumerate(items)
        ]
        predictions = predict_rows(outputs.logits, self._problem, self.thresholds)
        done = time.monotonic()
        return [
            _InlineResult(
                logits=outputs.logits[row],
                matrix=matrices[row],
                normxlogit=normx[row],
                queue_s=start - item.submitted,
                forward_s=forwarded - start,
                attribute_s=done - forwarded,
                batch_size=len(items),
                prediction=predictions[row],
            )
            for row, item in enumerate(items)
        ]

    def _record_batch(self, sizes: list[int], waits: list[float]) -> None:
        self.metrics.batch_size.observe(len(sizes))
        # Sizes are token counts: input / padded tokens is the length policy's efficiency.
        self.metrics.batch_tokens.labels(kind="input").inc(sum(sizes))
        self.metrics.batch_tokens.labels(kind="padded").inc(len(sizes) * max(sizes))

    def _record_anticipation(self, hit: bool) -> None:
        self.metrics.batch_anticipation.labels(outcome="hit" if hit else "miss").inc()

    async def explain(self, request: ExplainInput, caller: str | None = None) -> Explanation:
        """One inline explanation; ``caller`` (who the API layer says is calling; None for
        in-process callers) is held to its share of the backlog (``max_pending_per_caller``)."""
        with self._admit(), self._shares.take(caller):
            return await self._explain(request)

    async def _explain_with_others(self, request: ExplainInput) -> Explanation:
        """``explain`` for one input of a call that brought several (``explain_batch``)."""
        with self._admit():
            return await self._explain(request, tokenize_here=False)

    async def _explain_paced(self, request: ExplainInput) -> Explanation:
        """``explain`` for one input of a stream: it waits for room in a full backlog."""
        with self._admit():
            return await self._explain(request, paced=True)

    async def _explain(
        self, request: ExplainInput, tokenize_here: bool = True, paced: bool = False
    ) -> Explanation:
        """``paced``: wait for room in a full backlog (a stream's input) rather than be
        refused; a refusal comes before the text is tokenized for nothing."""
        assert self._batcher is not None
        began = time.monotonic()
        if request.expired():
            raise DeadlineExceeded("the deadline passed before the request was read")
        method, runtime = self._inline_method(request.method), self.runtime
        if request.target is not None:
            # An unknown label or an index out of range fails before any model work, so that
            # of several inputs sent at once the first bad one in order is named.
            resolve_target(self.model, request.target, 0)
        self._batcher.check_room(full=not paced)
        encoded = await self.encode_async(request.text, request.text_pair, tokenize_here, paced)
        if encoded.truncated and self._windowed(request):
            return await self._explain_windows(request, method, runtime, began, paced)
        tokenized = time.monotonic()
        result = await self._batcher.submit(
            _InlineItem(encoded, method, runtime, tokenized, tracing.span_context()),
            request.deadline,
            wait=paced,
        )
        explanation = self._assemble(request, encoded, method, result)
        timings = explanation.timings
        timings.tokenize_seconds = tokenized - began
        timings.total_seconds = time.monotonic() - began
        self._observe(explanation, result.matrix)
        return explanation

    def _windowed(self, request: ExplainInput) -> bool:
        return self.settings.truncation == "window" and request.text_pair is None

    async def _explain_windows(
        self,
        request: ExplainInput,
        method: InlineMethod,
        runtime: Runtime,
        began: float,
        paced: bool = False,
    ) -> Explanation:
        """A text over the token limit under ``truncation=window``: every window goes through
        the micro-batcher as an item of its own; the prediction and the attributions are put
        back together (``limelight.core.windows``)."""
        assert self._batcher is not None
        settings = self.settings
        limit = min(settings.max_tokens, self.model.max_tokens)
        windows, layout = await asyncio.get_running_loop().run_in_executor(
            self._tokenize_executor,
            encode_document,
            self.model,
            request.text,
            limit,
            settings.window_stride,
        )
        tokenized = time.monotonic()
        trace = tracing.span_context()
        # Admitted as a whole; once one window fails (its deadline passed in the queue, its
        # batch failed) the others are withdrawn rather than computed for nothing.
        items = [_InlineItem(w, method, runtime, tokenized, trace) for w in windows]
        if paced:
            pending = await self._batcher.admit(items, request.deadline)
        else:
            pending = self._batcher.submit_all(items, request.deadline)
        try:
            results = await asyncio.gather(*pending)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
        normx = [r.normxlogit for r in results if r.normxlogit is not None]
        merged = _InlineResult(
            logits=aggregate_logits([r.logits for r in results], settings.window_aggregation),
            matrix=layout.stitch([r.matrix for r in results]),
            normxlogit=layout.stitch(normx) if len(normx) == len(results) else None,
            # Windows share batches (with each other and other traffic): each counts its share.
            queue_s=max(r.queue_s for r in results),
            forward_s=sum(r.forward_s / r.batch_size for r in results),
            attribute_s=sum(r.attribute_s / r.batch_size for r in results),
            batch_size=max(r.batch_size for r in results),
        )
        document = Encoded(layout.tokens.ids, None, layout.tokens, truncated=False)
        explanation = self._assemble(request, document, method, merged)
        explanation.windows = len(windows)
        timings = explanation.timings
        timings.tokenize_seconds = tokenized - began
        timings.total_seconds = time.monotonic() - began
        self._observe(explanation, merged.matrix)
        return explanation

    async def explain_many(
        self,
        requests: AsyncIterator[ExplainInput | Failed],
        window: int | None = None,
        caller: str | None = None,
    ) -> AsyncIterator[Explanation | Failed]:
        """Explains a stream concurrently (so batches fill) and yields results in order.

        The first input that fails ends the stream with its error, after the answers before it,
        unless it asked for ``continue_on_error``: then its ``Failed`` is yielded in its place
        and the stream goes on. A ``Failed`` in ``requests`` (an input the caller could not even
        read) is passed through in its place. Past ``caller``'s share of the backlog the next
        input waits for room (the stream is paced, not refused)."""
        window = window or 2 * self.settings.max_batch_size
        pending: asyncio.Queue[asyncio.Task[Explanation | Failed] | None] = asyncio.Queue(window)
        # Every answer begun and not yet read: when the reader goes away (cancelled, its deadline
        # passed, an earlier answer failed) these include the one the feeder holds while it
        # waits for room in the queue.
        unread: set[asyncio.Task[Explanation | Failed]] = set()

        async def feed() -> None:
            try:
                async for request in requests:
                    task = asyncio.ensure_future(self._paced(request, caller))
                    unread.add(task)
                    await pending.put(task)
            except asyncio.CancelledError:
                raise  # the reader has left: there is no one to tell where the inputs end
            except Exception:
                await pending.put(None)  # the reader learns what failed from `await feeder`
                raise
            await pending.put(None)

        feeder = asyncio.ensure_future(feed())
        try:
            while (task := await pending.get()) is not None:
                unread.discard(task)
                yield await task
            await feeder
        finally:
            abandon([feeder, *unread])

    async def _paced(
        self, request: ExplainInput | Failed, caller: str | None
    ) -> Explanation | Failed:
        async with self._shares.wait(None if isinstance(request, Failed) else caller):
            return await self._answer(request, paced=True)

    async def _answer(
        self, request: ExplainInput | Failed, together: bool = False, paced: bool = False
    ) -> Explanation | Failed:
        """``explain`` (``together``: as one input of several sent at once; ``paced``: of a
        stream), with a failure answered as a ``Failed`` when the input asked for
        ``continue_on_error``."""
        if isinstance(request, Failed):
            return request
        if paced:
            explain = self._explain_paced
        else:
            explain = self._explain_with_others if together else self.explain
        try:
            if request.trace_context and tracing.enabled():
                # This input's caller is not necessarily the call's (pooled streams).
                with tracing.input_span(request.trace_context, request.request_id, self.redact):
                    return await explain(request)
            return await explain(request)
        except Exception as exc:
            # A server that is not ready (loading, draining) fails the whole call: no input's
            # fault, and an answer in its place would keep the caller on this server instead
            # of retrying elsewhere (the SDK retries and redials on UNAVAILABLE).
            if not request.continue_on_error or isinstance(exc, Unavailable):
                raise
            return Failed(exc, request.request_id)  # the API layer logs the unexpected

    async def explain_batch(
        self, requests: Sequence[ExplainInput], caller: str | None = None
    ) -> list[Explanation]:
        """Explain the inputs of one call concurrently (so that the micro-batcher fills) and
        answer in input order. The first input in order that failed fails the call, with its
        position in the message; the others are cancelled as soon as one fails.
        ``continue_on_error`` is not honoured here (``explain_each`` honours it)."""
        plain = [
            replace(r, continue_on_error=False) if r.continue_on_error else r for r in requests
        ]
        # Nothing asked to go on, so every answer is an Explanation (or the call raised).
        answers = await self.explain_each(plain, caller)
        return [r for r in answers if isinstance(r, Explanation)]

    async def explain_each(
        self, requests: Sequence[ExplainInput | Failed], caller: str | None = None
    ) -> list[Explanation | Failed]:
        """``explain_batch``, where an input that asked for ``continue_on_error`` is answered
        by its ``Failed`` when it fails, and fails neither the call nor the other inputs. A
        ``Failed`` in ``requests`` (an input the caller could not read) keeps its place. The
        call takes ``caller``'s share of the backlog for all its inputs at once, or is refused."""
        limit = self.settings.max_batch_request_items
        if len(requests) > limit:
            raise InvalidArgument(
                f"{len(requests)} inputs in one call; at most {limit} (max_batch_request_items)"
            )
        with self._shares.take(caller, sum(not isinstance(r, Failed) for r in requests)):
            return await self._explain_all(requests)

    async def _explain_all(
        self, requests: Sequence[ExplainInput | Failed]
    ) -> list[Explanation | Failed]:
        together = len(requests) > 1
        # At most two batches' worth of one call's inputs in the backlog at a time: one batch
        # running and the next queued keep the thread busy, and other callers' requests get in
        # between (a call's 256 inputs, all queued at once, held single calls 80x longer).
        in_backlog = asyncio.Semaphore(2 * self.settings.max_batch_size)

        async def answer(request: ExplainInput | Failed) -> Explanation | Failed:
            async with in_backlog:
                return await self._answer(request, together)

        tasks = [asyncio.ensure_future(answer(r)) for r in requests]
        if not tasks:
            return []
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # one failed, or the call itself was cancelled: the rest is not wanted
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failures = [
            (i, error)
            for i, task in enumerate(tasks)
            if not task.cancelled() and (error := task.exception()) is not None
        ]
        if failures:
            index, error = failures[0]
            if isinstance(error, LimelightError) and together:
                raise type(error)(f"input {index}: {error.message}") from error
            raise error
        return [task.result() for task in tasks]

    def _assemble(
        self,
        request: ExplainInput,
        encoded: Encoded,
        method: InlineMethod,
        result: _InlineResult,
    ) -> Explanation:
        model = self.model
        prediction = result.prediction or self.predict(result.logits)
        predicted = prediction.index
        labels = self._labels
        if request.target is None and not self._multi_label:
            targets = [predicted]  # what explained_targets answers, without its config reads
        else:
            targets = explained_targets(model, request.target, prediction)

        def attribution(target: int, primary: bool) -> Attribution:
            return Attribution(
                method=method.name,
                parameters={},
                target_index=target,
                target_label=labels[target],
                scores=np.ascontiguousarray(result.matrix[:, target]),
                class_scores=result.matrix if request.all_classes and primary else None,
                extra_scores=(
                    {NORMXLOGIT: np.ascontiguousarray(result.normxlogit[:, target])}
                    if result.normxlogit is not None
                    else {}
                ),
            )

        multi = self._multi_label
        return Explanation(
            request_id=request.request_id,
            label_index=predicted,
            label=labels[predicted],
            probabilities=[float(p) for p in prediction.probabilities],
            labels=list(labels),
            tokens=encoded.tokens,  # shared, never changed
            attribution=attribution(targets[0], True),
            predicted_labels=[] if self._regression else [labels[i] for i in prediction.active],
            multi_label=multi,
            thresholds=list(self.thresholds),
            label_attributions=[attribution(t, False) for t in targets[1:]],
            model_name=model.name,
            model_version=model.version,
            truncated=encoded.truncated,
            timings=Timings(
                queue_seconds=result.queue_s,
                forward_seconds=result.forward_s,
                attribute_seconds=result.attribute_s,
                batch_size=result.batch_size,
            ),
        )

    def predict(self, logits: FloatArray) -> Prediction:
        """Probabilities, top label and predicted set of one row of logits."""
        return predict(logits, self._problem, self.thresholds)

    def _observe(self, explanation: Explanation, matrix: FloatArray) -> None:
        """Metrics, and drift with each predicted class's scores (whatever the target was):
        one observation per predicted label (multi-label: every label over its threshold,
        none when no label is)."""
        m = self.metrics
        t = explanation.timings
        stage = self._stage
        stage["tokenize"].observe(t.tokenize_seconds)
        stage["queue"].observe(t.queue_seconds)
        stage["forward"].observe(t.forward_seconds)
        stage["attribute"].observe(t.attribute_seconds)
        # Per input, whatever the RPC: a stream's or a batch's own duration says nothing of it.
        stage["total"].observe(t.total_seconds)
        if explanation.multi_label:
            predicted = [self._labels.index(name) for name in explanation.predicted_labels]
        else:
            predicted = [explanation.label_index]
        for index in predicted:
            counter = self._predicted_counter.get(index)
            if counter is None:
                counter = self._predicted_counter[index] = m.predictions.labels(self._labels[index])
            counter.inc()
        if not self._regression:
            m.confidence.observe(explanation.probabilities[explanation.label_index])
        if explanation.truncated:
            m.truncated.inc()
        drift = self.drift
        if (
            drift is not None
            and explanation.attribution.method == self.default_method.name
            and drift.sampled()
        ):
            feeder = self._drift_feeder
            if feeder is None:
                feeder = self._drift_feeder = DriftFeeder(
                    self.settings.drift_queue_tokens, m.drift_dropped
                )
            # The monitor observing now (a swapped runtime brings its own) gets the answer.
            names = [self._labels[index] for index in predicted]
            tokens = explanation.tokens
            observe = partial(_observe_drift, drift, names, tokens, matrix, predicted)
            feeder.put(observe, size=len(tokens))

    # --- model info ----------------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        methods = [
            MethodInfo(
                name=m.name,
                cost=m.cost,
                description=m.description,
                defaults=m.defaults(),
                unavailable_reason=self.redact(self._unavailable(m)),
            )
            for m in self.methods
        ]
        return ModelInfo(
            name=self.model.name,
            version=self.model.version,
            architecture=self.model.architecture,
            labels=list(self.model.labels),
            num_layers=self.model.num_layers,
            num_heads=self.model.num_heads,
            hidden_size=self.model.hidden_size,
            methods=methods,
            default_method=self.default_method.name,
            max_tokens=min(self.settings.max_tokens, self.model.max_tokens),
            max_text_chars=self.settings.max_text_chars,
            runtime=self.runtime.name,
            supports_text_pair=not self.model.adapter.pools_last_token,
            problem_type=self.model.problem_type,
            thresholds=list(self.thresholds),
        )

    # --- jobs ----------------------------------------------------------------------------------

    def _job_backend(self) -> JobBackend:
        if self.jobs is None:
            raise Unimplemented("jobs are disabled on this server (jobs=off)")
        return self.jobs

    def _job_method(self, name: str) -> AttributionMethod:
        if not name:
            raise InvalidArgument("method is required for a job")
        method = self.methods.get(name)
        if method.cost is not Cost.JOB or not isinstance(method, JobMethod):
            raise InvalidArgument(
                f"{name!r} is an inline method; call Explain with method={name!r} instead"
            )
        reason = method.unavailable_reason(self.model)
        if reason:
            raise FailedPrecondition(reason)
        return method

    async def submit_job(
        self,
        method_name: str,
        text: str,
        text_pair: str | None,
        target: TargetSpec | None,
        params: Mapping[str, Any] | None,
        idempotency_key: str = "",
        timeout_s: float = 0.0,
        owner: str = "",
    ) -> JobRecord:
        """Validate everything before queueing: a bad parameter never becomes a failed job.
        ``owner``: the authenticated principal (only it can see the job afterwards)."""
        backend = self._job_backend()
        self._require_ready()
        method = self._job_method(method_name)
        checked = method.validate_params(params)
        method.validate_for_model(self.model, checked)
        self.encode(text, text_pair)  # length limits and truncation policy
        if target is not None:
            resolve_target(self.model, target, 0)
        if timeout_s < 0:
            raise InvalidArgument("timeout_seconds must be >= 0")
        if len(idempotency_key) > MAX_IDEMPOTENCY_KEY_CHARS:
            # Stored with the job and indexed: an unbounded key would fill the journal.
            raise InvalidArgument(
                f"idempotency_key has {len(idempotency_key)} characters; at most "
                f"{MAX_IDEMPOTENCY_KEY_CHARS} (a UUID or a hash of the request is enough)"
            )
        spec = JobSpec(
            method=method.name,
            text=text,
            text_pair=text_pair,
            target=target,
            params=checked,
            idempotency_key=idempotency_key,
            timeout_s=timeout_s,
            trace_context=tracing.current_context(),
            owner=owner,
            model_name=self.model.name,
            model_version=self.model.version,
            # The policy it was accepted under: a worker with other settings applies this one.
            policy=InputPolicy.of(self.settings),
        )
        return await backend.submit(spec)

    # ``owner`` below: the caller's principal; None reads every owner's jobs (in-process use).

    async def get_job(self, job_id: str, owner: str | None = None) -> JobRecord:
        return await self._job_backend().get(job_id, owner)

    async def cancel_job(self, job_id: str, owner: str | None = None) -> JobRecord:
        return await self._job_backend().cancel(job_id, owner)

    async def list_jobs(
        self,
        states: list[JobState] | None,
        limit: int,
        owner: str | None = None,
        page_token: str = "",
    ) -> tuple[list[JobRecord], str]:
        """A page of jobs, newest first, and the token of the next page ("" on the last)."""
        limit = max(1, min(limit if limit > 0 else 100, MAX_LIST_JOBS))
        after = JobCursor.from_token(page_token) if page_token else None
        # One more than asked: whether another page follows, without a second query.
        jobs = await self._job_backend().list(states or None, limit + 1, owner, after)
        if len(jobs) <= limit:
            return jobs, ""
        return jobs[:limit], JobCursor.of(jobs[limit - 1]).token()

    def watch_job(self, job_id: str, owner: str | None = None) -> AsyncIterator[JobRecord]:
        return self._job_backend().watch(job_id, owner)

    # --- drift ---------------------------------------------------------------------------------

    async def drift_report(self, top_k: int) -> Any:
        """The drift monitor's report, with every answer given so far observed (waiting up to
        ``DRIFT_FLUSH_S`` for the monitor's thread); computed off the event loop (milliseconds:
        it merges the window's sketches)."""
        drift = self.drift
        if drift is None:
            raise Unimplemented("drift monitoring is disabled on this server")
        feeder = self._drift_feeder

        def report() -> Any:
            if feeder is not None:
                feeder.flush(DRIFT_FLUSH_S)
            return drift.report(top_k if top_k > 0 else 10)

        return await asyncio.get_running_loop().run_in_executor(None, report)
