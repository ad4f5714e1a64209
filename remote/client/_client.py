"""The client: reaching a server (``devices``), the handshake (``dial``), the device kind
that makes ``tl.device("remote://HOST:PORT/INDEX")`` work, and ``stats``."""

from __future__ import annotations

import hmac
import math
import numbers
import re
import secrets
import socket
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

import tensorlib as tl

from .._conn import Framed, tune
from .._errors import RemoteAuthError, RemoteConnectionError, RemoteError
from .._handshake import (
    CONTROL,
    FLAG_AUTH,
    LIST_FRAME,
    MAGIC,
    NONCE_BYTES,
    REFUSED_AUTH,
    REFUSED_BUSY,
    REFUSED_CROWDED,
    REFUSED_TIMEOUT,
    check_token,
    client_proof,
    hello,
    parse_answer,
    parse_device_list,
    parse_greeting,
    server_proof,
    session_seal,
)
from .._tls import pinned_client
from .._wire import MAX_HELLO_FRAME, PROTOCOL_VERSION, ProtocolError
from . import _fused
from ._array import RemoteArray
from ._session import Session

__all__ = [
    "ServerInfo",
    "check_address",
    "check_fingerprint",
    "check_timeout",
    "devices",
    "dial",
    "stats",
]


@dataclass
class ServerInfo:
    """How to reach one server, as ``remote.devices`` learned it.

    Attributes:
        host, port: where it listens; ``where`` is ``"host:port"``.
        token: the shared token (None: the server asks for none).
        fingerprint: the pinned SHA-256 of its TLS certificate (None: no TLS).
        timeout: seconds without a reply or heartbeat after which it counts as lost.
        specs: its devices (``"cpu"``, ``"cuda:0"``), by index.
    """

    host: str
    port: int
    token: bytes | None
    fingerprint: str | None
    timeout: float
    specs: list[str]

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"


_servers: dict[str, ServerInfo] = {}
_sessions: dict[Any, Session] = {}
_lock = threading.Lock()


# HOST:PORT, an IPv6 host in brackets; a certificate's SHA-256 as `serve --tls` prints it.
_ADDRESS = re.compile(r"\[?([^\[\]]+?)\]?:(\d+)")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def check_address(address: object, who: str) -> tuple[str, int]:
    """``(host, port)`` of a ``"HOST:PORT"`` str (port 1-65535; ``who`` names the caller).

    Raises:
        TypeError: ``address`` is not a str.
        ValueError: it is not ``HOST:PORT``, or the port is out of range.
    """
    if not isinstance(address, str):
        raise TypeError(f"{who}: address must be a 'HOST:PORT' str, got {address!r}")
    m = _ADDRESS.fullmatch(address.strip())
    if m is None or not m.group(1).strip():
        raise ValueError(f"{who}: address must be 'HOST:PORT', got {address!r}")
    port = int(m.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"{who}: address {address!r} has port {port}; expected 1-65535")
    return m.group(1).lower(), port


def check_fingerprint(fingerprint: object, who: str) -> str:
    """``fingerprint`` if it is a SHA-256 in hex (colons and case ignored, as pinned).

    Raises:
        TypeError: it is not a str.
        ValueError: it is not 64 hex digits.
    """
    if not isinstance(fingerprint, str):
        raise TypeError(
            f"{who}: fingerprint must be a str (SHA-256 hex), got {type(fingerprint).__name__} "
            f"{fingerprint!r}"
        )
    if _FINGERPRINT.fullmatch(fingerprint.replace(":", "").strip().lower()) is None:
        raise ValueError(
            f"{who}: fingerprint must be the server certificate's SHA-256 as 64 hex digits "
            f"(colons allowed), got {fingerprint!r}"
        )
    return fingerprint


def check_timeout(timeout: object, who: str) -> float:
    """``timeout`` as seconds: a positive, finite number (a socket's timeout).

    Raises:
        TypeError: it is not a number.
        ValueError: it is not positive and finite.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{who}: timeout must be a number of seconds, got {timeout!r}")
    if not 0 < float(timeout) < math.inf:  # NaN fails this too
        raise ValueError(f"{who}: timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class _CrowdedError(RemoteConnectionError):
    """The server dropped this connection for a newer one (too many in its handshake)."""


# Tries of a connection the server drops as the oldest of too many in its handshake (a flood
# of idle connections): each try is dropped only if that many come in during its few
# milliseconds, so a second is rarely needed, as the rendezvous store's clients retry.
_CROWDED_TRIES = 5


def dial(info: ServerInfo, device: int) -> Framed:
    """Connect to ``info``'s server and complete the handshake for ``device`` (or CONTROL).

    Raises:
        RemoteConnectionError: the server cannot be reached, broke off the handshake, or
            turned it away (every session taken, or too busy ``_CROWDED_TRIES`` times).
        RemoteAuthError: a token or fingerprint mismatch, either way.
    """
    for _ in range(_CROWDED_TRIES - 1):
        try:
            return _dial(info, device)
        except _CrowdedError:
            continue
    return _dial(info, device)


def _dial(info: ServerInfo, device: int) -> Framed:
    try:
        sock = socket.create_connection((info.host, info.port), timeout=info.timeout)
    except OSError as exc:
        raise RemoteConnectionError(
            f"cannot reach remote server {info.where}: {type(exc).__name__}: {exc}"
        ) from exc
    framed: Framed | None = None
    try:
        tune(sock)
        if info.fingerprint is not None:
            sock = pinned_client(sock, info.host, info.fingerprint, info.where)
        framed = Framed(sock)
        _handshake(framed, info, device)
        sock.settimeout(None)
        return framed
    except RemoteError:
        sock.close()
        raise
    except (OSError, EOFError, ProtocolError) as exc:
        sock.close()
        raise _broken_off(info, framed, exc) from exc


def _broken_off(info: ServerInfo, framed: Framed | None, exc: Exception) -> RemoteError:
    """The error for a handshake that ended without the server's word on why."""
    what = f"{type(exc).__name__}: {exc}"
    if framed is not None and framed.received:  # it spoke plain text: not a TLS server
        return RemoteConnectionError(
            f"remote server {info.where} closed the connection during the handshake ({what})"
        )
    if info.fingerprint is None:  # silence from the start is what a TLS server gives us
        return RemoteConnectionError(
            f"remote server {info.where} sent no greeting ({what}); if it serves TLS "
            "(--tls), pass fingerprint="
        )
    return RemoteConnectionError(f"remote server {info.where} broke off the handshake ({what})")


def _refused(info: ServerInfo, refusal: tuple[int, str]) -> RemoteError:
    """The error for a REFUSED: the server's own words on why, which name the cause."""
    why, message = refusal
    said = f"remote server {info.where} refused the connection: {message}"
    if why == REFUSED_AUTH:
        return RemoteAuthError(said)
    if why == REFUSED_CROWDED:
        return _CrowdedError(f"{said} ({_CROWDED_TRIES} tries)")
    if why in (REFUSED_BUSY, REFUSED_TIMEOUT):  # nothing wrong with this client: try later
        return RemoteConnectionError(said)
    return RemoteError(said)


def _handshake(framed: Framed, info: ServerInfo, device: int) -> None:
    magic, version, flags, sn = parse_greeting(framed.recv(MAX_HELLO_FRAME))
    if magic != MAGIC:
        raise RemoteConnectionError(f"{info.where} is not a remote server (bad greeting)")
    if version != PROTOCOL_VERSION:
        raise RemoteConnectionError(
            f"remote server {info.where} speaks protocol {version}, this client {PROTOCOL_VERSION}"
        )
    needs = bool(flags & FLAG_AUTH)
    if needs and info.token is None:
        raise RemoteAuthError(f"remote server {info.where} requires a token (pass token=...)")
    if not needs and info.token is not None:
        raise RemoteAuthError(
            f"remote server {info.where} does not ask for the token, so it cannot prove it "
            "knows it: refusing it"
        )
    cn = secrets.token_bytes(NONCE_BYTES)
    framed.send(hello(device, cn, client_proof(info.token, sn, cn, device)))
    proof, refusal = parse_answer(framed.recv(4 * MAX_HELLO_FRAME))
    if refusal is not None:
        raise _refused(info, refusal)
    if not hmac.compare_digest(proof, server_proof(info.token, sn, cn, device)):
        raise RemoteAuthError(f"remote server {info.where} could not prove it knows the token")
    if info.token is not None:
        framed.seal = session_seal(info.token, sn, cn, device, server=False)


def devices(
    address: str,
    token: str | bytes | None = None,
    fingerprint: str | None = None,
    timeout: float = 5.0,
) -> list[tl.Device]:
    """The devices a server hosts, as tensorlib devices (``remote://HOST:PORT/INDEX``).

    After this, ``tl.device("remote://HOST:PORT/INDEX")`` names them too.

    Args:
        address: ``"HOST:PORT"`` of a ``python -m remote serve`` (or ``remote.serve``).
        token: the server's token (it proves it knows it too; never sent). Surrounding
            whitespace is stripped, as the server strips its token file's.
        fingerprint: the SHA-256 fingerprint of its TLS certificate (what ``--tls`` prints);
            given, the connection uses TLS and refuses any other certificate.
        timeout: seconds without an answer or heartbeat after which the server is lost.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``address`` is not ``HOST:PORT`` with a port in 1-65535, an empty
            token, a fingerprint that is not 64 hex digits, a timeout that is not positive.
        RemoteAuthError: a wrong or missing token, or a wrong fingerprint.
        RemoteConnectionError: the server cannot be reached.
    """
    who = "remote.devices"
    host, port = check_address(address, who)
    tok = None if token is None else check_token(token, who)
    fp = None if fingerprint is None else check_fingerprint(fingerprint, who)
    info = ServerInfo(host, port, tok, fp, check_timeout(timeout, who), [])
    framed = dial(info, CONTROL)
    try:
        framed.sock.settimeout(info.timeout)
        framed.send(LIST_FRAME)
        specs = parse_device_list(framed.recv(1 << 20))
        if specs is None:
            raise RemoteConnectionError(f"remote server {info.where} sent no device list")
        info.specs = specs
    except (OSError, EOFError, ProtocolError) as exc:
        raise RemoteConnectionError(f"remote server {info.where}: {exc}") from exc
    finally:
        framed.close()
    with _lock:
        _servers[info.where] = info
    return [tl.device(f"remote://{info.where}/{i}") for i in range(len(info.specs))]


def session_of(device: tl.Device) -> Session:
    """The session of a remote device (made on first use; connects on its first op)."""
    sess = _sessions.get(device)
    if sess is None:
        with _lock:
            sess = _sessions.get(device)
            if sess is None:
                where = str(device)[len("remote://") :].rsplit("/", 1)[0]
                sess = Session(_servers[where], int(device.index or 0), device)
                _sessions[device] = sess
    return sess


def _remote_device(device: object, who: str) -> tl.Device:
    # None would mean the default device (the CPU): name what was given instead.
    if not isinstance(device, str | tl.Device):
        raise TypeError(
            f"{who}: device must be a remote device (from remote.devices, or "
            f"'remote://HOST:PORT/INDEX'), got {device!r}"
        )
    dev = tl.device(device)
    if dev.type != "remote":
        raise ValueError(f"{who}: {dev} is not a remote device")
    return dev


def stats(device: tl.Device | str) -> dict[str, int]:
    """Counters of this process's session on a remote device.

    Returns:
        ``round_trips`` (reads and synchronizes that waited for the server), ``ops`` (op
        records issued; reads and frees not counted), ``bytes_sent`` and
        ``bytes_received`` (on the wire, frame headers and tags included).

    Raises:
        TypeError: ``device`` is neither a Device nor a str.
        ValueError: it is not a remote device (of a server reached in this process).
    """
    return session_of(_remote_device(device, "remote.stats")).stats()


def close(device: tl.Device | str) -> None:
    """Close this process's session on a remote device (the server frees its arrays); a
    device without a session (never used, or closed already) has nothing to close.

    Raises:
        TypeError: ``device`` is neither a Device nor a str.
        ValueError: it is not a remote device (of a server reached in this process).
    """
    dev = _remote_device(device, "remote.close")
    with _lock:
        sess = _sessions.pop(dev, None)
    if sess is not None:
        sess.close()


class RemoteKind:
    """The ``remote`` device kind registered with tensorlib."""

    type = "remote"
    fused_ops = MappingProxyType(
        {
            "adam": _fused.adam,
            "linear": _fused.linear,
            "linear_grad": _fused.linear_grad,
            "cross_entropy": _fused.cross_entropy,
            "relu_grad": _fused.relu_grad,
        }
    )

    def parse(self, spec: str) -> tuple[str, int]:
        m = re.fullmatch(r"remote://(.+):(\d+)/(\d+)", spec)
        if m is None:
            raise ValueError(f"invalid remote device {spec!r}: expected 'remote://HOST:PORT/INDEX'")
        where, index = f"{m.group(1)}:{int(m.group(2))}", int(m.group(3))
        info = _servers.get(where)
        if info is None:
            raise ValueError(
                f"remote device {spec!r}: its server {where} has not been reached in this "
                f"process; call remote.devices({where!r}, token=...) first"
            )
        if index >= len(info.specs):
            raise ValueError(
                f"remote device {spec!r}: server {where} hosts {len(info.specs)} device(s)"
            )
        return f"remote://{where}/{index}", index

    def xp(self, device: tl.Device) -> Any:
        return session_of(device).xp

    def synchronize(self, device: tl.Device) -> None:
        session_of(device).sync()

    def device_of(self, array: Any) -> tl.Device:
        return array._sess.device

    def to_host(self, array: Any) -> np.ndarray[Any, Any]:
        return array.get()

    def from_host(self, array: np.ndarray[Any, Any], device: tl.Device) -> Any:
        return session_of(device).upload(array)


tl.register_device_kind("remote", RemoteKind(), (RemoteArray,))
