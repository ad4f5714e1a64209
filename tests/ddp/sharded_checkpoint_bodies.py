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
    if kind == "fsdp":
        model = _shard(model, reshard=True)
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
    """Train 6 steps straight; and 3 steps, save, load into a fresh run, 3 more steps.

    ``fsdp``: the model alone (its optimizer's state is per rank, refused with it), and the
    check is the loaded shards; ``zero1``: model and optimizer, and the check is the end."""
    model, opt = _setup(kind, seed)
    _steps(model, opt, seed, 0, 6)
    whole = _local(model)

    model, opt = _setup(kind, seed)
    _steps(model, opt, seed, 0, 3)
    refused = ""
    if kind == "fsdp":
        try:
            save_checkpoint(path, model, opt, step=3)
        except NotImplementedError as exc:
            refused = str(exc)
        save_checkpoint(path, model, step=3)
        at_save = _local(model)
        model, opt = _setup(kind, seed + 1)  # other weights: the load must replace them
        load_checkpoint(path, model)
        same = all(np.array_equal(a, b) for a, b in zip(at_save, _local(model), strict=True))
    else:
        save_checkpoint(path, model, opt, step=3)
        model, opt = _setup(kind, seed + 1)
        load_checkpoint(path, model, opt)
        _steps(model, opt, seed, 3, 6)
        same = all(np.array_equal(a, b) for a, b in zip(whole, _local(model), strict=True))
    saved = tl.load(path)["model"]
    full_shapes = sorted(tuple(np.shape(v)) for v in saved.values())
    return {"same": same, "refused": refused, "full_shapes": [list(s) for s in full_shapes]}
