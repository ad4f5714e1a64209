"""Several threads of one rank on one group: refused with a clear error, never mixed data.

Calls of two threads on one group can reach the ranks in different orders, so rank 0's call
from thread A would meet rank 1's from thread B and sum their data. A group takes calls from
one thread (the one that created it, or the one given it with ``bind_thread``); another
thread's call raises RuntimeError before it gets a sequence number. One group per thread
(``new_group``) runs concurrently and right.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.collectives.expect import results
from tests.collectives.harness import RankPool, leaked_segments

pytestmark = pytest.mark.timeout(120)

ITERS = 200  # per thread: 400 results per rank
FAST = 5.0


@pytest.fixture
def pool() -> Iterator[RankPool]:
    p = RankPool.launch("cpu", 2, timeout=10.0)
    yield p
    p.close()
    assert leaked_segments(p.run_id) == []


def test_two_threads_on_one_group_are_refused(pool: RankPool) -> None:
    t0 = time.monotonic()
    got = results(pool.call("thread_bodies:two_threads_one_group", {"iters": ITERS, "size": 8}))
    took = time.monotonic() - t0
    for rank, res in enumerate(got):
        assert res["stuck"] == [], res
        threads = res["threads"]
        assert sum(t["wrong"] for t in threads) == 0, (rank, threads)
        errors = [t["error"] for t in threads if t["error"] is not None]
        assert errors, (rank, threads)  # a clear error on at least one thread, every rank
        for err in errors:
            msg = err["message"]
            assert err["type"] == "RuntimeError", err
            assert msg.startswith(f"[rank {rank}] all_reduce #"), msg
            assert "group 'world'" in msg and "worker-" in msg and "MainThread" in msg, msg
            assert "new_group" in msg and "bind_thread" in msg, msg
            assert err["elapsed"] < FAST, err
        assert res["after"] == 2.0, res
    assert took < FAST + 5, took


def test_one_group_per_thread_runs_concurrently_and_right(pool: RankPool) -> None:
    got = results(pool.call("thread_bodies:two_threads_own_groups", {"iters": ITERS, "size": 8}))
    for rank, res in enumerate(got):
        assert res["stuck"] == [], res
        for t in res["threads"]:
            assert t == {"right": ITERS, "wrong": 0, "error": None}, (rank, t)


def test_handoff_to_another_thread(pool: RankPool) -> None:
    got = results(pool.call("thread_bodies:handoff", {"iters": 20}))
    for res in got:
        assert "taker-False" in res["unbound"] and "bind_thread" in res["unbound"], res
        assert res["ok"] is True, res
        assert "taker-True" in res["creator_after"], res
