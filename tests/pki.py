"""A throwaway certificate authority for the TLS tests, made with the ``openssl`` CLI."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Subjects of the client certificates ``make_pki`` issues by default (name → subject).
CLIENTS = {"client": "/CN=client"}


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def _issue(directory: Path, name: str, subject: str, extensions: str, days: int = 2) -> None:
    """``name.key`` (P-256) and ``name.pem``, signed by the CA in ``directory``."""
    _openssl(
        directory, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key"
    )
    _openssl(
        directory, "req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr"
    )
    (directory / f"{name}.cnf").write_text(extensions)
    _openssl(
        directory, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", str(days), "-extfile", f"{name}.cnf", "-out", f"{name}.pem",
    )  # fmt: skip


def make_pki(directory: Path, clients: dict[str, str] = CLIENTS, days: int = 2) -> Path:
    """In ``directory``: a CA (``ca.pem``, ``ca.key``), a server certificate for ``localhost``
    and ``127.0.0.1`` valid for ``days`` (``server.pem``, ``server.key``) and a client
    certificate for each of ``clients`` (``NAME.pem``, ``NAME.key``), all signed by the CA.
    Returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(directory, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key")
    _openssl(
        directory, "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=limelight-test-ca",
        "-days", "2", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", "ca.pem",
    )  # fmt: skip
    server = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    _issue(directory, "server", "/CN=server", server, days)
    for name, subject in clients.items():
        _issue(directory, name, subject, "extendedKeyUsage=clientAuth\n")
    return directory


def mount_secret(secret: Path, files: dict[str, Path]) -> None:
    """Put ``files`` (name → source) in ``secret`` as the kubelet updates a mounted Secret: a
    new folder of files, then the ``..data`` symlink swapped in one rename (the names are
    symlinks through it)."""
    version = secret / f"..{time.time_ns()}"
    version.mkdir(parents=True)
    for name, source in files.items():
        (version / name).write_bytes(source.read_bytes())
    swap = secret / "..data_tmp"
    swap.symlink_to(version.name)
    os.replace(swap, secret / "..data")
    for name in files:
        if not (secret / name).is_symlink():
            (secret / name).symlink_to(f"..data/{name}")


def issue_server(directory: Path, name: str, not_before: datetime, not_after: datetime) -> Path:
    """``name.pem`` and ``name.key`` in ``directory`` (made by ``make_pki``): a server
    certificate for ``localhost`` and ``127.0.0.1`` signed by its CA, valid from ``not_before``
    to ``not_after`` (either may lie in the past or the future). Returns ``directory``."""
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return directory
