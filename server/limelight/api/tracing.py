"""A gRPC server interceptor that opens one SERVER span per RPC when tracing is on."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from limelight import tracing


def _code(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


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
                        return await behavior(request, context)
                    finally:
                        tracing.set_status(span, _code(context))

            return call

        def streaming(behavior: Any) -> Any:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                with tracing.server_span(method.lstrip("/"), carrier, attributes) as span:
                    try:
                        async for item in behavior(request, context):
                            yield item
                    finally:
                        tracing.set_status(span, _code(context))

            return call

        des, ser = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), des, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), des, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), des, ser)
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), des, ser)
