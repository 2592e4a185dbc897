"""Latency and throughput measurements behind `limelight bench` and bench/ scripts.

Every figure is a ratio against a baseline measured in the same run on the same inputs:
inline explain vs the plain classification forward (torch and ONNX Runtime), the gRPC path vs
the in-process path, job methods vs one forward pass.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Light imports only at module level: the out-of-process load generator imports this module
# and must not pay for (or compete with) torch.
if TYPE_CHECKING:
    from limelight.core.types import Encoded, FloatArray
    from limelight.methods.base import InlineMethod
    from limelight.models.loaded import LoadedModel
    from limelight.runtimes.base import InlineBatch, Runtime
    from limelight.settings import Settings


log = logging.getLogger(__name__)


def machine() -> str:
    """One line on where a measurement ran: CPU model, the cores this process may use, torch
    and its threads, the GPU when torch sees one, Python."""
    import torch

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")),
                cpu,
            )
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (
        f"{cpu}, {cores} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads){gpu}, Python {platform.python_version()}"
    )


def median_seconds(
    fn: Callable[[], object], repeats: int, warmup: int = 2, idle_s: float = 0.0
) -> float:
    """Median seconds of ``fn()``, each call after ``idle_s`` asleep (0: back to back)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if idle_s:
            time.sleep(idle_s)
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def paired_seconds(
    first: Callable[[], object],
    second: Callable[[], object],
    repeats: int,
    min_seconds: float = 1.0,
    warmup: int = 2,
) -> tuple[float, float, float]:
    """Median seconds of ``first`` and of ``second``, timed in alternating pairs, and the median
    of their per-pair ratio second / first.

    Pairs share whatever the machine is doing at that moment, so the ratio of a pair cancels
    slow drifts (frequency changes, a neighbour's load) that two separate series would each
    catch differently; the order inside a pair alternates so neither call always runs on the
    caches the other warmed. Calls of a fraction of a millisecond repeat until the pairs have
    taken ``min_seconds``: fifteen of them would be timer noise.
    """
    for _ in range(warmup):
        first()
        second()
    a: list[float] = []
    b: list[float] = []
    started = time.perf_counter()
    while len(a) < repeats or time.perf_counter() - started < min_seconds:
        for flip in (False, True) if len(a) % 2 else (True, False):
            fn, out = (second, b) if flip else (first, a)
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    return statistics.median(a), statistics.median(b), statistics.median(ratios)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def single_forward_seconds(model: LoadedModel, encoded: Encoded, repeats: int) -> float:
    """Median seconds of one plain classification forward pass of one input (after a warm-up)."""
    from limelight.runtimes.base import InlineBatch
    from limelight.runtimes.torch_runtime import TorchRuntime

    runtime = TorchRuntime(model)
    batch = InlineBatch.from_encoded([encoded], model.pad_id)
    return median_seconds(lambda: runtime.forward_logits(batch), repeats, warmup=1)


#: The pause before each forward of the "after idle" baseline: about what a closed-loop client
#: on loopback leaves between two requests. After it a torch forward measured up to 1.6 ms
#: slower than back to back on a 2-core VM (docs/benchmarks.md, "The plain forward after an
#: idle gap"), a cost no serving path can remove.
IDLE_GAP_S = 0.002


def single_forward_ms(
    model: LoadedModel, runtime: Runtime, text: str, repeats: int, idle_s: float = 0.0
) -> float:
    """Median milliseconds of one plain forward pass of ``text`` alone with ``runtime``, each
    after ``idle_s`` asleep (0: back to back)."""
    from limelight.runtimes.base import InlineBatch

    batch = InlineBatch.from_encoded([model.encode(text)], model.pad_id)
    call = lambda: runtime.forward_logits(batch)  # noqa: E731
    return median_seconds(call, repeats, warmup=1, idle_s=idle_s) * 1e3


@dataclass
class InlineRow:
    runtime: str
    texts: str
    batch: int
    forward_ms: float
    explain_ms: float
    ratio: float  # the median of paired ratios, not the ratio of the two medians
    bare_ratio: float | None = None
    """The same for the inline pass without the heads (NormXLogit alone), when measured."""

    @property
    def explain_per_s(self) -> float:
        return self.batch / (self.explain_ms / 1e3)


def inline_vs_forward(
    model: LoadedModel,
    runtimes: dict[str, Runtime],
    texts: dict[str, list[str]],
    batches: Sequence[int],
    repeats: int,
    method: InlineMethod | None = None,
    bare: Mapping[str, Runtime] | None = None,
) -> list[InlineRow]:
    """Plain forward vs the whole inline explanation (``method``, default NormXLogit, on
    runtimes that compute whatever heads the server loads), per runtime, length and batch;
    with ``bare`` (runtimes by the same names, without the heads) also vs NormXLogit alone,
    which is what the inline pass costs before any head is added."""
    from limelight.methods.normxlogit import NormXLogit
    from limelight.runtimes.base import InlineBatch

    normxlogit = NormXLogit()
    method = method or normxlogit
    rows = []
    for kind, pool in texts.items():
        for size in batches:
            encoded = [model.encode(t) for t in pool[:size]]
            batch = InlineBatch.from_encoded(encoded, model.pad_id)
            for name, runtime in runtimes.items():

                def forward(runtime: Runtime = runtime, batch: InlineBatch = batch) -> None:
                    runtime.forward_logits(batch)

                # Interleaved in pairs so machine noise hits both alike.
                explain = _explain_call(runtime, method, batch, encoded)
                f, e, ratio = paired_seconds(forward, explain, repeats)
                bare_ratio = None
                if bare is not None and name in bare:
                    alone = _explain_call(bare[name], normxlogit, batch, encoded)
                    bare_ratio = paired_seconds(forward, alone, repeats)[2]
                rows.append(InlineRow(name, kind, size, f * 1e3, e * 1e3, ratio, bare_ratio))
    return rows


def _explain_call(
    runtime: Runtime, method: InlineMethod, batch: InlineBatch, encoded: Sequence[Encoded]
) -> Callable[[], None]:
    """The whole inline explanation of ``batch`` as the service builds it: the runtime's pass,
    then ``method`` per row, and NormXLogit beside it when ``method`` is another one (every
    response carries it)."""
    from limelight.methods.normxlogit import NormXLogit

    beside = None if isinstance(method, NormXLogit) else NormXLogit()

    def explain() -> None:
        out = runtime.run_inline(batch)
        for row, enc in enumerate(encoded):
            method.attribute(out, row, len(enc))
            if beside is not None:
                beside.attribute(out, row, len(enc))

    return explain


def plain_onnx_runtime(
    model: LoadedModel, workdir: Path, heads: Mapping[str, Any] | None = None, threads: int = 0
) -> Runtime:
    """ONNX Runtime with an inline graph (with ``heads``) and a plain (logits-only) graph for
    the baseline, both on ``threads`` intra-op threads (0: ONNX Runtime's default) — the
    server's setting, so that served and in-process figures compare like with like."""
    from limelight.runtimes.base import InlineOutputs, Runtime
    from limelight.runtimes.onnx_export import export_onnx
    from limelight.runtimes.onnx_runtime import OnnxRuntime, graph_feed

    inline = OnnxRuntime(
        export_onnx(model, workdir / "inline.onnx", heads=heads), model, threads=threads
    )
    plain_path = export_onnx(model, workdir / "plain.onnx", kind="plain")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads > 0:
        options.intra_op_num_threads = threads
    plain = ort.InferenceSession(
        str(plain_path), sess_options=options, providers=["CPUExecutionProvider"]
    )
    plain_inputs = [i.name for i in plain.get_inputs()]

    class _Both(Runtime):
        name = "onnx"

        def run_inline(self, batch: InlineBatch) -> InlineOutputs:
            return inline.run_inline(batch)

        def forward_logits(self, batch: InlineBatch) -> FloatArray:
            logits: FloatArray = plain.run(["logits"], graph_feed(batch, plain_inputs))[0]
            return logits

    return _Both()


@contextmanager
def workdir() -> Iterator[Path]:
    """A scratch folder for the run's ONNX exports, removed when the run ends."""
    with tempfile.TemporaryDirectory(prefix="limelight-bench-") as folder:
        yield Path(folder)


def job_method_ratios(
    model: LoadedModel, settings: Settings, names: Sequence[str], texts: list[str], repeats: int
) -> list[list[object]]:
    """Each job method's time as a multiple of one plain forward pass of the same input."""
    from limelight.core.jobs import JobSpec
    from limelight.jobs.runner import JobRunner
    from limelight.methods.base import MethodRegistry
    from limelight.runtimes.base import InlineBatch
    from limelight.runtimes.torch_runtime import TorchRuntime

    methods = MethodRegistry.load(settings)
    runner = JobRunner(model, methods, settings)
    runtime = TorchRuntime(model)
    rows: list[list[object]] = []
    for name in names:
        method = methods.get(name)
        if method.unavailable_reason(model):
            rows.append([name, "unavailable", "", method.unavailable_reason(model)[:60]])
            continue
        ratios, seconds = [], []
        for text in texts:
            batch = InlineBatch.from_encoded([model.encode(text)], model.pad_id)
            spec = JobSpec(method=name, text=text, params=method.validate_params({}))

            def forward(batch: InlineBatch = batch) -> None:
                runtime.forward_logits(batch)

            def job(spec: JobSpec = spec) -> None:
                runner.run(spec)

            took = median_seconds(job, max(1, repeats // 4), warmup=1)
            forward_s = median_seconds(forward, repeats)
            ratios.append(took / forward_s)
            seconds.append(took)
        rows.append([name, statistics.median(ratios), statistics.median(seconds) * 1e3, ""])
    return rows


# --- out of process: the sidecar in one process, the load generator in another ----------------


def _clock_ticks() -> int:
    return int(os.sysconf("SC_CLK_TCK"))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based, man 5 proc).
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def process_tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and every live descendant (a ``--workers`` supervisor's
    workers); what ended before the call is not counted."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            total += process_cpu_seconds(current)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as fh:
                    stack.extend(int(child) for child in fh.read().split())
        except FileNotFoundError:  # it ended meanwhile
            continue
    return total


@dataclass
class LoadResult:
    """What the load generator measured in its window, per kind of text ("short", "long")."""

    duration_s: float
    clients: dict[str, int]
    latencies: dict[str, list[float]]
    tokens: dict[str, int]
    errors: int
    server_cpu_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    placement: str = ""
    """How the load generator's channels fell on the sidecar's workers: "4+4" is four on each
    of two (read from ``GetModel``'s ``instance``)."""

    def count(self, kind: str | None = None) -> int:
        kinds = [kind] if kind else list(self.latencies)
        return sum(len(self.latencies.get(k, [])) for k in kinds)

    def p50_ms(self, kind: str) -> float:
        return percentile(self.latencies.get(kind, []), 50) * 1e3

    def p99_ms(self, kind: str) -> float:
        return percentile(self.latencies.get(kind, []), 99) * 1e3

    def per_s(self, kind: str | None = None) -> float:
        return self.count(kind) / self.duration_s

    def tokens_per_answer(self, kind: str) -> float:
        return self.tokens.get(kind, 0) / max(1, self.count(kind))

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens.values()) / self.duration_s

    @property
    def cpu_ms_per_request(self) -> float:
        return self.server_cpu_s / max(1, self.count()) * 1e3


RPCS = ("unary", "stream", "batch", "http")
TOKEN_LAYOUTS = ("columns", "messages")
"""How the load generator calls the sidecar: ``Explain`` per request, one ``ExplainStream``
per client, ``ExplainBatch`` with several texts per call, or KServe v1 ``:explain`` on the
HTTP port, each client on its own keep-alive connection (as separate HTTP callers are)."""


def run_load(
    target: str,
    texts: dict[str, list[str]],
    clients: dict[str, int],
    duration_s: float,
    warmup_s: float = 2.0,
    server_pid: int | None = None,
    channels: int = 1,
    rpc: str = "unary",
    spread: bool = True,
    texts_per_call: int = 16,
    token_layout: str = "columns",
    security: Mapping[str, Any] | None = None,
) -> LoadResult:
    """Closed-loop load from a separate process: ``clients[kind]`` concurrent clients each send
    texts of that kind one after another, spread over ``channels`` gRPC channels (each its own
    connection); only requests that finish inside the measured window (after ``warmup_s``)
    count. ``rpc``: ``unary`` (one ``Explain`` call per request) or ``stream`` (each client
    keeps one ``ExplainStream`` open and sends its next request when the answer to the last
    one has come back) or ``batch`` (each client sends ``texts_per_call`` texts per
    ``ExplainBatch`` call; every text counts as a request, its latency the call's) or ``http``
    (``target`` is then the HTTP port's ``host:port``; each client keeps its own connection
    and posts KServe v1 ``:explain``; ``channels``, ``spread`` and ``token_layout`` do not
    apply). ``token_layout``: how the gRPC answers list their tokens, ``columns`` (what the SDK
    asks for) or ``messages`` (a Token message each). With ``spread`` the channels are spread
    evenly over the sidecar's workers (``limelight serve --workers``; the kernel alone places
    connections at random). Server CPU (the process and its children) is read from ``/proc``
    over the same window (not without ``server_pid``: a sidecar on another machine).
    ``security``: for a sidecar with TLS or tokens, ``tls`` (bool), ``ca_cert``,
    ``client_cert``, ``client_key`` (paths) and ``token`` — passed on stdin, never argv."""
    if rpc not in RPCS:
        raise ValueError(f"unknown rpc {rpc!r}; use one of {', '.join(RPCS)}")
    if token_layout not in TOKEN_LAYOUTS:
        raise ValueError(f"unknown token layout {token_layout!r}; use one of {TOKEN_LAYOUTS}")
    config = {
        "target": target,
        "texts": texts,
        "clients": clients,
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "server_pid": server_pid,
        "channels": channels,
        "rpc": rpc,
        "spread": spread,
        "texts_per_call": texts_per_call,
        "token_layout": token_layout,
        "security": dict(security or {}),
    }
    code = "from limelight.evaluation.benchmark import loadgen_main; loadgen_main()"
    from limelight.signals import child_env

    done = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        input=json.dumps(config).encode(),
        capture_output=True,
        check=False,
        timeout=duration_s + warmup_s + 600,
    )
    if done.returncode != 0:
        # Its last line says why (a traceback's first line says nothing); the rest is logged.
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        log.debug("the load generator's output:\n%s", "\n".join(lines))
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise RuntimeError(f"the load generator failed: {why}")
    out = json.loads(done.stdout)
    return LoadResult(
        duration_s=out["duration_s"],
        clients=clients,
        latencies=out["latencies"],
        tokens=out["tokens"],
        errors=out["errors"],
        server_cpu_s=out["server_cpu_s"],
        placement=out["placement"],
    )


def loadgen_main() -> None:
    """Entry point of the load-generator process: a JSON config on stdin, JSON out."""
    import grpc

    from limelight.signals import watch_parent

    # A benchmark killed outright (SIGKILL) must not leave its load running on.
    watch_parent()
    config = json.loads(sys.stdin.read())
    try:
        answer = asyncio.run(_generate_load(config))
    except grpc.aio.AioRpcError as exc:  # one line for the parent to show (its repr has many)
        sys.exit(f"{exc.code().name}: {exc.details()}")
    print(json.dumps(answer))


async def _generate_load(config: dict[str, Any]) -> dict[str, Any]:
    import grpc

    from limelight_client.proto import explainer_pb2 as pb
    from limelight_client.proto import explainer_pb2_grpc

    texts: dict[str, list[str]] = config["texts"]
    pid: int | None = config["server_pid"]
    if config.get("rpc") == "http":
        return await _generate_http_load(config)
    options = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
        # A connection per channel (not one shared by all): with several server workers on
        # the port, the kernel spreads connections, not calls.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    security: dict[str, Any] = config.get("security") or {}
    md = _call_metadata(security)
    channels, placed = await _open_channels(
        config["target"],
        options,
        max(1, int(config.get("channels", 1))),
        config["spread"],
        security,
    )
    stubs = [explainer_pb2_grpc.ExplainerStub(channel) for channel in channels]
    for stub in stubs:
        await stub.Explain(pb.ExplainRequest(text="warm up"), timeout=600, metadata=md)
    loop = asyncio.get_running_loop()
    tally = _Tally.starting(config)
    end = tally.end
    layout = (
        pb.TOKEN_LAYOUT_MESSAGES
        if config.get("token_layout") == "messages"
        else pb.TOKEN_LAYOUT_COLUMNS
    )

    def request(text: str) -> Any:
        return pb.ExplainRequest(text=text, token_layout=layout)

    def record(kind: str, started: float, response: Any) -> None:
        explanation = response.explanation
        tokens = len(explanation.tokens) or len(explanation.token_columns.id)
        tally.record(kind, started, tokens)

    async def client(kind: str, index: int) -> None:
        pool = texts[kind]
        stub = stubs[index % len(stubs)]
        i = index
        while (started := loop.time()) < end:
            text = pool[i % len(pool)]
            i += 7
            try:
                response = await stub.Explain(request(text), timeout=600, metadata=md)
            except grpc.aio.AioRpcError:
                await tally.failed(started)
                continue
            record(kind, started, response)

    async def stream_client(kind: str, index: int) -> None:
        pool = texts[kind]
        stub = stubs[index % len(stubs)]
        i = index
        while (opened := loop.time()) < end:  # a failed stream is counted and reopened
            call = stub.ExplainStream(timeout=600, metadata=md)
            started = opened
            try:
                while (started := loop.time()) < end:
                    await call.write(request(pool[i % len(pool)]))
                    i += 7
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        raise RuntimeError("the sidecar ended the stream early")
                    record(kind, started, response)
                await call.done_writing()
                if await call.code() != grpc.StatusCode.OK:
                    await tally.failed(started)
            except (grpc.aio.AioRpcError, RuntimeError):
                call.cancel()
                await tally.failed(started)

    async def batch_client(kind: str, index: int) -> None:
        pool = texts[kind]
        stub = stubs[index % len(stubs)]
        per_call = max(1, int(config.get("texts_per_call", 16)))
        i = index
        while (started := loop.time()) < end:
            requests = [request(pool[(i + j) % len(pool)]) for j in range(per_call)]
            i += 7 * per_call
            try:
                response = await stub.ExplainBatch(
                    pb.ExplainBatchRequest(requests=requests), timeout=600, metadata=md
                )
            except grpc.aio.AioRpcError:
                await tally.failed(started, per_call)
                continue
            for answer in response.responses:
                record(kind, started, answer)

    rpc = config.get("rpc", "unary")
    run = {"stream": stream_client, "batch": batch_client}.get(rpc, client)
    tasks = [run(kind, index) for kind, n in config["clients"].items() for index in range(int(n))]
    cpu = await _cpu_during(pid, tally, tasks)
    for channel in channels:
        await channel.close()
    placement = "+".join(str(n) for n in sorted(placed.values(), reverse=True))
    return tally.report(config, cpu, placement)


#: How long a load client waits after a failed call before it sends the next.
FAILURE_PAUSE_S = 0.05


@dataclass
class _Tally:
    """What the load generator's clients measured inside the window ``[begin, end]`` (the
    event loop's clock): latencies and answered tokens per kind of text, and failures."""

    begin: float
    end: float
    latencies: dict[str, list[float]]
    tokens: dict[str, int]
    errors: int = 0

    @classmethod
    def starting(cls, config: dict[str, Any]) -> _Tally:
        """A window opening ``warmup_s`` from now and lasting ``duration_s``."""
        begin = asyncio.get_running_loop().time() + config["warmup_s"]
        kinds = list(config["texts"])
        return cls(
            begin, begin + config["duration_s"], {k: [] for k in kinds}, dict.fromkeys(kinds, 0)
        )

    def record(self, kind: str, started: float, tokens: int) -> None:
        """A request of ``kind`` sent at ``started`` was answered now with ``tokens`` tokens."""
        finished = asyncio.get_running_loop().time()
        if self.begin <= started and finished <= self.end:
            self.latencies[kind].append(finished - started)
            self.tokens[kind] += tokens

    async def failed(self, started: float, calls: int = 1) -> None:
        """``calls`` sent at ``started`` failed: counted when sent inside the window, as
        answers are; then a pause, so that a sidecar that is down is not hammered by retries
        (thousands a second) that would fill the count and the event loop."""
        if self.begin <= started <= self.end:
            self.errors += calls
        await asyncio.sleep(FAILURE_PAUSE_S)

    def report(self, config: dict[str, Any], cpu: float, placement: str) -> dict[str, Any]:
        """The load generator's JSON answer (read back by ``run_load``)."""
        return {
            "duration_s": config["duration_s"],
            "latencies": self.latencies,
            "tokens": self.tokens,
            "errors": self.errors,
            "server_cpu_s": cpu,
            "placement": placement,
        }


async def _cpu_during(
    pid: int | None, tally: _Tally, clients: Sequence[Coroutine[Any, Any, None]]
) -> float:
    """Run the ``clients``; the server's CPU seconds over the tally's window."""
    window = asyncio.ensure_future(_cpu_window(pid, tally.begin, tally.end))
    await asyncio.gather(*clients)
    return await window


async def _cpu_window(pid: int | None, begin: float, end: float) -> float:
    """The server's CPU seconds between the loop times ``begin`` and ``end``."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, begin - loop.time()))
    before = process_tree_cpu_seconds(pid) if pid else 0.0
    await asyncio.sleep(max(0.0, end - loop.time()))
    return (process_tree_cpu_seconds(pid) if pid else 0.0) - before


async def _generate_http_load(config: dict[str, Any]) -> dict[str, Any]:
    """``_generate_load`` over the HTTP port: KServe v1 ``:explain``, one text per call."""
    import aiohttp

    texts: dict[str, list[str]] = config["texts"]
    security: dict[str, Any] = config.get("security") or {}
    context: ssl.SSLContext | bool = True
    if security.get("tls"):
        context = ssl.create_default_context(cafile=security.get("ca_cert"))
        if security.get("client_cert"):
            context.load_cert_chain(security["client_cert"], security.get("client_key"))
    base = f"{'https' if security.get('tls') else 'http'}://{config['target']}"
    headers = dict(_call_metadata(security) or ())
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=600)

    def connector() -> aiohttp.TCPConnector:  # one connection: a client's own, kept alive
        return aiohttp.TCPConnector(limit=1, ssl=context)

    async with (
        aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector()) as session,
        session.get(f"{base}/v1/models") as response,
    ):
        (name,) = (await response.json())["models"]
    url = f"{base}/v1/models/{name}:explain"
    clients = [(kind, index) for kind, n in config["clients"].items() for index in range(int(n))]
    # One connection per client (a connector of one), kept alive between its calls.
    sessions = [
        aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector())
        for _ in clients
    ]
    try:
        for session in sessions:
            async with session.post(url, json={"instances": ["warm up"]}) as response:
                response.raise_for_status()
        tally = _Tally.starting(config)

        async def client(kind: str, index: int, session: aiohttp.ClientSession) -> None:
            pool = texts[kind]
            i = index
            while (started := loop.time()) < tally.end:
                body = {"instances": [pool[i % len(pool)]]}
                i += 7
                try:
                    async with session.post(url, json=body) as response:
                        response.raise_for_status()
                        answer = await response.json()
                except aiohttp.ClientError:
                    await tally.failed(started)
                    continue
                tally.record(kind, started, len(answer["explanations"][0]["tokens"]))

        tasks = [client(kind, i, s) for (kind, i), s in zip(clients, sessions, strict=True)]
        cpu = await _cpu_during(config["server_pid"], tally, tasks)
    finally:
        for session in sessions:
            await session.close()
    return tally.report(config, cpu, placement="")


def _call_metadata(security: Mapping[str, Any]) -> tuple[tuple[str, str], ...] | None:
    token = security.get("token")
    return (("authorization", f"Bearer {token}"),) if token else None


def _read_file(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _grpc_channel(target: str, options: list[tuple[str, Any]], security: Mapping[str, Any]) -> Any:
    import grpc

    if not security.get("tls"):
        return grpc.aio.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        _read_file(security.get("ca_cert")),
        _read_file(security.get("client_key")),
        _read_file(security.get("client_cert")),
    )
    return grpc.aio.secure_channel(target, credentials, options=options)


async def _open_channels(
    target: str,
    options: list[tuple[str, Any]],
    n: int,
    spread: bool,
    security: Mapping[str, Any] | None = None,
) -> tuple[list[Any], collections.Counter[str]]:
    """``n`` channels, and how many reached each worker. With ``spread``, a new channel is
    kept only while its worker holds less than an even share (a few hundred dials at most;
    then it takes what comes), so that no worker gets more of the load than another, and the
    channels are ordered by worker in turn (client ``i`` takes channel ``i % n``, so even two
    clients land on two workers)."""

    from limelight_client.proto import explainer_pb2 as pb
    from limelight_client.proto import explainer_pb2_grpc

    channels: list[tuple[int, str, Any]] = []
    placed: collections.Counter[str] = collections.Counter()
    dials = 0
    while len(channels) < n:
        channel = _grpc_channel(target, options, security or {})
        info = await explainer_pb2_grpc.ExplainerStub(channel).GetModel(
            pb.GetModelRequest(), timeout=600, metadata=_call_metadata(security or {})
        )
        dials += 1
        share = -(-n // max(1, info.workers))
        if not spread or placed[info.instance] < share or dials > 32 * n:
            channels.append((placed[info.instance], info.instance, channel))
            placed[info.instance] += 1
        else:
            await channel.close()
    if spread:  # the workers in turn, so that fewer clients than channels still spread
        channels.sort(key=lambda c: (c[0], c[1]))
    return [channel for _, _, channel in channels], placed


@dataclass
class InProcessRow:
    """The same inline work without serving: tokenise, forward, NormXLogit, per text."""

    texts: str
    batch: int
    ms_per_batch: float
    cpu_ms_per_text: float

    @property
    def per_s(self) -> float:
        return self.batch / (self.ms_per_batch / 1e3)


def in_process_baseline(
    model: LoadedModel, runtime: Runtime, texts: list[str], batch: int, repeats: int, kind: str
) -> InProcessRow:
    """Wall and CPU time of the whole inline explanation in-process, batch by batch: the batch
    tokenizer, one forward pass, NormXLogit for every row (what serving adds is measured
    against this)."""
    from limelight.core.service import encode_batch
    from limelight.core.types import Encoded
    from limelight.methods.normxlogit import NormXLogit
    from limelight.runtimes.base import InlineBatch

    method = NormXLogit()
    pool = [texts[i % len(texts)] for i in range(batch)]

    def explain() -> None:
        encoded = [
            e
            for e in encode_batch(model, [(t, None) for t in pool], model.max_tokens, "truncate")
            if isinstance(e, Encoded)
        ]
        out = runtime.run_inline(InlineBatch.from_encoded(encoded, model.pad_id))
        for row, enc in enumerate(encoded):
            method.attribute(out, row, len(enc))

    explain()
    cpu0 = time.process_time()
    wall = median_seconds(explain, repeats, warmup=1)
    cpu = (time.process_time() - cpu0) / (repeats + 1)
    return InProcessRow(kind, batch, wall * 1e3, cpu / batch * 1e3)
