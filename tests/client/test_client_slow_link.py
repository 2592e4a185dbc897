"""The SDK over a slow link: a real sidecar behind a TCP proxy that delays every chunk in both
directions, as a connection across regions does (a round trip of 300 ms here)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest

from limelight_client import Client
from tests.conftest import RunningSidecar

ONE_WAY_S = 0.15


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``ONE_WAY_S`` late, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while True:
            data = await reader.read(65536)
            await queue.put((loop.time() + ONE_WAY_S, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(read(), write(), return_exceptions=True)


@contextlib.contextmanager
def slow_proxy(target_port: int) -> Iterator[int]:
    """A delaying proxy to ``127.0.0.1:target_port`` on a free port, in a thread of its own."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    port: list[int] = []

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        try:
            await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))
        finally:  # both ends hang up with the proxy, as a dropped link would
            server_w.close()
            client_w.close()

    async def serve() -> asyncio.Server:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        started.set()
        return server

    async def shut(server: asyncio.Server) -> None:
        server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(serve())
        loop.run_forever()
        loop.run_until_complete(shut(server))
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(30)
    try:
        yield port[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


@pytest.mark.parametrize("connections", [1, 2])
def test_a_client_connects_over_a_link_with_a_long_round_trip(
    sidecar: RunningSidecar, connections: int
) -> None:
    # Every attempt timed out before the server's first frame: the SDK gave a connection
    # attempt 100 ms (grpc.min_reconnect_backoff_ms), and each retry dialled afresh.
    port = int(sidecar.target.rsplit(":", 1)[1])
    with (
        slow_proxy(port) as proxied,
        Client(f"127.0.0.1:{proxied}", timeout=30, connections=connections) as client,
    ):
        assert client.explain("a gorgeous, witty, seductive movie").label in ("rotten", "fresh")
        assert len(list(client.explain_many(["one fine film", "a dull one"] * 4))) == 8
