"""What gRPC in Python costs by itself: an echo server, with no model and no Limelight code.

    .venv/bin/python bench/bench_grpc_floor.py [--servers aio,sync] [--rpcs unary,stream]
        [--clients 1,32] [--duration 5] [--rounds 2] [--request-bytes 200] [--response-bytes 2000]

Issue 14 asks the sidecar's CPU per request to stay within 1.15x of the in-process work per text
and a one-client request within a plain forward + 1.5 ms. Part of every served request is gRPC's
own: the HTTP/2 stream, headers and status, the C core's completion queue and the Python
callbacks around it. This measures that part alone. The server (a separate process) answers
every message with a fixed payload — the grpc.aio server, as the sidecar runs, or the
thread-pool server; unary calls or one bidirectional stream per client — and a load generator
in a third process runs closed-loop asyncio clients over one channel. Reported per condition:
requests per second, client-side p50, and the server process's CPU (user + system, from /proc)
per request. The conditions alternate round by round, so the machine's drift spreads over all.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from concurrent import futures

import grpc

from limelight.evaluation.benchmark import machine, process_cpu_seconds

SERVICE = "floor.Echo"


def _identity(data: bytes) -> bytes:
    return data


def _handlers(response: bytes, aio: bool) -> grpc.GenericRpcHandler:
    if aio:

        async def unary_aio(request: bytes, context: object) -> bytes:
            return response

        async def stream_aio(
            requests: AsyncIterator[bytes], context: object
        ) -> AsyncIterator[bytes]:
            async for _ in requests:
                yield response

        unary, stream = unary_aio, stream_aio
    else:

        def unary_sync(request: bytes, context: object) -> bytes:
            return response

        def stream_sync(requests: object, context: object) -> object:
            for _ in requests:  # type: ignore[attr-defined]
                yield response

        unary, stream = unary_sync, stream_sync  # type: ignore[assignment]
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _identity, _identity),
        },
    )


def serve(kind: str, port: int, response_bytes: int) -> None:
    response = b"r" * response_bytes
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        server.add_generic_rpc_handlers((_handlers(response, aio=False),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handlers(response, aio=True),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


async def load(
    port: int, rpc: str, clients: int, duration: float, request_bytes: int, server_pid: int
) -> tuple[float, float, float]:
    """Closed-loop clients for ``duration`` seconds after a warm-up: (req/s, p50 ms, CPU ms/req)."""
    request = b"q" * request_bytes
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(
            f"/{SERVICE}/Unary", request_serializer=_identity, response_deserializer=_identity
        )
        bidi = channel.stream_stream(
            f"/{SERVICE}/Stream", request_serializer=_identity, response_deserializer=_identity
        )
        latencies: list[float] = []
        measuring = False
        stop = 0.0

        async def client() -> None:
            if rpc == "unary":
                while time.perf_counter() < stop:
                    begin = time.perf_counter()
                    await unary(request)
                    if measuring:
                        latencies.append(time.perf_counter() - begin)
                return
            call = bidi()
            while time.perf_counter() < stop:
                begin = time.perf_counter()
                await call.write(request)
                await call.read()
                if measuring:
                    latencies.append(time.perf_counter() - begin)
            await call.done_writing()

        stop = time.perf_counter() + 1.0  # warm-up: connections, streams, caches
        await asyncio.gather(*(client() for _ in range(clients)))
        measuring = True
        cpu0, t0 = process_cpu_seconds(server_pid), time.perf_counter()
        stop = t0 + duration
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed, cpu = time.perf_counter() - t0, process_cpu_seconds(server_pid) - cpu0
    n = len(latencies)
    return n / elapsed, 1000.0 * statistics.median(latencies), 1000.0 * cpu / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="aio,sync", help="aio (the sidecar's), sync")
    parser.add_argument("--rpcs", default="unary,stream")
    parser.add_argument("--clients", default="1,32")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per condition")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--request-bytes", type=int, default=200, help="a short review")
    parser.add_argument(
        "--response-bytes", type=int, default=2000, help="about a short review's explanation"
    )
    parser.add_argument("--port", type=int, default=50071)
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--load", help=argparse.SUPPRESS)  # the load-generator process
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.response_bytes)
        return
    if args.load:
        rpc, clients = args.load.split(":")
        rate, p50, cpu = asyncio.run(
            load(args.port, rpc, int(clients), args.duration, args.request_bytes, args.server_pid)
        )
        print(f"{rate:.0f} {p50:.3f} {cpu:.3f}")
        return
    me = [sys.executable, os.path.abspath(__file__), "--port", str(args.port)]
    results: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    servers = args.servers.split(",")
    rpcs = args.rpcs.split(",")
    counts = [int(c) for c in args.clients.split(",")]
    for _ in range(args.rounds):
        for kind in servers:
            server = subprocess.Popen(
                [*me, "--serve", kind, "--response-bytes", str(args.response_bytes)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert server.stdout is not None and server.stdout.readline().strip() == "ready"
                for rpc in rpcs:
                    for clients in counts:
                        out = subprocess.run(
                            [
                                *me,
                                "--load",
                                f"{rpc}:{clients}",
                                "--server-pid",
                                str(server.pid),
                                "--duration",
                                str(args.duration),
                                "--request-bytes",
                                str(args.request_bytes),
                            ],
                            check=True,
                            capture_output=True,
                            text=True,
                        ).stdout.split()
                        rate, p50, cpu = (float(x) for x in out)
                        results.setdefault((kind, rpc, clients), []).append((rate, p50, cpu))
                        print(
                            f"  {kind:4} {rpc:6} {clients:3} clients: {rate:7.0f} req/s, "
                            f"p50 {p50:.3f} ms, server CPU {cpu:.3f} ms/req",
                            file=sys.stderr,
                        )
            finally:
                server.terminate()
                server.wait()
    print(f"{machine()}; {args.request_bytes} B requests, {args.response_bytes} B responses")
    print()
    print("| server | rpc | clients | req/s (each round) | p50 ms | server CPU ms/req |")
    print("|---|---|---|---|---|---|")
    for (kind, rpc, clients), rows in results.items():
        rates = " / ".join(f"{r[0]:,.0f}" for r in rows)
        p50s = " / ".join(f"{r[1]:.2f}" for r in rows)
        cpus = " / ".join(f"{r[2]:.2f}" for r in rows)
        print(f"| {kind} | {rpc} | {clients} | {rates} | {p50s} | {cpus} |")


if __name__ == "__main__":
    main()
