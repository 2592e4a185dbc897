"""A scripted Explainer servicer on a REAL grpc.server, for the client SDK tests.

It is a test double for the *network* behaviour only (retries, deadlines, metadata, error
codes, streaming order, job life cycles); the end-to-end tests run against the real sidecar.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import struct_pb2

from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc as pb_grpc

LABELS = ["negative", "positive"]


def word_tokens(text: str, segment: int = 0) -> list[pb.Token]:
    """Whitespace/punctuation tokens with char offsets (ids are just positions)."""
    return [
        pb.Token(text=m.group(), id=100 + i, start=m.start(), end=m.end(), segment=segment)
        for i, m in enumerate(re.finditer(r"\w+|[^\w\s]", text))
    ]


def make_response(
    text: str,
    text_pair: str | None = None,
    *,
    request_id: str = "",
    target: pb.Target | None = None,
    all_classes: bool = False,
) -> pb.ExplainResponse:
    """A deterministic ExplainResponse for ``text``: [CLS] tokens [SEP] (tokens [SEP])."""
    tokens = [pb.Token(text="[CLS]", id=101, special=True)]
    tokens += word_tokens(text)
    tokens.append(pb.Token(text="[SEP]", id=102, special=True))
    if text_pair is not None:
        tokens += word_tokens(text_pair, segment=1)
        tokens.append(pb.Token(text="[SEP]", id=102, special=True, segment=1))
    # Score i: alternating sign, growing magnitude; specials get a huge score that a ranking
    # must ignore.
    scores = [
        9.0 if t.special else (0.1 * (i + 1)) * (1 if i % 2 else -1) for i, t in enumerate(tokens)
    ]
    pred = len(text) % 2
    target_index = pred
    if target is not None and target.WhichOneof("kind") == "label":
        target_index = LABELS.index(target.label)
    elif target is not None and target.WhichOneof("kind") == "index":
        target_index = target.index
    exp = pb.Explanation(
        method="normxlogit",
        target_index=target_index,
        target_label=LABELS[target_index],
        tokens=tokens,
        scores=scores,
    )
    if all_classes:
        exp.class_scores.extend(pb.ClassScores(scores=[-s, s]) for s in scores)
    probs = [0.25, 0.75] if pred == 1 else [0.75, 0.25]
    return pb.ExplainResponse(
        request_id=request_id,
        label_index=pred,
        label=LABELS[pred],
        probabilities=probs,
        labels=LABELS,
        explanation=exp,
        model_name="tiny",
        model_version="abc123",
        timings=pb.Timings(total_seconds=0.004, forward_seconds=0.003, batch_size=2),
    )


@dataclass
class Call:
    method: str
    request: Any
    metadata: dict[str, str]
    time: float
    time_remaining: float | None
    #: The client's address and port: one per connection.
    peer: str = ""


@dataclass
class ScriptedExplainer(pb_grpc.ExplainerServicer):
    """A servicer with scripted failures, delays and jobs; it records every call."""

    failures: dict[str, list[tuple[grpc.StatusCode, str]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    delays: dict[str, float] = field(default_factory=dict)
    required_token: str | None = None
    calls: list[Call] = field(default_factory=list)
    jobs: dict[str, pb.Job] = field(default_factory=dict)
    job_text: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    watch_opens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: Which worker process a connection (the client's peer address) "reached", for
    #: GetModel's ``instance``; None: a server that does not say.
    instance_of: Callable[[str], str] | None = None
    workers: int = 1
    #: Seconds each ``ExplainStream`` answer takes.
    stream_gap: float = 0.0
    #: Texts starting "drop" that ended their stream with UNAVAILABLE (each does so once).
    dropped: set[str] = field(default_factory=set)
    #: Every request read from any ``ExplainStream``, in the order read.
    streamed: list[pb.ExplainRequest] = field(default_factory=list)

    def fail(self, method: str, code: grpc.StatusCode, times: int = 1, msg: str = "") -> None:
        self.failures[method].extend([(code, msg or f"scripted {code.name}")] * times)

    def calls_to(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    def _enter(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        with self.cond:
            call = Call(
                method, request, md, time.monotonic(), context.time_remaining(), context.peer()
            )
            self.calls.append(call)
            failure = self.failures[method].pop(0) if self.failures[method] else None
        token = self.required_token
        if token is not None and md.get("authorization") != f"Bearer {token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        if method in self.delays:
            time.sleep(self.delays[method])
        if failure is not None:
            context.abort(*failure)

    # -- inline ----------------------------------------------------------------------------

    def Explain(self, request: pb.ExplainRequest, context: grpc.ServicerContext) -> Any:
        self._enter("Explain", request, context)
        if request.text == "stall":  # answer nothing (a hung sidecar) until the call ends
            ended = threading.Event()
            context.add_callback(ended.set)
            ended.wait(60)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "stalled")
        return make_response(
            request.text,
            request.text_pair if request.HasField("text_pair") else None,
            request_id=request.request_id,
            target=request.target if request.HasField("target") else None,
            all_classes=request.all_classes,
        )

    def ExplainStream(self, request_iterator: Iterator[pb.ExplainRequest], context: Any) -> Any:
        received: list[str] = []  # the texts of this stream, in the order they came
        self._enter("ExplainStream", received, context)
        for request in request_iterator:
            received.append(request.text)
            self.streamed.append(request)
            if request.text == "boom":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "boom is not a review")
            if request.text == "hang up":  # end the stream (OK) without answering
                return
            if request.text.startswith("drop") and request.text not in self.dropped:
                self.dropped.add(request.text)  # the first time only: a worker going away
                context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
            if request.text == "stall":  # stop answering (a hung sidecar) until the call ends
                ended = threading.Event()
                context.add_callback(ended.set)
                ended.wait(60)
                return
            time.sleep(self.stream_gap)
            yield make_response(
                request.text,
                request.text_pair if request.HasField("text_pair") else None,
                request_id=request.request_id,
                all_classes=request.all_classes,
            )

    def ExplainBatch(
        self, request: pb.ExplainBatchRequest, context: grpc.ServicerContext
    ) -> pb.ExplainBatchResponse:
        self._enter("ExplainBatch", request, context)
        for i, r in enumerate(request.requests):
            if r.text == "boom":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"input {i}: boom is not a review")
        return pb.ExplainBatchResponse(
            responses=[
                make_response(
                    r.text,
                    r.text_pair if r.HasField("text_pair") else None,
                    request_id=r.request_id,
                    target=r.target if r.HasField("target") else None,
                    all_classes=r.all_classes,
                )
                for r in request.requests
            ]
        )

    def GetModel(self, request: pb.GetModelRequest, context: grpc.ServicerContext) -> Any:
        self._enter("GetModel", request, context)
        defaults = struct_pb2.Struct()
        defaults.update({"layer": 3, "tau": 5})
        return pb.ModelInfo(
            name="tiny",
            version="abc123",
            architecture="BertForSequenceClassification",
            labels=LABELS,
            num_layers=2,
            num_heads=2,
            hidden_size=32,
            methods=[
                pb.MethodInfo(name="normxlogit", cost="inline", description="inline"),
                pb.MethodInfo(
                    name="decoded_gradcam",
                    cost="job",
                    defaults=defaults,
                    unavailable_reason="no LM head",
                ),
            ],
            default_method="normxlogit",
            max_tokens=128,
            max_text_chars=10000,
            runtime="torch",
            supports_text_pair=True,
            instance=self.instance_of(context.peer()) if self.instance_of else "",
            workers=self.workers,
        )

    def GetDrift(self, request: pb.GetDriftRequest, context: grpc.ServicerContext) -> Any:
        self._enter("GetDrift", request, context)
        report = pb.DriftReport(
            reference_state="ready",
            reference_count=100,
            window_count=50,
            alert_threshold=0.2,
            labels=[
                pb.LabelDrift(
                    label="positive",
                    divergence=0.31,
                    alert=True,
                    window_count=30,
                    risers=[pb.TokenShift(token="refund", reference_share=0.0, current_share=0.1)],
                    fallers=[pb.TokenShift(token="great", reference_share=0.2, current_share=0.05)],
                )
            ],
            label_mix_divergence=0.02,
            reference_entropy=3.0,
            current_entropy=2.5,
        )
        report.generated_at.FromSeconds(1_700_000_000)
        return report

    # -- jobs ------------------------------------------------------------------------------
    # Job behaviour is scripted by the method name:
    #   "ok": QUEUED -> RUNNING -> SUCCEEDED as it is watched; "boom": ends FAILED;
    #   "hang": stays RUNNING until cancelled; "flaky": the first watch stream breaks with
    #   UNAVAILABLE after one message; "lean": like "ok" but the watch stream carries no result.

    def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> Any:
        self._enter("SubmitJob", request, context)
        with self.cond:
            if request.idempotency_key in self.keys:
                return self.jobs[self.keys[request.idempotency_key]]
            job_id = f"job-{len(self.jobs) + 1}"
            job = pb.Job(
                id=job_id,
                state=pb.JOB_STATE_QUEUED,
                method=request.method,
                parameters=request.parameters,
                idempotency_key=request.idempotency_key,
            )
            job.created_at.FromSeconds(1_700_000_000)
            self.jobs[job_id] = job
            self.job_text[job_id] = request.text
            if request.idempotency_key:
                self.keys[request.idempotency_key] = job_id
            return job

    def _job(self, job_id: str, context: grpc.ServicerContext) -> pb.Job:
        with self.cond:
            if job_id not in self.jobs:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id}")
            return self.jobs[job_id]

    def _advance(self, job: pb.Job) -> None:
        """One scripted step of a job's life (called with the lock held)."""
        if job.method in ("ok", "flaky", "boom", "lean") and job.state == pb.JOB_STATE_QUEUED:
            job.state = pb.JOB_STATE_RUNNING
            job.progress = 0.5
            job.message = "halfway"
        elif job.method in ("ok", "flaky", "lean") and job.state == pb.JOB_STATE_RUNNING:
            job.state = pb.JOB_STATE_SUCCEEDED
            job.progress = 1.0
            job.result.CopyFrom(make_response(self.job_text[job.id]))
            job.result.explanation.method = job.method
            job.finished_at.FromSeconds(1_700_000_060)
        elif job.method == "boom" and job.state == pb.JOB_STATE_RUNNING:
            job.state = pb.JOB_STATE_FAILED
            job.error = "out of memory on layer 3"
        elif job.method == "hang" and job.state == pb.JOB_STATE_QUEUED:
            job.state = pb.JOB_STATE_RUNNING
            job.progress = 0.1

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> Any:
        self._enter("GetJob", request, context)
        return self._job(request.id, context)

    def WatchJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> Any:
        self._enter("WatchJob", request, context)
        job = self._job(request.id, context)
        with self.cond:
            self.watch_opens[job.id] += 1
            opens = self.watch_opens[job.id]
        last: pb.Job | None = None
        sent = 0
        while context.is_active():
            with self.cond:
                snapshot = pb.Job()
                snapshot.CopyFrom(job)
            if job.method == "lean":  # a server that leaves results out of the watch stream
                snapshot.ClearField("result")
            if snapshot != last:
                if job.method == "flaky" and opens == 1 and sent == 1:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "worker restarting")
                yield snapshot
                sent += 1
                last = snapshot
            if snapshot.state in (
                pb.JOB_STATE_SUCCEEDED,
                pb.JOB_STATE_FAILED,
                pb.JOB_STATE_CANCELLED,
            ):
                return
            with self.cond:
                self._advance(job)
                if job == snapshot:
                    self.cond.wait(0.02)

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> Any:
        self._enter("CancelJob", request, context)
        job = self._job(request.id, context)
        with self.cond:
            if job.state in (pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING):
                job.state = pb.JOB_STATE_CANCELLED
                job.error = "cancelled by the client"
            self.cond.notify_all()
            return job

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> Any:
        self._enter("ListJobs", request, context)
        with self.cond:
            jobs = [
                j for j in self.jobs.values() if not request.states or j.state in request.states
            ]
            return pb.ListJobsResponse(jobs=jobs[: request.limit or None])


@dataclass
class AnswersOutOfOrder(ScriptedExplainer):
    """Answers ``ExplainBatch`` calls one at a time, ``gap`` seconds apart, in the order of
    their first texts in ``order`` (a server that keeps answering, but not in the order the
    calls were sent)."""

    order: list[str] = field(default_factory=list)
    gap: float = 0.3
    answered: int = 0

    def ExplainBatch(
        self, request: pb.ExplainBatchRequest, context: grpc.ServicerContext
    ) -> pb.ExplainBatchResponse:
        rank = self.order.index(request.requests[0].text)
        with self.cond:
            self.cond.wait_for(lambda: self.answered == rank, timeout=30)
        time.sleep(self.gap)
        response = super().ExplainBatch(request, context)
        with self.cond:
            self.answered += 1
            self.cond.notify_all()
        return response


@dataclass
class ScriptedServer:
    servicer: ScriptedExplainer
    target: str
    server: grpc.Server


def start_server(
    servicer: ScriptedExplainer,
    credentials: grpc.ServerCredentials | None = None,
) -> ScriptedServer:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ExplainerServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return ScriptedServer(servicer, f"127.0.0.1:{port}", server)


class Placement:
    """Where each new connection "lands": the next of ``workers`` for each new peer address,
    the same for every later call on that connection (as the kernel does with
    ``SO_REUSEPORT``, but scripted)."""

    def __init__(self, workers: Iterable[str]) -> None:
        self._next = iter(workers)
        self.of: dict[str, str] = {}

    def __call__(self, peer: str) -> str:
        if peer not in self.of:
            self.of[peer] = next(self._next)
        return self.of[peer]
