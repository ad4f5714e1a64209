"""A connection's first frames: the handshake that proves the token, and the device list.

Handshake (TLS, when used, wraps the socket first)::

    server: GREETING  b"DPTR" u8 version u8 flags nonce[32]     (flags bit 0: token required)
    client: HELLO     0x01 u8 version u16 device nonce[32] u8 n proof[n]
    server: WELCOME   0x10 u8 n proof[n]          or REFUSED 0x14 u8 kind bytes message

with ``proof = HMAC(token, b"dpt-remote v1 client" + sn + cn + u16 device)``, the server's
proof the same with ``b"... server"``, the session key with ``b"... session"`` (empty proofs
without a token). The token never crosses the wire; the server says nothing about its
devices before the client's proof checked (``hmac.compare_digest``), and the client refuses a
server that cannot prove the token too. ``device`` is ``CONTROL`` (0xFFFF) for a connection
that asks for the device list (LIST 0x02 -> DEVICES 0x11 u16 count + count ``str``), else the
index of the device the session runs on; its frames are then ``_records``'. A server that
drops a connection still in the handshake (``REFUSED_CROWDED``: too many waiting, this one
the oldest, so the client tries again; ``REFUSED_TIMEOUT``: its deadline passed) sends a
REFUSED in place of its next frame where it can (not inside a TLS handshake).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from collectives.framing import Seal

from ._wire import (
    DEVICES,
    HELLO,
    LIST,
    PROTOCOL_VERSION,
    REFUSED,
    U8,
    U16,
    U32,
    WELCOME,
    ProtocolError,
    Reader,
)

MAGIC = b"DPTR"
NONCE_BYTES = 32
CONTROL = 0xFFFF
FLAG_AUTH = 0x01
# REFUSED kinds. BUSY: every session slot is taken; CROWDED: too many connections were in
# the handshake and this one was the oldest; TIMEOUT: the handshake's deadline passed.
REFUSED_AUTH, REFUSED_PROTOCOL, REFUSED_DEVICE, REFUSED_BUSY = 1, 2, 3, 4
REFUSED_CROWDED, REFUSED_TIMEOUT = 5, 6

GREETING = struct.Struct(f"<{len(MAGIC)}sBB{NONCE_BYTES}s")
_HELLO_HEAD = struct.Struct(f"<BBH{NONCE_BYTES}sB")
LIST_FRAME = U8.pack(LIST)


def greeting(auth: bool, sn: bytes) -> bytes:
    """The server's GREETING: its version, whether it asks for a token, its nonce."""
    return GREETING.pack(MAGIC, PROTOCOL_VERSION, FLAG_AUTH if auth else 0, sn)


def parse_greeting(payload: bytes | memoryview) -> tuple[bytes, int, int, bytes]:
    """``(magic, version, flags, server nonce)`` of a GREETING (``struct.error`` for a
    payload of another size)."""
    magic, version, flags, sn = GREETING.unpack(bytes(payload))
    return magic, version, flags, sn


def _mac(token: bytes, label: bytes, sn: bytes, cn: bytes, device: int) -> bytes:
    return hmac.new(token, label + sn + cn + U16.pack(device), hashlib.sha256).digest()


def client_proof(token: bytes | None, sn: bytes, cn: bytes, device: int) -> bytes:
    return b"" if token is None else _mac(token, b"dpt-remote v1 client", sn, cn, device)


def server_proof(token: bytes | None, sn: bytes, cn: bytes, device: int) -> bytes:
    return b"" if token is None else _mac(token, b"dpt-remote v1 server", sn, cn, device)


def hello(device: int, cn: bytes, proof: bytes) -> bytes:
    return _HELLO_HEAD.pack(HELLO, PROTOCOL_VERSION, device, cn, len(proof)) + proof


def parse_hello(payload: bytes) -> tuple[int, int, bytes, bytes]:
    """``(version, device, client nonce, proof)`` of a HELLO."""
    r = Reader(payload)
    kind, version, device, cn, n = r.unpack(_HELLO_HEAD)
    if kind != HELLO or n > 64:
        raise ProtocolError("not a HELLO")
    proof = bytes(r.take(n))
    r.done()
    return int(version), int(device), bytes(cn), proof


def welcome(proof: bytes) -> bytes:
    """The server's WELCOME: its own proof of the token."""
    return U8.pack(WELCOME) + U8.pack(len(proof)) + proof


def refused(kind: int, message: str) -> bytes:
    data = message.encode("utf-8")[:200]
    return U8.pack(REFUSED) + U8.pack(kind) + U32.pack(len(data)) + data


def parse_answer(payload: bytes | memoryview) -> tuple[bytes, tuple[int, str] | None]:
    """The server's answer to a HELLO: ``(its proof, None)`` for a WELCOME, ``(b"", (kind,
    message))`` for a REFUSED.

    Raises:
        ProtocolError: another frame kind, or a truncated one.
    """
    r = Reader(payload)
    kind = r.u8()
    if kind == REFUSED:
        why = r.u8()
        return b"", (why, r.str())
    if kind != WELCOME:
        raise ProtocolError(f"unexpected handshake reply {kind}")
    return bytes(r.take(r.u8())), None


def session_seal(token: bytes, sn: bytes, cn: bytes, device: int, *, server: bool) -> Seal:
    """The seal of one end of a session's connection, once both proofs checked out (the
    framing's, ``collectives.framing``; a wrong tag raises :class:`ProtocolError`)."""
    key = _mac(token, b"dpt-remote v1 session", sn, cn, device)
    return Seal(key, server=server, error=ProtocolError)


def parse_list(payload: bytes | memoryview) -> None:
    """Check that a control connection's frame is the LIST request it may only send."""
    r = Reader(payload)
    if r.u8() != LIST:
        raise ProtocolError("a control connection may only ask for the device list")
    r.done()


def device_list(specs: list[str]) -> bytes:
    """The DEVICES answer: the server's device specs, by index."""
    parts = [U8.pack(DEVICES), U16.pack(len(specs))]
    for spec in specs:
        data = spec.encode("utf-8")
        parts += [U32.pack(len(data)), data]
    return b"".join(parts)


def parse_device_list(payload: bytes | memoryview) -> list[str] | None:
    """The device specs of a DEVICES frame (None: the frame is not one)."""
    r = Reader(payload)
    if r.u8() != DEVICES:
        return None
    return [r.str() for _ in range(r.u16())]


def check_token(token: object, who: str) -> bytes:
    """``token`` as the secret both ends prove: UTF-8 for a str, surrounding whitespace
    stripped, so a token read from a file (``open(f).read()``, with its trailing newline)
    matches the server's ``--token-file``. The one normalisation of client and server.

    Raises:
        TypeError: ``token`` is not str or bytes (the message names ``who`` and the type,
            never the value: it may be the secret).
        ValueError: it is empty, or only whitespace.
    """
    if not isinstance(token, str | bytes):
        raise TypeError(f"{who}: token must be a str or bytes, got {type(token).__name__}")
    data = (token.encode("utf-8") if isinstance(token, str) else token).strip()
    if not data:
        raise ValueError(f"{who}: token must not be empty (or only whitespace)")
    return data
