"""Rank bodies: ``ddp.save_checkpoint``/``load_checkpoint`` of a sharded run (a ``fully_shard``
model with AdamW, and DDP with a ``ZeroRedundancyOptimizer``): the checkpoint holds the full
(consolidated) state, and loading it into a fresh sharded run gives back every rank's shards
and optimizer state, so the next steps equal the uninterrupted run's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
from ddp import (
    DistributedDataParallel,
    ZeroRedundancyOptimizer,
    load_checkpoint,
    save_checkpoint,
)
from tensorlib import optim

from .fsdp_bodies import Model, _batch, _shard


def _setup(kind: str, seed: int) -> tuple[Any, Any]:
    model = Model(seed)
    if kind.startswith("fsdp"):
        model = _shard(model, reshard=True)
        if kind == "fsdp-sgd":
            return model, optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        if kind == "fsdp-adam":
            return model, optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
        return model, optim.AdamW(model.parameters(), lr=0.01)
    ddp_model = DistributedDataParallel(model)
    return ddp_model, ZeroRedundancyOptimizer(
        ddp_model.parameters(), optimizer_class=optim.AdamW, lr=0.01
    )


def _steps(model: Any, opt: Any, seed: int, first: int, last: int) -> None:
    rank = C.get_rank()
    for step in range(first, last):
        x, y = _batch(seed, step, rank)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _local(model: Any) -> list[list[float]]:
    return [p.numpy().tolist() for p in model.parameters()]


def round_trip(kind: str, seed: int, path: str) -> dict[str, Any]:
    """Train 6 steps straight; and 3 steps, save model and optimizer, load both into a fresh
    run (other weights, no optimizer state), 3 more steps: the end must be the same, bitwise.

    ``fsdp``, ``fsdp-adam``, ``fsdp-sgd``: a ``fully_shard`` model with a plain AdamW, Adam
    (amsgrad) or SGD (momentum) over its shards, their state gathered into full-shape arrays;
    ``zero1``: DDP with a ``ZeroRedundancyOptimizer`` (AdamW)."""
    model, opt = _setup(kind, seed)
    _steps(model, opt, seed, 0, 6)
    whole = _local(model)

    model, opt = _setup(kind, seed)
    _steps(model, opt, seed, 0, 3)
    save_checkpoint(path, model, opt, step=3)
    model, opt = _setup(kind, seed + 1)  # other weights: the load must replace them
    load_checkpoint(path, model, opt)
    _steps(model, opt, seed, 3, 6)
    same = all(np.array_equal(a, b) for a, b in zip(whole, _local(model), strict=True))
    saved = tl.load(path)
    full_shapes = sorted(tuple(np.shape(v)) for v in saved["model"].values())
    states = saved["optimizer"]["state"].values()
    # Each parameter's per-element state arrays (moments, momentum), all of one shape.
    moments = [sorted({tuple(np.shape(v)) for v in s.values() if np.ndim(v) > 0}) for s in states]
    steps = sorted({int(s["step"]) for s in states if "step" in s})
    return {
        "same": same,
        "full_shapes": [list(s) for s in full_shapes],
        "moment_shapes": [[list(s) for s in m] for m in moments],
        "steps": steps,
    }


def save_sharded(seed: int, path: str) -> bool:
    """3 ``fully_shard`` AdamW steps, then ``save_checkpoint`` of model and optimizer."""
    model, opt = _setup("fsdp", seed)
    _steps(model, opt, seed, 0, 3)
    save_checkpoint(path, model, opt, step=3)
    return True


def resume_elsewhere(seed: int, path: str) -> dict[str, Any]:
    """Load a checkpoint saved at another world size twice, into a ``fully_shard`` run and
    into an unsharded DDP run with a plain AdamW (the full-shape state is that optimizer's
    format), take 3 more steps in each on the same batches, and compare the full models.

    Both start from the same full state and average the same per-rank gradients (fully_shard
    matches DDP bitwise on the cpu backend, tests/ddp/test_fsdp.py), so they must agree
    bitwise; a rank given wrong rows of the optimizer state would make them differ."""
    sharded, opt = _setup("fsdp", seed + 1)
    load_checkpoint(path, sharded, opt)
    _steps(sharded, opt, seed, 3, 6)
    plain = DistributedDataParallel(Model(seed + 2))
    plain_opt = optim.AdamW(plain.parameters(), lr=0.01)
    load_checkpoint(path, plain, plain_opt)
    _steps(plain, plain_opt, seed, 3, 6)
    full, ref = sharded.state_dict(), plain.module.state_dict()
    return {
        "same": all(np.array_equal(full[k].numpy(), ref[k].numpy()) for k in ref),
        "moved": not np.array_equal(full["head.weight"].numpy(), Model(seed).head.weight.numpy()),
    }


def ranks_disagree(seed: int, path: str) -> str:
    """Ranks other than 0 drop their optimizer state before saving: every rank must raise
    the same kind of error (not hang in a gather of mismatched sizes)."""
    model, opt = _setup("fsdp", seed)
    _steps(model, opt, seed, 0, 1)
    if C.get_rank() != 0:
        opt.state = {}
    try:
        save_checkpoint(path, model, opt, step=1)
    except ValueError as exc:
        return str(exc)
    return ""
