"""The store server: one selector loop on a daemon thread serves every client.

It owns the sockets, the handshake, and the requests that wait (GET/WAIT on a missing key);
what each request does to the keys is in ``_actions``, the bytes on the wire in ``_wire``, the
caps that keep one client from exhausting the server in ``_limits``.
"""

from __future__ import annotations

import errno
import heapq
import hmac
import math
import os
import secrets
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque

from . import _actions
from ._addresses import bind_address, check_exposure, family_of
from ._errors import StoreError
from ._framing import TAG_BYTES, Seal
from ._limits import (
    HANDSHAKE_TIMEOUT,
    MAX_BUFFERED_REQUEST_BYTES,
    MAX_QUEUED_REPLY_BYTES,
    limits_from_env,
)
from ._wire import (
    FLAG_AUTH,
    FRAME_HEADER_BYTES,
    MAX_FRAME_BYTES,
    MAX_HELLO_FRAME,
    MAX_MAC_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    U32,
    ErrorKind,
    Op,
    ProtocolError,
    Reader,
    client_proof,
    error_payload,
    greeting_payload,
    hello_ok_payload,
    server_proof,
    session_seal,
)

# Time a server waits for a new connection to finish the handshake before dropping it. Read
# when a client connects (tests shorten it).
_HANDSHAKE_TIMEOUT = HANDSHAKE_TIMEOUT
_LISTEN_BACKLOG = 1024
_RECV_BYTES = 1 << 20
# How long close() waits for the loop's thread to finish closing every connection.
_JOIN_TIMEOUT = 10.0


class _ClientConn:
    """Server-side state of one client's connection."""

    __slots__ = (
        "addr",
        "authed",
        "closed",
        "closing",
        "events",
        "nonce",
        "parked",
        "queued",
        "rbuf",
        "seal",
        "sock",
        "stalled",
        "wbuf",
    )

    def __init__(self, sock: socket.socket, addr: str) -> None:
        self.sock = sock
        self.addr = addr
        self.rbuf = bytearray()
        self.wbuf: deque[memoryview] = deque()
        self.queued = 0  # bytes in wbuf
        # What the selector watches: READ unless rbuf must not grow, WRITE while wbuf did
        # not fit the socket; 0 (unregistered) when neither.
        self.events = selectors.EVENT_READ
        self.stalled = False  # requests wait in rbuf until its replies are read
        self.authed = False
        self.seal: Seal | None = None
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.parked: _actions.Parked | None = None
        self.closing = False  # send what is queued, then close
        self.closed = False


# A timer fires a parked request's deadline, or (parked None) the handshake's.
_Timer = tuple[float, int, _ClientConn, _actions.Parked | None]


class Server:
    """The store server, listening from construction until ``close()``.

    A single thread suffices because no handler blocks: a GET or WAIT on a missing key parks
    the connection (``_ClientConn.parked``) and the loop answers it when a SET creates the key
    or its deadline passes, so a waiting client never holds up the others.

    Attributes:
        bind_host: the address the server listens on.
        port: the port it listens on (the bound one when asked for port 0).
    """

    def __init__(self, host: str, port: int, secret: bytes | None) -> None:
        """Bind and start serving on a daemon thread.

        Raises:
            StoreError: ``host`` is not this machine's, it is the wildcard address and there
                is no secret, a limit variable is invalid, or the port cannot be bound.
        """
        limits = limits_from_env()
        self.bind_host = bind_address(host)
        check_exposure(self.bind_host, host, secret)
        self._listener = _listen(self.bind_host, port)
        self.port: int = self._listener.getsockname()[1]
        self._secret = secret
        self._max_pending = limits.max_pending
        # Connections still in the handshake, oldest first.
        self._pending: OrderedDict[_ClientConn, None] = OrderedDict()
        self._data = _actions.Data(limits.max_keys, limits.max_bytes)
        self._waiters: dict[str, set[_ClientConn]] = {}
        self._timers: list[_Timer] = []
        self._timer_seq = 0
        self._runnable: deque[_ClientConn] = deque()
        self._conns: set[_ClientConn] = set()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop = False
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=self._run, name=f"dpt-store-server:{self.port}", daemon=True
        )
        self._thread.start()

    # -- lifecycle

    def close(self) -> None:
        """Stop the loop and close every connection (clients see the connection close)."""
        if self._stop or os.getpid() != self._pid:
            return  # closed already, or a forked child, which does not run the server
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=_JOIN_TIMEOUT)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._loop_once()
        finally:
            for conn in list(self._conns):
                self._close_conn(conn)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _loop_once(self) -> None:
        timeout = None
        if self._runnable:
            timeout = 0.0
        elif self._timers:
            timeout = max(0.0, self._timers[0][0] - time.monotonic())
        for key, mask in self._sel.select(timeout):
            obj = key.fileobj
            if obj is self._listener:
                self._accept()
            elif obj is self._wake_r:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
            else:
                conn: _ClientConn = key.data
                if mask & selectors.EVENT_WRITE and not conn.closed:
                    self._flush(conn)
                if mask & selectors.EVENT_READ and not conn.closed:
                    self._on_readable(conn)
        self._fire_timers()
        # Connections whose parked request was just answered may have more requests queued.
        while self._runnable:
            conn = self._runnable.popleft()
            if not conn.closed:
                self._process(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                # Out of file descriptors: free one held by a peer that has not proven itself;
                # else (or another error) back off rather than spin.
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
                    self._close_conn(next(iter(self._pending)))
                    continue
                time.sleep(0.05)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _ClientConn(sock, f"{addr[0]}:{addr[1]}")
            # Full of peers that have not proven themselves: drop the oldest. A real rank
            # answers within a round trip (and retries if dropped); an idle flood cannot
            # hold the door shut, nor take the descriptors real ranks need.
            while len(self._pending) >= self._max_pending:
                self._close_conn(next(iter(self._pending)))
            self._pending[conn] = None
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            flags = FLAG_AUTH if self._secret else 0
            self._send(conn, greeting_payload(flags, conn.nonce))
            self._add_timer(time.monotonic() + _HANDSHAKE_TIMEOUT, conn, None)

    def _close_conn(self, conn: _ClientConn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._unpark(conn)
        self._conns.discard(conn)
        self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.wbuf.clear()
        conn.queued = 0
        conn.rbuf = bytearray()

    def _drop(self, conn: _ClientConn, kind: ErrorKind, message: str) -> None:
        """Tell the client why (best effort), then close its connection."""
        conn.rbuf = bytearray()
        self._send(conn, error_payload(kind, message))
        conn.closing = True
        if not conn.wbuf:
            self._close_conn(conn)

    # -- I/O

    def _send(self, conn: _ClientConn, payload: bytes) -> None:
        if conn.closed:
            return
        tag = conn.seal.tag(payload) if conn.seal is not None else b""
        data = U32.pack(len(payload) + len(tag)) + payload + tag
        conn.wbuf.append(memoryview(data))
        conn.queued += len(data)
        self._flush(conn)

    def _flush(self, conn: _ClientConn) -> None:
        while conn.wbuf:
            chunk = conn.wbuf[0]
            try:
                n = conn.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close_conn(conn)
                return
            conn.queued -= n
            if n < len(chunk):
                conn.wbuf[0] = chunk[n:]
                break
            conn.wbuf.popleft()
        if not conn.wbuf and conn.closing:
            self._close_conn(conn)
            return
        if conn.stalled and conn.queued <= MAX_QUEUED_REPLY_BYTES:
            conn.stalled = False  # its replies are being read: serve what it sent meanwhile
            self._runnable.append(conn)
        self._update_events(conn)

    def _update_events(self, conn: _ClientConn) -> None:
        """Watch for writability while replies wait, and stop reading from a connection
        whose requests cannot be served now once it has buffered enough of them."""
        if conn.closed:
            return
        blocked = conn.parked is not None or conn.stalled
        events = 0
        if not blocked or len(conn.rbuf) < MAX_BUFFERED_REQUEST_BYTES:
            events |= selectors.EVENT_READ
        if conn.wbuf:
            events |= selectors.EVENT_WRITE
        if events == conn.events:
            return
        if not events:  # a selector cannot watch for nothing
            self._sel.unregister(conn.sock)
        elif not conn.events:
            self._sel.register(conn.sock, events, conn)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _on_readable(self, conn: _ClientConn) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_conn(conn)
            return
        if not data:
            self._close_conn(conn)
            return
        if conn.closing:
            return  # we are hanging up on this client: ignore what it sends
        conn.rbuf += data
        self._process(conn)

    def _process(self, conn: _ClientConn) -> None:
        """Handle every complete frame buffered for ``conn``: it stops while one is parked,
        or while more replies than ``MAX_QUEUED_REPLY_BYTES`` wait unread."""
        self._serve_frames(conn)
        self._update_events(conn)

    def _serve_frames(self, conn: _ClientConn) -> None:
        while not conn.closed and not conn.closing and conn.parked is None:
            if conn.queued > MAX_QUEUED_REPLY_BYTES:
                conn.stalled = True  # _flush resumes it
                return
            rbuf = conn.rbuf
            if len(rbuf) < FRAME_HEADER_BYTES:
                return
            (n,) = U32.unpack_from(rbuf, 0)
            extra = TAG_BYTES if conn.seal is not None else 0
            limit = (MAX_FRAME_BYTES if conn.authed else MAX_HELLO_FRAME) + extra
            if n <= extra or n > limit:
                message = f"frame length {n} outside {extra + 1}..{limit}"
                self._drop(conn, ErrorKind.MALFORMED, message)
                return
            end = FRAME_HEADER_BYTES + n
            if len(rbuf) < end:
                return
            with memoryview(rbuf) as view:
                whole = bytes(view[FRAME_HEADER_BYTES:end])
            del rbuf[:end]
            body = memoryview(whole)[: n - extra]
            try:
                if conn.seal is not None:
                    conn.seal.check(body, memoryview(whole)[n - extra :])
                if conn.authed:
                    self._handle(conn, Reader(body))
                else:
                    self._handshake(conn, Reader(body))
            except ProtocolError as exc:
                self._drop(conn, ErrorKind.MALFORMED, f"malformed request: {exc}")
                return
            except Exception as exc:  # a bug or MemoryError: cost this client, not the server
                message = f"internal error: {type(exc).__name__}: {exc}"
                self._drop(conn, ErrorKind.MALFORMED, message)
                return

    # -- requests

    def _handshake(self, conn: _ClientConn, r: Reader) -> None:
        op = r.u8()
        if op != Op.HELLO:
            raise ProtocolError(f"expected HELLO (0x{Op.HELLO:02x}) first, got opcode 0x{op:02x}")
        version = r.u8()
        if version != PROTOCOL_VERSION:  # checked first: other versions' HELLOs differ
            self._drop(
                conn,
                ErrorKind.REFUSED,
                f"protocol version {version} not supported (server speaks {PROTOCOL_VERSION})",
            )
            return
        client_nonce = r.blob(NONCE_BYTES)
        proof = r.blob(MAX_MAC_BYTES)
        r.end()
        if len(client_nonce) != NONCE_BYTES:
            raise ProtocolError(f"client nonce of {len(client_nonce)} bytes, not {NONCE_BYTES}")
        theirs = b""
        if self._secret is not None:
            expected = client_proof(self._secret, conn.nonce, client_nonce)
            if not hmac.compare_digest(expected, proof):
                self._drop(conn, ErrorKind.REFUSED, "wrong or missing secret")
                return
            theirs = server_proof(self._secret, conn.nonce, client_nonce)
        conn.authed = True
        self._pending.pop(conn, None)
        self._send(conn, hello_ok_payload(theirs))
        if self._secret is not None:  # every later frame is sealed, both ways
            conn.seal = session_seal(self._secret, conn.nonce, client_nonce, server=True)

    def _handle(self, conn: _ClientConn, r: Reader) -> None:
        outcome = _actions.execute(self._data, r)
        if isinstance(outcome, _actions.Parked):
            self._park(conn, outcome)
            return
        self._send(conn, outcome.payload)
        if outcome.created is not None:
            self._key_created(outcome.created)

    # -- parked GET/WAIT

    def _park(self, conn: _ClientConn, parked: _actions.Parked) -> None:
        conn.parked = parked
        for k in parked.keys:
            if k not in self._data:
                self._waiters.setdefault(k, set()).add(conn)
        if math.isfinite(parked.deadline):
            self._add_timer(parked.deadline, conn, parked)

    def _unpark(self, conn: _ClientConn) -> None:
        parked, conn.parked = conn.parked, None
        if parked is None:
            return
        for k in parked.keys:
            waiting = self._waiters.get(k)
            if waiting is not None:
                waiting.discard(conn)
                if not waiting:
                    del self._waiters[k]

    def _key_created(self, key: str) -> None:
        for conn in self._waiters.pop(key, set()):
            parked = conn.parked
            if parked is None or conn.closed:
                continue
            missing = [k for k in parked.keys if k not in self._data]
            if missing:
                # Another key it waits for was deleted meanwhile: keep waiting for it.
                for k in missing:
                    self._waiters.setdefault(k, set()).add(conn)
                continue
            self._answer(conn, parked, [])

    def _add_timer(
        self, deadline: float, conn: _ClientConn, parked: _actions.Parked | None
    ) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (deadline, self._timer_seq, conn, parked))

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, conn, parked = heapq.heappop(self._timers)
            if conn.closed:
                continue
            if parked is None:  # the handshake's deadline
                if not conn.authed and not conn.closing:
                    self._drop(conn, ErrorKind.MALFORMED, "handshake not completed in time")
                continue
            if conn.parked is not parked:
                continue  # answered already
            self._answer(conn, parked, [k for k in parked.keys if k not in self._data])

    def _answer(self, conn: _ClientConn, parked: _actions.Parked, missing: list[str]) -> None:
        """Reply to ``conn``'s parked request, then serve the requests queued behind it."""
        self._unpark(conn)
        self._send(conn, _actions.answer_parked(self._data, parked, missing))
        self._runnable.append(conn)


def _listen(bind_host: str, port: int) -> socket.socket:
    """A non-blocking socket listening on ``bind_host:port``."""
    listener = socket.socket(family_of(bind_host), socket.SOCK_STREAM)
    try:
        # Lets a restarted job reuse a port whose old connections sit in TIME_WAIT; Linux
        # still refuses the bind while another socket listens on it.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_host, port))
        listener.listen(_LISTEN_BACKLOG)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            raise StoreError(
                f"cannot start the store server on {bind_host}:{port}: port {port} "
                "is already in use (another job or store?); choose another MASTER_PORT"
            ) from exc
        raise StoreError(f"cannot start the store server on {bind_host}:{port}: {exc}") from exc
    listener.setblocking(False)
    return listener
