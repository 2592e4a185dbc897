"""The server's TLS files, served to new connections again whenever they change.

cert-manager renews a certificate weeks before it expires and Kubernetes swaps the mounted
Secret's files in place; a server that read them only at start serves the old certificate until
it is restarted, and clients refuse it once it expires. ``ServerTls`` looks at the files every
``tls_reload_interval_s`` (and on SIGHUP); files that changed are checked like at start (a
readable PEM certificate, the key that matches it) and then served to every new connection:
gRPC asks for the new configuration before each handshake, and the HTTP port hands each new
handshake to an ``SSLContext`` built afresh from the new files (from the ``sni_callback``, which
OpenSSL calls on every ClientHello, with or without a server name): loading files into the old
context would add a client CA but never drop one, as OpenSSL's trust store only grows. Files
caught half-written (a certificate without its new key) are not served: the previous certificate
stays until the pair is whole. Connections already open keep the certificate they started with.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from limelight.api.tls_check import TlsConfigError, check_server_tls
from limelight.settings import Settings

log = logging.getLogger(__name__)

Stamp = tuple[tuple[int, int] | None, ...]


@dataclass(frozen=True)
class _Files:
    """One readable, matching set of the TLS files' contents."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    expires: float


class ServerTls:
    """TLS for the gRPC and HTTP ports from ``tls_cert``/``tls_key`` (and ``tls_client_ca``:
    mutual TLS), re-read when they change. ``on_expiry`` gets the served certificate's expiry
    (Unix time) at start and after every reload (for the expiry gauge)."""

    def __init__(
        self, settings: Settings, on_expiry: Callable[[float], None] | None = None
    ) -> None:
        if settings.tls_cert is None or settings.tls_key is None:
            raise ValueError("TLS needs both tls_cert and tls_key")
        self.cert = Path(settings.tls_cert)
        self.key = Path(settings.tls_key)
        self.client_ca = Path(settings.tls_client_ca) if settings.tls_client_ca else None
        self.on_expiry = on_expiry
        self._lock = threading.Lock()
        self._stamp = self._stamps()
        self._files = self._read()  # raises TlsConfigError: a bad file at start is an error
        self._generation = 0
        self._handed = 0  # the generation gRPC last got
        self._http: ssl.SSLContext | None = None  # what new HTTPS handshakes get, once asked
        if on_expiry is not None:
            on_expiry(self._files.expires)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def _paths(self) -> list[Path]:
        return [self.cert, self.key, *([self.client_ca] if self.client_ca else [])]

    def _stamps(self) -> Stamp:
        stamps: list[tuple[int, int] | None] = []
        for path in self._paths():
            try:
                info = path.stat()  # follows Kubernetes' ..data symlink to the current files
            except OSError:
                stamps.append(None)
            else:
                stamps.append((info.st_mtime_ns, info.st_size))
        return tuple(stamps)

    def _read(self) -> _Files:
        expires = check_server_tls(self.cert, self.key)
        try:
            return _Files(
                cert=self.cert.read_bytes(),
                key=self.key.read_bytes(),
                client_ca=self.client_ca.read_bytes() if self.client_ca else None,
                expires=expires,
            )
        except OSError as exc:
            raise TlsConfigError(f"cannot read the TLS files: {exc}") from None

    # --- what the ports serve -----------------------------------------------------------------

    def _grpc_config(self, files: _Files) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(files.key, files.cert)], root_certificates=files.client_ca
        )

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(self._files),
            self._fetch,
            require_client_authentication=self.mutual,
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks before each handshake: the new configuration once, else None (no change).
        Called on gRPC's threads; reads no file."""
        with self._lock:
            if self._handed == self._generation:
                return None
            self._handed = self._generation
            return self._grpc_config(self._files)

    def _http_context(self, files: _Files) -> ssl.SSLContext:
        """A server context for the HTTP port: the certificate and key on disk (``ssl`` reads a
        pair from files only; a pair that no longer matches raises ``ssl.SSLError``) and
        ``files``' client CA bundle."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if files.client_ca is not None:
            context.load_verify_locations(cadata=files.client_ca.decode("ascii", "replace"))
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def ssl_context(self) -> ssl.SSLContext:
        """The context to listen with on the HTTP port: each handshake is handed on to the
        context of the files served now."""
        self._http = self._http_context(self._files)
        listening = self._http_context(self._files)

        def current(ssl_object: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> None:
            if self._http is not None:
                ssl_object.context = self._http

        listening.sni_callback = current
        return listening

    # --- reloading ----------------------------------------------------------------------------

    def changed(self) -> _Files | None:
        """The files, read and checked, if they changed since last looked at and make a whole,
        valid set (file work: call it off the event loop). A set that does not load is not
        served: one warning per change of the files."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            return self._read()
        except TlsConfigError as exc:
            log.warning("the TLS files changed but cannot be served (%s): kept the previous", exc)
            return None

    def serve(self, files: _Files) -> None:
        """Serve ``files`` to new connections. Call it on the event loop that runs the HTTP
        port: its handshakes read the context this replaces."""
        if self._http is not None:
            try:
                self._http = self._http_context(files)
            except (ssl.SSLError, OSError) as exc:  # changed again since read: next look
                log.warning("the HTTP port keeps its TLS files for now: %s", exc)
                self._stamp = ()
        with self._lock:
            self._files = files
            self._generation += 1
        if self.on_expiry is not None:
            self.on_expiry(files.expires)
        log.info("TLS files reloaded: new connections get the certificate in %s", self.cert)

    async def check(self) -> bool:
        """Look at the files now and serve them if they changed; True when they did."""
        files = await asyncio.to_thread(self.changed)
        if files is None:
            return False
        self.serve(files)
        return True
