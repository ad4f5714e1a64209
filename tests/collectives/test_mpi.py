"""The mpi backend's own behaviour under ``mpiexec``: initialization, mismatches, timeouts,
ranks that die, and the job-wide abort that keeps a stuck MPI job from hanging.

(Every collective's correctness runs in test_collectives.py on the mpi pools.) Each test here
starts its own ``mpiexec`` job with a hard deadline; the pool kills mpiexec's whole session
when a test ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.collectives import expect
from tests.collectives.expect import results
from tests.collectives.harness import PoolCache, PoolSpec, free_port
from tests.collectives.harness.mpipool import (
    MpiRankPool,
    mpi_env,
    mpi_unavailable_reason,
    mpiexec_command,
    mpiexec_flavor,
)
from tests.helpers import run_to_end

_REASON = mpi_unavailable_reason()
pytestmark = [
    pytest.mark.slow,  # mpiexec jobs that wait out timeouts and aborts (test_collectives runs
    # the mpi backend's collectives in the default run)
    pytest.mark.timeout(120),
    pytest.mark.skipif(_REASON is not None, reason=f"backend mpi: {_REASON}"),
]

LONG = 120.0
FAST = 10.0
NONBLOCKING = {"DPT_MPI_ENGINE": "nonblocking"}


@pytest.fixture
def pools() -> Iterator[list[MpiRankPool]]:
    made: list[MpiRankPool] = []
    yield made
    for p in made:
        p.kill_all()


def launch(pools: list[MpiRankPool], n: int, **kw: Any) -> MpiRankPool:
    pool = MpiRankPool.launch("mpi", n, **kw)
    pools.append(pool)
    return pool


def finish(pool: MpiRankPool, limit: float = FAST) -> tuple[int | None, list[str]]:
    """Tell every live rank to exit; mpiexec's return code and each rank's stderr tail."""
    alive = [r for r in pool.ranks if pool.returncode(r) is None]
    pool._send(alive, {"fn": "__exit__"})
    try:
        rc: int | None = pool.launcher.wait(limit)
    except subprocess.TimeoutExpired:
        rc = None
    return rc, [pool.stderr_tail(r) for r in pool.ranks]


def wait_job_end(pool: MpiRankPool, limit: float) -> int | None:
    try:
        return pool.launcher.wait(limit)
    except subprocess.TimeoutExpired:
        return None


# ---------------------------------------------------------------------------- init
def test_world_comes_from_mpiexec(pool_cache: PoolCache) -> None:
    pool = pool_cache.get(PoolSpec("mpi", 2))
    got = pool.run("mpi_bodies:init_source")
    for rank, res in enumerate(got):
        assert res["mpi"] == [rank, 2]
        assert f"backend=mpi rank={rank} world_size=2" in res["config"], res
        # The launcher's variables (Open MPI's, or MPICH Hydra's PMI_*) agree with MPI.
        source = "ompi+mpi" if mpiexec_flavor() == "openmpi" else "pmi+mpi"
        assert f"(from {source})" in res["config"], res


def test_user_mpi_traffic_does_not_mix_with_the_groups(pool_cache: PoolCache) -> None:
    pool = pool_cache.get(PoolSpec("mpi", 3))
    assert pool.run("mpi_bodies:user_comm_untouched", {"seed": 7}) == [27] * 3  # 1 -> 3 -> 9 -> 27


def test_new_group_of_a_store_backend_is_refused(pool_cache: PoolCache) -> None:
    pool = pool_cache.get(PoolSpec("mpi", 2))
    for res in pool.run("mpi_bodies:new_group_other_backend"):
        assert res["type"] == "ValueError", res
        assert "backend='cpu'" in res["message"] and "use backend='mpi'" in res["message"], res


def test_mpi_group_inside_a_cpu_world(pools: list[MpiRankPool]) -> None:
    """A cpu world whose ranks mpiexec started (env:// from Open MPI's variables plus
    MASTER_ADDR/PORT) builds an mpi group with Comm.Create_group, over its members only."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    pool = MpiRankPool.launch("cpu", 3, env=env, timeout=30)
    pools.append(pool)
    got = pool.run("mpi_bodies:mpi_subgroup_of_cpu_world", {"members": [2, 0]})
    assert got[1] == {"member": False, "backend": "cpu"}
    for r in (0, 2):
        assert got[r] == {"member": True, "backend": "mpi", "size": 2, "value": 4.0}


def test_env_that_disagrees_with_mpi_is_an_error(pools: list[MpiRankPool]) -> None:
    """WORLD_SIZE=3 on ranks mpiexec started 2 of."""
    pool = MpiRankPool("mpi", 2, env={"RANK": "0", "WORLD_SIZE": "3"}, timeout=10)
    pools.append(pool)
    hello = pool.start(init_deadline=60)
    for rep in hello:
        assert not rep.ok
        assert "rank 0 of 3" in rep.error and "MPI started it as rank" in rep.error, rep.error
        assert "mpiexec -n 3" in rep.error, rep.error


def test_default_backend_under_mpiexec_is_mpi() -> None:
    """``mpiexec -n 2 python train.py`` with ``init_process_group()``: no store address, so
    the mpi backend (with MASTER_PORT set it would be the cpu backend's rendezvous)."""
    code = (
        "import sys, collectives as C; g = C.init_process_group(); "
        "sys.stdout.write(f'{C.get_backend()} {g.rank} {g.size}\\n'); sys.stdout.flush(); "
        "C.destroy_process_group()"
    )
    proc = run_to_end([*mpiexec_command(2), sys.executable, "-c", code], mpi_env(), 60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(ln for ln in proc.stdout.splitlines() if ln.strip())
    assert lines == ["mpi 0 2", "mpi 1 2"], proc.stdout


def test_singleton_under_another_launcher_is_an_error(tmp_path: Any) -> None:
    """collectives.run/torchrun-style variables on a process mpiexec did not start."""
    env = mpi_env()
    env.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    code = "import collectives as C; C.init_process_group('mpi')"
    proc = run_to_end([sys.executable, "-c", code], env, 60)
    assert proc.returncode != 0
    err = proc.stderr
    assert "EnvError" in err and "rank 1 of 2" in err, err[-2000:]
    assert "singleton" in err and "mpiexec -n 2" in err, err[-2000:]


# ---------------------------------------------------------------------------- mismatch
# The records are compared by the one shared renderer (every kind runs on the cpu backend in
# test_reliability.py); here each of mpi's two checks sees a kind that differs in the call, one
# in the arguments and one past the small-message size.
P2P_KINDS = ("op", "root", "large_shape")
CASES = [(kind, "p2p") for kind in P2P_KINDS] + [("op", "gather"), ("large_shape", "gather")]


@pytest.mark.parametrize("kind,check", CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_mismatch_fails_every_rank_before_data_moves(
    pools: list[MpiRankPool], kind: str, check: str
) -> None:
    env = {"DPT_MPI_P2P_CHECK_MAX": "0"} if check == "gather" else {}
    pool = launch(pools, 3, timeout=LONG, env=env)
    got = results(pool.call("bodies:mismatch", {"kind": kind}, deadline=30, grace=None))
    for after in expect.mismatched(got, kind, FAST):
        assert after["elapsed"] < 1.0, after
    # Nothing is pending inside MPI: the job ends normally.
    rc, _ = finish(pool)
    assert rc == 0


# ---------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize(
    "n,check,engine",
    [(2, "p2p", "blocking"), (3, "gather", "nonblocking")],
)
def test_timeout_names_op_seq_then_job_aborts_at_exit(
    pools: list[MpiRankPool], n: int, check: str, engine: str
) -> None:
    timeout, skipper = 2.0, 1
    env = {"DPT_MPI_ENGINE": engine}
    if check == "gather":
        env["DPT_MPI_P2P_CHECK_MAX"] = "0"
    pool = launch(pools, n, timeout=timeout, env=env)
    got = results(
        pool.call(
            "bodies:skip_collective",
            {"sleep": timeout + 1.0, "skipper": skipper},
            deadline=30,
            grace=None,
        )
    )
    waiting = [r for r in range(n) if r != skipper]
    # The p2p check knows who is missing; the gather check only that someone is.
    missing = f"ranks [{skipper}] never arrived" if check == "p2p" else "some rank never arrived"
    for rank in waiting:
        msg = expect.timed_out(got[rank], timeout, FAST, missing)
        assert f"[rank {rank}] all_reduce #2" in msg and "MPI_Abort" in msg, msg
    # The next call fails at once, saying why.
    for rep in pool.call("bodies:ping", {"seed": 0}, ranks=waiting, deadline=30):
        assert not rep.ok and "GroupAbortedError" in rep.error and "timed out" in rep.error
    rc, tails = finish(pool)
    assert rc not in (None, 0), f"mpiexec returncode {rc}"
    assert any("calling MPI_Abort" in tails[r] for r in waiting), tails


def test_timeout_without_check_nonblocking(pools: list[MpiRankPool]) -> None:
    timeout = 1.5
    env = {"DPT_MPI_CHECK": "0", **NONBLOCKING}
    pool = launch(pools, 2, timeout=timeout, env=env)
    got = results(
        pool.call("bodies:skip_collective", {"sleep": timeout + 1.0, "skipper": 1}, deadline=30)
    )
    assert got[0]["type"] == "CollectiveTimeoutError", got[0]
    assert "DPT_MPI_CHECK=0" in got[0]["message"], got[0]


def test_watchdog_aborts_a_stuck_blocking_call(pools: list[MpiRankPool]) -> None:
    """Blocking engine without the check: the data call itself waits for the skipper; past
    the timeout the watchdog ends the whole job with a message naming op and sequence."""
    timeout = 1.5
    pool = launch(pools, 2, timeout=timeout, env={"DPT_MPI_CHECK": "0"})
    t0 = time.monotonic()
    pool.submit("bodies:skip_collective", {"sleep": 60.0, "skipper": 1})
    rc = wait_job_end(pool, timeout + FAST)
    assert rc not in (None, 0), f"mpiexec returncode {rc}"
    assert time.monotonic() - t0 < timeout + FAST
    tail = pool.stderr_tail(0)
    assert "calling MPI_Abort" in tail and "all_reduce #2" in tail, tail
    assert "did not finish within the group's timeout" in tail, tail


def test_new_group_that_a_rank_skips_times_out(pools: list[MpiRankPool]) -> None:
    pool = launch(pools, 2, timeout=1.5)
    got = results(
        pool.call("mpi_bodies:new_group_missing_rank", {"skipper": 1, "sleep": 3.0}, deadline=30)
    )
    assert got[0]["type"] == "CollectiveTimeoutError", got[0]
    assert "did not call new_group" in got[0]["message"], got[0]


# ---------------------------------------------------------------------------- dying ranks
def test_sigkilled_rank_ends_the_job(pools: list[MpiRankPool]) -> None:
    n, victim = 3, 1
    pool = launch(pools, n, timeout=LONG)
    kw = {"size": 1_000_003, "victim": victim, "kill_after": 0.5, "limit": 60.0}
    t0 = time.monotonic()
    replies = pool.call("bodies:allreduce_until_error", kw, deadline=40, grace=None)
    rc = wait_job_end(pool, FAST)
    assert time.monotonic() - t0 < 0.5 + FAST + 5
    assert rc not in (None, 0), f"mpiexec returncode {rc}"
    assert all(rep.exited and not rep.ok for rep in replies), [r.describe() for r in replies]
    out = pool.launcher_output()
    assert "signal 9" in out or "Killed" in out, out


def test_uncaught_exception_aborts_the_job(pools: list[MpiRankPool]) -> None:
    n, victim = 3, 2
    pool = launch(pools, n, timeout=LONG)
    pool.submit(
        "bodies:raise_uncaught",
        {"victim": victim, "message": "boom from the victim", "delay": 0.3},
        uncaught=True,
    )
    rc = wait_job_end(pool, FAST + 5)
    assert rc not in (None, 0), f"mpiexec returncode {rc}"
    tail = pool.stderr_tail(victim)
    assert "ValueError: boom from the victim" in tail, tail
    assert "calling MPI_Abort: uncaught ValueError" in tail, tail
    for r in range(n):
        assert pool.returncode(r) is not None


def test_clean_exit_leaves_no_process(pools: list[MpiRankPool]) -> None:
    pool = launch(pools, 2, timeout=LONG)
    assert pool.run("bodies:ping", {"seed": 0}) == [3, 3]
    pids = list(pool.pids.values())
    rc, _ = finish(pool)
    assert rc == 0
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split(")")[-1].split()[0] in ("Z", "X")
