"""A session's memory limit bounds the server's memory, not only what its arrays are counted
as: an op or a frame the limit refuses is refused before the server allocates it, so a
refused op raises the server process's peak by no more than one small frame.

The peaks are those of a real ``python -m remote serve`` process (its VmHWM, reset through
``/proc/PID/clear_refs`` before each case), above its resident size before the session held
anything: they stay within the limit plus one small frame.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import remote
import tensorlib as tl
from remote._wire import OP_CODES, SMALL_FRAME_BYTES
from remote.server._ops import handlers

from .conftest import TOKEN, ServerProcess

LIMIT = 48_000_000
HELD = 5_000_000  # float64 elements: 40 MB, 8 MB short of the limit
BIG = 12_500_000  # float64 elements: 100 MB
BOUND = LIMIT + SMALL_FRAME_BYTES  # what the server may hold for one session, at its peak

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads a server process's peak from /proc"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server process for the module, its sessions limited to 48 MB."""
    token_file = tmp_path_factory.mktemp("limits") / "token"
    token_file.write_text(TOKEN + "\n")
    proc = ServerProcess(
        ["--device", "cpu", "--max-session-bytes", str(LIMIT), "--token-file", str(token_file)]
    )
    yield proc
    proc.kill()


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class Peak:
    """A server process's peak resident memory from now on, above what it holds now."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to VmRSS
        except OSError:
            pytest.skip("cannot reset a process's peak resident size here")
        self.base = _status(pid, "VmRSS")

    def rise(self) -> int:
        return _status(self.pid, "VmHWM") - self.base


@pytest.fixture
def session(server: ServerProcess) -> Iterator[tuple[tl.Device, Peak]]:
    """A fresh session on the server (run once, so its thread and code paths exist), and the
    server's peak measured from before the session held anything."""
    dev = remote.devices(server.address, token=TOKEN)[0]
    assert tl.ones(4, device=dev).sum().item() == 4
    peak = Peak(server.proc.pid)
    try:
        yield dev, peak
    finally:
        remote.close(dev)


def _held(dev: tl.Device) -> tl.Tensor:
    x = tl.ones(HELD, dtype=tl.float64, device=dev)
    assert x.sum().item() == HELD
    return x


def _refused(fn: Callable[[], Any]) -> str:
    with pytest.raises(remote.RemoteOpError) as info:
        fn()
    return str(info.value)


@pytest.mark.timeout(90)
def test_a_refused_upload_never_lands_on_the_server(session: tuple[tl.Device, Peak]) -> None:
    dev, peak = session
    held = _held(dev)
    host = np.ones(BIG)
    message = _refused(lambda: tl.tensor(host, device=dev).sum().item())
    # The error names the limit, the bytes asked and those held.
    assert "max_session_bytes=48000000" in message
    assert "100000000 bytes more" in message and "40000000 held" in message
    # Before the fix the server read the whole 100 MB frame and copied it: its peak rose
    # 200 MB above the 40 MB the session held (240 MB against a 48 MB limit).
    assert peak.rise() <= BOUND, f"server peak {peak.rise()} bytes above {BOUND}"
    # The session goes on: what it held is intact, and new work runs.
    assert held.sum().item() == HELD
    assert tl.ones(10, device=dev).sum().item() == 10


@pytest.mark.timeout(90)
def test_a_refused_broadcasting_add_is_never_computed(session: tuple[tl.Device, Peak]) -> None:
    dev, peak = session
    held = _held(dev)
    a = tl.ones((10_000, 1), dtype=tl.float64, device=dev)
    b = tl.ones((1, 1_250), dtype=tl.float64, device=dev)
    message = _refused(lambda: (a + b).sum().item())  # a 100 MB result
    assert "max_session_bytes=48000000" in message and "100000000 bytes more" in message
    # Before the fix the sum was computed, then refused: the peak rose 100 MB above 40 MB.
    assert peak.rise() <= BOUND, f"server peak {peak.rise()} bytes above {BOUND}"
    assert held.sum().item() == HELD
    assert (a[:2] * b[:, :3]).sum().item() == 6  # small work on the same arrays still runs


@pytest.mark.timeout(90)
def test_a_frame_too_long_for_the_session_is_refused_from_its_header(
    session: tuple[tl.Device, Peak], server: ServerProcess
) -> None:
    dev, peak = session
    _kept = _held(dev)
    one = dev.xp.ones(1)
    # A 100 MB NumPy operand travels inside its record: one frame the session cannot take.
    with pytest.raises(remote.RemoteConnectionError) as info:
        dev.xp.add(one, np.ones(BIG)).get()
    message = str(info.value)
    assert "the server closed the session" in message and "max_session_bytes=48000000" in message
    asked = re.search(r"a frame of (\d+) bytes", message)
    assert asked is not None and int(asked.group(1)) > BIG * 8, message
    # Before the fix the frame was read and copied, and the sum made: a 300 MB rise.
    assert peak.rise() <= BOUND, f"server peak {peak.rise()} bytes above {BOUND}"
    # Only that session ended: the server serves a new one.
    remote.close(dev)
    dev = remote.devices(server.address, token=TOKEN)[0]
    assert tl.ones(3, device=dev).sum().item() == 3


@pytest.mark.timeout(90)
def test_what_fits_under_the_limit_still_goes(session: tuple[tl.Device, Peak]) -> None:
    dev, peak = session
    rng = np.random.default_rng(0)
    small = rng.random(1_000_000)  # 8 MB in one frame (a NumPy operand): 24 MB of room
    y = dev.xp.add(dev.xp.zeros(1), small)
    assert np.array_equal(y.get(), small)
    del y
    host = rng.random(HELD)  # 40 MB: in pieces, into one array counted once
    x = tl.tensor(host, device=dev)
    assert np.array_equal(x.numpy(), host)
    # Before the fix, the 40 MB upload alone raised the peak by 80 MB (frame and copy).
    assert peak.rise() <= BOUND, f"server peak {peak.rise()} bytes above {BOUND}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "host",
    [
        np.arange(3 * 300_000, dtype=np.float64).reshape(3, 300_000),  # rows over a piece
        np.arange(2_000_000, dtype=np.int32),
        np.arange(600_000, dtype=np.float32).reshape(1_000, 600).T,  # not contiguous
        np.arange(3_000_000) % 3 == 0,
        np.ones((2, 3, 400_000), dtype=np.float16),
    ],
    ids=["rows", "int32", "transposed", "bool", "float16"],
)
def test_a_large_upload_arrives_whole(host: np.ndarray[Any, Any]) -> None:
    with remote.serve(["cpu"], token=TOKEN, max_session_bytes=LIMIT) as srv:
        dev = remote.devices(srv.address, token=TOKEN)[0]
        x = tl.tensor(host, device=dev)
        back = x.numpy()
        assert back.dtype == host.dtype and np.array_equal(back, host)
        # The pieces fill one array: the session counts it once.
        assert srv.stats()["peak_bytes"] == host.nbytes
        remote.close(dev)


def _cases() -> list[tuple[str, tuple[Any, ...]]]:
    r = np.random.default_rng(0)
    f32 = r.random((6, 1)).astype(np.float32)
    i8 = r.integers(0, 5, (4, 1, 3)).astype(np.int8)
    idx = np.array([0, 2, 1, 0])
    m = r.random((5, 4, 3))
    return [
        ("add", (f32, r.random((1, 7)))),
        ("add", (i8, 3)),
        ("true_divide", (i8, i8.reshape(4, 3, 1) + 1)),
        ("equal", (f32, 0.5)),
        ("sqrt", (i8,)),
        ("negative", (f32,)),
        ("where", (f32 > 0.5, f32, np.zeros((1, 9)))),
        ("clip", (i8, 0, 2)),
        ("matmul", (r.random((2, 5, 3)), r.random((3, 4)))),
        ("matmul", (r.random(3), r.random((3, 4)))),
        ("getitem", (m, (idx[:, None], idx[None, :]))),
        ("getitem", (m, (Ellipsis, idx))),
        ("getitem", (m, (slice(1, 3), m[0, :, 0] > 0.3))),
        ("getitem", (m, (slice(None), 1))),
        ("sum", (i8, 1, True, None)),
        ("mean", (i8, None, False, None)),
        ("sum", (m, (0, 2), False, np.dtype(np.float32))),
        ("argmax", (m, 0, False)),
        ("max", (i8, -1, False)),
        ("astype", (i8, np.dtype(np.float64))),
        ("copy", (m,)),
        ("concatenate", ((m, m.astype(np.float32)), 0)),
        ("stack", ((f32, f32), 1)),
        ("reshape", (m, (20, 3))),
        ("reshape", (m.transpose(2, 0, 1), (60,))),
        ("linear", (r.random((8, 3)), r.random((5, 3)), r.random(5))),
        ("linear_grad", (r.random((8, 5)), r.random((8, 3)), r.random((5, 3)), True, True, True)),
        ("relu_grad", (m, m - 0.5)),
        ("cross_entropy_grad", (r.random((8, 5)), idx.repeat(2), np.array(1.0), -100, 0.0, 2)),
        ("upload", ((4, 5), np.dtype(np.int16))),
        ("full", ((3, 4), 1.5, np.dtype(np.float32))),
        ("arange", (0, 10, 3, np.dtype(np.int64))),
    ]


@pytest.mark.timeout(30)
def test_an_op_is_sized_exactly_before_it_allocates() -> None:
    # The guard sees what the result will take, to the byte: an op that fits exactly is not
    # refused, and one a byte over is refused before NumPy allocates it. (Before the fix only
    # full and arange were sized; every other op was allocated, then refused.)
    for name, args in _cases():
        asked: list[int] = []
        table = handlers(np, asked.append)
        result = table[OP_CODES[name]](args, None)  # type: ignore[misc]
        results = result if isinstance(result, tuple) else (result,)
        operands = {id(_root(a)) for a in args if isinstance(a, np.ndarray)}
        made = sum(
            0 if id(_root(x)) in operands else _root(x).nbytes for x in map(np.asarray, results)
        )
        assert asked == [made], f"{name}{[getattr(a, 'shape', a) for a in args]}"


def _root(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The array that owns ``x``'s memory (what the session counts)."""
    while isinstance(x.base, np.ndarray):
        x = x.base
    return x
