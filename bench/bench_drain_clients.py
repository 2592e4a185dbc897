"""Plain gRPC clients through a rolling restart, with and without a connection age.

Kubernetes in miniature: two sidecars (separate ``limelight serve`` processes) behind a TCP
proxy that gives each new connection to one of its endpoints in turn, the way a Service does.
Plain gRPC clients (no SDK; a service config that retries ``UNAVAILABLE`` five times with
backoff) call ``Explain`` through the proxy from another process. Midway, one sidecar is taken
out of the endpoints and, after a ``preStop``-like pause (``--pre-stop``), sent SIGTERM; it
drains for its grace period. Reported: the calls answered and the calls that failed, before
the sidecar left the endpoints, from then until it stopped ("during"), and after.

    .venv/bin/python bench/bench_drain_clients.py --demo bert-tiny --ages 0,2 --grace 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from limelight.api.ports import free_port
from limelight.demo.build import ensure_demo_model
from limelight.settings import Settings

RETRY = {
    "methodConfig": [
        {
            "name": [{"service": "limelight.v1.Explainer"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}


class Proxy:
    """A TCP proxy that deals new connections over its endpoints in turn (a Service)."""

    def __init__(self, port: int, backends: list[int]) -> None:
        self.port = port
        self.endpoints = list(backends)
        self._next = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._main, daemon=True).start()
        self._ready.wait(30)

    def remove(self, backend: int) -> None:
        self.loop.call_soon_threadsafe(self.endpoints.remove, backend)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        self._ready.set()
        self.loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backend = self.endpoints[self._next % len(self.endpoints)]
        self._next += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def _serve(model_dir: Path, port: int, grace: float, age: float) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model_dir),
        "--port", str(port), "--metrics-port", "0", "--jobs", "off", "--runtime", "onnx",
        "--grace-period-s", str(grace),
    ]  # fmt: skip
    if age > 0:
        command += ["--max-connection-age-s", str(age)]
    env = {**os.environ, "LIMELIGHT_TORCH_THREADS": "1", "LIMELIGHT_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(command, env=env)


def _wait_serving(port: int) -> None:
    from limelight_client import Client

    with Client(f"127.0.0.1:{port}") as client:
        client.wait_ready(timeout=600)


def _clients(
    target: str, threads: int, seconds: float, marks: dict[str, float], out: object
) -> None:
    """Runs in its own process: ``threads`` plain gRPC callers, one channel each."""
    import grpc

    from limelight_client.proto import explainer_pb2 as pb
    from limelight_client.proto import explainer_pb2_grpc

    start = time.time()
    tally: Counter[tuple[str, str]] = Counter()
    lock = threading.Lock()

    def phase(now: float) -> str:
        if now < marks["removed"]:
            return "before"
        return "during" if now < marks["stopped"] else "after"

    def caller() -> None:
        options = [("grpc.service_config", json.dumps(RETRY)), ("grpc.enable_retries", 1)]
        with grpc.insecure_channel(target, options=options) as channel:
            stub = explainer_pb2_grpc.ExplainerStub(channel)
            while (now := time.time()) < start + seconds:
                try:
                    stub.Explain(pb.ExplainRequest(text="a fine, moving film"), timeout=10)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with lock:
                    tally[(phase(now), code)] += 1

    workers = [threading.Thread(target=caller) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.send(dict(tally))  # type: ignore[attr-defined]


def run(
    model_dir: Path, age: float, grace: float, threads: int, pre_stop: float
) -> dict[tuple[str, str], int]:
    ports = [free_port(), free_port()]
    servers = [_serve(model_dir, p, grace, age) for p in ports]
    try:
        for p in ports:
            _wait_serving(p)
        proxy = Proxy(free_port(), ports)
        now = time.time()
        marks = {"removed": now + 4.0, "stopped": now + 4.0 + pre_stop + grace + 1.0}
        receive, send = multiprocessing.Pipe(duplex=False)
        seconds = marks["stopped"] - now + 3.0
        load = multiprocessing.Process(
            target=_clients, args=(f"127.0.0.1:{proxy.port}", threads, seconds, marks, send)
        )
        load.start()
        time.sleep(max(0.0, marks["removed"] - time.time()))
        proxy.remove(ports[0])  # out of the endpoints
        time.sleep(pre_stop)  # the preStop sleep: out of the endpoints, still serving
        servers[0].send_signal(signal.SIGTERM)
        tally = receive.recv()
        load.join()
        servers[0].wait(grace + 30)
        return tally  # type: ignore[no-any-return]
    finally:
        for server in servers:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="bert-tiny")
    parser.add_argument("--ages", default="0,2", help="connection ages in seconds; 0: none")
    parser.add_argument("--grace", type=float, default=6.0, help="the drained sidecar's grace")
    parser.add_argument("--threads", type=int, default=4, help="plain gRPC callers")
    parser.add_argument(
        "--pre-stop",
        type=float,
        default=1.0,
        help="seconds between leaving the endpoints and SIGTERM",
    )
    args = parser.parse_args()
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    print("| connection age | phase | answered | failed (codes) |")
    print("|---|---|---|---|")
    for age in (float(a) for a in args.ages.split(",")):
        tally = run(model_dir, age, args.grace, args.threads, args.pre_stop)
        for phase in ("before", "during", "after"):
            ok = tally.get((phase, "OK"), 0)
            failed = {code: n for (p, code), n in tally.items() if p == phase and code != "OK"}
            shown = f"{age:g} s" if age > 0 else "none"
            codes = ", ".join(f"{n} {code}" for code, n in sorted(failed.items())) or "0"
            print(f"| {shown} | {phase} | {ok} | {codes} |", flush=True)


if __name__ == "__main__":
    main()
