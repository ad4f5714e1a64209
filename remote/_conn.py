"""A framed socket (both ends): length-prefixed frames, sealed once the token is proven.

Transport only; the format of what is inside a frame is ``_wire``'s.
"""

from __future__ import annotations

import socket
import threading

from collectives.framing import HEADER, TAG_BYTES, Seal, recv_exact, send_frame

from ._wire import MAX_FRAME_BYTES, ProtocolError

_DISCARD_CHUNK = 1 << 16


class FrameTooLongError(ProtocolError):
    """A frame longer than its receiver would read now; its body is still on the socket
    (:meth:`Framed.discard` reads it without keeping it).

    Attributes:
        length: the payload's length, as its header announced it.
        unread: the bytes of the frame still on the socket (the tag's too, when sealed).
    """

    def __init__(self, length: int, unread: int) -> None:
        super().__init__(f"a frame of {length} bytes, longer than its receiver takes now")
        self.length = length
        self.unread = unread


def tune(sock: socket.socket) -> None:
    """No Nagle delay, and a dead peer found in seconds even on an idle connection."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # unacknowledged data: give up after 10 s
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 10_000)
    except OSError:  # pragma: no cover - an exotic socket; defaults then
        pass


class Framed:
    """Frames over one socket; ``send`` may be called from several threads.

    Attributes:
        sock: the (maybe TLS-wrapped) socket.
        seal: tags and checks frames once the handshake proved the token (else None).
        sent, received: bytes on the wire so far, headers and tags included.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.seal: Seal | None = None
        self.sent = 0
        self.received = 0
        self._send_lock = threading.Lock()

    def send(self, *payload: bytes | memoryview) -> None:
        """Send one frame whose payload is the concatenation of ``payload``."""
        with self._send_lock:
            self.sent += send_frame(self.sock, self.seal, *payload)

    def recv(self, limit: int = MAX_FRAME_BYTES, room: int | None = None) -> memoryview:
        """The next frame's payload (its tag checked and removed when sealed).

        Args:
            limit: the longest payload the protocol allows here.
            room: the longest one the receiver will hold now (None: ``limit``): a longer
                one is refused from its header, before a byte of its body is read.

        Raises:
            FrameTooLongError: a length within ``limit`` but over ``room`` (body unread).
            ProtocolError: a length outside ``1..limit`` or a wrong tag.
            EOFError: the peer closed the connection.
        """
        # collectives.framing.recv_frame's steps, with the header read first so that a frame
        # too long for ``room`` is refused before its body is read (and allocated).
        extra = TAG_BYTES if self.seal is not None else 0
        (n,) = HEADER.unpack(recv_exact(self.sock, HEADER.size))
        if n <= extra or n > limit + extra:
            raise ProtocolError(f"frame length {n} outside {extra + 1}..{limit + extra}")
        self.received += HEADER.size
        if room is not None and n > room + extra:
            raise FrameTooLongError(n - extra, n)
        body = memoryview(recv_exact(self.sock, n))
        self.received += n
        if self.seal is None:
            return body
        self.seal.check(body[:-TAG_BYTES], body[-TAG_BYTES:])
        return body[:-TAG_BYTES]

    def discard(self, n: int) -> None:
        """Read ``n`` bytes (a refused frame's body) without keeping them (a small buffer at
        a time). The frame's tag is not checked: the caller closes the connection after."""
        buf = bytearray(min(n, _DISCARD_CHUNK))
        view = memoryview(buf)
        while n > 0:
            k = self.sock.recv_into(view, min(n, len(buf)))
            if k == 0:
                raise EOFError("the peer closed the connection")
            n -= k
            self.received += k

    def close(self) -> None:
        for fn in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                fn()
            except OSError:
                pass
