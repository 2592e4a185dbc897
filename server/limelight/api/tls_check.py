"""Start-up checks of the server's TLS files, so that a bad certificate says what is wrong.

gRPC reports a certificate that does not match its key as "Failed to bind to address", and
serves an expired certificate without a word. ``check_server_tls`` reads the files first:
unreadable or mismatched files raise ``TlsConfigError`` with the reason, and an expired (or
soon expiring, or not yet valid) certificate is logged as a warning; its expiry is returned for
the ``limelight_tls_certificate_expiry_timestamp_seconds`` gauge. ``check_client_ca`` refuses a
client CA bundle that is empty or cut short.
"""

from __future__ import annotations

import logging
import ssl
import time
from pathlib import Path

from cryptography import x509

log = logging.getLogger(__name__)

#: Warn this long before the server certificate expires.
EXPIRY_WARNING_S = 14 * 24 * 3600.0


class TlsConfigError(ValueError):
    """The TLS files cannot be served; the message says why."""


def load_server_tls(cert: Path, key: Path) -> x509.Certificate:
    """The leaf certificate of ``cert``, once the chain and ``key`` load and match (else
    ``TlsConfigError``)."""
    for what, path in (("tls_cert", cert), ("tls_key", key)):
        if not Path(path).is_file():
            raise TlsConfigError(f"{what} {path} does not exist or is not a file")
    try:
        leaf = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    except ValueError as exc:
        raise TlsConfigError(f"tls_cert {cert} is not a PEM certificate: {exc}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise TlsConfigError(
                f"tls_key {key} is not the private key of the certificate in tls_cert {cert}"
            ) from None
        raise TlsConfigError(
            f"tls_cert {cert} / tls_key {key} cannot be loaded: {exc.reason or exc}"
        ) from None
    return leaf


def check_client_ca(path: Path, data: bytes) -> None:
    """Raise ``TlsConfigError`` unless ``data`` (read from ``path``, the client CA bundle) is a
    whole PEM bundle of at least one certificate: an empty file, or one caught half-written
    (cut in a certificate), would make gRPC fail every handshake and keep serving an older
    configuration than the HTTP port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cadata=data.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        if not data.strip():
            reason = "the file is empty"
        elif b"-----BEGIN CERTIFICATE-----" not in data:
            reason = "no PEM certificate in it"
        else:
            detail = getattr(exc, "reason", None)  # OpenSSL's, when it has one: BAD_END_LINE
            reason = "a certificate in it is cut short or damaged"
            reason += f": {detail}" if detail else ""
        raise TlsConfigError(
            f"--tls-client-ca {path} is not a whole PEM bundle of CA certificates ({reason})"
        ) from None


def not_valid_now(leaf: x509.Certificate, now: float | None = None) -> str | None:
    """Why ``leaf`` cannot be served at ``now`` (expired, not valid yet), or None."""
    now = time.time() if now is None else now
    if leaf.not_valid_after_utc.timestamp() <= now:
        return f"it expired at {leaf.not_valid_after_utc.isoformat()}"
    if leaf.not_valid_before_utc.timestamp() > now:
        return f"it is not valid before {leaf.not_valid_before_utc.isoformat()}"
    return None


def warn_validity(leaf: x509.Certificate, now: float | None = None) -> None:
    """Log a warning if ``leaf`` has expired, expires soon or is not valid yet."""
    expires = leaf.not_valid_after_utc.timestamp()
    now = time.time() if now is None else now
    subject = leaf.subject.rfc4514_string()
    if expires <= now:
        log.warning(
            "the server certificate (%s) EXPIRED at %s: clients will refuse it",
            subject,
            leaf.not_valid_after_utc.isoformat(),
        )
    elif expires - now < EXPIRY_WARNING_S:
        log.warning(
            "the server certificate (%s) expires soon, at %s",
            subject,
            leaf.not_valid_after_utc.isoformat(),
        )
    if leaf.not_valid_before_utc.timestamp() > now:
        log.warning(
            "the server certificate (%s) is not valid before %s: clients will refuse it until then",
            subject,
            leaf.not_valid_before_utc.isoformat(),
        )


def check_server_tls(cert: Path, key: Path, now: float | None = None) -> float:
    """Validate the certificate chain and key; the leaf certificate's expiry (Unix time)."""
    leaf = load_server_tls(cert, key)
    warn_validity(leaf, now)
    return leaf.not_valid_after_utc.timestamp()
