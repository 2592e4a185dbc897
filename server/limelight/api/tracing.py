"""A gRPC server interceptor that opens one SERVER span per RPC when tracing is on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from limelight import tracing


def _code(context: grpc.aio.ServicerContext, exc: BaseException | None = None) -> str:
    """The call's status code name: the one set on ``context`` (an abort, an error answered
    by the servicer), else the one the exception that left the handler gives."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None or isinstance(exc, grpc.aio.AbortError):
        return "OK"
    return tracing.status_name(exc)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC runs inside a span named after its method, parented by ``traceparent``."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not tracing.enabled():
            return handler
        method = details.method or ""
        carrier = {
            key: value
            for key, value in (details.invocation_metadata or ())
            if isinstance(value, str)
        }
        service, _, name = method.lstrip("/").partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

        def unary(behavior: Any) -> Any:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with tracing.server_span(method.lstrip("/"), carrier, attributes) as span:
                    try:
                        result = await behavior(request, context)
                    except BaseException as exc:
                        tracing.set_status(span, _code(context, exc))
                        raise
                    tracing.set_status(span, _code(context))
                    return result

            return call

        def streaming(behavior: Any) -> Any:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                # The span is current only while the handler runs, never across a ``yield``: a
                # client that stops reading has this generator closed from another task, where
                # a context attached here could not be detached.
                span = tracing.start_server_span(method.lstrip("/"), carrier, attributes)
                items = behavior(request, context)
                code: str | None = None
                try:
                    while True:
                        with tracing.current(span):
                            try:
                                item = await items.__anext__()
                            except StopAsyncIteration:
                                break
                        yield item
                except (GeneratorExit, asyncio.CancelledError):
                    code = "CANCELLED"
                    raise
                except BaseException as exc:
                    code = _code(context, exc)
                    raise
                finally:
                    try:
                        closing = getattr(items, "aclose", None)
                        if closing is not None:
                            with tracing.current(span):
                                await closing()
                    finally:
                        tracing.set_status(span, code or _code(context))
                        span.end()

            return call

        des, ser = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), des, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), des, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), des, ser)
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), des, ser)
