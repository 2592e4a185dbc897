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
caught half-written (a certificate without its new key, a client CA bundle cut short or empty)
are not served: the previous set stays, on both ports, until the files make a whole one. A
renewal that has expired or is not valid yet is not served either while the certificate served
now is still valid (it is looked at again, and served once it is valid). Connections already
open keep the certificate they started with.

TLS sessions are not resumed across a change of the client CA bundle: OpenSSL does not verify a
client certificate again when a session is resumed, and the session cache and ticket keys
belong to the listening context, which is never replaced; a client refused by the new bundle
would otherwise get in with a session from before. The HTTP port issues no session tickets
(TLS 1.3 resumes only with those) and refuses a TLS 1.2 session-ID resumption of a session
made before the bundle last changed (the client's next, full, handshake is verified as usual).
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from limelight.api.tls_check import (
    TlsConfigError,
    check_client_ca,
    load_server_tls,
    not_valid_now,
    warn_validity,
)
from limelight.settings import Settings

log = logging.getLogger(__name__)

Stamp = tuple[tuple[int, int] | None, ...]


@dataclass(frozen=True)
class _Files:
    """One readable, matching set of the TLS files' contents."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    leaf: x509.Certificate  # the first certificate of ``cert``

    @property
    def expires(self) -> float:
        return self.leaf.not_valid_after_utc.timestamp()


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
        self._checking = asyncio.Lock()  # one look at a time (the interval's and SIGHUP's)
        self._stamp = self._stamps()
        self._files = self._read()  # raises TlsConfigError: a bad file at start is an error
        warn_validity(self._files.leaf)
        self._refused: Stamp | None = None  # files not served for their validity: warned once
        self._generation = 0
        self._handed = 0  # the generation gRPC last got
        self._http: ssl.SSLContext | None = None  # what new HTTPS handshakes get, once asked
        # When the client CA bundle last changed (Unix time, whole seconds, as OpenSSL's session
        # times): TLS sessions of that second or before do not resume.
        self._ca_since = -1
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
        """The files, checked (raises ``TlsConfigError``): a certificate and the key that
        matches it, and a client CA bundle of whole PEM certificates."""
        load_server_tls(self.cert, self.key)
        try:
            cert = self.cert.read_bytes()
            key = self.key.read_bytes()
            client_ca = self.client_ca.read_bytes() if self.client_ca else None
        except OSError as exc:
            raise TlsConfigError(f"cannot read the TLS files: {exc}") from None
        if self.client_ca is not None and client_ca is not None:
            check_client_ca(self.client_ca, client_ca)
        try:
            leaf = x509.load_pem_x509_certificate(cert)
        except ValueError as exc:  # replaced since checked
            raise TlsConfigError(f"tls_cert {self.cert} is not a PEM certificate: {exc}") from None
        return _Files(cert=cert, key=key, client_ca=client_ca, leaf=leaf)

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
        ``files``' client CA bundle. It issues no session tickets (see ``ssl_context``)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.options |= ssl.OP_NO_TICKET  # TLS 1.2: no tickets
        context.num_tickets = 0  # TLS 1.3: no tickets, hence no resumption
        context.load_cert_chain(self.cert, self.key)
        if files.client_ca is not None:
            context.load_verify_locations(cadata=files.client_ca.decode("ascii", "replace"))
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _stale(self, ssl_object: ssl.SSLObject) -> bool:
        """Whether a handshake resumes a session made before the client CA bundle last changed
        (the client certificate it carries was verified against an older bundle)."""
        if not ssl_object.session_reused:
            return False
        try:
            session = ssl_object.session
        except ValueError:  # cannot be read: refused, to be safe
            return True
        # Whole seconds: a session of the second the bundle changed in may be older than the
        # change, so it is refused too.
        return session is None or session.time <= self._ca_since

    def ssl_context(self) -> ssl.SSLContext:
        """The context to listen with on the HTTP port: each handshake is handed on to the
        context of the files served now.

        Session tickets and the session cache belong to this context, which stays while the
        files change: it issues no tickets (so TLS 1.3 never resumes) and, under mutual TLS, a
        TLS 1.2 handshake that resumes a session (by its ID, from this context's cache) made
        before the client CA bundle last changed is refused: OpenSSL would not verify the
        client's certificate again, and it may no longer be trusted."""
        self._http = self._http_context(self._files)
        listening = self._http_context(self._files)

        def current(ssl_object: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> int | None:
            # OpenSSL calls this on every ClientHello, after looking up the session it resumes.
            if self.mutual and self._stale(ssl_object):
                return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE
            if self._http is not None:
                ssl_object.context = self._http
            return None

        listening.sni_callback = current
        return listening

    # --- reloading ----------------------------------------------------------------------------

    def _not_servable(self, files: _Files, now: float) -> str | None:
        """Why a renewal must wait: its certificate has expired or is not valid yet while the
        one served now is valid (serving it would break every new connection)."""
        why = not_valid_now(files.leaf, now)
        if why is None or not_valid_now(self._files.leaf, now) is not None:
            return None
        return f"tls_cert {self.cert}: {why}, and the certificate served now is valid"

    def changed(self) -> _Files | None:
        """The files, read and checked, if they changed since last looked at and make a whole,
        valid set (file work: call it off the event loop). A set that does not load is not
        served: one warning per change of the files. A certificate outside its validity
        (while the served one is inside its own) is looked at again at every look, with one
        warning: a renewal not valid yet is served once it is."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return None
        try:
            files = self._read()
        except TlsConfigError as exc:
            self._stamp = stamp
            log.warning("the TLS files changed but cannot be served (%s): kept the previous", exc)
            return None
        why = self._not_servable(files, time.time())
        if why is not None:
            if self._refused != stamp:
                self._refused = stamp
                log.warning("the TLS files changed but are not served (%s): kept the previous", why)
            return None
        self._stamp = stamp
        warn_validity(files.leaf)
        return files

    def serve(self, files: _Files) -> bool:
        """Serve ``files`` to new connections on both ports; False (the previous set kept on
        both, the files read again at the next look) if the HTTP port cannot load them. Call it
        on the event loop that runs the HTTP port: its handshakes read the context this
        replaces."""
        if self._http is not None:
            try:
                http = self._http_context(files)
            except (ssl.SSLError, OSError, ValueError) as exc:  # changed again since read
                log.warning(
                    "the TLS files changed again while being loaded (%s): kept the previous on "
                    "both ports until the next look",
                    exc,
                )
                self._stamp = ()
                return False
            self._http = http
        if files.client_ca != self._files.client_ca:
            self._ca_since = math.floor(time.time())
        with self._lock:
            self._files = files
            self._generation += 1
        if self.on_expiry is not None:
            self.on_expiry(files.expires)
        log.info("TLS files reloaded: new connections get the certificate in %s", self.cert)
        return True

    async def check(self) -> bool:
        """Look at the files now and serve them if they changed; True when they did."""
        async with self._checking:
            files = await asyncio.to_thread(self.changed)
            return files is not None and self.serve(files)
