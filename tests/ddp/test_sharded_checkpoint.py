"""``ddp.save_checkpoint``/``load_checkpoint`` with ZeRO: every rank takes part in gathering
the sharded state (a rank-0-only ``state_dict()`` of a ``fully_shard`` model would wait for
peers that are elsewhere), the file holds the full tensors, and a ZeRO-1 run resumed from it
continues bitwise as the uninterrupted one. A ``fully_shard`` model's optimizer state (per
rank) is refused on every rank, not saved as rank 0's shards; its model alone round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.collectives.harness import RankPool

pytestmark = pytest.mark.timeout(120)
BODIES = "tests.ddp.sharded_checkpoint_bodies"


@pytest.mark.parametrize("kind", ["fsdp", "zero1"])
def test_a_sharded_run_saves_full_tensors_and_resumes_exactly(
    world: RankPool, kind: str, tmp_path: Path
) -> None:
    got = world.run(
        f"{BODIES}:round_trip",
        {"kind": kind, "seed": 3, "path": str(tmp_path / "ckpt.npz")},
        deadline=90.0,
    )
    for rank, g in enumerate(got):
        assert g["same"], f"rank {rank}: the loaded run differs from the saved one"
        if kind == "fsdp":  # every rank refuses alike: rank 0's shards are not the state
            assert "not supported yet" in g["refused"], (rank, g["refused"])
    # Full tensors, not shards: the embedding 7x6, the head 5x6, ... whatever the world size.
    assert [7, 6] in got[0]["full_shapes"] and [5, 6] in got[0]["full_shapes"]
