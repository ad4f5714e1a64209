"""The rendezvous store under attack and misconfiguration, with real processes.

Each test runs the store server, a fake server or a tampering relay in its own subprocess
(plain socket scripts written out here), and talks to it from the test process with a hard
time limit on everything: the bind address it was given (127.0.0.2, 127.0.1.1), the wildcard
address without a secret, a server that cannot prove the secret, a relay that rewrites
frames, floods of idle connections, and clients that grow the key space or never read
their replies.
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectives import _store
from collectives._store import (
    StoreAuthError,
    StoreError,
    StoreLimitError,
    TCPStore,
    _addresses,
    is_local_address,
)
from collectives._store._wire import ProtocolError, session_seal
from tests.collectives.harness import leaked_segments
from tests.helpers import run_to_end

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
PACKAGE = str(Path(_store.__file__).parent)
SECRET = "s3cret-for-tests"

# A store server in its own process, loaded by path (it needs nothing else of collectives).
# It prints its port, then serves until the test closes its stdin.
STORE_SERVER = """
import importlib.util, os, resource, sys
package, host = sys.argv[1], sys.argv[2]
nofile = int(os.environ.get("TEST_NOFILE", "0"))
if nofile:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
spec = importlib.util.spec_from_file_location(
    "dpt_store", os.path.join(package, "__init__.py"), submodule_search_locations=[package]
)
mod = importlib.util.module_from_spec(spec)
sys.modules["dpt_store"] = mod
spec.loader.exec_module(mod)
store = mod.TCPStore(host, 0, is_server=True, timeout=30)
store.set("seed", b"from the server")
print(store.port, flush=True)
sys.stdin.read()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPT_STORE_")}
    env.update(extra)
    return env


def _read_line(proc: subprocess.Popen[str], timeout: float = 10.0) -> str:
    """The first line ``proc`` prints, within ``timeout`` (its stderr if it dies instead)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no line from pid {proc.pid} within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        proc.wait(5)
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"pid {proc.pid} exited {proc.returncode} first:\n{err}")
    return line.strip()


@contextlib.contextmanager
def child(script: str, *args: str, **env: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Run ``script`` in a subprocess; yield it and the port it prints; end it afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(**env),
    )
    try:
        yield proc, int(_read_line(proc))
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


def store_process(
    host: str = "127.0.0.1", **env: str
) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[str], int]]:
    return child(STORE_SERVER, PACKAGE, host, **env)


def elapsed_since(t0: float) -> float:
    return time.monotonic() - t0


# ----------------------------------------------------------------------------- item 9: bind


def _loopbacks() -> list[str]:
    # 127.0.1.1 is what Debian and Ubuntu map the host name to.
    return [a for a in ("127.0.0.2", "127.0.1.1") if is_local_address(a)]


def _listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs process ``pid`` listens on over IPv4 (Linux's /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            addr, port = fields[1].split(":")
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ip = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
                out.add((ip, int(port, 16)))
    return out


@pytest.mark.parametrize("host", _loopbacks())
def test_server_binds_exactly_the_loopback_address_given(host: str) -> None:
    with store_process(host) as (proc, port):
        t0 = time.monotonic()
        with TCPStore(host, port, is_server=False, timeout=5, connect_timeout=3) as c:
            assert c.get("seed") == b"from the server"
        assert elapsed_since(t0) < 2.0
        # Exactly that address, not 0.0.0.0 nor 127.0.0.1 too. Asked of the server's own
        # sockets: a connect to 127.0.0.1:port may meet another process's listener there.
        assert _listening(proc.pid) == {(host, port)}


def test_loopback_name_binds_the_address_it_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    # A host name that maps to 127.0.1.1 (Debian's /etc/hosts): bind what peers will dial.
    real = _addresses._resolve
    monkeypatch.setattr(
        _addresses, "_resolve", lambda h: ["127.0.1.1"] if h == "myhost" else real(h)
    )
    assert _addresses.bind_address("myhost") == "127.0.1.1"
    assert _addresses.bind_address("localhost") == "127.0.0.1"
    assert _addresses.bind_address("127.0.0.2") == "127.0.0.2"
    assert _addresses.bind_address("[::1]") == "::1"


WORKER = """
import os, sys, time
import numpy as np
import collectives as dist
here = os.path.dirname(os.path.abspath(__file__))
t0 = time.monotonic()
group = dist.init_process_group("cpu", timeout=5)
x = np.full(4, float(group.rank + 1))
dist.all_reduce(x)
assert x.tolist() == [3.0] * 4, x
with open(os.path.join(here, f"rank{group.rank}"), "w") as f:
    f.write(os.environ["DPT_RUN_ID"] + " " + os.environ["MASTER_ADDR"])
dist.destroy_process_group()
print(f"rank {group.rank} joined in {time.monotonic() - t0:.2f} s", flush=True)
"""


def _job(
    tmp_path: Path, master_addr: str, timeout: float = 30, **env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "worker.py").write_text(WORKER)
    full = _env(**env)
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")])
    full["CUDA_VISIBLE_DEVICES"] = ""
    full["TMPDIR"] = str(tmp_path)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        full.pop(key, None)
    cmd = [sys.executable, "-m", "collectives.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", master_addr, "--grace-period", "1", "worker.py"]
    t0 = time.monotonic()
    res = run_to_end(cmd, full, timeout=timeout, cwd=tmp_path)
    return res, elapsed_since(t0)


def _no_leaks(tmp_path: Path) -> None:
    for name in ("rank0", "rank1"):
        path = tmp_path / name
        if path.exists():
            run_id = path.read_text().split()[0]
            assert leaked_segments(run_id) == []


@pytest.mark.parametrize("host", _loopbacks())
def test_two_rank_job_on_another_loopback_address(tmp_path: Path, host: str) -> None:
    res, took = _job(tmp_path, host)
    _no_leaks(tmp_path)
    assert res.returncode == 0, res.stderr
    assert took < 10.0, f"the job took {took:.1f} s"
    assert (tmp_path / "rank1").read_text().split()[1] == host


# ----------------------------------------------------------------------------- item 10: 0.0.0.0


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_wildcard_without_a_secret_is_refused(
    wildcard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    t0 = time.monotonic()
    with pytest.raises(StoreError) as info:
        TCPStore(wildcard, 0, is_server=True, timeout=5)
    assert elapsed_since(t0) < 1.0
    msg = str(info.value)
    assert "every interface" in msg and "DPT_STORE_SECRET" in msg and "MASTER_ADDR" in msg


def test_wildcard_with_a_secret_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    with TCPStore("0.0.0.0", 0, is_server=True, timeout=5, secret=SECRET) as s:
        assert s.server_address == ("0.0.0.0", s.port)
        with TCPStore("127.0.0.1", s.port, is_server=False, timeout=5, secret=SECRET) as c:
            c.set("k", b"v")
            assert s.get("k") == b"v"


def test_job_on_wildcard_fails_fast_without_secret_and_runs_with_one(tmp_path: Path) -> None:
    res, took = _job(tmp_path, "0.0.0.0")
    _no_leaks(tmp_path)
    assert res.returncode != 0, "the job ran on 0.0.0.0 without a secret"
    assert took < 10.0, f"the job took {took:.1f} s to fail"
    assert "every interface" in res.stderr and "DPT_STORE_SECRET" in res.stderr
    res, took = _job(tmp_path, "0.0.0.0", DPT_STORE_SECRET=SECRET)
    _no_leaks(tmp_path)
    assert res.returncode == 0, res.stderr
    assert took < 10.0


def _non_loopback_local_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_network_address_without_a_secret_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    addr = _non_loopback_local_address()
    if addr is None:
        pytest.skip("this host has no non-loopback address")
    monkeypatch.delenv(_store.SECRET_ENV_VAR, raising=False)
    with pytest.warns(RuntimeWarning, match="DPT_STORE_SECRET"), TCPStore(addr, 0, is_server=True):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TCPStore(addr, 0, is_server=True, secret=SECRET):
            pass


# ----------------------------------------------------------------------------- item 11: mutual


# A fake store: greets like one, then answers every request with a forged OK. MODE says
# what it does with the handshake. argv: the protocol version to greet with, MODE.
FAKE_SERVER = r"""
import os, socket, struct, sys, threading
version, mode = int(sys.argv[1]), sys.argv[2]
def recv_exact(c, n):
    b = b""
    while len(b) < n:
        k = c.recv(n - len(b))
        if not k:
            raise EOFError
        b += k
    return b
def recv_frame(c):
    return recv_exact(c, struct.unpack(">I", recv_exact(c, 4))[0])
def send_frame(c, p):
    c.sendall(struct.pack(">I", len(p)) + p)
def blob(b):
    return struct.pack(">I", len(b)) + b
def blobs(p, pos):
    out = []
    while pos < len(p):
        n = struct.unpack(">I", p[pos:pos + 4])[0]
        out.append(p[pos + 4:pos + 4 + n])
        pos += 4 + n
    return out
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen()
def serve(c):
    try:
        flags = 0 if mode == "no-secret-needed" else 1
        send_frame(c, b"DPTS" + bytes([version, flags]) + os.urandom(32))
        fields = blobs(recv_frame(c), 2)
        proof = {
            "no-secret-needed": b"",
            "no-proof": b"",
            "wrong-proof": os.urandom(32),
            "reflected-proof": fields[-1] if fields else b"",
        }[mode]
        send_frame(c, b"\x00" + blob(proof))
        while True:
            recv_frame(c)
            send_frame(c, b"\x00" + blob(b"forged rendezvous data"))
    except (EOFError, OSError):
        pass
    finally:
        c.close()
def accept():
    while True:
        threading.Thread(target=serve, args=(lst.accept()[0],), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
print(lst.getsockname()[1], flush=True)
sys.stdin.read()  # serve until the test closes stdin
"""

FAKES = ["no-secret-needed", "no-proof", "wrong-proof", "reflected-proof"]


@pytest.mark.parametrize("mode", FAKES)
def test_client_with_a_secret_refuses_a_server_that_cannot_prove_it(mode: str) -> None:
    with child(FAKE_SERVER, str(_store.PROTOCOL_VERSION), mode) as (_, port):
        t0 = time.monotonic()
        with pytest.raises(StoreAuthError) as info:
            c = TCPStore("127.0.0.1", port, is_server=False, secret=SECRET, connect_timeout=5)
            try:  # before the fix the client got this far: what does it believe?
                pytest.fail(f"the client trusted the fake server: get -> {c.get('k')!r}")
            finally:
                c.close()
        took = elapsed_since(t0)
        assert took < 1.0, f"refused only after {took:.1f} s"
        msg = str(info.value)
        assert f"127.0.0.1:{port}" in msg and "DPT_STORE_SECRET" in msg
        assert "prove" in msg


# A relay between clients and the store that rewrites one byte string in one direction.
RELAY = r"""
import socket, sys, threading
upstream, direction = int(sys.argv[1]), sys.argv[2]
old, new = b"genuine-value", b"forged--value"
def pump(src, dst, rewrite):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data.replace(old, new) if rewrite else data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen()
def accept():
    while True:
        c, _ = lst.accept()
        u = socket.create_connection(("127.0.0.1", upstream))
        threading.Thread(target=pump, args=(c, u, direction == "to-server"), daemon=True).start()
        threading.Thread(target=pump, args=(u, c, direction == "to-client"), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
print(lst.getsockname()[1], flush=True)
sys.stdin.read()  # relay until the test closes stdin
"""


@pytest.mark.parametrize("direction", ["to-client", "to-server"])
def test_a_relay_that_rewrites_frames_is_caught(direction: str) -> None:
    with (
        store_process(DPT_STORE_SECRET=SECRET) as (_, port),
        child(RELAY, str(port), direction) as (_, relay_port),
        TCPStore("127.0.0.1", port, is_server=False, secret=SECRET, timeout=5) as direct,
    ):
        if direction == "to-client":
            direct.set("k", b"genuine-value")
        via = TCPStore("127.0.0.1", relay_port, is_server=False, secret=SECRET, timeout=5)
        t0 = time.monotonic()
        try:
            with pytest.raises(StoreError, match="integrity") as info:
                if direction == "to-client":
                    pytest.fail(f"the client believed the relay: {via.get('k')!r}")
                else:
                    via.set("k", b"genuine-value")
                    via.num_keys()  # the server dropped the connection: this call says why
        finally:
            via.close()
        assert elapsed_since(t0) < 1.0
        assert f"127.0.0.1:{relay_port}" in str(info.value)
        # The store holds no forged value and keeps serving.
        if direction == "to-server":
            assert not direct.check(["k"])
        else:
            assert direct.get("k") == b"genuine-value"


def test_sealed_frames_replayed_reordered_or_reflected_fail() -> None:
    # The two ends of one connection: what the relay tests do to bytes, done to whole frames.
    sn, cn = os.urandom(32), os.urandom(32)
    client = session_seal(SECRET.encode(), sn, cn, server=False)
    server = session_seal(SECRET.encode(), sn, cn, server=True)
    first, second = b"set a", b"set b"
    t1, t2 = client.tag(first), client.tag(second)
    server.check(first, t1)
    with pytest.raises(ProtocolError, match="integrity"):
        server.check(first, t1)  # replayed (and, as the next expected frame, reordered)
    other = session_seal(SECRET.encode(), sn, cn, server=True)
    with pytest.raises(ProtocolError, match="integrity"):
        other.check(second, t2)  # the first frame dropped
    reply = server.tag(b"ok")
    with pytest.raises(ProtocolError, match="integrity"):
        session_seal(SECRET.encode(), sn, cn, server=True).check(b"ok", reply)  # reflected back
    with pytest.raises(ProtocolError, match="integrity"):  # another connection's nonces
        session_seal(SECRET.encode(), sn, os.urandom(32), server=True).check(first, t1)


# ----------------------------------------------------------------------------- item 12: limits


def _open_idle(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        socks.append(s)
    return socks


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "secret"])
def test_idle_connections_cannot_lock_ranks_out(secret: str | None) -> None:
    # The server process has 256 file descriptors; 500 idle connections would take them all.
    env = {"TEST_NOFILE": "256"}
    if secret:
        env["DPT_STORE_SECRET"] = secret
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 700:
        pytest.skip(f"the test process needs 700 file descriptors, has {soft}")
    with store_process(**env) as (proc, port):
        idle = _open_idle(port, 500)
        try:
            t0 = time.monotonic()
            with TCPStore(
                "127.0.0.1", port, is_server=False, secret=secret, timeout=5, connect_timeout=5
            ) as c:
                assert c.get("seed") == b"from the server"
                c.set("after", b"flood")
            took = elapsed_since(t0)
            assert took < 2.0, f"a legitimate client waited {took:.1f} s"
        finally:
            for s in idle:
                s.close()
        assert proc.poll() is None


def test_a_burst_of_ranks_over_the_pending_cap_all_get_in() -> None:
    # Dropping the oldest pending handshake must not cost a real rank its place: a dropped
    # client retries. 64 clients at once against a cap of 4.
    errors: list[BaseException] = []

    def join(port: int) -> None:
        try:
            with TCPStore(
                "127.0.0.1", port, is_server=False, secret=SECRET, timeout=5, connect_timeout=10
            ) as c:
                c.add("joined", 1)
        except BaseException as exc:
            errors.append(exc)

    with store_process(DPT_STORE_MAX_PENDING="4", DPT_STORE_SECRET=SECRET) as (_, port):
        threads = [threading.Thread(target=join, args=(port,)) for _ in range(64)]
        t0 = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join(15)
        assert errors == []
        assert elapsed_since(t0) < 10.0
        with TCPStore("127.0.0.1", port, is_server=False, secret=SECRET, timeout=5) as c:
            assert c.add("joined", 0) == 64


def test_key_count_cap_is_a_clear_error_and_others_are_served() -> None:
    with (
        store_process(DPT_STORE_MAX_KEYS="1000") as (_, port),
        TCPStore("127.0.0.1", port, is_server=False, timeout=5) as greedy,
        TCPStore("127.0.0.1", port, is_server=False, timeout=5) as other,
    ):
        t0 = time.monotonic()
        with pytest.raises(StoreLimitError) as info:
            for i in range(2000):
                greedy.set(f"key/{i}", b"x")
        assert elapsed_since(t0) < 10.0
        msg = str(info.value)
        assert "1000 keys" in msg and "DPT_STORE_MAX_KEYS" in msg
        assert greedy.num_keys() == 1000  # the seed + 999 of its own
        # Overwriting and deleting still work; deleting makes room.
        greedy.set("key/0", b"overwritten")
        assert other.get("key/0") == b"overwritten"
        assert other.delete("key/1")
        other.set("room", b"made")
        assert other.get("seed") == b"from the server"
        with pytest.raises(StoreLimitError):
            other.add("counter", 1)


def test_total_bytes_cap_is_a_clear_error() -> None:
    with (
        store_process(DPT_STORE_MAX_BYTES=str(1 << 20)) as (_, port),
        TCPStore("127.0.0.1", port, is_server=False, timeout=5) as c,
    ):
        value = b"v" * (64 << 10)
        with pytest.raises(StoreLimitError) as info:
            for i in range(40):
                c.set(f"big/{i}", value)
        assert "DPT_STORE_MAX_BYTES" in str(info.value)
        assert i == 15  # the 16th 64 KiB value (plus keys and the seed) is over 1 MiB
        assert c.compare_set("big/0", value, b"small") == b"small"  # shrinking is fine
        c.set("big/15", value)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def _blob(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _raw_session(port: int) -> socket.socket:
    """An authenticated raw connection to a store without a secret."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    _recv_exact(s, 4 + 38)  # the greeting
    hello = bytes([0x01, _store.PROTOCOL_VERSION]) + _blob(os.urandom(32)) + _blob(b"")
    s.sendall(_frame(hello))
    assert _recv_exact(s, 4 + 5) == _frame(b"\x00" + _blob(b""))
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def test_replies_not_read_are_not_buffered_without_bound() -> None:
    with (
        store_process() as (proc, port),
        TCPStore("127.0.0.1", port, is_server=False, timeout=5) as c,
    ):
        c.set("big", os.urandom(1 << 20))
        before = _rss_bytes(proc.pid)
        raw = _raw_session(port)
        try:
            get = _frame(b"\x03" + _blob(b"big") + struct.pack(">d", 1.0))
            raw.sendall(get * 256)  # 256 MiB of replies it never reads
            time.sleep(1.0)
            grown = _rss_bytes(proc.pid) - before
            t0 = time.monotonic()
            assert c.get("seed") == b"from the server"
            assert elapsed_since(t0) < 1.0
        finally:
            raw.close()
        assert grown < 48 << 20, f"the server buffered {grown >> 20} MiB for one client"


def test_requests_behind_a_parked_get_are_not_buffered_without_bound() -> None:
    with (
        store_process() as (_, port),
        TCPStore("127.0.0.1", port, is_server=False, timeout=5) as c,
    ):
        raw = _raw_session(port)
        try:
            raw.sendall(_frame(b"\x03" + _blob(b"never") + struct.pack(">d", 30.0)))
            chunk = _frame(b"\x02" + _blob(b"k") + _blob(b"x" * (1 << 20)))
            raw.setblocking(False)
            accepted = 0
            deadline = time.monotonic() + 1.5
            while accepted < (64 << 20) and time.monotonic() < deadline:
                try:
                    accepted += raw.send(chunk)
                except BlockingIOError:
                    time.sleep(0.01)
            assert accepted < 32 << 20, f"the server took {accepted >> 20} MiB behind a parked get"
            assert c.get("seed") == b"from the server"
        finally:
            raw.close()


def test_limits_from_the_environment_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPT_STORE_MAX_KEYS", "lots")
    with pytest.raises(StoreError, match="DPT_STORE_MAX_KEYS"):
        TCPStore("127.0.0.1", 0, is_server=True)
    monkeypatch.setenv("DPT_STORE_MAX_KEYS", "0")
    with pytest.raises(StoreError, match="DPT_STORE_MAX_KEYS"):
        TCPStore("127.0.0.1", 0, is_server=True)
