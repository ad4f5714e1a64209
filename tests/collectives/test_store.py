"""Tests for the rendezvous TCP key-value store (the collectives/_store package).

Every server binds a free port (port 0) on loopback. Raw-socket tests speak the wire format
documented in collectives/_store/_wire.py directly (as bytes written out here, not the
package's constants), to check that malformed input only ever costs the sender its own
connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from collectives import _store
from collectives._store import (
    MAX_VALUE_BYTES,
    StoreAuthError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    TCPStore,
    is_local_address,
    is_loopback,
)
from collectives._store import _server as store_server
from collectives.run import free_port

pytestmark = pytest.mark.timeout(30)

LOOPBACK = "127.0.0.1"
# TEST-NET-1 (RFC 5737): never assigned to a real host, so never an address of this machine.
FOREIGN = "192.0.2.1"


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStore]:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    store = TCPStore(LOOPBACK, 0, is_server=True, timeout=10.0)
    yield store
    join_timers()  # before closing: their calls use the store
    store.close()


def client(server: TCPStore, **kwargs: object) -> TCPStore:
    kwargs.setdefault("timeout", 10.0)
    return TCPStore(LOOPBACK, server.port, is_server=False, **kwargs)  # type: ignore[arg-type]


def later(delay: float, fn: Callable[..., object], *args: object) -> None:
    """Call ``fn(*args)`` on another thread after ``delay`` s; the test waits for it to end.

    Joining matters: a call still in flight when a fixture closes the store would fail on
    its thread (and pytest reports that as an error of the test).
    """
    timer = threading.Timer(delay, fn, args=args)
    timer.start()
    _TIMERS.append(timer)


_TIMERS: list[threading.Timer] = []


def join_timers() -> None:
    while _TIMERS:
        _TIMERS.pop().join(10)


def wait_for(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


# ----------------------------------------------------------------------------- semantics


def test_set_get_binary_and_str(server: TCPStore) -> None:
    every_byte = bytes(range(256)) * 3
    server.set("bin", every_byte)
    server.set("empty", b"")
    server.set("text", "héllo ✓")
    server.set("ключ/ü", b"unicode key")
    with client(server) as c:
        assert c.get("bin") == every_byte
        assert c.get("empty") == b""
        assert c.get("text") == "héllo ✓".encode()
        assert c.get("ключ/ü") == b"unicode key"
        c.set("bin", b"overwritten")
        assert server.get("bin") == b"overwritten"
        assert c.num_keys() == 4


def test_large_value_roundtrip(server: TCPStore) -> None:
    value = os.urandom(8 << 20)
    with client(server) as c:
        c.set("big", value)
        assert server.get("big") == value
        assert c.compare_set("big", value, b"small") == b"small"


def test_value_and_key_limits_checked_locally(server: TCPStore) -> None:
    with pytest.raises(ValueError, match="exceeds the limit"):
        server.set("k", b"\0" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(ValueError, match="key"):
        server.set("", b"x")
    with pytest.raises(ValueError, match="key"):
        server.set("k" * 5000, b"x")
    with pytest.raises(TypeError):
        server.set(b"bytes-key", b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        server.set("k", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        server.wait("single-str")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        server.get("k", timeout=-1)
    assert server.num_keys() == 0  # the connection is still fine


def test_get_blocks_until_set(server: TCPStore) -> None:
    with client(server) as c:
        later(0.2, server.set, "late", b"v")
        t0 = time.monotonic()
        assert c.get("late", timeout=5) == b"v"
        assert 0.15 < time.monotonic() - t0 < 3
        later(0.1, server.set, "forever", b"w")
        assert c.get("forever", timeout=math.inf) == b"w"  # inf: no limit


def test_add_semantics(server: TCPStore) -> None:
    assert server.add("n", 5) == 5  # created at 0
    assert server.add("n", -7) == -2
    assert server.add("n", 0) == -2
    assert server.get("n") == b"-2"
    server.set("m", "40")
    assert server.add("m", 2) == 42
    server.set("s", b"not a number")
    with pytest.raises(ValueError, match="not an integer"):
        server.add("s", 1)
    server.set("big", str(2**63 - 1))
    with pytest.raises(ValueError, match="overflows"):
        server.add("big", 1)
    with pytest.raises(ValueError, match="int64"):
        server.add("n", 2**63)
    with pytest.raises(TypeError):
        server.add("n", 1.5)  # type: ignore[arg-type]
    assert server.add("n", 1) == -1  # errors left the connection usable


@pytest.mark.timeout(30)
def test_concurrent_add_exact_count(server: TCPStore) -> None:
    threads_per_client, clients, adds = 4, 4, 50
    stores = [client(server) for _ in range(clients)]
    errors: list[BaseException] = []

    def work(store: TCPStore) -> None:
        try:
            for _ in range(adds):
                store.add("counter", 1)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(s,)) for s in stores for _ in range(threads_per_client)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for s in stores:
        s.close()
    assert not errors
    assert server.add("counter", 0) == threads_per_client * clients * adds


def test_wait_check_delete_num_keys(server: TCPStore) -> None:
    assert not server.check(["a"])
    server.set("a", b"1")
    assert server.check(["a"])
    assert not server.check(["a", "b"])
    later(0.1, server.set, "b", b"2")
    server.wait(["a", "b"], timeout=5)
    assert server.check(["a", "b"])
    assert server.num_keys() == 2
    assert server.delete("a") is True
    assert server.delete("a") is False
    assert not server.check(["a"])
    assert server.num_keys() == 1


def test_wait_for_deleted_then_recreated_key(server: TCPStore) -> None:
    # A wait for [x, y] where x is deleted before y arrives must keep waiting for x.
    server.set("x", b"1")
    done: list[bool] = []
    with client(server) as c:

        def wait() -> None:
            c.wait(["x", "y", "z"], timeout=5)
            done.append(True)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.1)
        server.delete("x")
        server.set("y", b"1")
        server.set("z", b"1")
        time.sleep(0.1)
        assert t.is_alive()  # x is missing again
        server.set("x", b"again")
        t.join(5)
        assert done == [True]


def test_compare_set(server: TCPStore) -> None:
    # A missing key holds b"": expected=b"" creates it.
    assert server.compare_set("k", b"", b"first") == b"first"
    assert server.compare_set("k", b"", b"second") == b"first"  # not b"" any more
    assert server.compare_set("k", b"wrong", b"second") == b"first"
    assert server.compare_set("k", b"first", b"second") == b"second"
    assert server.get("k") == b"second"
    assert server.compare_set("missing", b"x", b"y") == b""
    assert not server.check(["missing"])


def test_compare_set_wakes_waiters(server: TCPStore) -> None:
    with client(server) as c:
        later(0.1, server.compare_set, "cas", b"", b"v")
        assert c.get("cas", timeout=5) == b"v"


# ----------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("timeout", [0.0, 0.3])
def test_get_timeout_names_key_and_wait(server: TCPStore, timeout: float) -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        server.get("never/set", timeout=timeout)
    elapsed = time.monotonic() - t0
    assert timeout <= elapsed + 0.01 < timeout + 2.0
    msg = str(info.value)
    assert "'never/set'" in msg and f"{timeout:g} s" in msg
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RuntimeError)
    server.set("after", b"ok")  # the connection is still usable
    assert server.get("after") == b"ok"


def test_default_timeout_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    with TCPStore(LOOPBACK, 0, is_server=True, timeout=0.2) as s:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=r"0\.2 s"):
            s.get("nope")
        assert time.monotonic() - t0 < 2.0


def test_wait_timeout_names_only_missing_keys(server: TCPStore) -> None:
    server.set("here", b"1")
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        server.wait(["here", "gone1", "gone2"], timeout=0.3)
    assert time.monotonic() - t0 < 2.3
    msg = str(info.value)
    assert "'gone1'" in msg and "'gone2'" in msg and "0.3 s" in msg
    assert "['gone1', 'gone2']" in msg  # the missing ones, not 'here'


def test_blocked_get_does_not_block_others(server: TCPStore) -> None:
    # One client parked in get(); other clients, and other threads of the same store object,
    # are served meanwhile.
    waiter = client(server)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(waiter.get("slow", timeout=10)))
    t.start()
    time.sleep(0.1)
    other = client(server)
    t0 = time.monotonic()
    for i in range(20):
        other.set(f"k{i}", b"v")
        assert waiter.get(f"k{i}") == b"v"  # same object as the parked get, other thread
    assert time.monotonic() - t0 < 2.0
    other.set("slow", b"done")
    t.join(5)
    assert got == [b"done"]
    waiter.close()
    other.close()


@pytest.mark.timeout(30)
def test_many_concurrent_clients(server: TCPStore) -> None:
    n = 64
    errors: list[BaseException] = []
    ready = threading.Barrier(n)

    def rank(i: int) -> None:
        try:
            with client(server) as c:
                ready.wait(10)
                c.set(f"rank/{i}", str(i))
                c.add("joined", 1)
                c.wait([f"rank/{j}" for j in range(n)], timeout=10)
                assert c.get(f"rank/{(i + 1) % n}") == str((i + 1) % n).encode()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors[:3]
    assert server.add("joined", 0) == n


# ----------------------------------------------------------------------------- connecting


def test_client_retries_until_server_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    port = free_port(LOOPBACK)
    servers: list[TCPStore] = []
    timer = threading.Timer(
        0.5, lambda: servers.append(TCPStore(LOOPBACK, port, is_server=True, timeout=10))
    )
    timer.start()
    t0 = time.monotonic()
    try:
        with TCPStore(LOOPBACK, port, is_server=False, timeout=10, connect_timeout=8) as c:
            assert time.monotonic() - t0 >= 0.4
            c.set("hello", b"world")
            assert wait_for(lambda: bool(servers))
            assert servers[0].get("hello") == b"world"
    finally:
        timer.join()
        for s in servers:
            s.close()


def test_unreachable_store_fails_within_connect_timeout() -> None:
    port = free_port(LOOPBACK)  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        TCPStore(LOOPBACK, port, is_server=False, timeout=60, connect_timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.4 < elapsed < 3.0
    msg = str(info.value)
    assert f"{LOOPBACK}:{port}" in msg and "unreachable" in msg and "tried for" in msg
    assert isinstance(info.value, StoreError)


@contextlib.contextmanager
def scripted_server(script: Callable[[socket.socket], None]) -> Iterator[int]:
    """Serve one connection on loopback with ``script(conn)``; yield the port."""
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen()

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                script(conn)

        t = threading.Thread(target=serve)
        t.start()
        try:
            yield listener.getsockname()[1]
        finally:
            t.join()


def test_not_a_store_is_reported() -> None:
    # Something else listens on the port and greets with something that is not our hello.
    def greet_as_ssh(conn: socket.socket) -> None:
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        time.sleep(0.05)

    with (
        scripted_server(greet_as_ssh) as port,
        pytest.raises(StoreError, match="not a dpt store"),
    ):
        TCPStore(LOOPBACK, port, is_server=False, connect_timeout=5)


def test_port_already_taken_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    with socket.socket() as other:
        other.bind((LOOPBACK, 0))
        other.listen()
        port = other.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            TCPStore(LOOPBACK, port, is_server=True, timeout=60)
        assert time.monotonic() - t0 < 2.0
        msg = str(info.value)
        assert str(port) in msg and "already in use" in msg and "MASTER_PORT" in msg
    with TCPStore(LOOPBACK, 0, is_server=True) as first:
        with pytest.raises(StoreError, match="already in use"):
            TCPStore(LOOPBACK, first.port, is_server=True)
        first.set("still", b"fine")
        assert first.get("still") == b"fine"


def test_binds_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    for host in ("127.0.0.1", "localhost"):
        with TCPStore(host, 0, is_server=True) as s:
            assert s.server_address is not None
            addr, port = s.server_address
            assert addr == "127.0.0.1" and port == s.port
            with client(s) as c:
                c.set("x", b"1")
    with TCPStore(LOOPBACK, 0, is_server=True) as s, client(s) as c:
        assert c.server_address is None and not c.is_server


def test_refuses_to_host_on_a_foreign_address() -> None:
    with pytest.raises(StoreError, match="not an address of this machine") as info:
        TCPStore(FOREIGN, 0, is_server=True)
    assert "MASTER_ADDR" in str(info.value)


def test_address_helpers() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("localhost")
    assert is_loopback("::1") and is_loopback("[::1]")
    assert not is_loopback(FOREIGN) and not is_loopback("no-such-host.invalid")
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address(FOREIGN)
    assert not is_local_address("no-such-host.invalid")
    assert is_local_address(socket.gethostname())


def test_client_port_zero_and_bad_port_rejected() -> None:
    with pytest.raises(ValueError, match="port 0"):
        TCPStore(LOOPBACK, 0, is_server=False)
    with pytest.raises(ValueError, match=r"0\.\.65535"):
        TCPStore(LOOPBACK, 70000, is_server=True)


# ----------------------------------------------------------------------------- secret


def test_right_secret_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    with (
        TCPStore(LOOPBACK, 0, is_server=True, secret=b"s3cret") as s,
        client(s, secret=b"s3cret") as c,
    ):
        c.set("k", b"v")
        assert s.get("k") == b"v"


@pytest.mark.parametrize("secret", [None, b"wrong"], ids=["missing", "wrong"])
def test_bad_secret_refused_and_server_keeps_serving(
    monkeypatch: pytest.MonkeyPatch, secret: bytes | None
) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    with TCPStore(LOOPBACK, 0, is_server=True, secret=b"s3cret") as s:
        t0 = time.monotonic()
        with pytest.raises(StoreAuthError) as info:
            client(s, secret=secret, connect_timeout=5)
        assert time.monotonic() - t0 < 2.0  # refused, not retried until the timeout
        msg = str(info.value)
        assert "refused the connection" in msg and "wrong or missing secret" in msg
        assert "DPT_STORE_SECRET" in msg
        with client(s, secret=b"s3cret") as good:
            good.set("after", b"ok")
            assert s.get("after") == b"ok"


def test_raw_wrong_mac_gets_error_frame_and_close(monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's own check (not only the client's): a forged answer is refused.
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    with TCPStore(LOOPBACK, 0, is_server=True, secret=b"s3cret") as s:
        with RawPeer(s.port) as raw:
            assert raw.flags & 1  # auth required
            raw.send_frame(hello(proof(b"guess", b"client", raw.nonce)))
            reply = raw.recv_frame()
            assert reply[0] == 0x02 and b"wrong or missing secret" in reply
            assert raw.closed_by_server()
        with RawPeer(s.port) as raw:  # the server's own proof, reflected, is no client's
            raw.send_frame(hello(proof(b"s3cret", b"server", raw.nonce)))
            assert b"wrong or missing secret" in raw.recv_frame()
        with RawPeer(s.port) as raw:  # a correct answer from a raw client is accepted
            raw.send_frame(hello(proof(b"s3cret", b"client", raw.nonce)))
            # ... and the server proves the secret back, bound to both nonces.
            assert raw.recv_frame() == b"\x00" + blob(proof(b"s3cret", b"server", raw.nonce))
        assert s.num_keys() == 0


def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_store.SECRET_ENV_VAR, "from-env")
    with TCPStore(LOOPBACK, 0, is_server=True) as s:
        with client(s) as c:  # also reads the variable
            c.set("k", b"v")
        monkeypatch.delenv(_store.SECRET_ENV_VAR)
        with pytest.raises(StoreAuthError, match="DPT_STORE_SECRET"):
            client(s, connect_timeout=2)
        with client(s, secret=b"from-env") as c:
            assert c.get("k") == b"v"


REFUSALS: dict[str, tuple[int, int, str, str, bytes | None]] = {
    # name: (greeting flags, error kind, server's message, what the client's error says,
    # the client's secret)
    "refused-secret": (1, 2, "no", "wrong or missing secret (DPT_STORE_SECRET)", b"s3cret"),
    "refused-version": (0, 2, "protocol version 1 not supported", "version 1 not supported", None),
    "malformed-naming-secret": (
        1,
        1,
        "secret field truncated",
        ": secret field truncated",
        b"s3cret",
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_handshake_refusal_is_classified_by_its_kind(name: str) -> None:
    # A scripted server refuses the HELLO: the client reads the error kind, not the message.
    flags, kind, message, expected, secret = REFUSALS[name]

    def refuse(conn: socket.socket) -> None:
        greeting = b"DPTS" + bytes([_store.PROTOCOL_VERSION, flags]) + b"\0" * 32
        conn.sendall(blob(greeting))
        conn.recv(4096)  # the client's HELLO
        conn.sendall(blob(b"\x02" + bytes([kind]) + blob(message.encode())))

    with scripted_server(refuse) as port, pytest.raises(StoreAuthError) as info:
        TCPStore(LOOPBACK, port, is_server=False, secret=secret, connect_timeout=5)
    msg = str(info.value)
    assert "refused the connection" in msg and expected in msg
    if name != "refused-secret":
        assert "wrong or missing secret" not in msg


# ----------------------------------------------------------------------------- malformed frames


class RawPeer:
    """A bare socket speaking (or abusing) the store's wire format."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((LOOPBACK, port), timeout=5)
        greeting = self.recv_frame()
        assert greeting[:4] == b"DPTS"
        self.version, self.flags, self.nonce = greeting[4], greeting[5], greeting[6:]

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send_frame(self, payload: bytes) -> None:
        self.sock.sendall(struct.pack(">I", len(payload)) + payload)

    def recv_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def recv_frame(self) -> bytes:
        (n,) = struct.unpack(">I", self.recv_exact(4))
        return self.recv_exact(n)

    def authenticate(self) -> None:
        self.send_frame(hello(b""))
        assert self.recv_frame() == b"\x00" + blob(b"")  # OK, and no proof without a secret

    def closed_by_server(self) -> bool:
        """True once the server has closed this connection (after any error frame)."""
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False


# The raw client's nonce in every HELLO (a real client draws a fresh one).
CLIENT_NONCE = bytes(range(32))


def hello(proof: bytes) -> bytes:
    """HELLO: opcode, version, the client's nonce, its proof of the secret."""
    return bytes([0x01, _store.PROTOCOL_VERSION]) + blob(CLIENT_NONCE) + blob(proof)


def proof(secret: bytes, side: bytes, server_nonce: bytes) -> bytes:
    """What ``side`` (b"client" or b"server") proves the secret with: an HMAC bound to its
    direction and to both nonces."""
    label = b"dpt-store v2 " + side
    return hmac.new(secret, label + server_nonce + CLIENT_NONCE, hashlib.sha256).digest()


def blob(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


MALFORMED: dict[str, tuple[bool, bytes]] = {
    # name: (authenticate first, raw bytes sent)
    "oversize-length-before-auth": (False, struct.pack(">I", 10_000) + b"x" * 100),
    "oversize-length": (True, struct.pack(">I", 0xFFFFFFFF) + b"x" * 100),
    "zero-length": (True, struct.pack(">I", 0)),
    "garbage-before-auth": (False, b"\xde\xad\xbe\xef" * 16),
    "garbage-text": (True, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
    "unknown-opcode": (True, struct.pack(">I", 3) + b"\x7f\x00\x00"),
    "request-before-hello": (False, struct.pack(">I", 1) + b"\x09"),
    "truncated-fields": (True, struct.pack(">I", 6) + b"\x02" + struct.pack(">I", 50) + b"k"),
    "trailing-bytes": (True, blob(b"\x09extra")),
    "bad-utf8-key": (True, blob(b"\x02" + blob(b"\xff\xfe") + blob(b"v"))),
    "empty-key": (True, blob(b"\x02" + blob(b"") + blob(b"v"))),
    "key-too-long": (True, blob(b"\x02" + blob(b"k" * 5000) + blob(b"v"))),
    "negative-timeout": (True, blob(b"\x03" + blob(b"k") + struct.pack(">d", -1.0))),
    "nan-timeout": (True, blob(b"\x03" + blob(b"k") + struct.pack(">d", float("nan")))),
    "zero-wait-keys": (True, blob(b"\x05" + struct.pack(">I", 0) + struct.pack(">d", 1.0))),
    "wrong-version": (False, blob(bytes([0x01, 99]) + blob(b""))),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_frame_drops_only_that_connection(server: TCPStore, name: str) -> None:
    authenticate, data = MALFORMED[name]
    server.set("before", b"1")
    with client(server) as bystander:  # connected before, must survive
        with RawPeer(server.port) as raw:
            if authenticate:
                raw.authenticate()
            raw.sock.sendall(data)
            assert raw.closed_by_server(), f"{name}: the server kept the connection"
        assert bystander.get("before") == b"1"
        bystander.set("after", b"2")
    with client(server) as fresh:  # and new clients are served
        assert fresh.get("after") == b"2"


def test_truncated_frame_then_disconnect(server: TCPStore) -> None:
    with RawPeer(server.port) as raw:
        raw.authenticate()
        raw.sock.sendall(struct.pack(">I", 1000) + b"\x02partial")  # then hang up mid-frame
    with RawPeer(server.port) as raw:
        raw.sock.sendall(b"\x00\x00")  # half a length prefix
    assert wait_for(lambda: server.num_keys() == 0)
    server.set("ok", b"1")
    assert server.get("ok") == b"1"


def test_silent_peer_dropped_after_handshake_timeout(
    server: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A connection that never answers the hello cannot hold a slot forever. The server reads
    # its module's constant when a peer connects, so patching it affects only new peers.
    monkeypatch.setattr(store_server, "_HANDSHAKE_TIMEOUT", 0.2)
    with RawPeer(server.port) as raw:
        reply = raw.recv_frame()
        assert reply[0] == 0x02 and b"handshake not completed" in reply
        assert raw.closed_by_server()
    server.set("k", b"v")
    assert server.get("k") == b"v"


def test_error_frame_explains_the_drop(server: TCPStore) -> None:
    with RawPeer(server.port) as raw:
        raw.authenticate()
        raw.send_frame(b"\x7f")
        reply = raw.recv_frame()
        assert reply[0] == 0x02 and b"unknown opcode 0x7f" in reply
        assert raw.closed_by_server()


def test_client_abandoning_a_parked_get_is_cleaned_up(server: TCPStore) -> None:
    with RawPeer(server.port) as raw:
        raw.authenticate()
        raw.send_frame(b"\x03" + blob(b"parked") + struct.pack(">d", float("inf")))
        time.sleep(0.1)
    # The server noticed the hang-up: setting the key must not try to answer it.
    server.set("parked", b"v")
    assert server.get("parked") == b"v"


def test_pipelined_requests_are_answered_in_order(server: TCPStore) -> None:
    with RawPeer(server.port) as raw:
        raw.authenticate()
        frames = [
            b"\x03" + blob(b"p") + struct.pack(">d", 5.0),  # parks until p exists
            b"\x04" + blob(b"n") + struct.pack(">q", 3),  # queued behind the parked get
        ]
        raw.sock.sendall(b"".join(struct.pack(">I", len(f)) + f for f in frames))
        time.sleep(0.1)
        server.set("p", b"value")
        assert raw.recv_frame() == b"\x00" + blob(b"value")
        assert raw.recv_frame() == b"\x00" + struct.pack(">q", 3)


# ----------------------------------------------------------------------------- failures


SERVER_SCRIPT = """
import importlib.util, os, sys, time
package = sys.argv[1]
spec = importlib.util.spec_from_file_location(
    "dpt_store", os.path.join(package, "__init__.py"), submodule_search_locations=[package]
)
mod = importlib.util.module_from_spec(spec)
sys.modules["dpt_store"] = mod
spec.loader.exec_module(mod)
store = mod.TCPStore("127.0.0.1", 0, is_server=True, timeout=60)
print(store.port, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(30)
def test_server_process_dying_fails_waiting_client_fast() -> None:
    env = {k: v for k, v in os.environ.items() if k != _store.SECRET_ENV_VAR}
    # Load the store package by path: the subprocess needs nothing else of collectives.
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(Path(_store.__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with TCPStore(LOOPBACK, port, is_server=False, timeout=60) as c:
            c.set("alive", b"1")
            errors: list[BaseException] = []
            done = threading.Event()

            def waiting() -> None:
                try:
                    c.get("never", timeout=60)
                except BaseException as exc:
                    errors.append(exc)
                done.set()

            t = threading.Thread(target=waiting)
            t.start()
            time.sleep(0.2)
            t0 = time.monotonic()
            proc.kill()
            assert done.wait(10), "the waiting client hung after the server died"
            assert time.monotonic() - t0 < 3.0
            t.join()
            assert len(errors) == 1 and isinstance(errors[0], StoreConnectionError)
            msg = str(errors[0])
            assert "get('never')" in msg and "lost the connection" in msg
            assert f"{LOOPBACK}:{port}" in msg
            # The next call fails promptly too (no retry for the full connect timeout).
            t0 = time.monotonic()
            with pytest.raises(StoreConnectionError, match="is gone"):
                c.get("alive")
            assert time.monotonic() - t0 < 1.0
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_server_close_fails_waiting_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    s = TCPStore(LOOPBACK, 0, is_server=True, timeout=30)
    c = client(s)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(errors, c.get, "never"))
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    s.close()
    t.join(5)
    assert time.monotonic() - t0 < 3.0
    assert len(errors) == 1 and isinstance(errors[0], StoreConnectionError)
    c.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads, 3.12+
def test_forked_child_uses_its_own_connections(server: TCPStore) -> None:
    server.set("a", b"1")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            server.set("child", b"2")
            code = 0 if server.get("a") == b"1" else 3
            server.close()  # must not stop the parent's server or cut its connections
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert server.get("child") == b"2"
    with client(server) as c:
        assert c.get("a") == b"1"


def test_closed_store_raises(server: TCPStore) -> None:
    c = client(server)
    c.close()
    c.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        c.set("k", b"v")
    assert "closed" in repr(c)


def test_close_wakes_own_blocked_thread(server: TCPStore) -> None:
    c = client(server)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(errors, c.get, "never"))
    t.start()
    time.sleep(0.1)
    c.close()
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StoreError)


def _catch(errors: list[BaseException], fn: object, *args: object) -> None:
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as exc:
        errors.append(exc)
