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
``0x01 u8 version bytes mac`` where ``mac`` is HMAC-SHA256(secret, nonce), or empty without a
secret. The server replies ``OK`` and the connection is ready, or an ``ERROR`` frame and closes.
Until then a peer may only send frames of at most ``MAX_HELLO_FRAME`` bytes.

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
(authentication or protocol version refused: closes too) or 3 (bad value, e.g. ADD on a
value that is not an integer: the connection stays usable). A timeout of ``inf`` waits
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

PROTOCOL_VERSION = 1
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
# A HELLO's mac field: HMAC-SHA256 needs 32 bytes; anything over this is malformed.
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

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise ProtocolError(f"truncated frame: wanted {n} bytes at offset {self.pos}")
        out = self.buf[self.pos : end]
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


def hello_payload(mac: bytes) -> bytes:
    """The client's answer to the greeting: ``HELLO``, its version, and the ``mac``."""
    return Writer(Op.HELLO).u8(PROTOCOL_VERSION).blob(mac).payload()


def secret_mac(secret: bytes, nonce: bytes) -> bytes:
    """The proof of ``secret`` for the greeting's ``nonce``: HMAC-SHA256(secret, nonce)."""
    return hmac.new(secret, nonce, hashlib.sha256).digest()
