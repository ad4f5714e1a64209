"""A framed socket (both ends): length-prefixed frames, sealed once the token is proven.

Transport only; the format of what is inside a frame is ``_wire``'s.
"""

from __future__ import annotations

import socket
import threading

from collectives.framing import HEADER, TAG_BYTES, Seal, recv_frame, send_frame

from ._wire import MAX_FRAME_BYTES, ProtocolError


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

    def send(self, *payload: bytes) -> None:
        """Send one frame whose payload is the concatenation of ``payload``."""
        with self._send_lock:
            self.sent += send_frame(self.sock, self.seal, *payload)

    def recv(self, limit: int = MAX_FRAME_BYTES) -> memoryview:
        """The next frame's payload (its tag checked and removed when sealed).

        Raises:
            ProtocolError: a length outside ``1..limit`` or a wrong tag.
            EOFError: the peer closed the connection.
        """
        body = recv_frame(self.sock, self.seal, limit, ProtocolError)
        self.received += HEADER.size + len(body) + (TAG_BYTES if self.seal is not None else 0)
        return body

    def close(self) -> None:
        for fn in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                fn()
            except OSError:
                pass
