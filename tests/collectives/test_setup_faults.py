"""A rank dying while its peers set up a group: they fail fast, naming it, and leak nothing.

Group setup (``new_group``, a collective ``alloc``, DDP's bucket allocations) waits on store
keys that every rank publishes. A rank that dies before publishing its key must not make the
others sit out the group's timeout with an error that names a key: every other rank raises a
``PeerFailureError`` naming the dead rank, its pid and the setup op, within seconds. The
group timeout is long here, so passing the time bound proves no timeout was involved.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.collectives.expect import results
from tests.collectives.harness import RankPool, leaked_segments

pytestmark = pytest.mark.timeout(120)

LONG = 30.0  # the group timeout: far above the bound below
FAST = 5.0  # every survivor's error within this many seconds of the death


@pytest.fixture
def pools() -> Iterator[list[RankPool]]:
    made: list[RankPool] = []
    yield made
    for p in made:
        p.kill_all()
    leaked = [name for p in made for name in leaked_segments(p.run_id)]
    assert not leaked, f"shared-memory segments left behind: {leaked}"


def _run(
    pools: list[RankPool], n: int, step: str, victim: int, how: str
) -> tuple[RankPool, float, dict[int, Any]]:
    pool = RankPool.launch("cpu", n, timeout=LONG)
    pools.append(pool)
    t0 = time.monotonic()
    replies = pool.call(
        "setup_bodies:die_at_setup",
        {"step": step, "victim": victim, "how": how},
        deadline=LONG + 15,
        grace=None,
        uncaught=how == "raise",
    )
    took = time.monotonic() - t0
    if how == "leave":
        assert replies[victim].result == {"left": True}, replies[victim].describe()
    else:
        assert replies[victim].exited, replies[victim].describe()
    survivors = [r for r in range(n) if r != victim]
    got = results([replies[r] for r in survivors])
    return pool, took, dict(zip(survivors, got, strict=True))


@pytest.mark.parametrize(
    "n,step,victim,how",
    [
        (2, "new_group", 1, "kill"),
        (3, "new_group", 2, "exit"),
        (4, "new_group", 0, "kill"),  # rank 0 also hosts the store
        (3, "alloc", 1, "kill"),
        (2, "alloc", 0, "exit"),
        (3, "ddp", 1, "kill"),
        (3, "new_group", 1, "raise"),
        (2, "new_group", 1, "leave"),
    ],
)
def test_rank_dying_at_setup_is_named_fast(
    pools: list[RankPool], n: int, step: str, victim: int, how: str
) -> None:
    pool, took, got = _run(pools, n, step, victim, how)
    op = "alloc" if step in ("alloc", "ddp") else "new_group"
    named = {
        "raise": f"rank {victim} (pid {pool.pids[victim]}) failed: uncaught ValueError: boom",
        "leave": f"rank {victim} left the job (destroy_process_group) before this new_group",
    }.get(how, f"rank {victim} (pid {pool.pids[victim]}) is gone")
    for rank, res in got.items():
        assert res["type"] == "PeerFailureError", (rank, res)
        assert named in res["message"], (rank, res["message"])
        assert res["message"].startswith(f"[rank {rank}] {op}"), (rank, res["message"])
        assert res["elapsed"] < FAST, (rank, res)
    assert took < FAST + 3, took
    # The victim's and the survivors' segments are gone even though setup failed midway.
    for r in got:
        pool.kill(r)
    assert leaked_segments(pool.run_id) == []


def test_clean_setup_still_works(pools: list[RankPool]) -> None:
    pool = RankPool.launch("cpu", 3, timeout=LONG)
    pools.append(pool)
    assert pool.run("setup_bodies:after_setup_is_usable", {"size": 5000}) == [6.0] * 3
