"""Sharded checkpoints: ``save_checkpoint(dir, ..., sharded=True)`` has every rank write its own
shard file and rank 0 the index last; ``load_checkpoint(dir, ...)`` reads on each rank only
what it holds at the current world size. For DDP, ZeRO-1 (``ZeroRedundancyOptimizer``) and
``fully_shard`` with ``reshard_after_forward`` False (ZeRO-2) and True (ZeRO-3):

* at the same world size the resumed run ends bitwise where the uninterrupted one did (random
  generators restored too);
* saved at 4 ranks and resumed at 2 and 3 (and saved at 2, resumed at 4), the run holds right
  after the load, and after 3 more steps, bitwise what the run resumed from the consolidated
  checkpoint of the same step holds (that one resumes exactly: test_sharded_checkpoint.py);
* it loads into a plain, unsharded model and optimizer in one process, with exactly the
  values the consolidated checkpoint gives;
* a save that fails after the shards are written and before the index is, or while a rank
  writes its shard, leaves the previous checkpoint loadable and exact; what a killed save
  leaves behind is ignored and removed by the next save;
* mismatches (shapes, names, a missing index or shard file, ranks holding different state)
  raise a clear error on every rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import tensorlib as tl
from ddp import load_checkpoint, save_checkpoint
from tensorlib import optim
from tests.ddp.conftest import Pools

from .fsdp_bodies import Model
from .sharded_files_bodies import KINDS

pytestmark = pytest.mark.timeout(120)
BODIES = "tests.ddp.sharded_files_bodies"


def _plain_state(path: Path) -> dict[str, np.ndarray]:
    """A plain Model + AdamW in this process (world size 1) loaded from ``path``: its state."""
    model = Model(99)
    opt = optim.AdamW(model.parameters(), lr=0.01)
    load_checkpoint(path, model, opt)
    out = {k: v.numpy() for k, v in model.state_dict().items()}
    for i, entry in opt.state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": np.asarray(v) for k, v in entry.items()})
    return out


@pytest.mark.parametrize(("saved_at", "resumed_at"), [(4, 2), (4, 3), (2, 4)])
def test_a_sharded_checkpoint_resumes_exactly_at_any_world_size(
    pools: Pools, saved_at: int, resumed_at: int, tmp_path: Path
) -> None:
    root = str(tmp_path)
    saved = pools("cpu", saved_at).run(f"{BODIES}:save_all", {"seed": 7, "root": root})
    for rank, by_kind in enumerate(saved):
        for kind, g in by_kind.items():
            assert g["same"], f"{kind} rank {rank}: the resumed run differs from the uninterrupted"
            assert g["step"] == 3 and g["rng_restored"], (kind, rank, g)
    # One file per rank of the save, and the index.
    for kind in KINDS:
        names = sorted(p.name for p in (tmp_path / kind).iterdir())
        assert names[0] == "index.npz" and len(names) == saved_at + 1, names
        assert all(re.fullmatch(r"shard-[0-9a-f]{12}-0000[0-9]\.npz", n) for n in names[1:])
    got = pools("cpu", resumed_at).run(f"{BODIES}:resume_all", {"seed": 7, "root": root})
    for rank, by_kind in enumerate(got):
        for kind, g in by_kind.items():
            assert g["loaded_same"], f"{kind} rank {rank}: loaded state differs from consolidated"
            assert g["same"], f"{kind} rank {rank}: resumed run differs from the consolidated one's"
            assert g["moved"] and g["step"] == 3, (kind, rank, g)
            # rng states belong to the world size they were saved at.
            assert not g["rng_restored"] and g["warned"], (kind, rank, g)
    # Into a plain model in one process: exactly what the consolidated checkpoint holds.
    for kind in KINDS:
        sharded, consolidated = (
            _plain_state(tmp_path / kind),
            _plain_state(tmp_path / f"{kind}.npz"),
        )
        assert sharded.keys() == consolidated.keys()
        for k, v in consolidated.items():
            assert sharded[k].dtype == v.dtype and np.array_equal(sharded[k], v), (kind, k)


def test_a_failed_save_leaves_the_previous_checkpoint(pools: Pools, tmp_path: Path) -> None:
    got = pools("cpu", 3).run(f"{BODIES}:crash", {"seed": 4, "root": str(tmp_path)})
    for rank, by_kind in enumerate(got):
        for kind, g in by_kind.items():
            at_index, at_shard = g["errors"]
            # Rank 0 raises its own error, the others say which rank failed.
            if rank == 0:
                assert at_index.startswith("OSError: simulated fault in write_index"), at_index
            else:
                assert at_index.startswith("RuntimeError") and "rank 0" in at_index, at_index
            if rank == 2:
                assert at_shard.startswith("OSError: simulated fault in _local_state"), at_shard
            else:
                assert at_shard.startswith("RuntimeError") and "rank 2" in at_shard, at_shard
            assert g["loaded_v1"], f"{kind} rank {rank}: the step-1 checkpoint does not load"
            assert g["files_after_failures"] == g["files_v1"], g
            assert g["loaded_v2"], f"{kind} rank {rank}: the next save does not load"
            ids = {n.split("-")[1] for n in g["files_v2"] if n.startswith("shard-")}
            assert len(g["files_v2"]) == 4 and len(ids) == 1, g["files_v2"]
            assert not set(g["files_v2"]) & (set(g["files_v1"]) - {"index.npz"}), g


def test_mismatches_raise_on_every_rank(pools: Pools, tmp_path: Path) -> None:
    got = pools("cpu", 2).run(f"{BODIES}:mismatches", {"seed": 6, "root": str(tmp_path)})
    for rank, m in enumerate(got):
        assert (
            "shape mismatch: blocks.0.up.weight: checkpoint (10, 6) vs model (12, 6)"
            in (m["shape"])
        ), (rank, m["shape"])
        assert "missing from the checkpoint: ['blocks.2." in m["extra_param"], m["extra_param"]
        assert "not in the model: ['blocks.0.norm.bias'" in m["missing_param"], m
        assert (
            m["no_index"].startswith("FileNotFoundError") and "without index.npz" in (m["no_index"])
        ), m["no_index"]
        assert "shard file 'shard-" in m["missing_file"] and "missing" in m["missing_file"], m
        assert (
            m["ranks_differ"].startswith("ValueError") and "different state" in (m["ranks_differ"])
        ), m["ranks_differ"]


def test_single_process_errors(tmp_path: Path) -> None:
    """World size 1, in this process: a sharded save to a file's path, a consolidated load of
    the directory's pieces, and loads asking for what the checkpoint lacks or of other dtypes."""
    model = Model(1)
    opt = optim.AdamW(model.parameters(), lr=0.01)
    (tmp_path / "file.npz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a file .*sharded checkpoint is a directory"):
        save_checkpoint(tmp_path / "file.npz", model, opt, sharded=True)
    save_checkpoint(tmp_path / "ck", model, sharded=True)  # no optimizer
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "ck", Model(2), opt)
    half = Model(2).to(tl.float32)
    load_checkpoint(tmp_path / "ck", half)  # float64 -> float32 rounds, as the file format does
    assert np.array_equal(half.head.weight.numpy(), model.head.weight.numpy().astype(np.float32))
    index = tl.load(tmp_path / "ck" / "index.npz")
    index["tensors"]["model/head.weight"]["dtype"] = "int64"
    tl.save(index, tmp_path / "ck" / "index.npz")
    with pytest.raises(ValueError, match=r"dtype mismatch: head.weight: checkpoint int64 vs"):
        load_checkpoint(tmp_path / "ck", Model(2))
    index["tensors"]["model/head.weight"]["dtype"] = "float32"  # not what the file holds
    tl.save(index, tmp_path / "ck" / "index.npz")
    with pytest.raises(ValueError, match=r"float64 .* the index says float32"):
        load_checkpoint(tmp_path / "ck", Model(2))
