"""ZeRO-1, -2 and -3 on the mpi backend (two ranks under ``mpiexec``): the same parameters as
DDP, bit for bit, as on the other backends (test_fsdp.py, test_zero.py; the bodies are
theirs). ``fully_shard`` runs its prefetching all-gathers and its reduce-scatters as the
group's asynchronous work, and ZeRO-1 its bucketed all-gathers, so this covers the mpi
backend's ``async_op`` path for both. And a rank SIGKILLed with a ``fully_shard`` or
ZeRO-1 collective in flight ends the whole job within seconds, as with any other collective on
mpi (tests/collectives/test_mpi.py): mpiexec sees the death and takes the other ranks down.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.collectives.harness.mpipool import MpiRankPool, mpi_unavailable_reason

_REASON = mpi_unavailable_reason()
pytestmark = [
    pytest.mark.slow,  # mpiexec jobs, end to end
    pytest.mark.timeout(180),
    pytest.mark.skipif(_REASON is not None, reason=f"backend mpi: {_REASON}"),
]

DEADLINE = 120.0


@pytest.fixture(scope="module")
def mpi2() -> Iterator[MpiRankPool]:
    pool = MpiRankPool.launch("mpi", 2, timeout=20.0, tag="zero")
    yield pool
    pool.close()


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_fully_shard_equals_ddp_bitwise_on_mpi(mpi2: MpiRankPool, reshard: bool) -> None:
    kw = {"seed": 23, "steps": 50, "reshard": reshard}
    replies = mpi2.run("tests.ddp.fsdp_bodies:same_as_ddp", kw, deadline=DEADLINE)
    for rank, res in enumerate(replies):
        where = f"rank {rank} on {mpi2.label}, reshard_after_forward={reshard}"
        assert all(res["shapes"].values()), f"{where}: state_dict shapes {res['shapes']}"
        assert res["moved"] > 1e-2, f"{where}: training barely moved the parameters"
        assert res["bitwise"] and res["losses_equal"], f"{where}: not bitwise: {res}"


def test_zero_redundancy_optimizer_equals_ddp_bitwise_on_mpi(mpi2: MpiRankPool) -> None:
    # ~50 elements a bucket: several all-gathers in flight at once.
    kw = {"seed": 11, "opt": "adamw", "steps": 50, "bucket_cap_mb": 0.0004}
    got = mpi2.run("tests.ddp.zero_bodies:same_as_ddp", kw, deadline=DEADLINE)
    for rank, res in enumerate(got):
        assert res["bitwise"], f"rank {rank}: ZeRO-1 differs from DDP by {res['max_diff']:.3g}"
        assert res["buckets"] > 1, "the small cap should give several all-gather buckets"
    assert got[0]["digest"] == got[1]["digest"], "ranks ended with different parameters"
    assert sum(g["shard_elements"] for g in got) == got[0]["total"]


@pytest.mark.parametrize(
    ("body", "extra"),
    [
        ("fsdp_dies", {"phase": "all_gather", "reshard": True}),
        ("fsdp_dies", {"phase": "reduce_scatter", "reshard": True}),
        ("zero_dies", {}),
    ],
    ids=["fsdp-all_gather", "fsdp-reduce_scatter", "zero1-all_gather"],
)
def test_rank_killed_mid_sharded_step_ends_the_mpi_job(body: str, extra: dict[str, Any]) -> None:
    pool = MpiRankPool.launch("mpi", 3, timeout=60.0, tag="zero-faults")
    try:
        kw = {"seed": 5, "victim": 1, **extra}
        t0 = time.monotonic()
        fn = f"tests.ddp.zero_faults_bodies:{body}"
        replies = pool.call(fn, kw, deadline=40, grace=None)
        try:
            rc = pool.launcher.wait(10.0)
        except subprocess.TimeoutExpired:
            rc = None
        # Far below the 60 s group timeout: the death, not a timeout, ended the job.
        assert time.monotonic() - t0 < 20.0
        assert rc not in (None, 0), f"mpiexec returncode {rc}"
        assert all(rep.exited and not rep.ok for rep in replies), [r.describe() for r in replies]
        out = pool.launcher_output()
        assert "signal 9" in out or "Killed" in out, out
    finally:
        pool.kill_all()
