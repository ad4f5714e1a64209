"""Rank bodies: sharded checkpoints (``save_checkpoint(..., sharded=True)``, a directory of one
file per rank and an index) of DDP, ZeRO-1 and ``fully_shard`` (ZeRO-2/3) runs, loaded at the
same and at other world sizes.

The reference everywhere is the consolidated (single-file) checkpoint of the same run at the
same step, which tests/ddp/test_sharded_checkpoint.py shows resumes exactly: a run resumed
from the sharded checkpoint must hold, right after the load and after 3 more steps, bitwise
the same shards, pieces, parameters and optimizer state as the run resumed from the
consolidated one at the same world size (the same reduction order, so bitwise holds).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import collectives as C
import ddp._sharded_checkpoint as SC
from ddp import DistributedDataParallel, ZeroRedundancyOptimizer, load_checkpoint, save_checkpoint
from tensorlib import optim

from .fsdp_bodies import Model, _shard
from .sharded_checkpoint_bodies import _steps as steps

KINDS = ("ddp", "zero1", "fsdp2", "fsdp3")


def setup(kind: str, seed: int, **model_kw: Any) -> tuple[Any, Any]:
    """``ddp``: DDP + AdamW; ``zero1``: DDP + ZeroRedundancyOptimizer(AdamW); ``fsdp2`` /
    ``fsdp3``: fully_shard per block and at the root (reshard_after_forward False / True)."""
    model = Model(seed, **model_kw)
    if kind.startswith("fsdp"):
        model = _shard(model, reshard=kind == "fsdp3")
        return model, optim.AdamW(model.parameters(), lr=0.01)
    wrapped = DistributedDataParallel(model)
    if kind == "zero1":
        return wrapped, ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=optim.AdamW, lr=0.01
        )
    return wrapped, optim.AdamW(wrapped.parameters(), lr=0.01)


def local(model: Any, opt: Any) -> list[np.ndarray[Any, Any]]:
    """What this rank holds: its parameters (shards under fully_shard) and its optimizer
    state arrays (its pieces' under ZeRO-1), and the step counts."""
    out = [np.array(p.numpy()) for p in model.parameters()]
    inner: Any = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    for _, entry in sorted(inner.state_dict()["state"].items()):
        out += [np.asarray(v) for _, v in sorted(entry.items())]
    return out


def same(a: list[np.ndarray[Any, Any]], b: list[np.ndarray[Any, Any]]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b, strict=True)
    )


def save_all(seed: int, root: str) -> dict[str, Any]:
    """Per kind: 3 steps, save sharded (``root/kind``) and consolidated (``root/kind.npz``),
    3 more steps; then a fresh run (other weights) loads the sharded checkpoint with its
    random generators and takes the same 3 steps: it must end bitwise where the
    uninterrupted run did."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        noise = np.random.default_rng([seed, C.get_rank()])
        model, opt = setup(kind, seed)
        steps(model, opt, seed, 0, 3)
        noise.random(3)
        sharded = os.path.join(root, kind)
        save_checkpoint(sharded, model, opt, step=3, generators=[noise], sharded=True)
        save_checkpoint(sharded + ".npz", model, opt, step=3)
        steps(model, opt, seed, 3, 6)
        whole, drawn = local(model, opt), noise.random()
        model, opt = setup(kind, seed + 1)
        noise = np.random.default_rng(0)
        got = load_checkpoint(sharded, model, opt, rng=True, generators=[noise])
        steps(model, opt, seed, 3, 6)
        out[kind] = {
            "same": same(whole, local(model, opt)),
            "step": got["step"],
            "rng_restored": got["rng_restored"] and noise.random() == drawn,
        }
    return out


def resume_all(seed: int, root: str) -> dict[str, Any]:
    """Per kind, at this (other) world size: one run loads the sharded checkpoint, another the
    consolidated one; both must hold the same state bitwise after the load and after 3 more
    steps on the same batches."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        model, opt = setup(kind, seed + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = load_checkpoint(os.path.join(root, kind), model, opt, rng=True)
        ref_model, ref_opt = setup(kind, seed + 2)
        load_checkpoint(os.path.join(root, kind + ".npz"), ref_model, ref_opt)
        loaded = same(local(model, opt), local(ref_model, ref_opt))
        start = local(model, opt)
        steps(model, opt, seed, 3, 6)
        steps(ref_model, ref_opt, seed, 3, 6)
        out[kind] = {
            "loaded_same": loaded,
            "same": same(local(model, opt), local(ref_model, ref_opt)),
            "moved": not same(start, local(model, opt)),
            "step": got["step"],
            "rng_restored": got["rng_restored"],
            "warned": any("saved by" in str(w.message) for w in caught),
        }
    return out


def _raise_in(name: str, rank: int, exc: Exception) -> Any:
    """Replace ``SC.<name>`` on ``rank`` by a function that raises ``exc``; the original."""
    original = getattr(SC, name)
    if C.get_rank() == rank:

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise exc

        setattr(SC, name, failing)
    return original


def _failed_save(path: str, model: Any, opt: Any, name: str, rank: int) -> str:
    """A save in which ``SC.<name>`` raises on ``rank``: what this rank raised."""
    original = _raise_in(name, rank, OSError(f"simulated fault in {name}"))
    try:
        save_checkpoint(path, model, opt, step=2, sharded=True)
    except (OSError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        setattr(SC, name, original)
    return "no error"


def crash(seed: int, root: str) -> dict[str, Any]:
    """Per kind (fsdp3, zero1): save at step 1; then two saves at step 2 that fail, one on
    rank 0 after every shard file is written and before the index is (``write_index``), one
    on the last rank before its shard is written; the step-1 checkpoint must still load,
    exactly, and the failed saves' files be gone. Files a killed save would leave behind
    (another save's shard, a temporary file) must not disturb a load, and the next good save
    removes them along with the step-1 files."""
    out: dict[str, Any] = {}
    last = C.get_world_size() - 1
    for kind in ("fsdp3", "zero1"):
        path = os.path.join(root, kind)
        model, opt = setup(kind, seed)
        steps(model, opt, seed, 0, 1)
        save_checkpoint(path, model, opt, step=1, sharded=True)
        v1 = local(model, opt)
        files_v1 = sorted(os.listdir(path))
        steps(model, opt, seed, 1, 2)
        errors = [
            _failed_save(path, model, opt, "write_index", 0),
            _failed_save(path, model, opt, "_local_state", last),
        ]
        C.barrier()
        files_after = sorted(os.listdir(path))
        C.barrier()  # every rank has looked before rank 0 adds files
        if C.get_rank() == 0:  # what a killed save leaves: its shard, a writer's temp file
            shard = next(f for f in files_v1 if f.startswith("shard-"))
            shutil.copy(
                os.path.join(path, shard), os.path.join(path, "shard-0123456789ab-00000.npz")
            )
            Path(path, ".tmp-shard_0123456789ab_00001.npz-1a2b3c4d-99-0-0.npz").write_bytes(b"x")
        C.barrier()
        fresh, fresh_opt = setup(kind, seed + 1)
        got = load_checkpoint(path, fresh, fresh_opt)
        loaded_v1 = same(v1, local(fresh, fresh_opt)) and got["step"] == 1
        C.barrier()
        save_checkpoint(path, model, opt, step=2, sharded=True)
        fresh, fresh_opt = setup(kind, seed + 2)
        got2 = load_checkpoint(path, fresh, fresh_opt)
        out[kind] = {
            "errors": errors,
            "loaded_v1": loaded_v1,
            "files_v1": files_v1,
            "files_after_failures": files_after,
            "files_v2": sorted(os.listdir(path)),
            "loaded_v2": same(local(model, opt), local(fresh, fresh_opt)) and got2["step"] == 2,
        }
    return out


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, KeyError, RuntimeError, FileNotFoundError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def mismatches(seed: int, root: str) -> dict[str, str]:
    """Every rank must raise a clear error (never hang): a model of other shapes, one with a
    parameter the checkpoint lacks, one without a parameter it has, a directory without an
    index, an index naming a missing shard file, and a save where the ranks' optimizers hold
    different state."""
    path = os.path.join(root, "ck")
    model, opt = setup("fsdp3", seed)
    steps(model, opt, seed, 0, 1)
    save_checkpoint(path, model, opt, step=1, sharded=True)
    out = {
        "shape": _error(lambda: load_checkpoint(path, *setup("fsdp3", seed, hidden=12))),
        "extra_param": _error(lambda: load_checkpoint(path, *setup("fsdp3", seed, blocks=3))),
        "missing_param": _error(
            lambda: load_checkpoint(path, *setup("fsdp3", seed, norm_bias=False))
        ),
        "no_index": _error(lambda: load_checkpoint(root, *setup("fsdp3", seed))),
    }
    C.barrier()
    if C.get_rank() == 0:
        os.unlink(os.path.join(path, sorted(os.listdir(path))[-1]))  # the last rank's shard
    C.barrier()
    out["missing_file"] = _error(lambda: load_checkpoint(path, *setup("fsdp3", seed)))
    if C.get_rank() != 0:
        opt.state = {}
    out["ranks_differ"] = _error(
        lambda: save_checkpoint(os.path.join(root, "ck2"), model, opt, sharded=True)
    )
    return out
