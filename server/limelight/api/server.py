"""Server bootstrap: gRPC (Explainer + health + reflection), the metrics endpoint, start-up
order and graceful shutdown.

Start-up: the port opens at once with health NOT_SERVING; the model loads in a thread; the
service warms up; then health goes SERVING. (A worker that shares its port with others,
``--workers``, loads first and binds after, so connections that reach it find it ready.)
Health's ``liveness`` service answers SERVING from the moment the port opens to the end
(loading, not ready, draining): a liveness probe that asks for it restarts only a process that
no longer answers, never one that is merely out of rotation.
SIGTERM: health NOT_SERVING, no new work, in-flight requests finish within the grace period,
running jobs finish or go back to the durable queue. SIGHUP: look beside the model for a new
head, lexicon table or graph now (as the reloader does every ``reload_interval_s``; a build that
failed is tried again though no file moved: a head made readable with ``chmod``), and at the
TLS files (renewed ones are served to new connections: ``server_tls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from limelight import __version__, tracing
from limelight.api import oip, oip_grpc
from limelight.api.auth import BearerTokenInterceptor, TokenStore
from limelight.api.http_server import HttpServer
from limelight.api.log_filters import LibraryLogFilter
from limelight.api.server_tls import ServerTls
from limelight.api.servicer import SERVICE_NAME, ExplainerServicer, add_to_server
from limelight.api.tracing import TracingInterceptor
from limelight.app import Application, build_application, load_served_model
from limelight.metrics import Metrics
from limelight.models.lexicon_table import cached_lexicon_dir
from limelight.models.loaded import LoadedModel
from limelight.reload import FilesSeen, InlineReloader, served_files
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2

log = logging.getLogger(__name__)

#: Shutdown: after the drain, the gRPC server stops once no RPC has arrived for this long
#: (clients that have not yet seen NOT_SERVING are refused UNAVAILABLE meanwhile).
QUIET_BEFORE_STOP_S = 0.5

#: The health service name for liveness probes: SERVING while the process answers at all.
#: Readiness is the empty name (and ``limelight.v1.Explainer``).
LIVENESS_SERVICE = "liveness"


class ClientHangUps(LibraryLogFilter):
    """gRPC logs an answer its core would not send — the call had ended between the handler's
    return and the send: the client cancelled, its deadline passed or its connection closed —
    as an ERROR with a traceback ("ExecuteBatchError raised in core by servicer method").
    That is the client's hang-up, not a fault of the server: one WARNING line instead."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"
    LOGGER = "grpc._cython.cygrpc"

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.PREFIX):
            method = record.getMessage()[len(self.PREFIX) :].strip(" []") or "a call"
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "%s: the answer was not sent, the call had ended (the client hung up)"
            record.args = (method,)
            record.exc_info = record.exc_text = None
        return True


def keepalive_options(settings: Settings) -> list[tuple[str, int]]:
    """gRPC's server options for keepalive: ping idle clients, and let clients ping idle
    connections (gRPC's default refuses pings more often than every 5 minutes without a call)."""
    timeout_ms = round(settings.keepalive_timeout_s * 1000)
    return [
        ("grpc.keepalive_time_ms", round(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # A ping already in flight (a bandwidth probe) holds the keepalive ping back; it must
        # time out as soon (gRPC's default: a minute).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # The least time between a client's pings the server accepts (the "recv" interval).
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            round(settings.keepalive_min_client_interval_s * 1000),
        ),
    ]


def connection_age_options(settings: Settings) -> list[tuple[str, int]]:
    """gRPC's server options for ``max_connection_age_s`` and its grace (none when unset)."""
    options = []
    if settings.max_connection_age_s is not None:
        options.append(
            ("grpc.max_connection_age_ms", max(1, round(settings.max_connection_age_s * 1000)))
        )
    if settings.max_connection_age_grace_s is not None:
        options.append(
            ("grpc.max_connection_age_grace_ms", round(settings.max_connection_age_grace_s * 1000))
        )
    return options


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """The files of every service served, for reflection (grpcurl). The Open Inference
    Protocol's stubs live in a pool of their own (tritonclient's and KServe's register the same
    ``inference`` names in the default pool), so the default pool lacks that service."""
    from grpc_reflection.v1alpha import reflection_pb2

    from limelight_client.proto import open_inference_grpc_pb2

    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:  # a file is added after the files it imports
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for module in (explainer_pb2, health_pb2, open_inference_grpc_pb2, reflection_pb2):
        add(module.DESCRIPTOR)
    return pool


class SidecarServer:
    """One Limelight sidecar process: build with Settings, then ``await run()``."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        model: LoadedModel | None = None,
        on_ready: Callable[[SidecarServer], None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._model = model
        self._on_ready = on_ready
        self.port = settings.port
        self.metrics_port = settings.metrics_port
        self.app: Application | None = None
        self._health: Any = None
        self._server: grpc.aio.Server | None = None
        self._probes: grpc.aio.Server | None = None
        self.health_port = settings.health_port
        self._servicer = ExplainerServicer(
            self.metrics, workers=settings.workers, max_response_bytes=settings.max_response_bytes
        )
        self._inference = oip_grpc.InferenceServicer(
            self._servicer,
            __version__,
            model.name if model is not None else oip.configured_model_name(settings),
        )
        self._stopping: asyncio.Event | None = None
        #: Stopped while the model loaded: the load's thread may still be in native code.
        self.load_abandoned = False
        self._http: HttpServer | None = None
        self.reloader: InlineReloader | None = None
        self._reloading: asyncio.Task[None] | None = None
        self._asked_reloads: set[asyncio.Task[bool]] = set()
        self._reload_when_loaded = False  # a SIGHUP came while the model was loading
        self.tls: ServerTls | None = None
        self._tls_watch: asyncio.Task[None] | None = None

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        assert self._health is not None
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    def _build(self) -> tuple[Application, FilesSeen]:
        # The demo's LM head (Decoded Grad-CAM only) is fitted in the background: the first
        # start serves without waiting for it.
        model = self._model or load_served_model(self.settings, serving=True)
        # Before the build: a head written while it runs is picked up at the first check.
        paths = served_files(self.settings, model)
        seen = FilesSeen.of(paths)
        app = build_application(self.settings, self.metrics, model)
        if self.settings.lexicon_build:
            # The table the build wrote into the cache itself (LIMELIGHT_LEXICON_BUILD) is
            # served already: not a change for the first check to reload (and restart drift).
            seen = seen.looked_again(paths, [cached_lexicon_dir(model, self.settings.cache_dir)])
        return app, seen

    async def _build_or_stop(self) -> tuple[Application, FilesSeen] | None:
        """``_build`` on a daemon thread of its own, or None when a stop is asked for first.
        Loading can take minutes (a demo build, a lexicon table for a large model): a SIGTERM
        meanwhile ends the process within its grace period instead of after the build (the
        build is left behind; a daemon thread, unlike the default executor's, does not hold
        the exit up; what it writes to the cache is staged and locked, as under SIGKILL)."""
        loop = asyncio.get_running_loop()
        built: asyncio.Future[tuple[Application, FilesSeen]] = loop.create_future()

        def settle(result: Any, failure: BaseException | None) -> None:
            if built.done():
                return
            if failure is not None:
                built.set_exception(failure)
            else:
                built.set_result(result)

        def work() -> None:
            try:
                result, failure = self._build(), None
            except BaseException as exc:  # handed to the loop, raised where it is awaited
                result, failure = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
                loop.call_soon_threadsafe(settle, result, failure)

        threading.Thread(target=work, name="limelight-load", daemon=True).start()
        assert self._stopping is not None
        stop: asyncio.Future[Any] = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([built, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not built.done():
            built.cancel()
            self.load_abandoned = True
            log.info("stopping while the model is still loading: its load is left unfinished")
            return None
        return built.result()

    async def _load(self) -> Application | None:
        """Load and start the service; None when a stop came first."""
        if (loaded := await self._build_or_stop()) is None:
            return None
        app, seen = loaded
        self.app = app
        await app.service.start()
        self._servicer.service = app.service
        # Made even when polling is off (interval 0): SIGHUP still reloads on demand.
        self.reloader = InlineReloader(
            app, self.settings.reload_interval_s, seen, on_reload=self._health_after_reload
        )
        if self.settings.reload_interval_s > 0:
            self._reloading = asyncio.create_task(self.reloader.run())
        if self._reload_when_loaded:
            self._reload_when_loaded = False
            self.request_reload()
        return app

    async def _health_after_reload(self) -> None:
        """A reload may make the default method servable (its head came) or not (it went)."""
        if self.app is None or (self._stopping is not None and self._stopping.is_set()):
            return
        service = self.app.service
        await self._set_health(service.ready)
        if not service.ready:
            log.warning(
                "not ready: the default inline method %s cannot be served (%s)",
                service.default_method.name,
                service.default_unavailable,
            )

    def request_reload(self) -> None:
        """SIGHUP: check the TLS files and the files beside the model now, in a task of the
        running loop."""
        if self.tls is not None:
            self._track_reload(self.tls.check())
        if self.reloader is None:
            log.info(
                "SIGHUP: the model is still loading; the files beside it are checked once it is in"
            )
            self._reload_when_loaded = True
            return
        self._track_reload(self._reload_now(self.reloader))

    def _track_reload(self, check: Coroutine[Any, Any, bool]) -> None:
        task = asyncio.get_running_loop().create_task(check)
        self._asked_reloads.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._asked_reloads.discard)

    async def _watch_tls(self, tls: ServerTls, interval_s: float) -> None:
        """Serve renewed TLS files to new connections (``tls_reload_interval_s``)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await tls.check()
            except Exception:  # never let a surprise end the watch: the next look may work
                log.exception("checking the TLS files failed")

    async def _reload_now(self, reloader: InlineReloader) -> bool:
        if self._stopping is not None and self._stopping.is_set():
            return False
        reloaded = await reloader.check(force=True)  # a build that failed is tried again
        if not reloaded:
            log.info(
                "SIGHUP: nothing new served (the files beside the model are as they were, or "
                "could not be built: see above); default inline method %s",
                reloader.app.service.default_method.name,
            )
        return reloaded

    async def start(self) -> None:
        settings = self.settings
        self._stopping = asyncio.Event()
        # One of several workers on the port: bind only once the model is in, or the kernel
        # would hand new connections to a worker that can only refuse them.
        if settings.reuse_port and await self._load() is None:
            return
        tokens = TokenStore(settings)  # the tokens file is re-read when it changes
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if tracing.setup_tracing():  # OTEL_* variables; off by default
            interceptors.append(TracingInterceptor())
        if tokens:
            interceptors.append(BearerTokenInterceptor(tokens, counter=self._servicer))
        options = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_response_bytes),
            # Without it, gRPC's own defence against streams opened and reset in a loop
            # (HTTP/2 rapid reset) never engages: one such client starved every other.
            ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
            # Off unless several workers share the port: a second sidecar started on a taken
            # port must fail rather than silently split the traffic.
            ("grpc.so_reuseport", int(settings.reuse_port)),
            *connection_age_options(settings),
            *keepalive_options(settings),
        ]
        ClientHangUps.install()
        server = grpc.aio.server(interceptors=interceptors, options=options)
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        add_to_server(self._servicer, server)
        oip_grpc.add_to_server(self._inference, server)
        reflection.enable_server_reflection(
            (
                explainer_pb2.DESCRIPTOR.services_by_name["Explainer"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                oip_grpc.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
            pool=reflection_pool(),
        )
        address = f"{settings.host}:{settings.port}"
        if settings.tls_cert is not None or settings.tls_key is not None:
            # Say what is wrong with the files (gRPC would only fail to bind), warn on expiry.
            expiry = self.metrics.tls_certificate_expiry.labels(str(settings.tls_cert))
            self.tls = ServerTls(settings, on_expiry=expiry.set)
            self.port = server.add_secure_port(address, self.tls.grpc_credentials())
            if settings.tls_reload_interval_s > 0:
                self._tls_watch = asyncio.create_task(
                    self._watch_tls(self.tls, settings.tls_reload_interval_s)
                )
        else:
            self.port = server.add_insecure_port(address)
        await self._set_health(False)
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server = server
        if settings.health_port:
            # Health only, plaintext: kubelet gRPC probes cannot use TLS. Nothing else is
            # served here, so the main port can require TLS and tokens.
            probes = grpc.aio.server(options=[("grpc.so_reuseport", int(settings.reuse_port))])
            health_pb2_grpc.add_HealthServicer_to_server(self._health, probes)
            self.health_port = probes.add_insecure_port(f"{settings.host}:{settings.health_port}")
            await probes.start()
            self._probes = probes
        if settings.metrics_port:
            http = HttpServer(
                settings, self.metrics, lambda: self._servicer.service, tokens, __version__
            )
            http_tls = self.tls.ssl_context() if self.tls and settings.http_tls else None
            self.metrics_port = await http.start(settings.host, settings.metrics_port, http_tls)
            self._http = http
        log.info(
            "listening on %s:%d (gRPC%s), %s%s",
            settings.host,
            self.port,
            ", TLS" if self.tls else "",
            f"HTTP (metrics) on port {self.metrics_port}" if self.metrics_port else "no HTTP port",
            "" if self.app is not None else "; loading the model",
        )
        app = self.app or await self._load()
        if app is None:  # asked to stop while loading: `run` goes on to stop
            return
        await self._set_health(app.service.ready)
        if not app.service.ready:
            log.warning(
                "not ready: the default inline method %s cannot be served (%s); readiness "
                "stays false until it can (what is written beside the model is picked up "
                "without a restart), or serve another with --default-method",
                app.service.default_method.name,
                app.service.default_unavailable,
            )
        jobs = app.service.jobs
        log.info(
            "SERVING %s (%s, version %s) on %s:%d; jobs %s",
            app.model.name,
            app.model.architecture,
            app.model.version,
            settings.host,
            self.port,
            jobs.describe() if jobs is not None else "off",
        )
        if self._on_ready is not None:
            self._on_ready(self)

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def wait(self) -> None:
        assert self._stopping is not None
        await self._stopping.wait()

    async def stop(self) -> None:
        """Graceful, within one deadline of ``grace_period_s`` for the whole shutdown:
        NOT_SERVING, refuse new work (UNAVAILABLE) while every admitted request finishes and
        jobs stop, wait for a quiet moment with no new RPC, end the calls still open with
        UNAVAILABLE, stop the server, close.

        The quiet moment matters: the gRPC server's own stop ends every call still in transit
        (sent by a client, not yet handed to a handler) as CANCELLED, which clients do not
        retry; while it runs, such a call is answered UNAVAILABLE instead."""
        grace = self.settings.grace_period_s
        deadline = time.monotonic() + grace
        for task in [self._reloading, self._tls_watch, *self._asked_reloads]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Keep a little of the budget for ending the calls still open and the final stop.
        final = min(2.0, 0.1 * grace)
        if self._server is not None:
            await self._set_health(False)
        if self.app is not None:
            await self.app.service.drain(max(0.0, grace - final))
        if self._server is not None:
            await self._servicer.wait_quiet(QUIET_BEFORE_STOP_S, deadline - final)
            self._servicer.end_calls()
            await self._server.stop(grace=max(0.05, deadline - time.monotonic()))
        if self._probes is not None:
            await self._probes.stop(0)
            self._probes = None
        if self.app is not None:
            await self.app.service.close()
        if self._http is not None:
            await self._http.stop()
        # Whatever is left of the grace period (at least a moment), off the event loop.
        flush_s = min(5.0, max(0.5, deadline - time.monotonic()))
        await asyncio.to_thread(tracing.shutdown_tracing, flush_s)
        log.info("stopped")

    async def run(
        self,
        install_signal_handlers: bool = True,
        hangup_before: Callable[[], bool] | None = None,
    ) -> None:
        """Serve until asked to stop. ``hangup_before``: whether a SIGHUP came before this
        loop's handler took over (then it is honoured as if it came now)."""
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        if hangup_before is not None and hangup_before():
            self.request_reload()
        try:
            await self.start()
            await self.wait()
        finally:
            await self.stop()


def serve_until_stopped(
    server: SidecarServer, hangup_before: Callable[[], bool] | None = None
) -> None:
    """Run ``server`` in an event loop of its own until it stops. Stopped during its load, the
    process ends here: the interpreter's exit would wait for, or tear down under, the load's
    thread still inside torch or tokenizers ("terminate called without an active exception",
    an abort)."""
    asyncio.run(server.run(hangup_before=hangup_before))
    if server.load_abandoned:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
