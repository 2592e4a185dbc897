"""Start-up checks of the server's TLS files, so that a bad certificate says what is wrong.

gRPC reports a certificate that does not match its key as "Failed to bind to address", and
serves an expired certificate without a word. ``check_server_tls`` reads the files first:
unreadable or mismatched files raise ``TlsConfigError`` with the reason, and an expired (or
soon expiring) certificate is logged as a warning; its expiry is returned for the
``limelight_tls_certificate_expiry_timestamp_seconds`` gauge.
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


def check_server_tls(cert: Path, key: Path, now: float | None = None) -> float:
    """Validate the certificate chain and key; the leaf certificate's expiry (Unix time)."""
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
    starts = leaf.not_valid_before_utc.timestamp()
    if starts > now:
        log.warning("the server certificate (%s) is not valid before %s", subject, starts)
    return expires
