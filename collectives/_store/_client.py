"""The store's client, ``TCPStore``: a pool of connections to the server, one per thread.

``TCPStore(..., is_server=True)`` also starts the server (``_server``) in this process.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Iterable
from types import TracebackType

from ._addresses import connect_address, strip_brackets
from ._connection import Connection, Dialer, secret_from
from ._errors import StoreConnectionError, StoreError, StoreLimitError, StoreTimeoutError
from ._server import Server
from ._wire import (
    I64_MAX,
    I64_MIN,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MAX_WAIT_KEYS,
    ErrorKind,
    Op,
    ProtocolError,
    Reader,
    Status,
    Writer,
)

# Extra time a client waits for the server's TIMEOUT reply to a blocking GET/WAIT.
_REPLY_GRACE = 5.0
# After the first connection, new ones (other threads) retry this long at most: the server
# was up, so a refusal now most likely means it is gone and the caller should hear so soon.
_RECONNECT_WINDOW = 2.0
_MAX_IDLE_CONNECTIONS = 8


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
    """A key-value store over TCP for rendezvous (see ``_wire`` for the protocol).

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
            host: the store's host (MASTER_ADDR). The server binds exactly the address it
                names (``localhost``: 127.0.0.1), which must be this host's; the wildcard
                address (every interface) only with a secret.
            port: the store's port (MASTER_PORT); 0 lets the server pick a free one.
            is_server: host the server in this process (rank 0).
            timeout: default timeout in seconds of ``get``/``wait`` and of every reply.
            secret: shared secret the server and every client prove to each other (str is
                taken as UTF-8); default: the ``DPT_STORE_SECRET`` environment variable when
                set and non-empty. An empty secret means none. A client with a secret only
                talks to a server that proves it.
            connect_timeout: how long to retry connecting while the server is not up
                (default: ``timeout``).

        Raises:
            StoreError: the server cannot bind (port taken, address not local, every
                interface without a secret) or a ``DPT_STORE_MAX_*`` variable is invalid.
            StoreTimeoutError: the server could not be reached within ``connect_timeout``.
            StoreAuthError: the server refused this client (wrong or missing secret), or
                did not prove the secret this client has.
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
        self._secret = secret_from(secret)
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()
        self._closed = False
        self._pid = os.getpid()
        self._server: Server | None = None
        connect_host = strip_brackets(host)
        if is_server:
            self._server = Server(host, port, self._secret)
            port = self._server.port
            # Our own client connects to exactly what the server bound.
            connect_host = connect_address(self._server.bind_host)
            # A server dropped without close() stops with its owner, as a client would expect.
            weakref.finalize(self, self._server.close)
        self.port = port
        self._dialer = Dialer(connect_host, port, self._secret, where=self._where)
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
            StoreLimitError: the store is full (its key or byte limit, see ``_limits``).
        """
        payload = Writer(Op.SET).blob(_encode_key(key)).blob(_encode_value(value)).payload()
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
        payload = Writer(Op.GET).blob(_encode_key(key)).f64(wait).payload()
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
        if not I64_MIN <= amount <= I64_MAX:
            raise ValueError(f"add() amount {amount} does not fit in int64")
        payload = Writer(Op.ADD).blob(_encode_key(key)).i64(amount).payload()
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
        payload = Writer(Op.WAIT).keys(raw).f64(wait).payload()
        self._call(f"wait({_show_keys(keys)})", payload, wait, blocking=True).end()

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` exists (does not wait)."""
        payload = Writer(Op.CHECK).keys(self._encode_keys(keys)).payload()
        r = self._call(f"check({_show_keys(keys)})", payload, self.timeout)
        found = r.u8()
        r.end()
        return bool(found)

    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        payload = Writer(Op.DELETE).blob(_encode_key(key)).payload()
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
            Writer(Op.COMPARE_SET)
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
        r = self._call("num_keys()", Writer(Op.NUM_KEYS).payload(), self.timeout)
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

    def _call(self, what: str, payload: bytes, timeout: float, *, blocking: bool = False) -> Reader:
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
                r = Reader(conn.recv())
                status = r.u8()
            except TimeoutError as exc:
                raise StoreTimeoutError(
                    f"store {what}: no reply from the store at {self._where} within "
                    f"{_fmt_s(sock_timeout or 0.0)}"
                ) from exc
            except (EOFError, OSError) as exc:
                raise self._lost(what, exc) from exc
            if status == Status.OK:
                keep = True
                return r
            if status == Status.TIMEOUT:
                keep = True
                missing = r.keys()
                shown = missing[0] if len(missing) == 1 else missing
                raise StoreTimeoutError(
                    f"store {what} timed out after {_fmt_s(timeout)} waiting for "
                    f"key{'s' if len(missing) != 1 else ''} {shown!r} (store at {self._where})"
                )
            if status == Status.ERROR:
                kind, message = r.error()
                if kind == ErrorKind.VALUE:
                    keep = True  # the server keeps this connection open
                    raise ValueError(f"store {what}: {message}")
                if kind == ErrorKind.LIMIT:
                    keep = True
                    raise StoreLimitError(f"store {what} refused by {self._where}: {message}")
                raise StoreError(f"store {what} rejected by {self._where}: {message}")
            raise ProtocolError(f"unknown reply status 0x{status:02x}")
        except ProtocolError as exc:
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
        self._dialer.server_lost = True
        detail = "connection closed" if isinstance(exc, EOFError) else str(exc)
        return StoreConnectionError(
            f"store {what}: lost the connection to the store at {self._where} ({detail}); "
            "did the process hosting it (rank 0) exit?"
        )

    def _acquire(self) -> Connection:
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
        if self._dialer.server_lost:
            conn = self._connect(0.0)  # one attempt: the caller should hear promptly
        else:
            conn = self._connect(min(self.connect_timeout, _RECONNECT_WINDOW))
        with self._lock:
            if self._closed:
                conn.close()
                raise StoreError(f"the store client for {self._where} is closed")
            self._busy.add(conn)
        return conn

    def _release(self, conn: Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
            if not self._closed and len(self._idle) < _MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _discard(self, conn: Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()

    def _connect(self, window: float) -> Connection:
        return self._dialer.connect(window, self.connect_timeout, lambda: self._closed)


def _show_keys(keys: Iterable[str]) -> str:
    keys = list(keys) if not isinstance(keys, str) else [keys]
    shown = ", ".join(repr(k) for k in keys[:4])
    return shown + (f", ... ({len(keys)} keys)" if len(keys) > 4 else "")
