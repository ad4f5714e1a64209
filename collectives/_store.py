"""A small TCP key-value store for rendezvous, hosted by rank 0.

``TCPStore(host, port, is_server=True)`` starts the server on a daemon thread of this process
and connects to it like every other client; ranks > 0 create ``TCPStore(host, port,
is_server=False)``, which retries while the server is not up yet. Keys are strings, values are
bytes. ``get`` and ``wait`` block (on the server, without holding up other clients) until the
keys exist or their timeout passes.

Security: the server binds to loopback unless ``host`` names another address of this machine;
an optional shared secret (argument, or the ``DPT_STORE_SECRET`` environment variable) must be
proven by each client with a challenge-response; nothing from the wire is ever unpickled or
evaluated, and unauthenticated peers may only send frames of at most ``MAX_HELLO_FRAME`` bytes.

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

import errno
import hashlib
import heapq
import hmac
import ipaddress
import math
import os
import re
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from types import TracebackType

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "SECRET_ENV_VAR",
    "StoreAuthError",
    "StoreConnectionError",
    "StoreError",
    "StoreTimeoutError",
    "TCPStore",
    "is_local_address",
    "is_loopback",
]

SECRET_ENV_VAR = "DPT_STORE_SECRET"
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
_NONCE_BYTES = 32
# Time a server waits for a new connection to finish the handshake before dropping it.
_HANDSHAKE_TIMEOUT = 30.0
# Extra time a client waits for the server's TIMEOUT reply to a blocking GET/WAIT.
_REPLY_GRACE = 5.0
# After the first connection, new ones (other threads) retry this long at most: the server
# was up, so a refusal now most likely means it is gone and the caller should hear so soon.
_RECONNECT_WINDOW = 2.0
_MAX_IDLE_CONNECTIONS = 8

_OP_HELLO = 0x01
_OP_SET = 0x02
_OP_GET = 0x03
_OP_ADD = 0x04
_OP_WAIT = 0x05
_OP_CHECK = 0x06
_OP_DELETE = 0x07
_OP_COMPARE_SET = 0x08
_OP_NUM_KEYS = 0x09

_ST_OK = 0x00
_ST_TIMEOUT = 0x01
_ST_ERROR = 0x02

_ERR_MALFORMED = 1
_ERR_REFUSED = 2
_ERR_VALUE = 3

_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1
_INT_VALUE = re.compile(rb"[+-]?[0-9]{1,19}")
_FLAG_AUTH = 0x01

_U8 = struct.Struct(">B")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")


# ----------------------------------------------------------------------------- errors


class StoreError(RuntimeError):
    """The store failed: unreachable, refused, closed, or it rejected a request."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store operation (connect, get, wait) did not complete within its timeout."""


class StoreConnectionError(StoreError, ConnectionError):
    """The connection to the store was lost (the process hosting it exited?)."""


class StoreAuthError(StoreError):
    """The store refused this client: wrong or missing shared secret, or protocol mismatch."""


class _ProtocolError(Exception):
    """A malformed frame (internal: the server drops the connection, a client raises)."""


# ----------------------------------------------------------------------------- addresses


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback name or address (``localhost``, ``127.x.x.x``, ``::1``).

    A name other than ``localhost`` counts when every address it resolves to is loopback.

    Args:
        host: a host name or an IPv4/IPv6 literal (brackets allowed).

    Returns:
        True for loopback; False otherwise, also when the name does not resolve.
    """
    host = _strip_brackets(host)
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    addresses = _resolve(host)
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (so a server here can bind to it).

    Loopback counts. Otherwise each address the name resolves to is tried with a UDP bind to
    port 0, which succeeds exactly for this host's own addresses (and the wildcard).

    Args:
        host: a host name or an IPv4/IPv6 literal.

    Returns:
        True if a socket can be bound to (one of) the address(es) ``host`` names.
    """
    if is_loopback(host):
        return True
    return _first_bindable(_strip_brackets(host)) is not None


def _strip_brackets(host: str) -> str:
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def _resolve(host: str) -> list[str]:
    try:
        return [ipaddress.ip_address(host).compressed]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            addr = str(sockaddr[0]).split("%", 1)[0]  # drop an IPv6 zone id
            if addr not in out:
                out.append(addr)
    return out


def _first_bindable(host: str) -> str | None:
    for addr in _resolve(host):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr, 0))
            return addr
        except OSError:
            continue
    return None


def _bind_address(host: str) -> str:
    """The address the server binds to for ``host`` (see the module docstring)."""
    plain = _strip_brackets(host)
    if is_loopback(plain):
        try:
            if ipaddress.ip_address(plain).version == 6:
                return "::1"
        except ValueError:
            pass
        return "127.0.0.1"
    addr = _first_bindable(plain)
    if addr is None:
        resolved = _resolve(plain)
        seen = f" (resolves to {', '.join(resolved)})" if resolved else " (does not resolve)"
        raise StoreError(
            f"cannot host the store on {host!r}{seen}: it is not an address of this machine "
            f"({socket.gethostname()}). The store server runs on the rank-0 host, which "
            "MASTER_ADDR must name; check MASTER_ADDR."
        )
    return addr


# ----------------------------------------------------------------------------- encoding


class _Writer:
    __slots__ = ("parts",)

    def __init__(self, opcode: int) -> None:
        self.parts: list[bytes] = [_U8.pack(opcode)]

    def u8(self, v: int) -> _Writer:
        self.parts.append(_U8.pack(v))
        return self

    def i64(self, v: int) -> _Writer:
        self.parts.append(_I64.pack(v))
        return self

    def f64(self, v: float) -> _Writer:
        self.parts.append(_F64.pack(v))
        return self

    def blob(self, v: bytes) -> _Writer:
        self.parts.append(_U32.pack(len(v)))
        self.parts.append(v)
        return self

    def keys(self, keys: list[bytes]) -> _Writer:
        self.parts.append(_U32.pack(len(keys)))
        for k in keys:
            self.blob(k)
        return self

    def payload(self) -> bytes:
        return b"".join(self.parts)


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise _ProtocolError(f"truncated frame: wanted {n} bytes at offset {self.pos}")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def u8(self) -> int:
        return int(_U8.unpack(self._take(1))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self._take(8))[0])

    def f64(self) -> float:
        return float(_F64.unpack(self._take(8))[0])

    def blob(self, limit: int = MAX_FRAME_BYTES) -> bytes:
        n = self.u32()
        if n > limit:
            raise _ProtocolError(f"field of {n} bytes exceeds the limit of {limit}")
        return self._take(n)

    def key(self) -> str:
        raw = self.blob(MAX_KEY_BYTES)
        if not raw:
            raise _ProtocolError("empty key")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _ProtocolError("key is not valid UTF-8") from exc

    def keys(self) -> list[str]:
        n = self.u32()
        if not 1 <= n <= MAX_WAIT_KEYS:
            raise _ProtocolError(f"key count {n} outside 1..{MAX_WAIT_KEYS}")
        return [self.key() for _ in range(n)]

    def timeout(self) -> float:
        t = self.f64()
        if math.isnan(t) or t < 0:
            raise _ProtocolError(f"invalid timeout {t!r}")
        return t

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise _ProtocolError(f"{len(self.buf) - self.pos} trailing bytes in frame")


def _frame(payload: bytes) -> bytes:
    return _U32.pack(len(payload)) + payload


def _error_payload(kind: int, message: str) -> bytes:
    return _Writer(_ST_ERROR).u8(kind).blob(message.encode("utf-8", "replace")).payload()


# ----------------------------------------------------------------------------- server


class _Pending:
    """A GET or WAIT parked on the server until its keys exist or its deadline passes."""

    __slots__ = ("deadline", "keys", "op")

    def __init__(self, op: int, keys: list[str], deadline: float) -> None:
        self.op = op
        self.keys = keys
        self.deadline = deadline


class _Peer:
    """Server-side state of one client connection."""

    __slots__ = (
        "addr",
        "authed",
        "closed",
        "closing",
        "nonce",
        "pending",
        "rbuf",
        "sock",
        "wbuf",
        "writing",
    )

    def __init__(self, sock: socket.socket, addr: str) -> None:
        self.sock = sock
        self.addr = addr
        self.rbuf = bytearray()
        self.wbuf: deque[memoryview] = deque()
        self.writing = False
        self.authed = False
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self.pending: _Pending | None = None
        self.closing = False  # send what is queued, then close
        self.closed = False


class _Server:
    """The store server: one selector loop on a daemon thread serves every client.

    A single thread suffices because no handler blocks: a GET or WAIT on a missing key parks
    the connection (``_Peer.pending``) and the loop answers it when a SET creates the key or
    its deadline passes, so a waiting client never holds up the others.
    """

    def __init__(self, host: str, port: int, secret: bytes | None) -> None:
        self.bind_host = _bind_address(host)
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            # Lets a restarted job reuse a port whose old connections sit in TIME_WAIT; Linux
            # still refuses the bind while another socket listens on it.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.bind_host, port))
            listener.listen(1024)
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                raise StoreError(
                    f"cannot start the store server on {self.bind_host}:{port}: port {port} "
                    "is already in use (another job or store?); choose another MASTER_PORT"
                ) from exc
            raise StoreError(
                f"cannot start the store server on {self.bind_host}:{port}: {exc}"
            ) from exc
        listener.setblocking(False)
        self.port: int = listener.getsockname()[1]
        self._listener = listener
        self._secret = secret
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, set[_Peer]] = {}
        self._timers: list[tuple[float, int, _Peer, _Pending | None]] = []
        self._timer_seq = 0
        self._runnable: deque[_Peer] = deque()
        self._peers: set[_Peer] = set()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, None)
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
            self._thread.join(timeout=10.0)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._loop_once()
        finally:
            for peer in list(self._peers):
                self._close_peer(peer)
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
                peer: _Peer = key.data
                if mask & selectors.EVENT_WRITE and not peer.closed:
                    self._flush(peer)
                if mask & selectors.EVENT_READ and not peer.closed:
                    self._on_readable(peer)
        self._fire_timers()
        # Connections whose parked request was just answered may have more requests queued.
        while self._runnable:
            peer = self._runnable.popleft()
            if not peer.closed:
                self._process(peer)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:
                # Out of file descriptors or similar: back off rather than spin.
                time.sleep(0.05)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = _Peer(sock, f"{addr[0]}:{addr[1]}")
            self._peers.add(peer)
            self._sel.register(sock, selectors.EVENT_READ, peer)
            flags = _FLAG_AUTH if self._secret else 0
            hello = MAGIC + _U8.pack(PROTOCOL_VERSION) + _U8.pack(flags) + peer.nonce
            self._send(peer, hello)
            self._add_timer(time.monotonic() + _HANDSHAKE_TIMEOUT, peer, None)

    def _close_peer(self, peer: _Peer) -> None:
        if peer.closed:
            return
        peer.closed = True
        self._unpark(peer)
        self._peers.discard(peer)
        try:
            self._sel.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
        peer.wbuf.clear()
        peer.rbuf = bytearray()

    def _drop(self, peer: _Peer, kind: int, message: str) -> None:
        """Tell the peer why (best effort), then close its connection."""
        peer.rbuf = bytearray()
        self._send(peer, _error_payload(kind, message))
        peer.closing = True
        if not peer.wbuf:
            self._close_peer(peer)

    # -- I/O

    def _send(self, peer: _Peer, payload: bytes) -> None:
        if peer.closed:
            return
        peer.wbuf.append(memoryview(_frame(payload)))
        self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        while peer.wbuf:
            chunk = peer.wbuf[0]
            try:
                n = peer.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close_peer(peer)
                return
            if n < len(chunk):
                peer.wbuf[0] = chunk[n:]
                break
            peer.wbuf.popleft()
        want_write = bool(peer.wbuf)
        if want_write != peer.writing:
            peer.writing = want_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
            self._sel.modify(peer.sock, events, peer)
        if not peer.wbuf and peer.closing:
            self._close_peer(peer)

    def _on_readable(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_peer(peer)
            return
        if not data:
            self._close_peer(peer)
            return
        if peer.closing:
            return  # we are hanging up on this peer: ignore what it sends
        peer.rbuf += data
        self._process(peer)

    def _process(self, peer: _Peer) -> None:
        """Handle every complete frame buffered for ``peer`` (stops while one is parked)."""
        while not peer.closed and not peer.closing and peer.pending is None:
            rbuf = peer.rbuf
            if len(rbuf) < 4:
                return
            (n,) = _U32.unpack_from(rbuf, 0)
            limit = MAX_FRAME_BYTES if peer.authed else MAX_HELLO_FRAME
            if n == 0 or n > limit:
                self._drop(peer, _ERR_MALFORMED, f"frame length {n} outside 1..{limit}")
                return
            if len(rbuf) < 4 + n:
                return
            with memoryview(rbuf) as view:
                body = bytes(view[4 : 4 + n])
            del rbuf[: 4 + n]
            try:
                if peer.authed:
                    self._handle(peer, _Reader(body))
                else:
                    self._handshake(peer, _Reader(body))
            except _ProtocolError as exc:
                self._drop(peer, _ERR_MALFORMED, f"malformed request: {exc}")
                return
            except Exception as exc:  # a bug or MemoryError: cost this client, not the server
                self._drop(peer, _ERR_MALFORMED, f"internal error: {type(exc).__name__}: {exc}")
                return

    # -- requests

    def _handshake(self, peer: _Peer, r: _Reader) -> None:
        op = r.u8()
        if op != _OP_HELLO:
            raise _ProtocolError(f"expected HELLO (0x01) first, got opcode 0x{op:02x}")
        version = r.u8()
        mac = r.blob(64)
        r.end()
        if version != PROTOCOL_VERSION:
            self._drop(
                peer,
                _ERR_REFUSED,
                f"protocol version {version} not supported (server speaks {PROTOCOL_VERSION})",
            )
            return
        if self._secret is not None:
            expected = hmac.new(self._secret, peer.nonce, hashlib.sha256).digest()
            if not hmac.compare_digest(expected, mac):
                self._drop(peer, _ERR_REFUSED, "wrong or missing secret")
                return
        peer.authed = True
        self._send(peer, _U8.pack(_ST_OK))

    def _handle(self, peer: _Peer, r: _Reader) -> None:
        op = r.u8()
        data = self._data
        if op == _OP_SET:
            key, value = r.key(), r.blob(MAX_VALUE_BYTES)
            r.end()
            data[key] = value
            self._send(peer, _U8.pack(_ST_OK))
            self._key_created(key)
        elif op == _OP_GET:
            key, timeout = r.key(), r.timeout()
            r.end()
            if key in data:
                self._send(peer, _Writer(_ST_OK).blob(data[key]).payload())
            else:
                self._park(peer, _Pending(_OP_GET, [key], time.monotonic() + timeout))
        elif op == _OP_ADD:
            key, amount = r.key(), r.i64()
            r.end()
            old = data.get(key, b"0")
            if not _INT_VALUE.fullmatch(old):
                message = f"the value {old[:40]!r} of key {key!r} is not an integer"
                self._send(peer, _error_payload(_ERR_VALUE, message))
                return
            new = int(old) + amount
            if not _I64_MIN <= new <= _I64_MAX:
                message = f"{int(old)} + {amount} overflows int64 (key {key!r})"
                self._send(peer, _error_payload(_ERR_VALUE, message))
                return
            data[key] = str(new).encode()
            self._send(peer, _Writer(_ST_OK).i64(new).payload())
            self._key_created(key)
        elif op == _OP_WAIT:
            keys, timeout = r.keys(), r.timeout()
            r.end()
            if all(k in data for k in keys):
                self._send(peer, _U8.pack(_ST_OK))
            else:
                self._park(peer, _Pending(_OP_WAIT, keys, time.monotonic() + timeout))
        elif op == _OP_CHECK:
            keys = r.keys()
            r.end()
            self._send(peer, _Writer(_ST_OK).u8(all(k in data for k in keys)).payload())
        elif op == _OP_DELETE:
            key = r.key()
            r.end()
            existed = data.pop(key, None) is not None
            self._send(peer, _Writer(_ST_OK).u8(existed).payload())
        elif op == _OP_COMPARE_SET:
            key, expected, desired = r.key(), r.blob(MAX_VALUE_BYTES), r.blob(MAX_VALUE_BYTES)
            r.end()
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                data[key] = current = desired
                self._key_created(key)
            self._send(peer, _Writer(_ST_OK).blob(current or b"").payload())
        elif op == _OP_NUM_KEYS:
            r.end()
            self._send(peer, _Writer(_ST_OK).i64(len(data)).payload())
        else:
            raise _ProtocolError(f"unknown opcode 0x{op:02x}")

    # -- parked GET/WAIT

    def _park(self, peer: _Peer, pending: _Pending) -> None:
        peer.pending = pending
        for k in pending.keys:
            if k not in self._data:
                self._waiters.setdefault(k, set()).add(peer)
        if math.isfinite(pending.deadline):
            self._add_timer(pending.deadline, peer, pending)

    def _unpark(self, peer: _Peer) -> None:
        pending, peer.pending = peer.pending, None
        if pending is None:
            return
        for k in pending.keys:
            waiting = self._waiters.get(k)
            if waiting is not None:
                waiting.discard(peer)
                if not waiting:
                    del self._waiters[k]

    def _key_created(self, key: str) -> None:
        for peer in self._waiters.pop(key, set()):
            pending = peer.pending
            if pending is None or peer.closed:
                continue
            missing = [k for k in pending.keys if k not in self._data]
            if missing:
                # Another key it waits for was deleted meanwhile: keep waiting for it.
                for k in missing:
                    self._waiters.setdefault(k, set()).add(peer)
                continue
            self._unpark(peer)
            self._send(peer, self._answer(pending, []))
            self._runnable.append(peer)

    def _add_timer(self, deadline: float, peer: _Peer, pending: _Pending | None) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (deadline, self._timer_seq, peer, pending))

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, peer, pending = heapq.heappop(self._timers)
            if peer.closed:
                continue
            if pending is None:
                if not peer.authed and not peer.closing:
                    self._drop(peer, _ERR_MALFORMED, "handshake not completed in time")
                continue
            if peer.pending is not pending:
                continue  # answered already
            missing = [k for k in pending.keys if k not in self._data]
            self._unpark(peer)
            self._send(peer, self._answer(pending, missing))
            self._runnable.append(peer)

    def _answer(self, pending: _Pending, missing: list[str]) -> bytes:
        """The reply to a parked GET/WAIT: TIMEOUT naming ``missing`` keys, or its result."""
        if missing:
            return _Writer(_ST_TIMEOUT).keys([k.encode() for k in missing]).payload()
        if pending.op == _OP_GET:
            return _Writer(_ST_OK).blob(self._data[pending.keys[0]]).payload()
        return _U8.pack(_ST_OK)


# ----------------------------------------------------------------------------- client


class _Connection:
    """One authenticated client socket (used by one thread at a time)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send(self, payload: bytes) -> None:
        header = _U32.pack(len(payload))
        if len(payload) < 1 << 16:
            self.sock.sendall(header + payload)
        else:  # avoid copying a large value just to prepend 4 bytes
            self.sock.sendall(header)
            self.sock.sendall(payload)

    def recv(self, limit: int = MAX_FRAME_BYTES) -> bytes:
        (n,) = _U32.unpack(self._recv_exact(4))
        if n == 0 or n > limit:
            raise _ProtocolError(f"reply frame length {n} outside 1..{limit}")
        return self._recv_exact(n)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError
            got += k
        return bytes(buf)


def _secret_from(secret: bytes | str | None) -> bytes | None:
    if secret is None:
        env = os.environ.get(SECRET_ENV_VAR, "")
        return env.encode("utf-8") if env else None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"secret must be bytes, str or None, got {type(secret).__name__}")
    # An empty secret is treated as none (like an empty DPT_STORE_SECRET).
    return bytes(secret) or None


def _check_timeout(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be >= 0 seconds (inf waits forever), got {value!r}")
    return value


def _encode_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    raw = key.encode("utf-8")
    if not 1 <= len(raw) <= MAX_KEY_BYTES:
        raise ValueError(
            f"store key must be 1..{MAX_KEY_BYTES} bytes of UTF-8, got {len(raw)} bytes"
        )
    return raw


def _encode_value(value: bytes | str, what: str = "value") -> bytes:
    if isinstance(value, str):
        raw = value.encode("utf-8")
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
    else:
        raise TypeError(f"store {what} must be bytes or str, got {type(value).__name__}")
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueError(
            f"store {what} of {len(raw)} bytes exceeds the limit of {MAX_VALUE_BYTES} bytes"
        )
    return raw


def _fmt_s(seconds: float) -> str:
    return "no limit" if math.isinf(seconds) else f"{seconds:g} s"


class TCPStore:
    """A key-value store over TCP for rendezvous (see the module docstring for the protocol).

    Thread-safe: each concurrent call uses its own connection (taken from a small pool), so a
    thread blocked in ``get`` does not hold up another thread's ``set``.

    Example::

        store = TCPStore("127.0.0.1", 29500, is_server=(rank == 0), timeout=60)
        store.set(f"addr/{rank}", my_address)
        peer = store.get(f"addr/{(rank + 1) % world}")   # waits until it is set

    Attributes:
        host: the host clients connect to.
        port: the server's port (the bound one when created with ``port=0``).
        timeout: default timeout in seconds for ``get``/``wait`` and for replies.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        is_server: bool,
        timeout: float = 300.0,
        secret: bytes | str | None = None,
        connect_timeout: float | None = None,
    ) -> None:
        """Start the server (when ``is_server``) and connect to it.

        Args:
            host: the store's host (MASTER_ADDR). The server binds to loopback when it is a
                loopback name or address, else to that address, which must be this host's.
            port: the store's port (MASTER_PORT); 0 lets the server pick a free one.
            is_server: host the server in this process (rank 0).
            timeout: default timeout in seconds of ``get``/``wait`` and of every reply.
            secret: shared secret every client must prove (str is taken as UTF-8); default:
                the ``DPT_STORE_SECRET`` environment variable when set and non-empty. An
                empty secret means none.
            connect_timeout: how long to retry connecting while the server is not up
                (default: ``timeout``).

        Raises:
            StoreError: the server cannot bind (port taken, address not local).
            StoreTimeoutError: the server could not be reached within ``connect_timeout``.
            StoreAuthError: the server refused this client (wrong or missing secret).
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"store port must be an integer in 0..65535, got {port!r}")
        if not is_server and port == 0:
            raise ValueError("a store client needs the server's port; port 0 is for servers")
        self.timeout = _check_timeout("timeout", timeout)
        self.connect_timeout = (
            self.timeout
            if connect_timeout is None
            else _check_timeout("connect_timeout", connect_timeout)
        )
        self.host = host
        self._secret = _secret_from(secret)
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._closed = False
        self._server_lost = False  # a connection broke: reconnect once, without retrying
        self._pid = os.getpid()
        self._server: _Server | None = None
        self._connect_host = _strip_brackets(host)
        if is_server:
            self._server = _Server(host, port, self._secret)
            port = self._server.port
            # Our own client connects to exactly what the server bound (loopback for the
            # wildcard address).
            bound = self._server.bind_host
            unspecified = ipaddress.ip_address(bound).is_unspecified
            self._connect_host = ("::1" if ":" in bound else "127.0.0.1") if unspecified else bound
            # A server dropped without close() stops with its owner, as a client would expect.
            weakref.finalize(self, self._server.close)
        self.port = port
        try:
            self._release(self._connect(self.connect_timeout))
        except BaseException:
            self.close()
            raise

    @property
    def is_server(self) -> bool:
        """Whether this object hosts the server."""
        return self._server is not None

    @property
    def server_address(self) -> tuple[str, int] | None:
        """The (address, port) the server listens on, or None for a client."""
        if self._server is None:
            return None
        return self._server.bind_host, self._server.port

    def __repr__(self) -> str:
        role = "server" if self._server is not None else "client"
        return f"TCPStore({self.host}:{self.port}, {role}{', closed' if self._closed else ''})"

    # -- public API

    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value`` (str is stored as UTF-8), waking waiters on it.

        Raises:
            StoreError: the store is closed or unreachable.
        """
        payload = _Writer(_OP_SET).blob(_encode_key(key)).blob(_encode_value(value)).payload()
        self._call(f"set({key!r})", payload, self.timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting until it is set.

        Args:
            key: the key.
            timeout: seconds to wait (default: the store's timeout; ``inf`` waits forever).

        Raises:
            StoreTimeoutError: the key was not set in time (the message names it).
        """
        wait = self.timeout if timeout is None else _check_timeout("timeout", timeout)
        payload = _Writer(_OP_GET).blob(_encode_key(key)).f64(wait).payload()
        r = self._call(f"get({key!r})", payload, wait, blocking=True)
        value = r.blob(MAX_VALUE_BYTES)
        r.end()
        return value

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (created at 0); return the sum.

        Raises:
            ValueError: the key holds a value that is not a decimal integer, or int64 overflow.
        """
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"add() amount must be an int, got {type(amount).__name__}")
        if not _I64_MIN <= amount <= _I64_MAX:
            raise ValueError(f"add() amount {amount} does not fit in int64")
        payload = _Writer(_OP_ADD).blob(_encode_key(key)).i64(amount).payload()
        r = self._call(f"add({key!r})", payload, self.timeout)
        value = r.i64()
        r.end()
        return value

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Block until every key in ``keys`` exists.

        Args:
            keys: the keys (at least one).
            timeout: seconds to wait (default: the store's timeout; ``inf`` waits forever).

        Raises:
            StoreTimeoutError: some keys were not set in time (the message names them).
        """
        raw = self._encode_keys(keys)
        wait = self.timeout if timeout is None else _check_timeout("timeout", timeout)
        payload = _Writer(_OP_WAIT).keys(raw).f64(wait).payload()
        self._call(f"wait({_show_keys(keys)})", payload, wait, blocking=True).end()

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` exists (does not wait)."""
        payload = _Writer(_OP_CHECK).keys(self._encode_keys(keys)).payload()
        r = self._call(f"check({_show_keys(keys)})", payload, self.timeout)
        found = r.u8()
        r.end()
        return bool(found)

    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        payload = _Writer(_OP_DELETE).blob(_encode_key(key)).payload()
        r = self._call(f"delete({key!r})", payload, self.timeout)
        existed = r.u8()
        r.end()
        return bool(existed)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Atomically set ``key`` to ``desired`` if it holds ``expected``.

        A missing key counts as holding ``b""``, so ``expected=b""`` creates it.

        Returns:
            The value stored after the call (``desired`` on success), or ``b""`` when the key
            does not exist.
        """
        payload = (
            _Writer(_OP_COMPARE_SET)
            .blob(_encode_key(key))
            .blob(_encode_value(expected, "expected value"))
            .blob(_encode_value(desired, "desired value"))
            .payload()
        )
        r = self._call(f"compare_set({key!r})", payload, self.timeout)
        value = r.blob(MAX_VALUE_BYTES)
        r.end()
        return value

    def num_keys(self) -> int:
        """The number of keys in the store."""
        r = self._call("num_keys()", _Writer(_OP_NUM_KEYS).payload(), self.timeout)
        n = r.i64()
        r.end()
        return n

    def close(self) -> None:
        """Close this client's connections; a server also stops, so its clients see errors.

        Idempotent. Calls in flight on other threads fail with ``StoreConnectionError``.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle, busy = self._idle, list(self._busy)
            self._idle = []
            self._busy.clear()
        if self._pid != os.getpid():
            # A forked child holds copies of the parent's sockets: close the copies only
            # (shutdown would cut the parent's connections) and leave the server alone.
            for conn in idle + busy:
                conn.close()
            return
        for conn in idle:
            conn.close()
        for conn in busy:
            conn.shutdown()  # wakes a thread blocked in recv; it closes the socket itself
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> TCPStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals

    @staticmethod
    def _encode_keys(keys: list[str]) -> list[bytes]:
        if isinstance(keys, str):
            raise TypeError("keys must be a list of str, not a single str")
        raw = [_encode_key(k) for k in keys]
        if not 1 <= len(raw) <= MAX_WAIT_KEYS:
            raise ValueError(f"expected 1..{MAX_WAIT_KEYS} keys, got {len(raw)}")
        return raw

    @property
    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _call(
        self, what: str, payload: bytes, timeout: float, *, blocking: bool = False
    ) -> _Reader:
        """Send one request and return a reader positioned after the OK status byte."""
        # A blocking GET/WAIT is answered by the server when its timeout passes; the socket
        # timeout only guards against a server that stopped answering.
        grace = _REPLY_GRACE if blocking else 0.0
        sock_timeout = None if math.isinf(timeout) else timeout + grace
        conn = self._acquire()
        keep = False
        try:
            try:
                conn.sock.settimeout(sock_timeout)
                conn.send(payload)
                r = _Reader(conn.recv())
                status = r.u8()
            except TimeoutError as exc:
                raise StoreTimeoutError(
                    f"store {what}: no reply from the store at {self._where} within "
                    f"{_fmt_s(sock_timeout or 0.0)}"
                ) from exc
            except (EOFError, OSError) as exc:
                raise self._lost(what, exc) from exc
            if status == _ST_OK:
                keep = True
                return r
            if status == _ST_TIMEOUT:
                keep = True
                missing = r.keys()
                shown = missing[0] if len(missing) == 1 else missing
                raise StoreTimeoutError(
                    f"store {what} timed out after {_fmt_s(timeout)} waiting for "
                    f"key{'s' if len(missing) != 1 else ''} {shown!r} (store at {self._where})"
                )
            if status == _ST_ERROR:
                kind, message = r.u8(), r.blob().decode("utf-8", "replace")
                if kind == _ERR_VALUE:
                    keep = True  # the server keeps this connection open
                    raise ValueError(f"store {what}: {message}")
                raise StoreError(f"store {what} rejected by {self._where}: {message}")
            raise _ProtocolError(f"unknown reply status 0x{status:02x}")
        except _ProtocolError as exc:
            keep = False
            raise StoreError(f"store {what}: malformed reply from {self._where}: {exc}") from exc
        finally:
            if keep:
                self._release(conn)
            else:
                self._discard(conn)

    def _lost(self, what: str, exc: BaseException) -> StoreError:
        if self._closed:
            return StoreConnectionError(f"store {what}: the store object was closed")
        self._server_lost = True
        detail = "connection closed" if isinstance(exc, EOFError) else str(exc)
        return StoreConnectionError(
            f"store {what}: lost the connection to the store at {self._where} ({detail}); "
            "did the process hosting it (rank 0) exit?"
        )

    def _acquire(self) -> _Connection:
        with self._lock:
            if self._closed:
                raise StoreError(f"the store client for {self._where} is closed")
            if self._pid != os.getpid():
                # Forked: the pooled sockets are shared with the parent; using one would mix
                # the two processes' requests. Drop our copies and connect afresh.
                for conn in self._idle:
                    conn.close()
                self._idle = []
                self._busy.clear()
                self._pid = os.getpid()
            if self._idle:
                conn = self._idle.pop()
                self._busy.add(conn)
                return conn
        if self._server_lost:
            conn = self._connect(0.0)  # one attempt: the caller should hear promptly
        else:
            conn = self._connect(min(self.connect_timeout, _RECONNECT_WINDOW))
        with self._lock:
            if self._closed:
                conn.close()
                raise StoreError(f"the store client for {self._where} is closed")
            self._busy.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
            if not self._closed and len(self._idle) < _MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _discard(self, conn: _Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()

    def _connect(self, window: float) -> _Connection:
        """Connect and authenticate, retrying with backoff while the server is not up."""
        start = time.monotonic()
        deadline = start + window
        delay = 0.01
        attempts = 0
        last: BaseException | None = None
        while True:
            attempts += 1
            remaining = deadline - time.monotonic()
            if window == 0:
                remaining = min(self.connect_timeout, 5.0)
            try:
                sock = socket.create_connection(
                    (self._connect_host, self.port), timeout=max(0.05, min(remaining, 5.0))
                )
            except OSError as exc:  # refused, unreachable, name not resolved, timed out
                last = exc
            else:
                try:
                    conn = self._handshake(sock, max(remaining, 1.0))
                    self._server_lost = False
                    return conn
                except StoreConnectionError as exc:  # reset mid-handshake: try again
                    sock.close()
                    last = exc
                except BaseException:
                    sock.close()
                    raise
            if self._closed:
                raise StoreError(f"the store client for {self._where} is closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.5)
        waited = time.monotonic() - start
        if self._server_lost:
            raise StoreConnectionError(
                f"store at {self._where} is gone ({last}); it was reachable before: did the "
                "process hosting it (rank 0) exit?"
            )
        raise StoreTimeoutError(
            f"store at {self._where} unreachable: tried for {waited:.1f} s "
            f"({attempts} attempts, connect timeout {window:g} s); last error: {last}. "
            "Is rank 0 running, and do MASTER_ADDR/MASTER_PORT name its host and a free port?"
        )

    def _handshake(self, sock: socket.socket, timeout: float) -> _Connection:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.settimeout(timeout)
        conn = _Connection(sock)
        try:
            hello = conn.recv(MAX_HELLO_FRAME)
            if len(hello) != 6 + _NONCE_BYTES or hello[:4] != MAGIC:
                raise StoreError(
                    f"the service at {self._where} is not a dpt store (unexpected greeting); "
                    "check MASTER_PORT"
                )
            version, flags = hello[4], hello[5]
            nonce = hello[6:]
            if version != PROTOCOL_VERSION:
                raise StoreAuthError(
                    f"store at {self._where} speaks protocol version {version}, this client "
                    f"{PROTOCOL_VERSION}: use the same dpt version on every rank"
                )
            if flags & _FLAG_AUTH and self._secret is None:
                raise StoreAuthError(
                    f"store at {self._where} refused the connection: wrong or missing secret "
                    f"({SECRET_ENV_VAR}): the server requires a shared secret and this client "
                    "has none"
                )
            mac = hmac.new(self._secret, nonce, hashlib.sha256).digest() if self._secret else b""
            conn.send(_Writer(_OP_HELLO).u8(PROTOCOL_VERSION).blob(mac).payload())
            reply = _Reader(conn.recv(MAX_HELLO_FRAME * 4))
            status = reply.u8()
        except _ProtocolError as exc:
            raise StoreError(
                f"the service at {self._where} is not a dpt store ({exc}); check MASTER_PORT"
            ) from exc
        except (EOFError, OSError) as exc:
            # Transient (the server is starting or closing): the caller retries.
            raise StoreConnectionError(
                f"store at {self._where}: handshake failed ({str(exc) or 'connection closed'})"
            ) from exc
        if status == _ST_OK:
            return conn
        message = "unknown reply"
        try:
            reply.u8()
            message = reply.blob().decode("utf-8", "replace")
        except _ProtocolError:
            pass
        if "secret" in message:
            raise StoreAuthError(
                f"store at {self._where} refused the connection: wrong or missing secret "
                f"({SECRET_ENV_VAR})"
            )
        raise StoreAuthError(f"store at {self._where} refused the connection: {message}")


def _show_keys(keys: Iterable[str]) -> str:
    keys = list(keys) if not isinstance(keys, str) else [keys]
    shown = ", ".join(repr(k) for k in keys[:4])
    return shown + (f", ... ({len(keys)} keys)" if len(keys) > 4 else "")
