"""TLS, both ends: the server's certificate is self-signed and its fingerprint is its
identity, which the client pins (``devices(..., fingerprint=)``) instead of checking a CA chain.

The certificate is made with ``cryptography`` (the ``remote`` extra); a certificate and key of
one's own (PEM files, e.g. from ``openssl req -x509``) work without it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
import ssl
import tempfile

from ._errors import RemoteAuthError, RemoteError

__all__ = ["fingerprint_of", "pinned_client", "self_signed", "server_context"]


def self_signed() -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a self-signed certificate for it, as PEM.

    Raises:
        RemoteError: when ``cryptography`` is not installed.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:
        raise RemoteError(
            "TLS with a generated certificate needs the cryptography package: "
            "pip install '.[remote]' (or pass tls=(certfile, keyfile) of your own)"
        ) from exc
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dpt-remote")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def fingerprint_of(cert_pem: bytes) -> str:
    """The SHA-256 fingerprint (lower-case hex) of a PEM certificate, as clients pin it."""
    return _fingerprint(ssl.PEM_cert_to_DER_cert(cert_pem.decode("ascii")))


def _fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A server-side TLS context holding this certificate and key."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # load_cert_chain reads files only: a private directory, gone right after.
    with tempfile.TemporaryDirectory(prefix="remote-tls-") as tmp:
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, data in ((cert_path, cert_pem), (key_path, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def pinned_client(sock: socket.socket, host: str, fingerprint: str, where: str) -> socket.socket:
    """``sock`` wrapped in TLS to the server ``where``, whose certificate must have
    ``fingerprint`` (colons and case ignored).

    Raises:
        RemoteAuthError: it presented another certificate.
    """
    # The certificate is self-signed: its identity is the fingerprint we pin, not a CA chain.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    tls = ctx.wrap_socket(sock, server_hostname=host)
    got = _fingerprint(tls.getpeercert(binary_form=True) or b"")
    if not hmac.compare_digest(got, fingerprint.replace(":", "").strip().lower()):
        tls.close()
        raise RemoteAuthError(
            f"remote server {where} presented a TLS certificate with fingerprint {got}, "
            f"not the pinned {fingerprint}: refusing it"
        )
    return tls
