"""A rank dying in the middle of a sharded training step ends the job as any collective does.

One rank of three SIGKILLs itself with a ``fully_shard`` all-gather (forward) or
reduce-scatter (backward) in flight, or with ``ZeroRedundancyOptimizer``'s all-gather in
``step()`` in flight. Every survivor's step raises ``PeerFailureError`` naming the dead rank
within seconds (the group timeout is far longer, so no timeout was involved), and its next
collective fails at once with ``GroupAbortedError``: no hang, no silent wrong result. Each
test runs on its own pool (a death breaks it). The bodies are in
tests/ddp/zero_faults_bodies.py.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.collectives.harness import RankPool, Reply, leaked_segments

pytestmark = pytest.mark.timeout(90)

BODIES = "tests.ddp.zero_faults_bodies"
N, VICTIM = 3, 1
LONG = 60.0  # the group timeout: far above FAST, so failing within FAST proves no timeout
FAST = 10.0  # generous for "within seconds" on a loaded 2-core machine
STEP_OPS = ("all_gather", "reduce_scatter")  # a sharded step's collectives


@pytest.fixture
def pool() -> Iterator[RankPool]:
    p = RankPool.launch("cpu", N, timeout=LONG, tag="zero-faults")
    yield p
    p.close()
    assert not leaked_segments(p.run_id), "shared-memory segments left behind"


def check_survivors(pool: RankPool, replies: list[Reply]) -> None:
    dead = replies[VICTIM]
    assert dead.exited and dead.returncode == -signal.SIGKILL, dead.describe()
    for rank in range(N):
        if rank == VICTIM:
            continue
        assert replies[rank].ok, replies[rank].describe()
        res: dict[str, Any] = replies[rank].result
        assert res["type"] == "PeerFailureError", f"rank {rank}: {res}"
        msg = res["message"]
        assert f"rank {VICTIM}" in msg and f"pid {pool.pids[VICTIM]}" in msg, msg
        # The step's collective that fails: the victim's in-flight one, or the next one when
        # its communication thread had already sent its part (a race the test leaves open).
        assert any(f"] {op} #" in msg for op in STEP_OPS), f"rank {rank}: {msg}"
        assert res["elapsed"] < FAST, f"rank {rank} needed {res['elapsed']:.1f} s: {res}"
        nxt = res["next"]
        assert nxt["type"] == "GroupAbortedError" and nxt["elapsed"] < 1.0, nxt
        assert f"rank {VICTIM}" in nxt["message"], nxt


@pytest.mark.parametrize("phase", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_rank_killed_mid_fully_shard_step_fails_peers_fast(
    pool: RankPool, phase: str, reshard: bool
) -> None:
    kw = {"seed": 5, "victim": VICTIM, "phase": phase, "reshard": reshard}
    replies = pool.call(f"{BODIES}:fsdp_dies", kw, deadline=40, grace=None)
    check_survivors(pool, replies)


def test_rank_killed_mid_zero_optimizer_all_gather_fails_peers_fast(pool: RankPool) -> None:
    replies = pool.call(
        f"{BODIES}:zero_dies", {"seed": 5, "victim": VICTIM}, deadline=40, grace=None
    )
    check_survivors(pool, replies)
