"""One typed settings object for the whole sidecar.

Values come from (highest first) explicit constructor arguments / CLI flags, ``LIMELIGHT_*``
environment variables, then the defaults below. Nothing here is read at import time: build a
``Settings()`` in the entry point and pass it down through constructors.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

#: A TCP port; 0 picks a free one (or, where documented, turns the endpoint off).
Port = Annotated[int, Field(ge=0, le=65535)]
#: A probability: a divergence in bits, an alert's threshold.
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
#: The range of a multi-label model's label threshold: above the first bound, at most the
#: second (at 0 every label would be predicted, whatever the model says). The one definition,
#: which ``limelight.core.prediction.label_thresholds`` checks too.
LABEL_THRESHOLD_RANGE = (0.0, 1.0)
#: A label threshold (multi-label models).
LabelThreshold = Annotated[float, Field(gt=LABEL_THRESHOLD_RANGE[0], le=LABEL_THRESHOLD_RANGE[1])]
#: gRPC takes its times as 32-bit milliseconds: at most about 24 days.
GrpcSeconds = Annotated[float, Field(gt=0.0, le=2_000_000.0)]


def default_cache_dir() -> Path:
    """Where built demo models and other derived artefacts are cached."""
    return Path.home() / ".cache" / "limelight"


#: LIMELIGHT_* variables that are not sidecar settings: the CLI client's defaults for
#: ``--target`` and ``--token``, and the test suite's own switches.
OTHER_VARIABLES = frozenset(
    {
        "LIMELIGHT_TARGET",
        "LIMELIGHT_TOKEN",
        "LIMELIGHT_TEST_DEVICE",
        "LIMELIGHT_TEST_OLDEST_PYTHON",
        "LIMELIGHT_SKIP_CONTAINER_TEST",
    }
)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``LIMELIGHT_*`` variable in ``environ`` that names no setting, with
    the closest setting's name: the settings ignore unknown variables, so a misspelt one would
    otherwise leave its setting at the default without a word. Names are matched without case,
    as the settings read them."""
    known = {f"LIMELIGHT_{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES
    # compared without the prefix they all share, which would make any two look alike
    suffixes = sorted(k.removeprefix("LIMELIGHT_") for k in known)
    lines = []
    for variable in sorted(environ):
        name = variable.upper()
        if not name.startswith("LIMELIGHT_") or name in known:
            continue
        close = difflib.get_close_matches(name.removeprefix("LIMELIGHT_"), suffixes, 1, 0.75)
        hint = f"; did you mean LIMELIGHT_{close[0]}?" if close else ""
        lines.append(f"{variable} is not a Limelight setting and is ignored{hint}")
    return lines


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

JobBackendKind = Literal["off", "sqlite", "redis"]


def job_backend_kind(spec: str) -> JobBackendKind:
    """Which job backend a ``jobs`` setting names; ValueError for none."""
    spec = spec.strip()
    if spec in ("off", "", "none"):
        return "off"
    if spec == "sqlite":
        return "sqlite"
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return "redis"
    raise ValueError(
        "unknown job backend: use sqlite, redis://host:port/db (rediss://, unix://) or off"
    )


class Settings(BaseSettings):
    """Configuration of a Limelight sidecar, worker or CLI command."""

    # Inputs stay out of a ValidationError's text (tracebacks, logs): a queue address may
    # carry a password. The CLI repeats a rejected value itself, redacted.
    model_config = SettingsConfigDict(
        env_prefix="LIMELIGHT_",
        extra="ignore",
        hide_input_in_errors=True,
        allow_inf_nan=False,  # no setting means "forever" by inf; NaN means nothing
    )

    # --- model -------------------------------------------------------------------------------
    model_dir: Path | None = None
    """Local Hugging Face sequence-classification directory. Unset: the demo model."""
    model_name: str | None = None
    """Name the model is served under (Open Inference Protocol, KServe); unset: the directory's
    name."""
    demo_model: Literal["minilm", "bert-tiny", "bert-tiny-multilabel"] = "minilm"
    """Which demo model to build and serve when ``model_dir`` is unset."""
    cache_dir: Path = Field(default_factory=default_cache_dir)
    """Cache for built demo models (rebuilt only when their recipe changes)."""
    device: str = "cpu"
    """Torch device: ``cpu``, ``cuda``, ``cuda:1`` or ``auto`` (CUDA when available)."""
    torch_threads: NonNegativeInt = 0
    """Intra-op threads for torch and ONNX Runtime. 0: their default (the machine's physical
    cores), lowered to the CPUs this process may use — its CPU affinity and its cgroup CPU limit
    (a container's ``resources.limits.cpu``), shared among ``workers``."""
    runtime: Literal["torch", "onnx"] = "torch"
    """Runtime of the inline path. Jobs always use torch on the same weights."""
    onnx_path: Path | None = None
    """Exported ONNX graph for ``runtime=onnx``, served as it is; unset: the graph beside the
    model (``<model_dir>/limelight.onnx``) when it carries the model's inline heads, otherwise
    one the sidecar exports itself (``onnx_export``)."""
    onnx_export: bool = True
    """With ``runtime=onnx`` and no ``onnx_path``: when the graph beside the model is missing or
    does not carry the distilled head beside it (one trained or rebuilt after the export), export
    the inline graph into ``<cache_dir>/onnx/<model version>`` and serve that — at start, and
    again when the reloader sees a new head. Off: serve the graph beside the model as it is, or
    refuse to start without one."""
    lm_head_dir: Path | None = None
    """Directory of the base model's masked-LM head for Decoded Grad-CAM; unset: a head fitted
    beside the model (``limelight fit-lm-head``), else for the BERT-tiny demos served by name
    their base checkpoint's own."""
    head_mask_path: Path | None = None
    """Head mask file for LRP; unset: ``<model_dir>/limelight_head_mask.json`` when present."""

    # --- serving -----------------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Interface the gRPC server binds to (``0.0.0.0`` in containers)."""
    port: Port = 50051
    """gRPC port."""
    metrics_port: Port = 9464
    """HTTP port: Prometheus ``/metrics``, the Open Inference Protocol REST routes (``/v2/...``)
    and KServe v1 (``/v1/models/NAME:predict|:explain``); 0 disables the HTTP endpoint."""
    workers: PositiveInt = 1
    """Sidecar processes sharing the gRPC port (``SO_REUSEPORT``: the kernel spreads client
    connections over them, each connection stays on one worker). Above 1 the job backend must
    be Redis or off. The workers share the HTTP port the same way; ``/metrics`` on any of them
    adds up every worker's. Each worker loads its own copy of the model."""
    worker_start_timeout_s: PositiveFloat = 900.0
    """With ``workers`` above 1: how long a worker may take from its start to serving (loading
    its model included). One that takes longer (a load stuck on a hung volume, say) is killed
    and started again, at start-up or when it replaces a worker that died; it counts as a failed
    start, and three failed starts in a row stop the server."""
    worker_unresponsive_s: PositiveFloat = 30.0
    """With ``workers`` above 1: how long a serving worker's event loop may go without a sign of
    life (it touches a file every few seconds) before the supervisor kills and restarts it — a
    deadlocked or stopped process still holds its share of the port, and the kubelet's probes,
    which land on one worker or another, would notice it only by chance."""
    reuse_port: bool = False
    """Bind the gRPC, health and HTTP ports with ``SO_REUSEPORT``. ``workers`` sets it in each
    worker; off otherwise, so that a second sidecar started on a taken port fails instead of
    sharing it."""
    health_port: Port = 0
    """Plaintext port serving only the gRPC health service, for kubelet gRPC probes (which
    cannot speak TLS) when the main port uses TLS; 0: off."""
    http_tls: bool = True
    """Serve the HTTP port with TLS too when ``tls_cert``/``tls_key`` are set (same client CA);
    false keeps it plain HTTP, e.g. for a Prometheus without client certificates."""
    http_allowed_hosts: list[str] = []
    """Host names the HTTP port answers besides ``localhost`` and IP addresses (the ``Host``
    header, any port; ``LIMELIGHT_HTTP_ALLOWED_HOSTS='["viewer.example.com"]'``; ``"*"``: any).
    Empty: a port bound to a loopback ``host`` answers those only (a guard against DNS
    rebinding: 403 for other names), one bound to another address any name."""
    viewer_enabled: bool = True
    """Serve the web explanation viewer on the HTTP port (``/viewer/``, with its JSON routes
    under ``/viewer/api/``, behind the same bearer tokens as the other HTTP APIs); false
    removes every ``/viewer`` route."""
    viewer_drift_sample_s: NonNegativeFloat = 30.0
    """How often the viewer samples the drift report for its divergence-over-time chart
    (kept in memory, the last 720 samples); 0: only when the page asks."""
    default_method: str = "auto"
    """Inline method used when a request names none. ``auto``: the distilled head when a valid
    one lies beside the model (the demo build makes one; ``limelight distill``), else the
    lexicon lookup when a lexicon table does (``limelight lexicon``), else ``normxlogit``."""
    lexicon_build: bool = False
    """Build the lexicon table at start-up when the default method needs one (``auto`` on a
    model without a distilled head, or ``lexicon_lookup``) and none lies beside the model or in
    ``cache_dir``. It goes to ``<cache_dir>/lexicons/<model version>`` (the model's directory
    may be read-only) and is reused on the next start; readiness waits for it: one pass over the
    vocabulary, seconds for small models on CPU, a few minutes for a base-size one. A failed
    build is logged and ``auto`` serves NormXLogit; a named ``lexicon_lookup`` stops the start."""
    label_threshold: LabelThreshold = 0.5
    """Multi-label models (config ``problem_type`` ``multi_label_classification``): a label is
    predicted when its sigmoid probability is at least this (above 0, at most 1)."""
    label_thresholds: dict[str, LabelThreshold] = {}
    """Multi-label: per-label thresholds overriding ``label_threshold``, by label name
    (``LIMELIGHT_LABEL_THRESHOLDS='{"toxic": 0.3}'``); an unknown label is a start-up error."""
    max_text_chars: PositiveInt = 20_000
    """Longest accepted text (characters, text and pair together)."""
    max_tokens: PositiveInt = 512
    """Token limit per input, special tokens included (also capped by the model's limit)."""
    truncation: Literal["truncate", "reject", "window"] = "truncate"
    """Over-long input: cut it to ``max_tokens`` and flag it, reject it with INVALID_ARGUMENT,
    or (``window``) explain all of it: overlapping windows of ``max_tokens``, the prediction
    aggregated over them (``window_aggregation``), the attributions stitched back onto the whole
    text. Text pairs are truncated; a job runs its method on every window."""
    window_stride: NonNegativeInt = 64
    """``truncation=window``: tokens each window shares with the previous one (at most half
    the token limit)."""
    window_aggregation: Literal["mean", "max"] = "mean"
    """``truncation=window``: the document's logits are the mean of its windows' logits, or
    their maximum per class (a label as strong as its strongest window)."""
    max_message_bytes: PositiveInt = 4 * 1024 * 1024
    """Largest request accepted: a gRPC message, or an HTTP request's body."""
    max_response_bytes: PositiveInt = 64 * 1024 * 1024
    """Largest gRPC answer sent. An answer outgrows its question (each token's text, offsets
    and scores: an ``ExplainBatch`` of long documents answers about 4 bytes for each byte of
    text), so this is above ``max_message_bytes``; a larger answer fails RESOURCE_EXHAUSTED,
    saying its size, instead of gRPC's bare "Sent message larger than max". Clients must
    accept as much: the Python SDK does (64 MiB); grpc-go and grpc-java default to 4 MiB."""
    max_connection_age_s: GrpcSeconds | None = None
    """Close each client connection after about this long (gRPC sends GOAWAY, ±10 % jitter):
    the client's next call opens a new one, which the load balancer may send to another
    replica. gRPC keeps a connection for as long as it lives, so behind a Kubernetes Service
    (which balances connections, not calls) a replica added by a scale-up or a rollout gets no
    traffic from clients already connected until they reconnect, and a draining replica keeps
    its clients until it stops. Calls in progress are not cut (see
    ``max_connection_age_grace_s``); calls in transit are retried by gRPC itself. Unset: off
    (gRPC's default)."""
    max_connection_age_grace_s: Annotated[float, Field(ge=0.0, le=2_000_000.0)] | None = None
    """How long calls still open on a connection past ``max_connection_age_s`` may run before it
    is closed under them (they end ``UNAVAILABLE``; the SDK opens an ``explain_many`` stream
    ended so again and resends what was unanswered). Unset: as long as they take."""
    keepalive_time_s: GrpcSeconds = 60.0
    """The server pings a client connection idle for this long and closes it when no answer
    comes within ``keepalive_timeout_s``: a client that vanished without closing (a crashed
    pod, a NAT or load balancer that dropped the connection) no longer holds its streams
    (``WatchJob``, ``ExplainStream``) open for ever."""
    keepalive_timeout_s: GrpcSeconds = 20.0
    """How long a keepalive ping may go unanswered before the connection is closed."""
    keepalive_min_client_interval_s: GrpcSeconds = 10.0
    """How often clients may ping, also with no call in flight (the SDK pings idle connections
    every 30 s so that a load balancer does not drop them silently); a client that pings more
    often is sent GOAWAY ("too_many_pings") and reconnects."""
    max_batch_size: PositiveInt = 32
    """Most inline requests run in one forward pass."""
    max_batch_wait_ms: NonNegativeFloat = 0.0
    """How long a request that finds the inference thread idle waits for company. 0: it is
    dispatched at once; requests that arrive while a batch runs form the next batch anyway."""
    max_batch_tokens: NonNegativeInt = 1024
    """Most padded tokens (requests x longest request) in one forward pass; a single longer
    request still runs, alone. 0: no token budget."""
    batch_bucket_floor: PositiveInt = 32
    """Length buckets: inputs of at most this many tokens may share a batch; above it a batch
    only holds inputs within a factor of two of each other, so short ones are never padded to
    long ones."""
    batch_length_penalty: NonNegativeFloat = 0.25
    """Fair share between length buckets: a batch of bucket B is charged its padded tokens x
    (B / batch_bucket_floor) ** penalty. 0: equal padded tokens per bucket; 0.25: a 512-token
    request pays 2x its tokens, so short requests keep most of the thread, long ones a
    guaranteed share (docs/benchmarks.md compares 0, 0.25 and 0.5)."""
    batch_anticipate_ms: NonNegativeFloat = 10.0
    """Right after a batch, while its length bucket is still owed the next turn and only other
    buckets have work, wait up to this long for its clients' next requests before starting a
    batch of another bucket (adaptive below it: about three times the usual return gap, and
    skipped while clients mostly do not come back in time). 0: never wait."""
    max_pending: PositiveInt = 1024
    """Inline requests waiting for a batch before new ones get RESOURCE_EXHAUSTED (a stream's
    next input waits for room instead: streams are paced, not ended)."""
    max_pending_per_caller: PositiveInt | None = None
    """Inline inputs one caller may have waiting or running at once, so that one tenant cannot
    fill ``max_pending`` for everyone (a caller: the bearer token's identity or the client
    certificate's subject; without auth every caller is one and the same). Past it a call is
    refused RESOURCE_EXHAUSTED (a batch as a whole) and a stream's next input waits for room.
    Counted in each process, like ``max_pending`` (with ``workers`` above 1, per worker).
    None: no limit per caller."""
    http_body_timeout_s: PositiveFloat = 30.0
    """The HTTP port: how long a request body may take to arrive (waiting for a read slot
    included) before the request is refused 400 and its connection closed."""
    http_max_body_reads: PositiveInt = 64
    """The HTTP port: request bodies read at once; more wait (within ``http_body_timeout_s``).
    Each may hold up to ``max_message_bytes``: this bounds what slow senders can pin."""
    http_keepalive_timeout_s: PositiveFloat = 75.0
    """The HTTP port: how long an idle keep-alive connection stays open."""
    grpc_max_concurrent_streams: PositiveInt = 100
    """The gRPC port: concurrent calls (HTTP/2 streams) one connection may hold; a client
    asking for more waits for a free one. Also what lets gRPC close a connection that opens and
    resets streams in a loop (HTTP/2 rapid reset), which otherwise starved every other client."""
    max_batch_request_items: PositiveInt = 256
    """Most inputs one ``ExplainBatch`` call (or one Open Inference Protocol / KServe request)
    may carry; a larger one is refused INVALID_ARGUMENT before any of it runs."""
    warmup: bool = True
    """Run a forward pass before reporting SERVING."""
    reload_interval_s: NonNegativeFloat = 10.0
    """How often the sidecar looks beside the model for a distilled head or lexicon table (or,
    with ``runtime=onnx``, a graph) written after it loaded the model — by `limelight distill`,
    `limelight lexicon`, `limelight export-onnx` or a background demo build — and serves it
    from the next batch on, without a restart; 0: never on its own (what it loaded at start
    stays until SIGHUP). SIGHUP (``kill -HUP``; with ``workers`` above 1, to the supervisor, which
    passes it on) looks at once, whatever the interval."""
    grace_period_s: Annotated[float, Field(ge=0.0, le=86_400.0)] = 20.0
    """On SIGTERM: how long in-flight work may take before the server stops."""

    # --- jobs --------------------------------------------------------------------------------
    jobs: str = "sqlite"
    """Job backend: ``sqlite`` (embedded, journalled), ``redis://host:port/db``, or ``off``."""
    jobs_db: Path | None = None
    """SQLite journal path; unset: ``<cache_dir>/jobs.sqlite3``."""
    jobs_password_file: Path | None = None
    """Redis backend: a file holding the queue user's password (a mounted Secret), read at
    each new connection, so a rotated password takes effect without a restart; the address
    then carries at most the user name (``redis://limelight@host:6379/0``)."""
    jobs_queue: str = "limelight"
    """Redis backend: the queue's name, which begins every key the jobs use (``<name>:stream``,
    ``<name>:job:<id>``, …). Sidecars and workers of one model share it. Give each model
    deployed on the same Redis database its own: a job runs only on the model it was submitted
    to, so a worker of one model would fail the other's jobs. A Redis ACL can then keep each
    deployment to its own keys (``~<name>:*``)."""
    jobs_refused_at_start: Literal["stop", "serve"] = "stop"
    """Redis backend: what ``limelight serve`` does when the queue refuses its credentials or
    ACL at start. ``stop``: exit with the reason (a wrong Secret stalls a rollout instead of
    passing it). ``serve``: log the reason, serve inline explanations, answer job calls
    UNAVAILABLE and ask again every 30 s — for a sidecar in the classifier's pod, whose
    readiness should not wait on the queue. A refusal that starts later never stops it."""
    job_workers: NonNegativeInt = 1
    """Job worker threads (embedded backend) or processes (``limelight worker``)."""
    method_plugins: list[str] = []
    """Extra attribution methods, as ``"module:Class"`` paths, loaded next to the built-in ones
    by the sidecar and by workers alike (``LIMELIGHT_METHOD_PLUGINS='["pkg.mod:Cls"]'``), so
    that the sidecar accepts a job method that its workers run."""
    job_timeout_s: PositiveFloat = 600.0
    """Default per-job timeout."""
    job_timeout_max_s: PositiveFloat = 3600.0
    """Longest timeout a job may ask for; SubmitJob rejects more (and jobs whose estimated
    cost cannot finish within it)."""
    job_memory_mb: PositiveFloat = 1024.0
    """Working memory a job may use for activations: gradient and SLALOM batches are chunked
    to fit it, and a job that cannot fit even one input is rejected before it is queued."""
    job_result_ttl_s: PositiveFloat = 24 * 3600.0
    """How long finished jobs and their results stay readable."""
    job_queue_max: PositiveInt = 1000
    """Queued jobs before SubmitJob answers RESOURCE_EXHAUSTED."""
    job_queue_max_per_owner: PositiveInt | None = None
    """Queued jobs one owner (a bearer token's identity or a client certificate's subject; with
    authentication off every caller is the same owner) may have before its SubmitJob answers
    RESOURCE_EXHAUSTED; unset: only ``job_queue_max`` applies. Where several tenants share a
    sidecar, set it below ``job_queue_max`` so that no one of them can fill the queue. On Redis
    each submission with it set reads the queue's entries once (about a millisecond of Redis
    time per thousand queued jobs)."""
    job_retain_max: PositiveInt = 10_000
    """Jobs kept per owner, finished ones included: past it, a new submission drops that
    owner's oldest finished jobs before their TTL (queued and running ones are never dropped),
    so that one caller's stream of cheap jobs cannot grow the job store without bound, nor
    push other owners' results out. On Redis only jobs submitted by sidecars of 7 December
    2026 or later are counted (older ones still leave with their TTL)."""
    job_max_attempts: PositiveInt = 3
    """Attempts before a job whose worker keeps dying is FAILED."""
    job_reclaim_idle_s: PositiveFloat = 30.0
    """Redis backend: a running job whose worker sent no heartbeat for this long is reclaimed
    by another worker (workers heartbeat every third of it)."""

    # --- drift -------------------------------------------------------------------------------
    drift_enabled: bool = True
    """Feed every inline explanation into the drift monitor."""
    drift_reference: Path | None = None
    """Reference file from ``limelight drift-reference build``; unset: the first N requests."""
    drift_bootstrap_n: PositiveInt = 500
    """Without a reference file: how many first requests become the reference (at least
    ``drift_min_count``: a smaller reference could never be compared)."""
    drift_window: PositiveInt = 500
    """Sliding window of recent explanations compared with the reference (at least
    ``drift_min_count``; it holds more than 90 % of this many, at most this many)."""
    drift_min_count: PositiveInt = 150
    """Explanations of a label that the window and the reference must each hold before that
    label is compared (fewer: not compared, no alert). Fewer give a divergence that reads as
    drift on unchanged traffic: on held-out reviews 50 of a label gave 0.04–0.06 (95th
    percentile), 150 under 0.01 (docs/drift.md, "How many explanations"). Only explanations
    with positive attribution mass count. A label rarer than ``drift_min_count / drift_window``
    of the traffic needs a larger window. Settings refuse a ``drift_window`` (or, without a
    ``drift_reference``, a ``drift_bootstrap_n``) below it."""
    drift_sample_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Share of inline explanations the drift monitor observes, drawn at random (whatever
    their content): 1 observes every one. The window and the bootstrap count observed ones,
    so below 1 they span ``1 / drift_sample_rate`` times as many requests. Lower it where the
    monitor's cost shows: a cheap model under heavy load (docs/drift.md, "Sampling")."""
    drift_queue_tokens: PositiveInt = 131_072
    """Tokens of the answers waiting for the drift monitor's thread, at most (what they hold in
    memory: about 5,000 short reviews, or 29 documents of 20,000 characters). The monitor observes
    answers after they are sent; when it falls behind (a cheap model under heavy load), an
    answer that finds no room goes unobserved and is counted in
    ``limelight_drift_dropped_total`` (docs/drift.md, "Observed after the answer")."""
    drift_sketch_size: PositiveInt = 256
    """Tokens tracked per label by the heavy-hitter sketch (the rest go to "other")."""
    drift_alert_threshold: Probability = 0.02
    """JSD (base 2) above which a label's drift counts as an alert. Measured on the demo models
    (docs/drift.md): held-out traffic stays below 0.005, one strongly weighted word appended to
    every review reaches 0.03-0.075 for its label (NormXLogit), 0.12-0.15 (the distilled head)."""

    @model_validator(mode="after")
    def _drift_can_compare(self) -> Settings:
        # A label is compared once the window and the reference each hold drift_min_count
        # explanations of it: a window (or, without a file, a bootstrap) smaller than that
        # would never compare any label, its gauges NaN for ever without a word.
        if not self.drift_enabled:
            return self
        short = []
        if self.drift_window < self.drift_min_count:
            short.append(f"drift_window is {self.drift_window}")
        if self.drift_reference is None and self.drift_bootstrap_n < self.drift_min_count:
            short.append(f"drift_bootstrap_n is {self.drift_bootstrap_n} (no drift_reference)")
        if short:
            raise ValueError(
                f"{' and '.join(short)}, below drift_min_count ({self.drift_min_count}): a "
                "label is compared only once the window and the reference each hold "
                "drift_min_count explanations of it, so no label ever would be; raise "
                f"drift_window and drift_bootstrap_n to at least {self.drift_min_count} or lower "
                "drift_min_count (LIMELIGHT_DRIFT_WINDOW, LIMELIGHT_DRIFT_BOOTSTRAP_N, "
                "LIMELIGHT_DRIFT_MIN_COUNT)"
            )
        return self

    # --- security ----------------------------------------------------------------------------
    tls_cert: Path | None = None
    """Server certificate (PEM). With ``tls_key`` it turns TLS on."""
    tls_key: Path | None = None
    """Server private key (PEM)."""
    tls_client_ca: Path | None = None
    """CA bundle for client certificates: set it to require mutual TLS."""
    tls_reload_interval_s: NonNegativeFloat = 30.0
    """How often the TLS files are looked at: changed ones (a certificate renewed by
    cert-manager, a rotated Secret) are served to new connections without a restart once they
    load and the key matches; connections already open keep theirs. 0: only on SIGHUP."""
    auth_tokens_file: Path | None = None
    """File with one accepted bearer token per line; enables auth."""
    auth_token: str | None = None
    """A single accepted bearer token (from the environment); enables auth."""

    log_level: str = "INFO"
    """Python logging level: DEBUG (adds tracebacks to CLI errors), INFO, WARNING, ERROR or
    CRITICAL, in any case."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        value = value.strip().lower()
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", value):
            # checked here rather than by torch at load time, whose message lists every
            # device type it knows, served here or not
            raise ValueError("the device is cpu, cuda, cuda:N (a GPU's index) or auto")
        return value

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, value: str) -> str:
        level = value.strip().upper()
        if level not in LOG_LEVELS:  # logging would fall back to INFO without a word
            raise ValueError(f"the log level is one of {', '.join(LOG_LEVELS)}")
        return level

    @field_validator("auth_token")
    @classmethod
    def _token_not_blank(cls, value: str | None) -> str | None:
        # Set but empty (a Secret's missing key, say) must not mean "auth off" or "any token".
        if value is not None and not value.strip():
            raise ValueError(
                "the bearer token is blank; unset LIMELIGHT_AUTH_TOKEN to serve without auth"
            )
        return value

    @field_validator("jobs")
    @classmethod
    def _known_job_backend(cls, value: str) -> str:
        # Checked with the other settings, before a start loads (or builds) the model.
        job_backend_kind(value)
        return value.strip()

    @field_validator("jobs_queue")
    @classmethod
    def _queue_name(cls, value: str) -> str:
        # A key prefix: a space or a colon would make keys an ACL pattern cannot tell apart.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", value):
            raise ValueError(
                "the queue name is 1 to 64 letters, digits, '.', '_' or '-', beginning with a "
                "letter or digit"
            )
        return value

    def resolved_jobs_db(self) -> Path:
        return self.jobs_db or self.cache_dir / "jobs.sqlite3"

    def demo_lm_head_dir(self) -> Path | None:
        """For a demo model served by name whose base checkpoint carries a pretrained
        masked-LM head (the BERT-tiny demos), that checkpoint, else None: where Decoded
        Grad-CAM reads its head when neither ``lm_head_dir`` nor a head fitted beside the model
        gives one."""
        if self.model_dir is not None:
            return None
        from limelight.demo.recipes import base_lm_head_dir

        return base_lm_head_dir(self.demo_model)
