"""`limelight serve`: run the sidecar."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from limelight.cli.common import add_model_args, json_value, settings_from_args, setup_logging
from limelight.errors import InvalidArgument
from limelight.settings import Settings


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve",
        help="run the gRPC sidecar",
        description="Serve inline explanations, jobs and drift over gRPC; metrics over HTTP. "
        "Every flag also reads from its LIMELIGHT_* environment variable.",
    )
    add_model_args(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 in containers)")
    p.add_argument("--port", type=int, help="gRPC port (default 50051; 0 picks a free one)")
    p.add_argument(
        "--workers",
        type=int,
        help="sidecar processes sharing the gRPC port (default 1; above 1: --jobs off or redis)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="HTTP port: /metrics, Open Inference Protocol REST, KServe v1 (default 9464; 0: off)",
    )
    p.add_argument(
        "--model-name", help="name OIP/KServe clients address (default: the model directory's)"
    )
    p.add_argument("--runtime", choices=["torch", "onnx"], help="inline runtime (default torch)")
    p.add_argument("--onnx-path", type=Path, help="exported graph for --runtime onnx")
    p.add_argument("--lm-head", dest="lm_head_dir", type=Path, help="masked-LM head directory")
    p.add_argument("--head-mask", dest="head_mask_path", type=Path, help="LRP head mask file")
    p.add_argument("--default-method", help="inline method when a request names none")
    p.add_argument(
        "--lexicon-build",
        action="store_const",
        const=True,
        help="build the lexicon table into the cache at start-up when the default method needs "
        "one and none is found (LIMELIGHT_LEXICON_BUILD)",
    )
    p.add_argument("--max-batch-size", type=int, help="inline requests per forward pass")
    p.add_argument("--max-batch-wait-ms", type=float, help="how long a batch waits to fill")
    p.add_argument("--max-tokens", type=int, help="token limit per input")
    p.add_argument(
        "--truncation",
        choices=["truncate", "reject", "window"],
        help="over-long input policy (window: overlapping windows over the whole text)",
    )
    p.add_argument("--window-stride", type=int, help="window: tokens shared by windows (64)")
    p.add_argument(
        "--window-aggregation", choices=["mean", "max"], help="window: the logits' aggregate"
    )
    p.add_argument(
        "--label-threshold",
        type=float,
        help="multi-label models: predict a label at this sigmoid probability (above 0, at most "
        "1; default 0.5)",
    )
    p.add_argument(
        "--label-thresholds",
        type=json_value,
        metavar="JSON",
        help="multi-label: per-label thresholds, e.g. '{\"toxic\": 0.3}'",
    )
    p.add_argument("--jobs", help="sqlite (default), redis://host:port/db, or off")
    p.add_argument("--jobs-db", type=Path, help="SQLite journal for the embedded job backend")
    p.add_argument(
        "--jobs-password-file",
        type=Path,
        help="Redis password, read at each new connection (a mounted Secret: rotates without a "
        "restart)",
    )
    p.add_argument(
        "--jobs-queue",
        metavar="NAME",
        help="Redis queue name, the prefix of its keys (default limelight): one per model "
        "sharing a Redis database",
    )
    p.add_argument("--job-workers", type=int, help="in-process job worker threads")
    p.add_argument("--drift-reference", type=Path, help="reference file for drift")
    p.add_argument(
        "--drift-sample-rate",
        type=float,
        help="share of inline explanations the drift monitor observes, at random (default 1: "
        "all; lower it on a cheap model under heavy load)",
    )
    p.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    p.add_argument("--tls-key", type=Path, help="server key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, help="require client certs signed by this CA")
    p.add_argument(
        "--http-tls",
        action=argparse.BooleanOptionalAction,
        help="TLS on the HTTP port too when TLS is on (default: yes)",
    )
    p.add_argument(
        "--viewer",
        dest="viewer_enabled",
        action=argparse.BooleanOptionalAction,
        help="the web viewer at /viewer/ on the HTTP port (default: yes)",
    )
    p.add_argument("--auth-tokens-file", type=Path, help="accepted bearer tokens, one per line")
    p.add_argument("--grace-period-s", type=float, help="SIGTERM drain time")
    p.add_argument(
        "--reload-interval-s",
        type=float,
        help="how often to look beside the model for a new head, lexicon table or graph and "
        "serve it without a restart (default 10; 0: never; SIGHUP looks at once either way)",
    )
    p.add_argument(
        "--max-connection-age-s",
        type=float,
        help="close each client connection after about this long (GOAWAY; clients reconnect, "
        "possibly to another replica); default: never",
    )
    p.add_argument(
        "--max-connection-age-grace-s",
        type=float,
        help="how long calls open on an aged connection may still run; default: to their end",
    )
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    p.set_defaults(func=run)


def _check_readable(flag: str, path: Path | None, pem: bool = False) -> None:
    if path is None:
        return
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if pem and b"-----BEGIN" not in data:
        raise InvalidArgument(f"{flag} {path}: not a PEM file (no -----BEGIN line)")


def preflight(settings: Settings) -> None:
    """Refuse, before any port opens, what the settings alone show to be wrong."""
    if settings.model_dir is not None:
        from limelight.models.loaded import check_model_directory
        from limelight.models.sources import resolve_model_source

        check_model_directory(resolve_model_source(settings.model_dir).path)
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise InvalidArgument("--tls-cert and --tls-key go together: give both or neither")
    if settings.tls_client_ca is not None and settings.tls_cert is None:
        raise InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key")
    _check_readable("--tls-cert", settings.tls_cert, pem=True)
    _check_readable("--tls-key", settings.tls_key, pem=True)
    _check_readable("--tls-client-ca", settings.tls_client_ca, pem=True)
    _check_readable("--auth-tokens-file", settings.auth_tokens_file)
    if settings.max_connection_age_grace_s is not None and settings.max_connection_age_s is None:
        raise InvalidArgument("--max-connection-age-grace-s needs --max-connection-age-s")
    if settings.runtime == "onnx" and settings.onnx_path is not None:
        _check_readable("--onnx-path", settings.onnx_path)
    from limelight.api.workers import check_workers

    check_workers(settings)


class _EarlyHangup:
    """SIGHUP before the server's own handler is in place: importing torch and gRPC takes
    seconds, and SIGHUP's default action ends the process (a ``kill -HUP`` right after a pod
    started would restart it). Noted here instead, and honoured once the server runs."""

    def __init__(self) -> None:
        self.seen = False
        signal.signal(signal.SIGHUP, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True


def run(args: argparse.Namespace) -> int:
    hangup = _EarlyHangup()  # first: everything below may take seconds
    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    preflight(settings)
    if settings.workers > 1:
        from limelight.api.workers import Supervisor

        # Its own handler takes over; no worker has read the model's files yet, and each will.
        return Supervisor(settings).run()
    from limelight.api.server import SidecarServer, serve_until_stopped

    serve_until_stopped(SidecarServer(settings), hangup_before=lambda: hangup.seen)
    return 0


def worker_main() -> None:
    """Entry point of one ``--workers`` process, started by ``limelight.api.workers.Supervisor``
    with its settings file, the file to announce its port in, and its index."""
    hangup = _EarlyHangup()  # first, as in ``run``: a SIGHUP sent to the worker while it starts
    from limelight.api.server import SidecarServer, serve_until_stopped
    from limelight.api.server_process import publish_port
    from limelight.api.workers import EXIT_REFUSED, heartbeat_interval, refusal_file
    from limelight.cli.main import describe_error
    from limelight.metrics import Metrics
    from limelight.signals import watch_parent

    settings_file, ready_file, index = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    settings = Settings.model_validate(json.loads(settings_file.read_text()))
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)-7s [worker {index}] %(name)s: %(message)s",
    )
    watch_parent()
    metrics = Metrics(multiprocess_dir=Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
    interval = heartbeat_interval(settings)

    def beat() -> None:
        # On the event loop: a frozen loop stops the beats and the supervisor restarts us.
        with contextlib.suppress(OSError):
            os.utime(ready_file)
        asyncio.get_running_loop().call_later(interval, beat)

    def on_ready(server: SidecarServer) -> None:
        publish_port(ready_file, server.port)
        asyncio.get_running_loop().call_later(interval, beat)

    server = SidecarServer(settings, metrics=metrics, on_ready=on_ready)
    try:
        serve_until_stopped(server, hangup_before=lambda: hangup.seen)
    except Exception as exc:  # one line, like `limelight serve` itself
        args = argparse.Namespace(**settings.model_dump())
        message, status = describe_error(exc, args)
        print(f"limelight serve: error: worker {index}: {message}", file=sys.stderr)
        if status == EXIT_REFUSED:  # the supervisor stops with this as its own last line
            with contextlib.suppress(OSError):
                refusal_file(ready_file).write_text(message)
        sys.exit(status)
