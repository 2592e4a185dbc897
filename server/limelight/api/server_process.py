"""A sidecar in a child process on a loopback port, for the benchmarks (`limelight bench`,
bench/): the parent measures the gRPC path from outside, as a client would."""

from __future__ import annotations

import cProfile
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from limelight.api.server import SidecarServer, serve_until_stopped
from limelight.settings import Settings
from limelight.signals import child_env, watch_parent


@dataclass
class ServerProcess:
    """A sidecar running in its own process on a loopback port."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 60.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM: graceful drain
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server_process(
    settings: dict[str, Any], timeout: float = 900.0, profile: Path | None = None
) -> ServerProcess:
    """Start ``limelight``'s sidecar in a child process with these Settings values (port and
    metrics port are picked here); returns once it is SERVING. ``profile``: write a cProfile
    of the server's event-loop thread there when it stops."""
    # No credentials from the environment (LIMELIGHT_AUTH_TOKENS_FILE, LIMELIGHT_TLS_*): the
    # benchmark's load generator has none to present. `limelight bench --against` measures
    # a sidecar that asks for them.
    values = {"port": 0, "metrics_port": 0, "jobs": "off", "drift_enabled": False}
    values |= dict.fromkeys(("auth_token", "auth_tokens_file", "tls_cert", "tls_key"))
    values |= dict.fromkeys(("tls_client_ca",))
    values.update({k: str(v) if isinstance(v, Path) else v for k, v in settings.items()})
    # The child says "ready" by writing its port here; the folder goes once it is read.
    with tempfile.TemporaryDirectory(prefix="limelight-bench-") as folder:
        port_file = Path(folder) / "port"
        code = "from limelight.api.server_process import serve_main; serve_main()"
        args = [sys.executable, "-c", code, json.dumps(values), str(port_file), str(profile or "")]
        process = subprocess.Popen(args, env=child_env())
        end = time.monotonic() + timeout
        while not port_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"the benchmark server exited with {process.returncode}")
            if time.monotonic() > end:
                process.kill()
                raise TimeoutError("the benchmark server did not become ready")
            time.sleep(0.05)
        return ServerProcess(process, int(port_file.read_text()))


def publish_port(path: Path, port: int) -> None:
    """Say "ready on ``port``" to a waiting parent: the file appears whole or not at all."""
    partial = path.with_suffix(".partial")
    partial.write_text(str(port))
    partial.rename(path)


def serve_main() -> None:
    """Entry point of the server child process (see ``start_server_process``)."""
    logging.basicConfig(level=logging.WARNING)
    values, port_file, profile_path = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    settings = Settings(**values)
    # A benchmark killed outright (SIGKILL) must not leave its sidecar serving forever.
    watch_parent()
    if settings.workers > 1:  # a supervisor with its worker processes (`--workers`)
        from limelight.api.workers import Supervisor

        sys.exit(Supervisor(settings, on_ready=lambda port: publish_port(port_file, port)).run())
    server = SidecarServer(settings, on_ready=lambda s: publish_port(port_file, s.port))
    profiler = cProfile.Profile() if profile_path else None
    if profiler is not None:
        profiler.enable()
    try:
        serve_until_stopped(server)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)
