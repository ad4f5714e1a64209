"""The server: ``serve`` hosts devices; each connection is one session on one device.

Threads: one accepts and holds each connection until its HELLO arrives (TLS: its first
bytes); one per connection then checks the HELLO (TLS: runs both handshakes) and receives
and runs that session's frames on its device (``_worker``); one sends heartbeats to clients
that may be waiting for a reply. A malformed frame or a failed tag closes that one
connection (its session is freed); the others go on.

A connection that has not proven the token holds no session slot: at most ``MAX_PENDING``
of them wait at once (a new one drops the oldest, as the rendezvous store does), each for
``HANDSHAKE_TIMEOUT`` seconds from its accept, so idle or slow sockets, however many and
however often reopened, cannot lock clients out. Each one dropped is told why (a REFUSED
frame) where the protocol allows it.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import resource
import secrets
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import tensorlib as tl
from collectives.framing import HEADER

from .._conn import Framed, tune
from .._handshake import (
    CONTROL,
    NONCE_BYTES,
    REFUSED_AUTH,
    REFUSED_BUSY,
    REFUSED_CROWDED,
    REFUSED_DEVICE,
    REFUSED_PROTOCOL,
    REFUSED_TIMEOUT,
    check_token,
    client_proof,
    device_list,
    greeting,
    parse_hello,
    parse_list,
    refused,
    server_proof,
    session_seal,
    welcome,
)
from .._records import HEARTBEAT_FRAME
from .._tls import fingerprint_of, self_signed, server_context
from .._wire import MAX_HELLO_FRAME, PROTOCOL_VERSION, ProtocolError
from ._checks import (
    check_devices,
    check_host,
    check_limit,
    check_port,
    check_resolvable,
    check_tls,
)
from ._worker import Worker

__all__ = ["Server", "serve"]

# Seconds from accept to a proven HELLO (and a control connection's LIST): a client answers
# in a round trip or two (TLS: two more), so even a loaded machine or a far one has room.
HANDSHAKE_TIMEOUT = 2.0
# Connections still in the handshake, at most (and a quarter of the descriptors): a new one
# beyond drops the oldest, so a real client is dropped only if this many others come in
# during its own round trip, and then it tries again (``client._client.dial``). Read when a
# server starts (tests lower it).
MAX_PENDING = 256
# Sessions open at once (a control connection that only lists the devices holds none).
MAX_SESSIONS = 64
HEARTBEAT_S = 1.0
_LISTEN_BACKLOG = 1024
_TICK_S = 0.1  # how often the accept thread looks at deadlines and whether it is closed
_ACCEPTS_PER_ROUND = 64  # then serve connections that spoke, before accepting more


class _Pending:
    """A connection that has not proven the token yet.

    The accept thread owns it while it is silent, and in plain text while its HELLO comes
    in (``rbuf``; once whole, ``hello``, and it leaves the handshake's queue: a slow
    client's own HMAC check never races the flood). Under TLS its first bytes hand it to a
    thread of its own (``threaded``), which runs the TLS handshake and ours. ``dropped`` (a
    REFUSED kind and message) is set, under the server's lock, when the accept thread drops
    it (too many waiting, or its deadline passed); its thread, woken by a shutdown of its
    reading side, then says why.
    """

    __slots__ = ("deadline", "dropped", "hello", "nonce", "rbuf", "sock", "threaded")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.rbuf = b""
        self.hello: bytes | None = None
        self.threaded = False
        self.dropped: tuple[int, str] | None = None


def _max_pending() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_PENDING
    return max(1, min(MAX_PENDING, soft // 4))


def _whole_hello(buf: bytes) -> bytes | None:
    """The HELLO's payload once ``buf`` holds its whole frame (None: more to come).

    Raises:
        ProtocolError: ``buf`` cannot be a HELLO frame, or holds more (a client waits for
            the answer before it sends anything else).
    """
    if len(buf) < HEADER.size:
        return None
    (n,) = HEADER.unpack_from(buf)
    if not 1 <= n <= MAX_HELLO_FRAME or len(buf) > HEADER.size + n:
        raise ProtocolError("not a HELLO frame")
    return buf[HEADER.size :] if len(buf) == HEADER.size + n else None


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def _hang_up(sock: socket.socket, last: bytes) -> None:
    """Send ``last`` if the socket takes it at once, then close. What the peer sent is read
    first: closing with it unread would send a reset, which may discard ``last`` there."""
    with contextlib.suppress(OSError):
        if last:
            sock.send(last, socket.MSG_DONTWAIT)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.recv(4096, socket.MSG_DONTWAIT)
    sock.close()


def _due(w: Worker, now: float) -> bool:
    """Whether a session's client may be waiting: a reply is due, or a frame runs so long
    that a read may sit behind it, not yet received."""
    busy = w.busy_since
    return w.waiting > 0 or (busy is not None and now - busy >= HEARTBEAT_S)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """A running server (from :func:`serve`); a context manager that closes it.

    Attributes:
        address: ``"HOST:PORT"`` to pass to ``remote.devices``.
        port: the port it listens on.
        fingerprint: SHA-256 of its TLS certificate (None without TLS).
        specs: the devices it hosts, by index.
    """

    def __init__(
        self,
        specs: list[str],
        listener: socket.socket,
        host: str,
        token: bytes | None,
        tls: ssl.SSLContext | None,
        fingerprint: str | None,
        max_session_bytes: int | None,
    ) -> None:
        self.specs = specs
        self._devices = [tl.device(s) for s in specs]
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self.address = f"{host}:{self.port}"
        self.fingerprint = fingerprint
        self._token = token
        self._tls = tls
        self._limit = max_session_bytes
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[Framed] = set()
        self._workers: set[Worker] = set()
        self._slots = threading.BoundedSemaphore(MAX_SESSIONS)
        self._max_sessions = MAX_SESSIONS
        self._max_pending = _max_pending()
        # Connections in the handshake, oldest first (so in deadline order).
        self._pending: OrderedDict[_Pending, None] = OrderedDict()
        self._threads = [
            threading.Thread(target=self._accept, name="remote-accept", daemon=True),
            threading.Thread(target=self._heartbeats, name="remote-heartbeat", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<remote.Server {self.address} devices={self.specs}>"

    def stats(self) -> dict[str, int]:
        """``sessions`` open now, the ``bytes`` their arrays hold, and ``peak_bytes``: the
        sum of each one's most at once since it began (what one session's limit sees)."""
        with self._lock:
            workers = [w for w in self._workers if not w.closed]
        return {
            "sessions": len(workers),
            "bytes": sum(w.bytes for w in workers),
            "peak_bytes": sum(w.peak_bytes for w in workers),
        }

    def close(self) -> None:
        """Stop serving: close every connection (sessions are freed) and the listener."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
            waiting = [q.sock for q in self._pending]
            for w in self._workers:
                w.closed = True  # each stops between two records
        for c in conns:
            c.close()
        for sock in waiting:  # wakes a handshake still in TLS; the accept thread closes
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2.0)

    # ------------------------------------------------------------------ threads
    def _accept(self) -> None:
        """Accept connections and hold each until its HELLO (plain text) or its first
        bytes (TLS) arrive, then give it a thread; drop the oldest when too many wait, and
        any past its deadline. A silent connection costs a socket, never a thread or a slot."""
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        try:
            while not self._closed.is_set():
                try:
                    events = sel.select(_TICK_S)
                except (OSError, ValueError):
                    return  # the listener was closed under us: close() is under way
                # Those that spoke first: accepting more may drop them.
                for key, _ in sorted(events, key=lambda e: e[0].data is None):
                    if key.data is None:
                        self._admit(sel)
                    else:
                        self._start(sel, key.data)
                self._expire(sel)
        finally:
            with self._lock:
                waiting = [q for q in self._pending if not q.threaded]
                for q in waiting:
                    del self._pending[q]
            for q in waiting:
                q.sock.close()
            sel.close()
            self._listener.close()

    def _admit(self, sel: selectors.BaseSelector) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors: free one held by a peer that has not proven itself.
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._drop_oldest(sel):
                    continue
                return
            sock.setblocking(False)
            q = _Pending(sock, time.monotonic() + HANDSHAKE_TIMEOUT)
            while len(self._pending) >= self._max_pending:
                self._drop_oldest(sel)
            with self._lock:
                self._pending[q] = None
            if self._tls is None:  # plain text: the server speaks first (TLS: the client)
                try:
                    sock.send(_frame(greeting(self._token is not None, q.nonce)))
                except OSError:
                    self._drop(sel, q, (REFUSED_CROWDED, "could not greet"))
                    continue
            sel.register(sock, selectors.EVENT_READ, q)

    def _drop_oldest(self, sel: selectors.BaseSelector) -> bool:
        """Drop the oldest connection in the handshake; under TLS, the oldest still silent
        first (one in its TLS handshake cannot be told why, and costs the flood a thread)."""
        with self._lock:
            silent = (q for q in self._pending if not q.threaded)
            oldest = next(silent, None) or next(iter(self._pending), None)
        if oldest is None:
            return False
        why = f"server busy: {self._max_pending} connections were in the handshake at once"
        self._drop(sel, oldest, (REFUSED_CROWDED, f"{why}, this one the oldest"))
        return True

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        why = (REFUSED_TIMEOUT, f"handshake not completed within {HANDSHAKE_TIMEOUT:g} s")
        while True:
            with self._lock:
                oldest = next(iter(self._pending), None)
            if oldest is None or oldest.deadline > now:
                return
            self._drop(sel, oldest, why)

    def _drop(self, sel: selectors.BaseSelector, q: _Pending, why: tuple[int, str]) -> None:
        """Take ``q`` out of the handshake and close it, telling it ``why`` (a REFUSED kind
        and message) where it can read it; nothing when its thread claimed it first."""
        with self._lock:
            if q not in self._pending:
                return
            del self._pending[q]
            q.dropped = why
        if q.threaded:
            try:  # wakes its thread, which says why and closes
                q.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            return
        try:
            sel.unregister(q.sock)
        except (KeyError, ValueError):
            pass
        # A TLS peer cannot read a plain-text frame: it is just closed.
        _hang_up(q.sock, _frame(refused(*why)) if self._tls is None else b"")

    def _start(self, sel: selectors.BaseSelector, q: _Pending) -> None:
        """``q`` spoke: read its HELLO (plain text) or hand it to a thread of its own
        (TLS). A plain HELLO once whole leaves the handshake's queue, and a thread checks
        it and runs the session. A peer that hung up, or sent what is no HELLO, is closed."""
        tls = self._tls is not None
        try:
            data = q.sock.recv(4096, socket.MSG_PEEK if tls else 0)
            if data and not tls:
                q.rbuf += data
                q.hello = _whole_hello(q.rbuf)
                if q.hello is None:
                    return  # more to come
        except (BlockingIOError, InterruptedError):
            return  # nothing after all: keep watching it
        except (OSError, ProtocolError):
            data = b""
        with self._lock:
            if q not in self._pending:
                return  # dropped already
            if data and tls:
                q.threaded = True  # still in the handshake, now on its own thread
            else:
                del self._pending[q]
        sel.unregister(q.sock)
        if data:
            try:
                threading.Thread(
                    target=self._connection, args=(q,), name="remote-conn", daemon=True
                ).start()
                return
            except RuntimeError:  # no thread to be had: drop this one, serve the others
                with self._lock:
                    self._pending.pop(q, None)
        q.sock.close()

    def _heartbeats(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            now = time.monotonic()
            with self._lock:
                workers = [w for w in self._workers if not w.closed and _due(w, now)]
            for w in workers:
                try:
                    w.framed.send(HEARTBEAT_FRAME)
                except OSError:
                    pass

    def _connection(self, q: _Pending) -> None:
        sock = q.sock
        framed: Framed | None = None
        worker: Worker | None = None
        device: int | None = None
        try:
            sock.settimeout(max(q.deadline - time.monotonic(), 0.001))
            tune(sock)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            framed = Framed(sock)
            with self._lock:
                self._conns.add(framed)
            if self._closed.is_set():
                return
            device = self._handshake(framed, q)
            if device is None:
                return
            sock.settimeout(None)
            dev = self._devices[device]
            worker = Worker(framed, dev.xp, dev if dev.type == "cuda" else None, self._limit)
            with self._lock:
                self._workers.add(worker)
            if not self._closed.is_set():
                worker.run()
        except (OSError, EOFError, ProtocolError, ssl.SSLError, ValueError):
            pass  # a broken or hostile connection: drop it, serve the others
        finally:
            if worker is not None:
                worker.closed = True
                with self._lock:
                    self._workers.discard(worker)
            with self._lock:
                self._pending.pop(q, None)
                why = q.dropped
            if framed is not None:
                if why is not None:  # dropped by the accept thread: say why
                    try:
                        framed.send(refused(*why))
                    except (OSError, ValueError):
                        pass
                framed.close()
                with self._lock:
                    self._conns.discard(framed)
            else:
                sock.close()
            if device is not None:
                self._slots.release()

    def _handshake(self, framed: Framed, q: _Pending) -> int | None:
        """Run the handshake; the session's device index (its slot taken), or None
        (refused, or a control connection that got its device list)."""
        token, sn = self._token, q.nonce
        if q.hello is None:  # TLS: the greeting and HELLO go through it, on this thread
            framed.send(greeting(token is not None, sn))
            q.hello = bytes(framed.recv(MAX_HELLO_FRAME))
            with self._lock:  # claim it: the accept thread may drop it no more
                if q.dropped is not None:
                    return None
                del self._pending[q]
        version, device, cn, proof = parse_hello(q.hello)
        if version != PROTOCOL_VERSION:
            framed.send(refused(REFUSED_PROTOCOL, f"protocol {version} is not {PROTOCOL_VERSION}"))
            return None
        if not hmac.compare_digest(proof, client_proof(token, sn, cn, device)):
            framed.send(refused(REFUSED_AUTH, "authentication failed: wrong or missing token"))
            return None
        if device != CONTROL and device >= len(self.specs):
            framed.send(refused(REFUSED_DEVICE, f"no device {device} here"))
            return None
        if device != CONTROL and not self._slots.acquire(blocking=False):
            message = f"server busy: all {self._max_sessions} sessions are open; try again later"
            framed.send(refused(REFUSED_BUSY, message))
            return None
        try:
            framed.send(welcome(server_proof(token, sn, cn, device)))
        except BaseException:
            if device != CONTROL:
                self._slots.release()
            raise
        if token is not None:
            framed.seal = session_seal(token, sn, cn, device, server=True)
        if device != CONTROL:
            return device
        parse_list(framed.recv(MAX_HELLO_FRAME))
        framed.send(device_list(self.specs))
        return None


def serve(
    devices: Sequence[str | tl.Device],
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | bytes | None = None,
    *,
    tls: bool | tuple[str, str] = False,
    max_session_bytes: int | None = None,
) -> Server:
    """Host ``devices`` (``"cpu"``, ``"cuda:0"``...) for remote clients, on background threads.

    Every argument is checked before anything listens.

    Args:
        devices: a list of tensorlib devices or specs, one per device clients may use
            (repeats allowed); a single ``"cpu"`` is refused (``["cpu"]`` hosts one).
        host: the address to listen on; anything but loopback requires a token.
        port: the port, 0-65535 (0: any free one; see ``Server.port``).
        token: the shared secret clients prove (and this server proves back): a str or
            bytes, surrounding whitespace stripped as clients strip it (a token file's
            trailing newline is not part of it).
        tls: True for TLS with a fresh self-signed certificate (needs ``cryptography``), or
            ``(certfile, keyfile)`` PEM paths; clients pin ``Server.fingerprint``.
        max_session_bytes: what one session's arrays may hold, a positive int (None: no
            limit).

    Returns:
        The running :class:`Server` (close it, or use it as a context manager).

    Raises:
        TypeError: an argument of the wrong type (``devices`` a single str, ``token`` not
            str or bytes, ``port`` or ``max_session_bytes`` not an int...).
        ValueError: no devices, a non-local device, an empty token, a port outside
            0-65535, a non-positive ``max_session_bytes``, a ``host`` that does not
            resolve, or a non-loopback host without a token.
        RemoteError: ``tls=True`` without ``cryptography``.
    """
    specs = list(check_devices(devices, "serve"))
    host = check_host(host, "serve")
    port = check_port(port, "serve")
    tok = None if token is None else check_token(token, "serve")
    tls = check_tls(tls, "serve")
    max_session_bytes = check_limit(max_session_bytes, "serve")
    check_resolvable(host, port)
    if any(tl.device(d).type not in ("cpu", "cuda") for d in specs):
        raise ValueError("serve: hosts local devices only ('cpu', 'cuda:N')")
    if tok is None and not _is_loopback(host):
        raise ValueError(
            f"serve: refusing to listen on {host!r} without a token (anyone who can reach it "
            "could run code on its devices); pass token=... or listen on 127.0.0.1"
        )
    ctx = fingerprint = None
    if tls:
        if not isinstance(tls, tuple):
            cert, key = self_signed()
        else:
            with open(tls[0], "rb") as f:
                cert = f.read()
            with open(tls[1], "rb") as f:
                key = f.read()
        ctx, fingerprint = server_context(cert, key), fingerprint_of(cert)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(_LISTEN_BACKLOG)
    listener.setblocking(False)
    shown = f"[{host}]" if ":" in host else host
    return Server(specs, listener, shown, tok, ctx, fingerprint, max_session_bytes)
