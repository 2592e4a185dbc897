"""An OTLP/gRPC trace receiver for tests, built on the published OTLP protos
(``opentelemetry-proto``): it keeps every span it is sent."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from limelight.api.ports import free_port


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[Any, Any]] = []
        """(resource, span) pairs, in arrival order."""
        self.lock = threading.Lock()
        self.endpoint = ""

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend((resource.resource, s) for s in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[Any]:
        with self.lock:
            return [s for _, s in self.spans if s.name == name]

    def arrived(self, name: str, trace_id: str, flush: Callable[[], object]) -> Any:
        """The span ``name`` of trace ``trace_id`` (hex), once exported: a span a server ends
        after the call that made it returned (a cancelled stream) arrives later."""
        for _ in range(2000):
            flush()
            found = [s for s in self.named(name) if s.trace_id.hex() == trace_id]
            if found:
                (span,) = found
                return span
            threading.Event().wait(0.05)
        raise AssertionError(f"no span {name!r} in trace {trace_id} was exported")


@contextmanager
def running_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(None)
