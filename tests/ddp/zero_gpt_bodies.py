"""Rank bodies: the transformer example's model (examples/train_transformer_ddp.py's CharGPT,
small, float64) trained 50 AdamW steps under DDP, ZeRO-1, ZeRO-2 and ZeRO-3 on the same
per-rank batches."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
from ddp import DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard

ROOT = Path(__file__).resolve().parents[2]
VOCAB, D_MODEL, LAYERS, HEADS, BLOCK, PER_RANK = 11, 16, 2, 2, 8, 2
_LOADING = threading.Lock()  # rank threads load it once, and none sees it half-executed


def _example() -> Any:
    """The example script as a module (its ``main`` only runs as ``__main__``)."""
    name = "_train_transformer_ddp_example"
    with _LOADING:
        mod = sys.modules.get(name)
        if mod is None:
            path = ROOT / "examples" / "train_transformer_ddp.py"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # dataclasses look their module up while it executes
            spec.loader.exec_module(mod)
    return mod


def _model(seed: int) -> Any:
    ex = _example()
    tl.manual_seed(seed)
    return ex.CharGPT(VOCAB, D_MODEL, LAYERS, HEADS, BLOCK, "cpu").to(dtype=tl.float64)


def _wrap(stage: str, seed: int) -> tuple[Any, Any]:
    model = _model(seed)
    kw: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.1}
    if stage in ("ddp", "zero1"):
        model = DistributedDataParallel(model)
        if stage == "zero1":
            return model, ZeroRedundancyOptimizer(model.parameters(), tl.optim.AdamW, **kw)
        return model, tl.optim.AdamW(model.parameters(), **kw)
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=stage == "zero3")
    fully_shard(model, reshard_after_forward=stage == "zero3")
    return model, tl.optim.AdamW(model.parameters(), **kw)


def _full(model: Any) -> dict[str, Any]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {k: v.numpy().copy() for k, v in inner.state_dict().items()}


def fifty_steps(seed: int, steps: int) -> dict[str, Any]:
    """Each stage's full parameters after ``steps`` AdamW steps, against DDP's."""
    rank, world = C.get_rank(), C.get_world_size()
    lm_loss = _example().lm_loss
    rng = np.random.default_rng(seed)
    data = rng.integers(0, VOCAB, size=(steps, world * PER_RANK, BLOCK + 1))
    mine = data[:, rank * PER_RANK : (rank + 1) * PER_RANK]
    out: dict[str, Any] = {}
    ref: dict[str, Any] = {}
    for stage in ("ddp", "zero1", "zero2", "zero3"):
        model, opt = _wrap(stage, seed)
        for s in range(steps):
            opt.zero_grad()
            lm_loss(model(tl.tensor(mine[s, :, :-1])), tl.tensor(mine[s, :, 1:])).backward()
            opt.step()
        full = _full(model)
        if stage == "ddp":
            ref = full
            start = _full(_model(seed))
            out["moved"] = max(float(np.abs(full[k] - start[k]).max()) for k in full)
            continue
        out[stage] = {
            "keys": list(full) == list(ref),
            "max_diff": max(float(np.abs(full[k] - ref[k]).max()) for k in ref),
            "bitwise": all(np.array_equal(full[k], ref[k]) for k in ref),
        }
    return out
