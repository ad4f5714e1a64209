"""Rank bodies for the training essentials under DDP: clipping, the gradient scaler, autocast
and a learning-rate schedule, against the single-process reference on the global batch.

Every rank trains the same seeded :class:`~tests.ddp.ddp_bodies.Net` with DDP; in the same
process a plain copy trains on the union of all ranks' samples of each step (what averaging
gives). On the steps in ``inf_steps`` rank ``inf_rank`` alone puts an inf into its input, so
only that rank's local gradients are nonfinite: after the all-reduce every rank must see it,
skip that step, and back the scale off alike.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
from ddp import DistributedDataParallel
from tensorlib import Tensor, nn
from tensorlib.nn.utils import clip_grad_norm_
from tensorlib.optim import lr_scheduler

from .ddp_bodies import D_OUT, Net, Shards, _digest, _widths


class _Trainer:
    """One model with its optimizer, schedule and scaler, stepped the way a script does."""

    def __init__(self, model: nn.Module, case: dict[str, Any]) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if case.get("opt", "adamw") == "sgd":
            self.opt: tl.optim.Optimizer = tl.optim.SGD(params, lr=0.1, momentum=0.9)
        else:
            self.opt = tl.optim.AdamW(params, lr=0.02, weight_decay=0.01)
        warmup = 3
        self.sched = lr_scheduler.SequentialLR(
            self.opt,
            [
                lr_scheduler.LinearLR(self.opt, start_factor=0.25, total_iters=warmup),
                lr_scheduler.CosineAnnealingLR(self.opt, T_max=case["steps"] - warmup),
            ],
            milestones=[warmup],
        )
        self.scaler = tl.amp.GradScaler(init_scale=2.0**8, growth_interval=2)
        self.params = params
        self.max_norm: float = case["max_norm"]
        self.model = model

    def step(self) -> tuple[float, bool, float]:
        """Unscale, clip, step, update; returns (total norm, skipped, scale after update)."""
        self.scaler.unscale_(self.opt)
        norm = float(clip_grad_norm_(self.params, self.max_norm).item())
        before = _digest(self.model)
        scale = self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        skipped = self.scaler.get_scale() < scale
        if skipped != (_digest(self.model) == before):
            raise AssertionError("the scaler reported a skip but the parameters moved, or not")
        self.sched.step()
        return norm, skipped, self.scaler.get_scale()


def _poisoned(x: Tensor) -> Tensor:
    data = x.numpy().copy()
    data[0, 0] = np.inf
    return tl.tensor(data)


def essentials(seed: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train ``case`` with DDP and the reference; per-step norms, skips, scales, learning rates.

    A case: ``dtype``, ``steps``, ``batch``, ``accum`` (micro-batches, all but the last under
    ``no_sync``), ``amp`` (autocast to float16), ``inf_steps``, ``inf_rank``, ``max_norm``,
    ``opt`` (adamw|sgd).
    """
    group = C.get_default_group()
    world, rank = group.size, group.rank
    steps, batch, accum = case["steps"], case.get("batch", 4), case.get("accum", 1)
    dtype, amp = case.get("dtype", "float32"), case.get("amp", False)
    inf_steps, inf_rank = set(case.get("inf_steps", ())), case.get("inf_rank", 0) % world
    data = Shards(seed, world, batch, steps, accum, dtype)
    widths = _widths(3, 16)
    ddp = DistributedDataParallel(Net(widths, dtype, seed + 1000 * rank))
    ref = Net(widths, dtype, seed)
    mine, theirs = _Trainer(ddp.module, case), _Trainer(ref, case)
    autocast = tl.autocast(dtype=tl.float16, enabled=amp)

    rec: dict[str, list[Any]] = {k: [] for k in ("norm", "skip", "scale", "lr", "ref_norm")}
    for step in range(steps):
        mine.opt.zero_grad()
        theirs.opt.zero_grad()
        for micro in range(accum):
            x, y = data.xy(data.rows(rank, step, micro))
            if step in inf_steps and rank == inf_rank and micro == 0:
                x = _poisoned(x)
            sync = contextlib.nullcontext() if micro == accum - 1 else ddp.no_sync()
            with sync, autocast:
                loss = ((ddp(x) - y) ** 2).mean() * (1.0 / accum)
            mine.scaler.scale(loss).backward()
        rows = [data.rows(r, step, m) for r in range(world) for m in range(accum)]
        x, y = data.xy(np.concatenate(rows))
        if step in inf_steps:
            x = _poisoned(x)
        with autocast:
            ref_loss = ((ref(x) - y) ** 2).sum() * (1.0 / (world * accum * batch * D_OUT))
        theirs.scaler.scale(ref_loss).backward()
        norm, skipped, scale = mine.step()
        ref_norm, _, _ = theirs.step()
        rec["norm"].append(norm)
        rec["ref_norm"].append(ref_norm)
        rec["skip"].append(skipped)
        rec["scale"].append(scale)
        rec["lr"].append(mine.opt.param_groups[0]["lr"])
    diff = max(
        float(np.max(np.abs(p.data - q.data)))
        for p, q in zip(ddp.module.parameters(), ref.parameters(), strict=True)
    )
    size = max(float(np.max(np.abs(q.data))) for q in ref.parameters())
    return {**rec, "param_diff": diff, "param_scale": size, "digest": _digest(ddp.module)}
