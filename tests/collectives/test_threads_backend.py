"""The ``threads`` backend: rank threads of one process, each bound to a device.

What only this backend promises (the shared collective bodies run on it in
test_collectives.py): ``spawn``/``Parallel`` with ``backend="threads"`` return the ranks'
values as they are; inside a rank thread the module-level API is that rank's, a thread that is
not a rank sees no group; ``get_device()`` is the rank's device under every backend; the
failure rules of the process backends hold (a mismatch, a timeout naming the rank that never
arrived, a rank that leaves, a rank that arrives late, a thread that raises: every other rank
fails at once, ``spawn`` raises ``SpawnError`` naming it with its traceback); and engines plug
in by device kind (what the remote package does).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import collectives as C
from collectives.backends import threads as T
from tests.collectives import expect
from tests.collectives.expect import MISMATCHES
from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool

pytestmark = pytest.mark.timeout(60)

FAST = 5.0  # "within a moment" on a loaded 2-core machine


# ---------------------------------------------------------------------------- spawn and the API
def test_spawn_returns_values_as_they_are_and_each_thread_is_its_rank() -> None:
    marker = object()

    def train(rank: int, scale: float) -> Any:
        x = np.full(5, (rank + 1) * scale)
        C.all_reduce(x)
        seen = {
            "rank": C.get_rank(),
            "size": C.get_world_size(),
            "local": (C.get_local_rank(), C.get_local_world_size()),
            "backend": C.get_backend(),
            "device": C.get_device(),
            "initialized": C.is_initialized(),
        }
        return (seen, x, marker)  # a tuple, an ndarray, an object: no JSON round trip

    got = C.spawn(train, args=(2.0,), nprocs=3, backend="threads", timeout=10)
    assert got is not None and len(got) == 3
    for rank, (seen, x, obj) in enumerate(got):
        assert obj is marker
        assert isinstance(x, np.ndarray) and x.tolist() == [12.0] * 5
        assert seen == {
            "rank": rank,
            "size": 3,
            "local": (rank, 3),
            "backend": "threads",
            "device": C.get_device(),  # this (non-rank) thread: the CPU
            "initialized": True,
        }
    assert not C.is_initialized() and C.get_rank() == 0 and C.get_world_size() == 1


def test_a_thread_that_is_not_a_rank_sees_no_group() -> None:
    def body(rank: int) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        def helper() -> None:  # a thread the rank starts: not a rank itself
            seen.update(init=C.is_initialized(), rank=C.get_rank(), size=C.get_world_size())

        t = threading.Thread(target=helper)
        t.start()
        t.join()
        return seen

    main_saw: list[Any] = []

    def watcher() -> None:
        main_saw.append((C.is_initialized(), C.get_world_size()))

    got = C.spawn(body, nprocs=2, backend="threads", timeout=10)
    watcher()
    assert got == [{"init": False, "rank": 0, "size": 1}] * 2
    assert main_saw == [(False, 1)]


def test_init_false_lets_the_function_join_and_the_api_refuses_before() -> None:
    def body(rank: int) -> dict[str, Any]:
        before = (C.is_initialized(), C.get_rank())
        with pytest.raises(RuntimeError, match="before calling init_process_group"):
            C.all_reduce(np.ones(2))
        with pytest.raises(ValueError, match="use backend 'threads'"):
            C.init_process_group("cpu")
        C.init_process_group()
        x = np.ones(2)
        C.all_reduce(x)
        return {"before": before, "after": C.get_rank(), "sum": float(x[0])}

    got = C.spawn(body, nprocs=2, backend="threads", init=False, timeout=10)
    assert got == [{"before": (False, 0), "after": r, "sum": 2.0} for r in range(2)]


def test_parallel_runs_rank_threads() -> None:
    def fn(local_rank: int, base: int, *, extra: int) -> tuple[int, int]:
        x = np.array([base + local_rank + extra])
        C.all_reduce(x)
        return (local_rank, int(x[0]))

    with C.Parallel(backend="threads", nproc_per_node=3, timeout=10) as p:
        got = p.run(fn, 10, extra=1)
    assert got == [(r, 36) for r in range(3)]
    with pytest.raises(ValueError, match="nproc_per_node"):
        C.Parallel(backend="threads")


def test_new_group_and_get_device_in_rank_threads() -> None:
    def body(rank: int) -> dict[str, Any]:
        g = C.new_group([0, 2])
        with pytest.raises(ValueError, match="use backend 'threads'"):
            C.new_group([0, 1], backend="cpu")
        out: dict[str, Any] = {"member": g.is_member()}
        if isinstance(g, C.ProcessGroup):
            x = np.array([rank + 1.0])
            C.all_reduce(x, group=g)
            out["sum"] = float(x[0])
            out["backend"] = C.get_backend(g)
        return out

    got = C.spawn(body, nprocs=3, backend="threads", timeout=10)
    assert got is not None
    assert got[0] == got[2] == {"member": True, "sum": 4.0, "backend": "threads"}
    assert got[1] == {"member": False}


def test_get_device_is_the_cpu_under_process_backends() -> None:
    with RankPool.launch("cpu", 2, timeout=10) as pool:
        assert pool.run("threads_bodies:device_and_backend") == [["cpu", "cpu"]] * 2


def test_bad_devices_are_refused_before_anything_starts() -> None:
    def fn(rank: int) -> None:
        raise AssertionError("must not run")

    with pytest.raises(ValueError, match="devices has 1 entries but nprocs=2"):
        C.spawn(fn, nprocs=2, backend="threads", devices=["cpu"])
    with pytest.raises(ValueError, match="needs backend='threads'"):
        C.spawn(fn, nprocs=1, backend="cpu", devices=["cpu"])
    with pytest.raises(ValueError, match="no engine for devices of kind 'abacus'"):
        C.spawn(fn, nprocs=1, backend="threads", devices=[_Device("abacus")])
    with pytest.raises(ValueError, match="must be of one kind"):
        C.spawn(fn, nprocs=2, backend="threads", devices=["cpu", _Device("abacus")])
    with pytest.raises(ValueError, match="join=True"):
        C.spawn(fn, nprocs=1, backend="threads", join=False)
    with pytest.raises(RuntimeError, match="joins a threads job from one of its rank"):
        C.init_process_group("threads")


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_mismatch_fails_every_rank_at_once(kind: str) -> None:
    got = ThreadsPool(3, timeout=30).run("bodies:mismatch", {"kind": kind}, deadline=30)
    for after in expect.mismatched(got, kind, FAST):
        assert after["elapsed"] < 1.0


def test_timeout_names_the_rank_that_never_arrived() -> None:
    timeout, skipper = 1.0, 1
    got = ThreadsPool(3, timeout=timeout).run(
        "bodies:skip_collective", {"sleep": timeout + 1.0, "skipper": skipper}, deadline=30
    )
    for rank in (0, 2):
        expect.timed_out(got[rank], timeout, FAST, f"ranks [{skipper}] never arrived")


def test_rank_arriving_after_timeout_fails_too() -> None:
    timeout, late = 1.0, 1
    pool = ThreadsPool(3, timeout=timeout)
    got = pool.run("bodies:late_rank", {"sleep": timeout + 0.5, "late": late}, deadline=30)
    expect.late_rank_failed(got, late)
    assert got[late]["elapsed"] < 1.0


@pytest.mark.parametrize("n", [2, 3])
def test_rank_leaving_the_group_fails_waiting_peers_at_once(n: int) -> None:
    leaver = n - 1
    got = ThreadsPool(n, timeout=30).run("bodies:leave_early", {"leaver": leaver}, deadline=30)
    expect.left_the_group(got, leaver, FAST)


def test_a_raising_thread_fails_the_others_pending_and_next_calls_and_spawn_names_it() -> None:
    seen: dict[int, Any] = {}
    issued = threading.Barrier(3)

    def body(rank: int) -> None:
        if rank == 1:
            issued.wait(10)
            time.sleep(0.2)  # the others are waiting in their all_reduce by now
            raise ValueError("rank one broke")
        work = C.all_reduce(np.ones(1000), async_op=True)
        issued.wait(10)
        t0 = time.monotonic()
        try:
            work.wait()
        except C.CollectiveError as exc:
            seen[rank] = {"pending": (type(exc).__name__, str(exc), time.monotonic() - t0)}
        try:
            C.barrier()
        except C.CollectiveError as exc:
            seen[rank]["next"] = (type(exc).__name__, str(exc))
            raise

    t0 = time.monotonic()
    with pytest.raises(C.SpawnError) as info:
        C.spawn(body, nprocs=3, backend="threads", timeout=30)
    assert time.monotonic() - t0 < FAST
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert err.traceback_text is not None and "rank one broke" in err.traceback_text
    assert 'raise ValueError("rank one broke")' in err.traceback_text
    assert "rank 1 (of 3 threads) failed first" in str(err)
    for rank in (0, 2):
        kind, msg, waited = seen[rank]["pending"]
        assert kind == "PeerFailureError" and waited < 1.0, seen[rank]
        assert f"[rank {rank}] all_reduce #1" in msg and "rank 1 failed" in msg, msg
        assert "ValueError: rank one broke" in msg
        kind, msg = seen[rank]["next"]
        assert kind in ("PeerFailureError", "GroupAbortedError") and "rank 1" in msg, msg


def test_a_thread_that_never_arrives_gives_a_timeout_naming_it() -> None:
    release = threading.Event()

    def body(rank: int) -> None:
        C.barrier()
        if rank == 2:
            release.wait(30)  # stuck outside collectives
            return
        C.all_reduce(np.ones(4))

    t0 = time.monotonic()
    try:
        with pytest.raises(C.SpawnError) as info:
            C.spawn(body, nprocs=3, backend="threads", timeout=1.0, grace_period=0.5)
    finally:
        release.set()
    assert time.monotonic() - t0 < 1.0 + 0.5 + FAST
    text = str(info.value)
    assert info.value.exc_type is not None and "CollectiveTimeoutError" in info.value.exc_type
    assert "all_reduce #2" in text and "ranks [2] never arrived" in text, text
    assert "rank 2 still running" in text, text


def test_send_recv_mismatch_names_both_calls() -> None:
    def body(rank: int) -> str:
        if rank == 0:
            C.send(np.ones(3, np.float32), 1)
            return ""
        try:
            C.recv(np.zeros(4, np.float32), 0)
        except C.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    got = C.spawn(body, nprocs=2, backend="threads", timeout=10)
    assert got is not None
    assert "[rank 1] recv #1" in got[1] and "rank 0 sent send #1" in got[1], got[1]
    assert "shape=(3,)" in got[1] and "shape=(4,)" in got[1]


# ---------------------------------------------------------------------------- engines
class _Device:
    """A device of a kind of its own (as a remote package's devices are)."""

    def __init__(self, kind: str, name: str = "") -> None:
        self.type = kind
        self.name = name

    def __repr__(self) -> str:
        return f"_Device({self.type!r}, {self.name!r})"


class _LeaderEngine(T.ThreadEngine):
    """A remote-style engine: the ranks agree on the arrays, then one rank does the work
    (a remote engine asks the server to reduce its sessions' tensors there)."""

    calls: list[tuple[int, str]] = []  # noqa: RUF012

    def _do_all_reduce(self, req: Any) -> None:
        arrays = self.meet(req, req.array)  # signatures checked, every member's array
        if self.rank == 0:
            total = sum(a.astype(np.float64) for a in arrays)
            for a in arrays:
                a[...] = total
            _LeaderEngine.calls.append((self.info.global_rank, str(self.bound_device.name)))
        self.phase(req)


def test_an_engine_registered_by_device_kind_serves_those_devices() -> None:
    T.register_engine("leader-test", _LeaderEngine, description="test engine")
    devices = [_Device("leader-test", f"d{r}") for r in range(3)]

    def body(rank: int) -> tuple[str, float]:
        x = np.array([rank + 1.0])
        C.all_reduce(x)
        return C.get_device().name, float(x[0])  # type: ignore[attr-defined]

    try:
        got = C.spawn(body, nprocs=3, backend="threads", devices=devices, timeout=10)
    finally:
        T.unregister_engine("leader-test")
    assert got == [("d0", 6.0), ("d1", 6.0), ("d2", 6.0)]
    assert _LeaderEngine.calls == [(0, "d0")]
