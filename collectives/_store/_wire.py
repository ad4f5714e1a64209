"""The store's wire protocol: its specification, constants, and frame codec.

Both ends build every message with ``Writer`` and parse it with ``Reader``; nothing from the
wire is ever unpickled or evaluated. A reviewer auditing the format needs only this file.

Wire format
-----------
Every message in either direction is a *frame*: a 4-byte big-endian unsigned payload length
``n`` (``1 <= n <= MAX_FRAME_BYTES``) followed by ``n`` payload bytes. Payload fields are::

    u8, u32, i64, f64   big-endian fixed-size integers / IEEE double
    bytes               u32 length + that many bytes
    key                 ``bytes`` holding 1..MAX_KEY_BYTES bytes of UTF-8
    keys                u32 count (1..MAX_WAIT_KEYS) + that many ``key``

Handshake. On accept the server sends ``HELLO = b"DPTS" u8 version u8 flags nonce[32]``
(flags bit 0: a secret is required). The client answers with the request
``0x01 u8 version bytes client_nonce[32] bytes proof``; the server replies
``0x00 bytes server_proof`` and the connection is ready, or an ``ERROR`` frame and closes.
With a secret ``S`` and the two nonces ``sn`` (server's) and ``cn`` (client's)::

    proof        = HMAC-SHA256(S, b"dpt-store v2 client" + sn + cn)
    server_proof = HMAC-SHA256(S, b"dpt-store v2 server" + sn + cn)
    session key  = HMAC-SHA256(S, b"dpt-store v2 session" + sn + cn)

Without a secret both proofs are empty. The server checks the client's proof, the client the
server's: a client with a secret refuses a server that does not ask for it or cannot prove
it (anyone could have bound the port), and the direction label keeps a proof reflected back
at its sender from passing. The secret never crosses the wire. Until the handshake is done a
peer may only send frames of at most ``MAX_HELLO_FRAME`` bytes.

Sealed frames. With a secret, every later frame's payload is followed by a 32-byte tag,
``HMAC-SHA256(session key, direction + u64 seq + payload)`` (direction ``b"C"`` from the
client, ``b"S"`` from the server; ``seq`` counts that direction's frames from 0), and the
length prefix counts it. A frame altered, dropped, replayed or reordered by someone between
the two ends fails its tag: the server drops that connection, the client raises. (Frames
are authenticated, not encrypted: the secret protects who may join and what they are told,
not the privacy of the keys.)

Requests are ``u8 opcode`` + fields; each gets exactly one reply, in order:

====  ============  ==========================  ===========================================
op    name          request fields              OK reply fields
====  ============  ==========================  ===========================================
0x02  SET           key, bytes value            (none)
0x03  GET           key, f64 timeout_s          bytes value
0x04  ADD           key, i64 amount             i64 new value
0x05  WAIT          keys, f64 timeout_s         (none)
0x06  CHECK         keys                        u8 all exist
0x07  DELETE        key                         u8 existed
0x08  COMPARE_SET   key, bytes expected,        bytes value now stored (b"" if none)
                    bytes desired
0x09  NUM_KEYS      (none)                      i64 count
====  ============  ==========================  ===========================================

A reply starts with a status byte: ``0x00 OK`` + the fields above; ``0x01 TIMEOUT`` + ``keys``
(those still missing; GET and WAIT only); ``0x02 ERROR`` + ``u8 kind`` + ``bytes`` UTF-8
message, where kind is 1 (malformed request: the server then closes the connection), 2
(authentication or protocol version refused: closes too), 3 (bad value, e.g. ADD on a
value that is not an integer: the connection stays usable) or 4 (the store is full: too
many keys or bytes, see ``_limits``; the request did nothing and the connection stays
usable). A timeout of ``inf`` waits
forever; negative or NaN timeouts are malformed. Any malformed frame (length 0 or too large,
unknown opcode, truncated or trailing bytes, keys that are not UTF-8) makes the server drop
that one connection; it keeps serving all others.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import struct
from typing import NamedTuple

from ._framing import Seal

# 2: mutual challenge-response and sealed frames (1 had the client prove the secret only).
PROTOCOL_VERSION = 2
MAGIC = b"DPTS"
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
MAX_WAIT_KEYS = 4096
# COMPARE_SET carries two values; the rest of the limit covers opcodes, lengths and keys.
MAX_FRAME_BYTES = 2 * MAX_VALUE_BYTES + (1 << 20)
# Before a peer has proven the secret it may only send a small HELLO: an unauthenticated
# peer cannot make the server buffer more than this.
MAX_HELLO_FRAME = 256
# The server's answer to HELLO: OK, or an ERROR with a short message.
MAX_HELLO_REPLY_FRAME = 4 * MAX_HELLO_FRAME
# A HELLO's proof field: HMAC-SHA256 needs 32 bytes; anything over this is malformed.
MAX_MAC_BYTES = 64
NONCE_BYTES = 32
# Greeting flags.
FLAG_AUTH = 0x01  # the server requires the shared secret

I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1

U8 = struct.Struct(">B")
U32 = struct.Struct(">I")
I64 = struct.Struct(">q")
F64 = struct.Struct(">d")
# A frame is this length prefix (a u32) + the payload.
FRAME_HEADER_BYTES = U32.size
_GREETING = struct.Struct(f">{len(MAGIC)}sBB{NONCE_BYTES}s")


class Op(enum.IntEnum):
    """A request's opcode (its first payload byte)."""

    HELLO = 0x01
    SET = 0x02
    GET = 0x03
    ADD = 0x04
    WAIT = 0x05
    CHECK = 0x06
    DELETE = 0x07
    COMPARE_SET = 0x08
    NUM_KEYS = 0x09


class Status(enum.IntEnum):
    """A reply's first payload byte."""

    OK = 0x00
    TIMEOUT = 0x01  # GET/WAIT only; the missing keys follow
    ERROR = 0x02  # an ``ErrorKind`` and a message follow


class ErrorKind(enum.IntEnum):
    """What an ``ERROR`` reply is about, and whether the connection survives it."""

    MALFORMED = 1  # the server closes the connection
    REFUSED = 2  # authentication or protocol version refused; the server closes
    VALUE = 3  # a bad value (ADD on a non-integer, overflow); the connection stays usable
    LIMIT = 4  # the store is full (keys or bytes); the connection stays usable


class ProtocolError(Exception):
    """A malformed frame (internal: the server drops the connection, a client raises)."""


class Writer:
    """Builds one payload: ``Writer(Op.SET).blob(key).blob(value).payload()``."""

    __slots__ = ("parts",)

    def __init__(self, first: int) -> None:
        """Start a payload with its opcode or status byte ``first``."""
        self.parts: list[bytes] = [U8.pack(first)]

    def u8(self, v: int) -> Writer:
        self.parts.append(U8.pack(v))
        return self

    def i64(self, v: int) -> Writer:
        self.parts.append(I64.pack(v))
        return self

    def f64(self, v: float) -> Writer:
        self.parts.append(F64.pack(v))
        return self

    def blob(self, v: bytes) -> Writer:
        self.parts.append(U32.pack(len(v)))
        self.parts.append(v)
        return self

    def keys(self, keys: list[bytes]) -> Writer:
        self.parts.append(U32.pack(len(keys)))
        for k in keys:
            self.blob(k)
        return self

    def payload(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    """Parses one payload field by field; every violation raises ``ProtocolError``."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise ProtocolError(f"truncated frame: wanted {n} bytes at offset {self.pos}")
        out = bytes(self.buf[self.pos : end])  # a copy, also when reading a memoryview
        self.pos = end
        return out

    def u8(self) -> int:
        return int(U8.unpack(self._take(U8.size))[0])

    def u32(self) -> int:
        return int(U32.unpack(self._take(U32.size))[0])

    def i64(self) -> int:
        return int(I64.unpack(self._take(I64.size))[0])

    def f64(self) -> float:
        return float(F64.unpack(self._take(F64.size))[0])

    def blob(self, limit: int = MAX_FRAME_BYTES) -> bytes:
        n = self.u32()
        if n > limit:
            raise ProtocolError(f"field of {n} bytes exceeds the limit of {limit}")
        return self._take(n)

    def key(self) -> str:
        raw = self.blob(MAX_KEY_BYTES)
        if not raw:
            raise ProtocolError("empty key")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError("key is not valid UTF-8") from exc

    def keys(self) -> list[str]:
        n = self.u32()
        if not 1 <= n <= MAX_WAIT_KEYS:
            raise ProtocolError(f"key count {n} outside 1..{MAX_WAIT_KEYS}")
        return [self.key() for _ in range(n)]

    def timeout(self) -> float:
        t = self.f64()
        if math.isnan(t) or t < 0:
            raise ProtocolError(f"invalid timeout {t!r}")
        return t

    def error(self) -> tuple[int, str]:
        """An ``ERROR`` reply's fields after the status byte: its kind and its message."""
        kind = self.u8()
        return kind, self.blob().decode("utf-8", "replace")

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise ProtocolError(f"{len(self.buf) - self.pos} trailing bytes in frame")


def frame(payload: bytes) -> bytes:
    """``payload`` with its length prefix."""
    return U32.pack(len(payload)) + payload


def error_payload(kind: ErrorKind, message: str) -> bytes:
    """An ``ERROR`` reply of ``kind`` carrying ``message``."""
    return Writer(Status.ERROR).u8(kind).blob(message.encode("utf-8", "replace")).payload()


OK_PAYLOAD = U8.pack(Status.OK)


# ----------------------------------------------------------------------------- handshake


class Greeting(NamedTuple):
    """The server's first frame: its protocol version, flags and a fresh nonce."""

    version: int
    flags: int
    nonce: bytes


def greeting_payload(flags: int, nonce: bytes) -> bytes:
    """The frame the server sends on accept (``MAGIC``, version, ``flags``, ``nonce``)."""
    return _GREETING.pack(MAGIC, PROTOCOL_VERSION, flags, nonce)


def parse_greeting(payload: bytes) -> Greeting | None:
    """The server's greeting, or None if ``payload`` is not one (another service?)."""
    if len(payload) != _GREETING.size:
        return None
    magic, version, flags, nonce = _GREETING.unpack(payload)
    if magic != MAGIC:
        return None
    return Greeting(version, flags, nonce)


def hello_payload(client_nonce: bytes, proof: bytes) -> bytes:
    """The client's answer to the greeting: ``HELLO``, its version, its nonce, its proof."""
    return Writer(Op.HELLO).u8(PROTOCOL_VERSION).blob(client_nonce).blob(proof).payload()


def hello_ok_payload(server_proof: bytes) -> bytes:
    """The server's acceptance of a HELLO: ``OK`` and its own proof of the secret."""
    return Writer(Status.OK).blob(server_proof).payload()


def _derive(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the client sends to prove ``secret`` (see the handshake above)."""
    return _derive(secret, b"dpt-store v2 client", server_nonce, client_nonce)


def server_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the server sends to prove ``secret``; differs from the client's by its label."""
    return _derive(secret, b"dpt-store v2 server", server_nonce, client_nonce)


def session_seal(secret: bytes, server_nonce: bytes, client_nonce: bytes, *, server: bool) -> Seal:
    """The :class:`~collectives.framing.Seal` of one connection end (see "Sealed frames"),
    made once both proofs checked out; ``server`` says which end. A wrong tag raises
    :class:`ProtocolError`."""
    key = _derive(secret, b"dpt-store v2 session", server_nonce, client_nonce)
    return Seal(key, server=server, error=ProtocolError)
