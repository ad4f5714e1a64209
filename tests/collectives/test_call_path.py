"""The per-call path: what the shorter path of a repeated call keeps, and the communication
thread's switch interval. Real ranks (cpu backend), one body per behaviour."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from collectives import CollectiveTimeoutError, _backend
from tests.collectives.expect import results
from tests.collectives.harness import RankPool, leaked_segments

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"world{n}")
def pool(request: pytest.FixtureRequest) -> Iterator[RankPool]:
    p = RankPool.launch("cpu", request.param, timeout=10.0)
    yield p
    p.close()
    assert leaked_segments(p.run_id) == []


@pytest.mark.parametrize("size", [3, 40_000])  # one staging round, and the chunked path
def test_repeated_calls_keep_every_check(pool: RankPool, size: int) -> None:
    got = results(pool.call("call_path_bodies:repeated_calls_keep_their_checks", {"size": size}))
    for rank, res in enumerate(got):
        assert res["x"] == [res["expect"]] * size and res["y"] == res["x"], rank
        err = res["errors"]
        assert err["strided"].startswith(f"ValueError: [rank {rank}] all_reduce #2"), err
        assert "is not C-contiguous" in err["strided"], err
        assert err["frozen"].startswith(f"ValueError: [rank {rank}] all_reduce #2"), err
        assert "is read-only but all_reduce writes into it" in err["frozen"], err
        assert "op must be a ReduceOp" in err["op"] and "'nope'" in err["op"], err


def test_switch_interval_is_short_while_async_work_is_in_flight() -> None:
    p = RankPool.launch("cpu", 2, timeout=10.0)
    try:
        got = results(
            p.call("call_path_bodies:switch_interval_during_async", {"delay": 0.3, "size": 8})
        )
    finally:
        p.close()
    for res in got:
        assert res["sum"] == 2.0, res
        assert res["after"] == res["before"], res  # the user's interval is back
    assert got[0]["during"] == pytest.approx(50e-6), got[0]  # rank 0 waited for rank 1


def test_switch_interval_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPT_COMM_SWITCH_INTERVAL", "1e-4")
    assert _backend._switch_interval() == pytest.approx(1e-4)
    monkeypatch.setenv("DPT_COMM_SWITCH_INTERVAL", "fast")
    with pytest.raises(ValueError, match="DPT_COMM_SWITCH_INTERVAL must be seconds"):
        _backend._switch_interval()


class _Recorder:
    """What an :class:`~collectives._backend.Executor` needs of a backend; records which
    thread ran each request."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(name="fake", global_rank=0, timeout=5.0)
        self.ran: list[tuple[int, str]] = []

    def check_usable(self, op: str, seq: int) -> None:
        pass

    def run(self, req: _backend.Request) -> None:
        self.ran.append((req.seq, threading.current_thread().name))
        req.result = req.seq

    def abort(self, exc: BaseException) -> None:
        raise AssertionError(f"unexpected abort: {exc}")


class _Asleep:
    """A communication thread that never gets to run (as one not yet woken up)."""

    def join(self, timeout: float | None = None) -> None:
        pass


@pytest.mark.timeout(10)  # without the hand-back it waits for a thread that never runs
def test_a_waiter_runs_the_calls_still_queued_up_to_its_own_in_order() -> None:
    """``Work.wait()`` on an async call nobody has started runs it, and what was queued before
    it, on the waiting thread: no hand-over to the communication thread and back. With a
    timeout it only waits (running the call could take longer than the timeout)."""
    backend = _Recorder()
    ex = _backend.Executor(backend)  # type: ignore[arg-type]
    ex._thread = _Asleep()  # type: ignore[assignment]
    sig: Any = None
    works = [
        ex.submit(_backend.Request(op="all_reduce", seq=i, signature=sig), async_op=True)
        for i in range(3)
    ]
    with pytest.raises(CollectiveTimeoutError, match="expired"):
        works[0].wait(timeout=0.01)
    assert backend.ran == []
    assert works[1].wait() == 1
    here = threading.current_thread().name
    assert backend.ran == [(0, here), (1, here)]
    assert works[0].is_completed() and not works[2].is_completed()
    assert works[2].wait() == 2 and works[0].wait() == 0
    assert backend.ran[-1] == (2, here)
