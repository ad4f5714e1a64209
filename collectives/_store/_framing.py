"""Length-prefixed frames over a stream socket, sealed once both ends proved a shared secret.

One frame is a 4-byte big-endian length ``n`` and ``n`` bytes. Once a connection's two ends
have proven a secret to each other (each protocol does its own handshake and derives a session
key from the secret and both ends' nonces), every frame carries a 32-byte HMAC-SHA256 tag
after its payload, over the direction (``C`` client to server, ``S`` the other way), the
frame's sequence number in that direction (8 bytes, big-endian) and the payload. A frame that
was altered, dropped, replayed, reordered or reflected back to its sender fails the check,
and its receiver drops the connection.

The rendezvous store frames its connections this way, and so do remote devices (``remote``,
through the public ``collectives.framing``); what goes inside a frame is each protocol's own.
Like the rest of the store, this module needs nothing outside the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

__all__ = [
    "HEADER",
    "TAG_BYTES",
    "FrameError",
    "Seal",
    "recv_exact",
    "recv_frame",
    "send_frame",
]

HEADER = struct.Struct(">I")  # the payload's length (tag included)
TAG_BYTES = 32  # HMAC-SHA256
_SEQ = struct.Struct(">Q")
# Payloads at least this large go out after their header in their own send, not copied.
_COPY_LIMIT = 1 << 16


class FrameError(Exception):
    """A frame that breaks the framing: a length out of bounds or a wrong tag."""


class Seal:
    """Tags one connection end's outgoing frames and checks its incoming ones.

    Args:
        key: the session key both ends derived after the handshake.
        server: which end this is (it sets the direction of each side's tags).
        error: the exception class a wrong tag raises (a protocol's own, so that its
            callers catch one type); :class:`FrameError` by default.

    Attributes:
        sent, received: frames tagged and checked so far (the next sequence numbers).
    """

    __slots__ = ("_error", "_in", "_key", "_out", "received", "sent")

    def __init__(self, key: bytes, *, server: bool, error: type[Exception] = FrameError) -> None:
        self._key = key
        self._out, self._in = (b"S", b"C") if server else (b"C", b"S")
        self._error = error
        self.sent = 0
        self.received = 0

    def tag(self, *payload: bytes | memoryview) -> bytes:
        """The tag to send after the next outgoing frame, whose payload is ``payload``'s
        parts, concatenated."""
        mac = hmac.new(self._key, self._out + _SEQ.pack(self.sent), hashlib.sha256)
        for part in payload:
            mac.update(part)
        self.sent += 1
        return mac.digest()

    def check(self, payload: bytes | memoryview, tag: bytes | memoryview) -> None:
        """Check the next incoming frame's ``tag``.

        Raises:
            the ``error`` class: the tag is wrong: the frame was altered, dropped, replayed,
                reordered or reflected on the way.
        """
        mac = hmac.new(self._key, self._in + _SEQ.pack(self.received), hashlib.sha256)
        mac.update(payload)
        self.received += 1
        if not hmac.compare_digest(mac.digest(), bytes(tag)):
            raise self._error(
                "frame failed its integrity check (wrong tag): something between the two "
                "ends altered, dropped or replayed it"
            )


def send_frame(sock: socket.socket, seal: Seal | None, *payload: bytes | memoryview) -> int:
    """Send one frame whose payload is ``payload``'s parts, concatenated (tagged when
    ``seal`` is given); returns the bytes it put on the wire. Not thread-safe: one sender
    per socket at a time (a sealed frame's tag is the next in sequence)."""
    n = sum(len(p) for p in payload)
    tag = seal.tag(*payload) if seal is not None else b""
    header = HEADER.pack(n + len(tag))
    if n < _COPY_LIMIT:
        sock.sendall(b"".join((header, *payload, tag)))
    else:  # not worth copying a large payload to put 4 bytes in front of it
        sock.sendall(header)
        for p in payload:
            sock.sendall(p)
        if tag:
            sock.sendall(tag)
    return HEADER.size + n + len(tag)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes from ``sock``.

    Raises:
        EOFError: the peer closed the connection first.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k
    return buf


def recv_frame(
    sock: socket.socket, seal: Seal | None, limit: int, error: type[Exception] = FrameError
) -> memoryview:
    """The next frame's payload, its tag checked and removed when ``seal`` is given (the frame
    took ``HEADER.size + len(payload)`` bytes, plus ``TAG_BYTES`` when sealed).

    Raises:
        the ``error`` class: a length outside ``1..limit`` (payload bytes), or a wrong tag.
        EOFError: the peer closed the connection.
    """
    extra = TAG_BYTES if seal is not None else 0
    (n,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    if n <= extra or n > limit + extra:
        raise error(f"frame length {n} outside {extra + 1}..{limit + extra}")
    body = memoryview(recv_exact(sock, n))
    if seal is None:
        return body
    seal.check(body[:-TAG_BYTES], body[-TAG_BYTES:])
    return body[:-TAG_BYTES]
