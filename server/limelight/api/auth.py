"""Optional bearer-token authentication for the Explainer and the Open Inference Protocol.

Health, reflection and the OIP liveness/readiness RPCs stay open so that kubelet probes and
grpcurl work without a token; an open OIP RPC called without an accepted token is told no more
than whether what it names is served (``caller_trusted``: ModelReady does not name the served
model to it).
Tokens are compared through their SHA-256 digests (see ``bearer_allowed``): a set lookup whose
time does not depend on how much of an accepted token a guess gets right, and does not grow
with the number of tokens.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import contextvars
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import grpc

from limelight.settings import Settings

log = logging.getLogger(__name__)

_PROTECTED_PREFIXES = ("/limelight.v1.", "/inference.GRPCInferenceService/")
_OPEN_METHODS = frozenset(
    f"/inference.GRPCInferenceService/{name}"
    for name in ("ServerLive", "ServerReady", "ModelReady")
)


#: A tokens file larger than this is refused (a path given by mistake, a model's weights, would
#: otherwise be read into memory, line by line, as tokens).
MAX_TOKENS_FILE_BYTES = 64 * 1024 * 1024


def _read_tokens_file(path: Path) -> list[bytes]:
    """The tokens in ``path``: one per line, as bytes (compared as bytes: a line that is not
    UTF-8 is a token like any other, not an error), blank lines and ``#`` comments skipped,
    a UTF-8 byte order mark (an editor's) dropped. Raises OSError (unreadable) or ValueError
    (over ``MAX_TOKENS_FILE_BYTES``), both naming the file."""
    with path.open("rb") as file:
        data = file.read(MAX_TOKENS_FILE_BYTES + 1)
    if len(data) > MAX_TOKENS_FILE_BYTES:
        raise ValueError(
            f"the tokens file {path} (--auth-tokens-file) is larger than "
            f"{MAX_TOKENS_FILE_BYTES // (1024 * 1024)} MiB: is it the right file?"
        )
    data = data.removeprefix(codecs.BOM_UTF8)
    lines = (line.strip() for line in data.splitlines())
    return [line for line in lines if line and not line.startswith(b"#")]


def load_tokens(settings: Settings) -> list[bytes]:
    tokens: list[bytes] = []
    if settings.auth_tokens_file is not None:
        tokens += _read_tokens_file(Path(settings.auth_tokens_file))
    if settings.auth_token and settings.auth_token.strip():
        tokens.append(settings.auth_token.strip().encode())
    return tokens


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class TokenStore:
    """The accepted tokens, re-read when ``auth_tokens_file`` changes (rotation without a
    restart). Iterating yields the current tokens; ``digests`` their SHA-256 digests. The file
    is looked at (``stat``) at most every ``check_s`` seconds; a changed file is read on a
    thread of its own, not on the event loop of the caller (a large file would stall every
    port), and its tokens are accepted once read. A file that cannot be read keeps the previous
    tokens, with one warning per change of the file."""

    def __init__(self, settings: Settings, check_s: float = 1.0) -> None:
        self.settings = settings
        self.check_s = check_s
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._stamp = self._file_stamp()
        self._warned: tuple[int, int] | None = None  # the stamp last warned about
        self._reading: threading.Thread | None = None
        self._current = self._pair(load_tokens(settings))

    @staticmethod
    def _pair(tokens: list[bytes]) -> tuple[list[bytes], frozenset[bytes]]:
        # Replaced in one assignment: a reader sees the old pair or the new one, never a mix.
        return tokens, frozenset(_digest(t) for t in tokens)

    def _file_stamp(self) -> tuple[int, int] | None:
        path = self.settings.auth_tokens_file
        if path is None:
            return None
        try:
            info = Path(path).stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def _look(self) -> None:
        """Start reading the file again if it changed (at most every ``check_s``)."""
        if self.settings.auth_tokens_file is None:
            return
        with self._lock:
            now = time.monotonic()
            if now - self._checked < self.check_s or self._reading is not None:
                return
            self._checked = now
            stamp = self._file_stamp()
            if stamp is None or stamp == self._stamp:
                return
            self._reading = threading.Thread(
                target=self._reload, args=(stamp,), name="limelight-tokens", daemon=True
            )
            self._reading.start()

    def _reload(self, stamp: tuple[int, int]) -> None:
        """Read the changed file (on its own thread) and accept its tokens."""
        path = self.settings.auth_tokens_file
        try:
            tokens = load_tokens(self.settings)
        except (OSError, ValueError) as exc:
            with self._lock:
                self._reading = None
                if isinstance(exc, ValueError):
                    self._stamp = stamp  # the same content fails the same way: not read again
                if self._warned == stamp:
                    return
                self._warned = stamp
            log.warning(
                "bearer tokens not reloaded from %s (the previous tokens stay accepted): %s",
                path,
                exc,
            )
            return
        with self._lock:
            self._reading = None
            self._stamp = stamp
            self._current = self._pair(tokens)
        log.info("bearer tokens reloaded from %s: %d accepted", path, len(tokens))

    def current(self) -> list[bytes]:
        self._look()
        return self._current[0]

    def digests(self) -> frozenset[bytes]:
        """The SHA-256 digests of the current tokens (what ``bearer_allowed`` looks up)."""
        self._look()
        return self._current[1]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.current())

    def __bool__(self) -> bool:
        """Whether auth is on (a tokens file or a token is configured)."""
        return self.settings.auth_tokens_file is not None or bool(self.settings.auth_token)


def needs_token(method: str) -> bool:
    """Whether a gRPC method (``/package.Service/Method``) is behind the bearer tokens."""
    return method.startswith(_PROTECTED_PREFIXES) and method not in _OPEN_METHODS


def bearer_allowed(tokens: Iterable[bytes], authorization: str | bytes | None) -> bool:
    """Whether an ``authorization`` value (``Bearer <token>``) carries an accepted token."""
    if authorization is None:
        return False
    # surrogateescape: an HTTP header aiohttp decoded from bytes that are not UTF-8 is compared
    # as those bytes (tokens are bytes), not turned into an error.
    token = _token(authorization)
    if not token:
        return False
    # Constant time without comparing against every token: the presented token is hashed first
    # and its SHA-256 digest looked up among the accepted tokens' digests. What the lookup's
    # timing can depend on is the presented digest, which a caller cannot steer towards an
    # accepted token's digest without a SHA-256 preimage: getting more of a token's bytes right
    # brings its digest no closer (hash-then-compare). The time taken does not grow with the
    # number of tokens either (a file of a million tokens once cost every request ~40 ms).
    digests = (
        tokens.digests()
        if isinstance(tokens, TokenStore)
        else frozenset(_digest(candidate) for candidate in tokens)
    )
    return _digest(token) in digests


#: The bearer token the interceptor accepted for the call being handled (each RPC runs in its
#: own task, the interceptor's check included): unset when auth is off, so that a header no
#: one checked does not make its sender someone else.
_verified_token: contextvars.ContextVar[bytes | None] = contextvars.ContextVar(
    "limelight_verified_token", default=None
)


#: Whether the call being handled may be told what this server serves (the model's name): false
#: only for a call to an open method of a guarded service (ModelReady) while auth is on, without
#: an accepted token. Set by the interceptor in the call's own task, like ``_verified_token``.
_trusted: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "limelight_caller_trusted", default=True
)


def caller_trusted() -> bool:
    """Whether the gRPC call being handled may be told the served model's name: auth is off, or
    its caller sent an accepted token."""
    return _trusted.get()


def principal(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for job ownership: the accepted bearer token's identity (a digest, never
    the token), else the client certificate's subject (mutual TLS), else "" (anonymous).

    With auth on, the interceptor has already refused calls without an accepted token; with
    auth off an ``authorization`` header is ignored: everyone is the same anonymous caller.
    """
    token = _verified_token.get()
    if token is not None:
        return "token:" + hashlib.sha256(token).hexdigest()[:32]
    auth = context.auth_context() or {}
    for prop in ("x509_subject", "x509_common_name"):
        values = auth.get(prop)
        if values:
            first = values[0]
            return "x509:" + (first.decode(errors="replace") if isinstance(first, bytes) else first)
    return ""


def _token(authorization: str | bytes) -> bytes:
    """The token of an ``authorization`` value (``Bearer <token>``); b"" for another scheme."""
    raw = (
        authorization.encode(errors="surrogateescape")
        if isinstance(authorization, str)
        else bytes(authorization)
    )
    scheme, _, token = raw.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class RefusalCounter(Protocol):
    def count_refused(self, rpc: str, code: str, seconds: float) -> None: ...


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Iterable[bytes], counter: RefusalCounter | None = None) -> None:
        """``counter``: counts each refusal among the requests (the servicer's metrics)."""
        # A TokenStore stays live (reloads on change); anything else is a fixed list.
        self._tokens = tokens if isinstance(tokens, TokenStore) else list(tokens)
        self._counter = counter

    def _allowed(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key.lower() == "authorization":
                if not bearer_allowed(self._tokens, value):
                    return False
                # The handler runs in this task: the caller's identity for job ownership.
                _verified_token.set(_token(value))
                return True
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None:
            # An unknown method: nothing to wrap; gRPC answers UNIMPLEMENTED.
            return handler
        if not needs_token(method):
            if method.startswith(_PROTECTED_PREFIXES):  # open (ModelReady): answered to anyone
                _trusted.set(self._allowed(handler_call_details.invocation_metadata))
            return handler
        if self._allowed(handler_call_details.invocation_metadata):
            return handler
        # Bounded label values: a method with a handler is one this server serves.
        return _deny(handler, method.rpartition("/")[2] or "unknown", self._counter)


#: Refusing a client-streaming call: read at most this many messages, this long, first.
_DRAIN_MESSAGES = 64
_DRAIN_S = 1.0


def _deny(
    handler: grpc.RpcMethodHandler, rpc: str, counter: RefusalCounter | None
) -> grpc.RpcMethodHandler:
    message = "missing or invalid bearer token (send 'authorization: Bearer <token>')"
    start = time.monotonic()

    async def refuse(context: grpc.aio.ServicerContext) -> None:
        # Counted like the calls the guard answers: dashboards watch code!="OK" per RPC.
        if counter is not None:
            counter.count_refused(rpc, "UNAUTHENTICATED", time.monotonic() - start)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)
        yield  # pragma: no cover - makes this an async generator

    async def drained(requests: AsyncIterator[Any]) -> None:
        """Read what the client already sent (bounded) before refusing: a grpc.aio client
        whose request writer is still busy when the status arrives reports the call as
        INTERNAL ("Internal error from Core") instead of the real status."""
        count = 0
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_DRAIN_S):
                async for _ in requests:
                    count += 1
                    if count >= _DRAIN_MESSAGES:
                        break

    async def client_streaming(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> Any:
        await drained(requests)
        await refuse(context)

    async def bidi_streaming(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> Any:
        await drained(requests)
        await refuse(context)
        yield  # pragma: no cover - makes this an async generator

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(client_streaming, des, ser)
    return grpc.stream_stream_rpc_method_handler(bidi_streaming, des, ser)
