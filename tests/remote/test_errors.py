"""Each way a remote session can go wrong fails clearly, and never hangs: tokens, a server
that dies, a client that dies, the memory limit, failing ops, isolation, hostile frames."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import remote
import tensorlib as tl
from collectives.framing import Seal
from remote import _handshake as wire_handshake
from remote import _records as wire_records
from remote import _wire
from remote.client import _client, _session

from .conftest import ROOT, TOKEN, ServerProcess, env, train_mlp


def test_a_wrong_or_missing_token_gets_no_answer(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu")
    with pytest.raises(remote.RemoteAuthError, match="wrong or missing token"):
        remote.devices(server.address, token="not-the-token")
    with pytest.raises(remote.RemoteAuthError, match="requires a token"):
        remote.devices(server.address)
    assert len(remote.devices(server.address, token=TOKEN)) == 1  # still serving


def test_a_client_with_a_token_refuses_a_server_that_asks_for_none() -> None:
    with remote.serve(["cpu"]) as server, pytest.raises(remote.RemoteAuthError, match="prove"):
        remote.devices(server.address, token=TOKEN)


def test_no_token_off_loopback_is_refused() -> None:
    with pytest.raises(ValueError, match="without a token"):
        remote.serve(["cpu"], host="0.0.0.0")
    out = subprocess.run(
        [sys.executable, "-m", "remote", "serve", "--device", "cpu", "--host", "0.0.0.0"],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 2 and "without a token" in out.stderr


def test_a_server_killed_mid_training_fails_the_client_promptly_naming_it(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu")
    dev = remote.devices(server.address, token=TOKEN)[0]
    threading.Timer(0.3, server.kill).start()
    with pytest.raises(remote.RemoteConnectionError, match=server.address):
        train_mlp(dev, steps=100_000)  # ends by the error, within the test's timeout
    start = time.monotonic()
    with pytest.raises(remote.RemoteConnectionError, match=server.address):
        tl.zeros(3, device=dev).numpy()
    assert time.monotonic() - start < 5.0  # the next call fails at once, too


CLIENT = """
import sys, time, numpy as np, remote, tensorlib as tl
dev = remote.devices(sys.argv[1], token=sys.argv[2])[0]
x = tl.zeros(1 << 20, dtype=tl.float64, device=dev)  # 8 MiB on the server
dev.synchronize()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_client_that_dies_frees_its_session_on_the_server() -> None:
    with remote.serve(["cpu"], token=TOKEN) as server:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, server.address, TOKEN],
            env=env(), stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            assert server.stats() == {"sessions": 1, "bytes": 8 << 20, "peak_bytes": 8 << 20}
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while server.stats()["sessions"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.stats() == {"sessions": 0, "bytes": 0, "peak_bytes": 0}
        finally:
            proc.kill()
            proc.wait(timeout=10)


def test_the_session_memory_limit_is_a_clear_error_and_the_session_goes_on() -> None:
    with remote.serve(["cpu"], token=TOKEN, max_session_bytes=1 << 20) as server:
        dev = remote.devices(server.address, token=TOKEN)[0]
        small = tl.ones(1000, dtype=tl.float64, device=dev)
        big = tl.zeros(1 << 18, dtype=tl.float64, device=dev)  # 2 MiB
        with pytest.raises(remote.RemoteOpError, match="max_session_bytes=1048576"):
            small.numpy()
        with pytest.raises(remote.RemoteOpError, match="full"):
            big.numpy()  # the array that did not fit is poisoned
        assert float((small * 2).sum().item()) == 2000.0
        remote.close(dev)


def test_a_failing_op_is_reported_at_the_next_read_with_its_call_site(rdev: tl.Device) -> None:
    ints = tl.arange(4, device=rdev)
    bad = ints**-1  # NumPy refuses negative integer powers: on the server
    line = sys._getframe().f_lineno - 1
    ok = tl.ones(2, device=rdev)
    with pytest.raises(remote.RemoteOpError, match="'power'") as info:
        ok.numpy()  # the next read reports it, whatever it reads
    assert f"test_errors.py:{line}" in str(info.value) and info.value.op == "power"
    with pytest.raises(remote.RemoteOpError, match=f"test_errors.py:{line}"):
        (bad + 1).numpy()  # what depends on it fails the same way
    assert ok.numpy().tolist() == [1.0, 1.0]  # the session goes on


def test_two_clients_see_only_their_own_arrays(local_server: remote.Server) -> None:
    dev = remote.devices(local_server.address, token=TOKEN)[0]
    a = _session.Session(_client._servers[local_server.address], 0, dev)
    b = _session.Session(_client._servers[local_server.address], 0, dev)
    xa = a.upload(np.arange(3.0))
    xb = b.upload(np.full(3, 7.0))
    assert xa._id == xb._id  # the same id, in two tables
    assert a.read(xa).tolist() == [0.0, 1.0, 2.0]
    assert b.read(xb).tolist() == [7.0, 7.0, 7.0]
    only_a = a.upload(np.ones(3))  # an id session b never made
    ghost = b.issue_new(_wire.OP_CODES["copy"], (only_a,), (3,), xa.dtype)
    with pytest.raises(remote.RemoteOpError, match="no array"):
        b.read(ghost)  # an id only the other session could have: not there
    a.close()
    b.close()


def _raw(server: remote.Server) -> socket.socket:
    host, port = server.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.recv(64)  # the greeting
    return s


def _handshake(server: remote.Server) -> tuple[socket.socket, Seal]:
    """A raw connection that completed the handshake for device 0."""
    host, port = server.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    (n,) = struct.unpack(">I", s.recv(4))
    _, _, _, sn = wire_handshake.GREETING.unpack(s.recv(n))
    cn = os.urandom(32)
    hello = wire_handshake.hello(0, cn, wire_handshake.client_proof(TOKEN.encode(), sn, cn, 0))
    s.sendall(struct.pack(">I", len(hello)) + hello)
    (n,) = struct.unpack(">I", s.recv(4))
    assert s.recv(n)[0] == wire_handshake.WELCOME
    return s, wire_handshake.session_seal(TOKEN.encode(), sn, cn, 0, server=False)


def _closed_by_server(s: socket.socket) -> bool:
    try:
        s.settimeout(5)
        while s.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_fuzzed_frames_close_only_their_connection(
    local_server: remote.Server, rdev: tl.Device
) -> None:
    x = tl.tensor(np.arange(4.0), device=rdev)
    rng = np.random.default_rng(7)
    hostile: list[bytes] = [
        rng.bytes(300),  # random
        struct.pack(">I", 1 << 31) + b"x" * 16,  # oversized
        struct.pack(">I", 200) + b"\x01" * 10,  # truncated, then closed
        struct.pack(">I", 0),  # empty
    ]
    for blob in hostile:
        s = _raw(local_server)
        try:
            s.sendall(blob)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed it already: as it should
            pass
        assert _closed_by_server(s)
        s.close()
    # After the handshake: garbage records, an unknown op, a replayed sealed frame.
    head = wire_records.RECORDS_HEAD
    records = head.pack(_wire.RECORDS, 0, 1) + wire_records.record_head(250, 0, 1, 0)
    garbage = wire_records.RECORDS_HEAD.pack(_wire.RECORDS, 0, 3) + rng.bytes(40)
    for payload in (records, garbage):
        s, seal = _handshake(local_server)
        tag = seal.tag(payload)
        s.sendall(struct.pack(">I", len(payload) + 32) + payload + tag)
        assert _closed_by_server(s)
        s.close()
    s, seal = _handshake(local_server)
    sync = wire_records.RECORDS_HEAD.pack(_wire.RECORDS, 0, 0)
    frame = struct.pack(">I", len(sync) + 32) + sync + seal.tag(sync)
    s.sendall(frame + frame)  # the second is a replay: its tag fails
    assert _closed_by_server(s)
    s.close()
    # The server survived; the other session is unaffected.
    assert (x * 2).numpy().tolist() == [0.0, 2.0, 4.0, 6.0]
    assert len(remote.devices(local_server.address, token=TOKEN)) == 2


def test_a_device_of_a_server_not_reached_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"remote.devices\('10.9.9.9:1'"):
        tl.device("remote://10.9.9.9:1/0")
    with pytest.raises(remote.RemoteConnectionError, match="cannot reach"):
        remote.devices("127.0.0.1:1", token=TOKEN)


def test_a_read_behind_a_long_frame_gets_heartbeats_not_a_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from remote.server import _server

    monkeypatch.setattr(_server, "HEARTBEAT_S", 0.05)
    with remote.serve(["cpu"], token=TOKEN) as server:
        timeout = 0.4
        dev = remote.devices(server.address, token=TOKEN, timeout=timeout)[0]
        sess = _client.session_of(dev)
        # Enough matmuls in one frame to run about 5 timeouts here (timed locally first).
        local = np.ones((700, 700))
        t0 = time.perf_counter()
        local @ local
        rounds = max(10, int(5 * timeout / max(time.perf_counter() - t0, 1e-4)))
        a = dev.xp.asarray(np.ones((700, 700)))
        for _ in range(rounds):
            a = (a @ a) * (1 / 700)
        sess.flush()  # the read goes in a later frame, not yet received while they run
        start = time.monotonic()
        assert np.isfinite(a.get()).all()  # a busy server is told from a dead one
        # The read did wait longer than the timeout (else this test proved nothing).
        assert time.monotonic() - start > timeout
        remote.close(dev)
