"""``ddp.save_checkpoint``/``load_checkpoint`` with ZeRO: every rank takes part in gathering
the sharded state (a rank-0-only ``state_dict()`` of a ``fully_shard`` model would wait for
peers that are elsewhere), the file holds the full tensors, and a ZeRO-1 run resumed from it
continues bitwise as the uninterrupted one. A ``fully_shard`` model's optimizer state is
gathered into full-shape arrays (the plain optimizer's format for the unsharded model), and
loads back at any world size."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.collectives.harness import RankPool
from tests.ddp.conftest import Pools

pytestmark = pytest.mark.timeout(120)
BODIES = "tests.ddp.sharded_checkpoint_bodies"


@pytest.mark.parametrize("kind", ["fsdp", "fsdp-adam", "fsdp-sgd", "zero1"])
def test_a_sharded_run_saves_full_tensors_and_resumes_exactly(
    world: RankPool, kind: str, tmp_path: Path
) -> None:
    got = world.run(
        f"{BODIES}:round_trip",
        {"kind": kind, "seed": 3, "path": str(tmp_path / "ckpt.npz")},
        deadline=90.0,
    )
    for rank, g in enumerate(got):
        assert g["same"], f"rank {rank}: the resumed run differs from the uninterrupted one"
    # Full tensors, not shards: the embedding 7x6, the head 5x6, ... whatever the world size;
    # the optimizer's moments too (the plain optimizer's format), step counts as they were.
    assert [7, 6] in got[0]["full_shapes"] and [5, 6] in got[0]["full_shapes"]
    assert sorted(m for (m,) in got[0]["moment_shapes"]) == got[0]["full_shapes"]
    assert got[0]["steps"] == ([] if kind == "fsdp-sgd" else [3])


@pytest.mark.parametrize("resume_at", [2, 3])
def test_a_fully_shard_checkpoint_resumes_at_another_world_size(
    pools: Pools, resume_at: int, tmp_path: Path
) -> None:
    """Saved by 4 ranks, resumed by 2 or 3: the sharded run continues exactly as an unsharded
    DDP run given the same checkpoint (the file is the plain optimizer's format)."""
    path = str(tmp_path / "ckpt.npz")
    pools("cpu", 4).run(f"{BODIES}:save_sharded", {"seed": 5, "path": path}, deadline=90.0)
    got = pools("cpu", resume_at).run(
        f"{BODIES}:resume_elsewhere", {"seed": 5, "path": path}, deadline=90.0
    )
    for rank, g in enumerate(got):
        assert g["moved"], f"rank {rank}: the model did not train"
        assert g["same"], f"rank {rank}: the resumed fully_shard run differs from DDP's"


def test_ranks_with_different_optimizer_state_all_raise(multi: RankPool, tmp_path: Path) -> None:
    got = multi.run(
        f"{BODIES}:ranks_disagree", {"seed": 2, "path": str(tmp_path / "c.npz")}, deadline=60.0
    )
    for rank, message in enumerate(got):
        assert "different state" in message, (rank, message)
