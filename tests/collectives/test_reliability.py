"""Failure behaviour of the cpu backend, each on its own dedicated processes.

Mismatched collectives, a rank that skips one (timeout), a rank killed with SIGKILL in the
middle of an all_reduce, a rank that dies of an uncaught exception, bad configurations at init.
Every case must end in a clear error on every surviving rank, quickly, never in a hang; and no
shared-memory segment may survive. Every test has a hard time limit, and the harness kills its
processes when a deadline passes.
"""

from __future__ import annotations

import signal
import socket
import time
from typing import Any

import pytest

from tests.collectives import expect
from tests.collectives.expect import MISMATCHES, results
from tests.collectives.harness import PoolError, RankPool, Reply, leaked_segments

pytestmark = pytest.mark.timeout(90)

# Far above every "fails fast" bound below: passing those bounds proves no timeout was involved.
LONG = 120.0
FAST = 10.0  # generous bound for "within seconds" on a loaded 2-core machine


def launch(pools: list[RankPool], world_size: int, **kw: Any) -> RankPool:
    pool = RankPool.launch("cpu", world_size, **kw)
    pools.append(pool)
    return pool


def errtype(outcome: dict[str, Any]) -> str:
    return str(outcome.get("type"))


# ---------------------------------------------------------------------------- (1) mismatch
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_mismatch_fails_every_rank_fast(pools: list[RankPool], kind: str) -> None:
    n = 3
    pool = launch(pools, n, timeout=LONG)
    got = results(pool.call("bodies:mismatch", {"kind": kind}, deadline=30, grace=None))
    for after in expect.mismatched(got, kind, FAST):
        assert "unusable" in after["message"], after
        assert after["elapsed"] < 1.0


# ---------------------------------------------------------------------------- (2) timeout
@pytest.mark.slow
@pytest.mark.parametrize("n,skipper", [(2, 1), (3, 1)])
def test_timeout_names_op_seq_and_missing_rank(pools: list[RankPool], n: int, skipper: int) -> None:
    timeout = 2.0
    pool = launch(pools, n, timeout=timeout)
    got = results(
        pool.call(
            "bodies:skip_collective",
            {"sleep": timeout + 0.5, "skipper": skipper},
            deadline=30,
            grace=None,
        )
    )
    waiting = [r for r in range(n) if r != skipper]
    for rank in waiting:
        # It waited for the timeout (not less), and not much longer.
        expect.timed_out(got[rank], timeout, FAST, f"ranks [{skipper}] never arrived")
    # Every process was alive throughout: the skipper answered, and nobody exited.
    assert got[skipper] == {"type": None, "slept": timeout + 0.5, "pid": pool.pids[skipper]}
    assert all(pool.returncode(r) is None for r in range(n))
    # Afterwards the next collective of the ranks that timed out fails at once, saying why.
    after = pool.call(
        "bodies:collective_after_peer_death", {"timeout_hint": 0}, ranks=waiting, deadline=30
    )
    expect.aborted_after_timeout(results(after))


@pytest.mark.parametrize("n", [2, 3])
def test_rank_leaving_the_group_fails_waiting_peers_fast(pools: list[RankPool], n: int) -> None:
    pool = launch(pools, n, timeout=LONG)
    leaver = n - 1
    got = results(pool.call("bodies:leave_early", {"leaver": leaver}, deadline=60, grace=None))
    expect.left_the_group(got, leaver, FAST)


@pytest.mark.slow
def test_rank_arriving_after_timeout_fails_too(pools: list[RankPool]) -> None:
    """A slow rank that calls the same collective after its peers timed out must not complete
    it (its peers reported failure): it gets the timeout error as well, with its data as is."""
    timeout, late = 1.5, 1
    pool = launch(pools, 3, timeout=timeout)
    got = results(
        pool.call(
            "bodies:late_rank", {"sleep": timeout + 1.5, "late": late}, deadline=30, grace=None
        )
    )
    expect.late_rank_failed(got, late)
    assert got[late]["elapsed"] < 1.0


# ---------------------------------------------------------------------------- (3) SIGKILL
@pytest.mark.slow
def test_sigkill_mid_all_reduce_fails_peers_fast(pools: list[RankPool]) -> None:
    """The victim kills itself from a timer thread while its main thread is inside a large
    (multi-chunk) all_reduce loop."""
    n, victim = 3, 1
    pool = launch(pools, n, timeout=LONG, env={"DPT_CPU_CHUNK_BYTES": "65536"})
    kw = {"size": 1_000_003, "victim": victim, "kill_after": 0.5, "limit": 60.0}
    t0 = time.monotonic()
    replies = pool.call("bodies:allreduce_until_error", kw, deadline=40, grace=None)
    elapsed = time.monotonic() - t0
    assert replies[victim].exited and replies[victim].returncode == -signal.SIGKILL
    survivors = [r for r in range(n) if r != victim]
    for rank in survivors:
        res = replies[rank].result
        assert replies[rank].ok, replies[rank].describe()
        assert res["count"] >= 1, "the victim died before the first all_reduce completed"
        assert errtype(res) == "PeerFailureError", res
        assert f"rank {victim}" in res["message"] and "gone" in res["message"], res["message"]
        assert f"pid {pool.pids[victim]}" in res["message"], res["message"]
        # Failed within seconds of the kill (at ~0.5 s), far from the 120 s timeout.
        assert res["elapsed"] < 0.5 + FAST, res["elapsed"]
        nxt = res["next"]
        assert errtype(nxt) == "GroupAbortedError" and nxt["elapsed"] < 1.0, nxt
        assert f"rank {victim}" in nxt["message"], nxt
    assert elapsed < 0.5 + FAST + 5


@pytest.mark.slow
def test_parent_sigkill_during_all_reduce_loop(pools: list[RankPool]) -> None:
    """The test kills a rank from outside while all ranks loop large all_reduces; the
    survivors' errors arrive within seconds of the kill."""
    n, victim = 4, 2
    pool = launch(pools, n, timeout=LONG)
    kw = {"size": 2_000_003, "victim": -1, "kill_after": 0.0, "limit": 60.0}
    targets = pool.submit("bodies:allreduce_until_error", kw)
    time.sleep(1.0)
    assert all(pool.returncode(r) is None for r in targets)
    killed_at = time.monotonic()
    pool.kill(victim)
    survivors = [r for r in targets if r != victim]
    got = pool.collect(survivors, deadline=FAST + 20)
    waited = time.monotonic() - killed_at
    for rep in got:
        assert rep.ok, rep.describe()
        res = rep.result
        assert errtype(res) == "PeerFailureError", res
        assert f"rank {victim}" in res["message"] and "gone" in res["message"], res
        assert res["count"] >= 1
        assert errtype(res["next"]) == "GroupAbortedError", res["next"]
    assert waited < FAST, f"survivors needed {waited:.1f} s to notice the kill"
    assert pool.wait_exit(victim, 5) == -signal.SIGKILL


@pytest.mark.slow
def test_queued_async_work_fails_when_peer_dies(pools: list[RankPool]) -> None:
    """Async all_reduces queued behind one that waits for a rank that then dies: every Work
    completes with an error (first the peer's failure, then aborted), none hangs."""
    n, victim, count = 3, 2, 20
    pool = launch(pools, n, timeout=LONG)
    survivors = [0, 1]
    pool.submit("bodies:async_then_peer_dies", {"count": count}, ranks=survivors)
    time.sleep(0.5)
    killed_at = time.monotonic()
    pool.kill(victim)
    got = results(pool.collect(survivors, deadline=FAST + 20))
    assert time.monotonic() - killed_at < FAST
    for res in got:
        assert res["kinds"] == ["PeerFailureError"] + ["GroupAbortedError"] * (count - 1), res


@pytest.mark.slow
def test_peer_killed_while_idle_next_collective_fails_fast(pools: list[RankPool]) -> None:
    n, victim = 3, 2
    pool = launch(pools, n, timeout=LONG)
    assert results(pool.call("bodies:ping", {"seed": 0})) == [6, 6, 6]
    pool.kill(victim)
    assert pool.wait_exit(victim, 10) == -signal.SIGKILL
    got = results(
        pool.call(
            "bodies:collective_after_peer_death", {"timeout_hint": LONG}, ranks=[0, 1], deadline=30
        )
    )
    for res in got:
        assert errtype(res) == "PeerFailureError", res
        assert f"rank {victim}" in res["message"] and "gone" in res["message"], res
        assert res["elapsed"] < FAST, res["elapsed"]
        assert errtype(res["next"]) == "GroupAbortedError", res["next"]


@pytest.mark.slow
def test_recv_from_killed_peer_fails_fast(pools: list[RankPool]) -> None:
    pool = launch(pools, 2, timeout=LONG)
    pool.kill(1)
    assert pool.wait_exit(1, 10) == -signal.SIGKILL
    (res,) = results(pool.call("bodies:recv_from_dead_peer", {"src": 1}, ranks=[0], deadline=30))
    assert errtype(res) == "PeerFailureError", res
    assert "recv" in res["message"] and "rank 1" in res["message"] and "gone" in res["message"]
    assert res["elapsed"] < FAST


# ---------------------------------------------------------------------------- (4) uncaught
@pytest.mark.slow
def test_uncaught_exception_names_rank_and_text(pools: list[RankPool]) -> None:
    n, victim = 3, 0
    pool = launch(pools, n, timeout=LONG)
    text = "boom: the loss went NaN at step 7"
    replies = pool.call(
        "bodies:raise_uncaught",
        {"victim": victim, "message": text, "delay": 0.3},
        deadline=30,
        grace=None,
        uncaught=True,
    )
    assert replies[victim].exited and replies[victim].returncode == 1
    assert f"ValueError: {text}" in pool.stderr_tail(victim)  # its own traceback, as usual
    for rank in range(n):
        if rank == victim:
            continue
        res = replies[rank].result
        assert replies[rank].ok, replies[rank].describe()
        assert errtype(res) == "PeerFailureError", res
        assert f"rank {victim} failed" in res["message"], res["message"]
        assert f"ValueError: {text}" in res["message"], res["message"]
        assert res["elapsed"] < 0.3 + FAST


# ---------------------------------------------------------------------------- (5) leaks
@pytest.mark.slow
def test_no_segments_left_after_every_rank_is_killed(pools: list[RankPool]) -> None:
    """Segments are unlinked as soon as all ranks mapped them: even SIGKILL of the whole job
    (no cleanup code runs) leaves nothing in /dev/shm, also with alloc'd arrays."""
    pool = launch(pools, 3, timeout=LONG)
    results(pool.call("bodies:alloc_all_reduce", {"seed": 1, "size": 100_003, "pattern": "all"}))
    mapped = results(pool.call("bodies:shm_names"))
    assert all(any(name.startswith(f"dpt-{pool.run_id}") for name in m) for m in mapped), mapped
    assert leaked_segments(pool.run_id) == []
    for r in range(3):
        pool.kill(r)
    for r in range(3):
        assert pool.wait_exit(r, 10) == -signal.SIGKILL
    assert leaked_segments(pool.run_id) == []


@pytest.mark.slow
def test_rank_killed_during_setup_fails_fast_and_leaks_nothing(pools: list[RankPool]) -> None:
    """Rank 1 SIGKILLs itself while mapping its peers' segments (after publishing its own):
    the others fail within seconds naming it, and its segment does not stay in /dev/shm."""
    pool = RankPool("cpu", 3, timeout=LONG, rank_env={1: {"DPT_TEST_DIE_IN_INIT": "1"}})
    pools.append(pool)
    t0 = time.monotonic()
    replies = pool.start(init_deadline=60)
    took = time.monotonic() - t0
    assert replies[1].exited and replies[1].returncode == -signal.SIGKILL
    gone = f"rank 1 (pid {pool.pids[1]}) is gone"
    assert "PeerFailureError" in replies[0].error and gone in replies[0].error, replies[0].error
    # Rank 2 names rank 1 too, unless rank 0 failed first and closed the store (hosted there).
    err = replies[2].error
    assert gone in err or "lost the connection to the store" in err, err
    assert took < FAST
    assert leaked_segments(pool.run_id) == []


# ---------------------------------------------------------------------------- (6) init errors
def start(
    pool: RankPool, pools: list[RankPool], deadline: float = 30.0
) -> tuple[list[Reply], float]:
    pools.append(pool)
    t0 = time.monotonic()
    replies = pool.start(deadline)
    return replies, time.monotonic() - t0


def test_store_unreachable_is_a_clear_error(pools: list[RankPool]) -> None:
    """Rank 1 of 2 starts, rank 0 (the store's host) never does."""
    pool = RankPool("cpu", 2, timeout=2.0, ranks=[1])
    (rep,), took = start(pool, pools)
    assert not rep.ok and not rep.missing, rep.describe()
    assert "StoreTimeoutError" in rep.error and "unreachable" in rep.error, rep.error
    assert f"127.0.0.1:{pool.master_port}" in rep.error
    assert took < 2.0 + FAST


def test_wrong_world_size_is_a_clear_error(pools: list[RankPool]) -> None:
    pool = RankPool("cpu", 2, timeout=3.0, world_sizes=[2, 3])
    replies, took = start(pool, pools)
    assert not any(r.ok or r.missing for r in replies), [r.describe() for r in replies]
    assert "ranks disagree on WORLD_SIZE" in replies[0].error, replies[0].error
    assert "this rank has 2, ranks [1] have [3]" in replies[0].error
    # Rank 1 (told 3) fails too: the store went away, or rank 2 never joined.
    assert "Error" in replies[1].error
    assert took < 3.0 + FAST


def test_port_taken_is_a_clear_error(pools: list[RankPool]) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        pool = RankPool("cpu", 2, timeout=3.0, master_port=port)
        replies, took = start(pool, pools)
    assert not any(r.ok or r.missing for r in replies), [r.describe() for r in replies]
    assert f"port {port} is already in use" in replies[0].error, replies[0].error
    assert f"127.0.0.1:{port}" in replies[1].error, replies[1].error
    assert took < 3.0 + FAST


# ---------------------------------------------------------------------------- (7) chunk sizes
@pytest.mark.parametrize("var", ["DPT_CPU_CHUNK_BYTES", "DPT_CPU_P2P_CHUNK_BYTES"])
def test_different_chunk_size_on_one_rank_fails_init(pools: list[RankPool], var: str) -> None:
    pool = RankPool("cpu", 3, timeout=5.0, rank_env={1: {var: "8192"}})
    replies, took = start(pool, pools)
    assert not any(r.ok or r.missing for r in replies), [r.describe() for r in replies]
    # Rank 0 compares with rank 1 and says exactly what differs. Others may instead find the
    # store gone (rank 0 closes it when its init fails), which their error says; nobody hangs.
    fix = "set DPT_CPU_CHUNK_BYTES and DPT_CPU_P2P_CHUNK_BYTES the same on every rank"
    assert "rank 1 uses cpu-backend chunk sizes" in replies[0].error and fix in replies[0].error
    assert "8192" in replies[0].error
    for rep in replies[1:]:
        assert fix in rep.error or "store" in rep.error, rep.describe()
    assert took < 5.0 + FAST


def test_invalid_chunk_size_fails_init(pools: list[RankPool]) -> None:
    pool = RankPool("cpu", 2, timeout=5.0, env={"DPT_CPU_CHUNK_BYTES": "1k"})
    replies, took = start(pool, pools)
    assert not any(r.ok or r.missing for r in replies), [r.describe() for r in replies]
    assert "DPT_CPU_CHUNK_BYTES must be an integer number of bytes, got '1k'" in replies[0].error
    assert "DPT_CPU_CHUNK_BYTES must be an integer" in replies[1].error or (
        "store" in replies[1].error
    ), replies[1].error
    assert took < 5.0 + FAST


# ---------------------------------------------------------------------------- the harness itself
def test_harness_kills_a_pool_that_misses_its_deadline(pools: list[RankPool]) -> None:
    """A hung rank becomes a prompt failure naming it, and no process outlives the pool."""
    pool = launch(pools, 2, timeout=LONG)
    t0 = time.monotonic()
    with pytest.raises(PoolError) as info:
        pool.run("bodies:sleep", {"seconds": 60.0}, per_rank={0: {"seconds": 0.0}}, deadline=1.0)
    assert time.monotonic() - t0 < FAST
    text = str(info.value)
    assert "rank 0: ok" in text and "rank 1: no reply before the deadline" in text, text
    assert pool.broken and all(pool.returncode(r) is not None for r in range(2))


def test_harness_reports_every_ranks_traceback(pools: list[RankPool]) -> None:
    pool = launch(pools, 2, timeout=LONG)
    with pytest.raises(PoolError) as info:
        pool.run("bodies:fail", {"message": "x"}, per_rank={1: {"message": "rank one says no"}})
    text = str(info.value)
    assert "rank 0: FAILED" in text and "rank 1: FAILED" in text
    assert "AssertionError: rank one says no" in text and "in fail" in text, text
    assert pool.broken


# ---------------------------------------------------------------------------- (9) harness
def test_ranks_die_with_a_killed_test_process(tmp_path: Any) -> None:
    """A test process killed while its ranks are busy (a CI job's time limit, a GPU check's step
    limit) takes them with it: none is left holding its GPU, shared memory or ports."""
    import os
    import subprocess
    import sys

    from tests.collectives.harness.pool import REPO_ROOT

    pids = tmp_path / "pids"
    code = (
        "import os, sys\n"
        "from tests.collectives.harness import RankPool\n"
        "pool = RankPool.launch('cpu', 2, timeout=60)\n"
        f"open({str(pids)!r}, 'w').write(' '.join(map(str, pool.pids.values())))\n"
        "pool._send(list(pool.pids), {'fn': 'tests.collectives.bodies:sleep', "
        "'kwargs': {'seconds': 120}})\n"
        "sys.stdout.write('busy\\n'); sys.stdout.flush()\n"
        "import time; time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "busy"
        ranks = [int(p) for p in pids.read_text().split()]
        assert len(ranks) == 2
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + FAST
        alive = ranks
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in ranks if _running(p)]
        assert not alive, f"ranks {alive} outlived the killed test process"
    finally:
        parent.kill()
        for p in pids.read_text().split() if pids.exists() else []:
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
