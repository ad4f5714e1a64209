"""A tiny training run that checkpoints, can kill itself, and resumes exactly (tests only).

    python -m collectives.run --nproc-per-node 2 tests/ddp/resume_script.py \\
        --ckpt /tmp/c.npz --out /tmp/final.npz --steps 30 --every 4 --kill-step 9 --kill-rank 1

Everything that makes resuming hard is here: dropout (tensorlib's generator, a different mask on
every rank), NumPy's legacy global generator, a ``numpy.random.Generator`` and Python's
``random`` (input noise, per rank), AdamW with a StepLR schedule, a GradScaler that grows its
scale, and a shuffled DistributedSampler whose epochs end mid-run. Rank 0 writes the final
parameters to ``--out``. The attempt number is ``DPT_RESTART_COUNT`` (set by the launcher's
``--max-restarts``); a fresh attempt (0) writes a step-0 checkpoint before training and never
resumes, a later one resumes from ``--ckpt`` when it exists. Only attempt 0 kills itself, at the
start of ``--kill-step`` (rank ``--kill-rank``), or with ``--kill-in-save`` in the middle of the
checkpoint written at that step (rank 0 SIGKILLs itself at its first ``os.fsync``: the temporary
file is written, not yet renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import collectives
import tensorlib as tl
from ddp import (
    DataLoader,
    DistributedDataParallel,
    DistributedSampler,
    load_checkpoint,
    save_checkpoint,
)
from tensorlib import nn, optim
from tensorlib.optim import lr_scheduler

SAMPLES = 23  # with a per-rank batch of 2: epochs of 6 (2 ranks) or 4 (3 ranks) steps


@dataclass
class Run:
    """What one rank trains with."""

    model: Any
    opt: optim.Optimizer
    sched: lr_scheduler.LRScheduler
    scaler: tl.amp.GradScaler
    loader: DataLoader
    gen: np.random.Generator


def build(dtype: str, world: int, rank: int) -> Run:
    """The same model and data on every rank; per-rank random streams seeded by rank."""
    tl.manual_seed(0)
    dt = np.dtype(dtype)
    model: Any = nn.Sequential(
        nn.Linear(4, 8, dtype=dt), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 2, dtype=dt)
    )
    if world > 1:
        model = DistributedDataParallel(model)
    opt = optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    scaler = tl.amp.GradScaler(init_scale=2.0**8, growth_interval=3)
    data = np.random.default_rng(7)
    x = data.standard_normal((SAMPLES, 4)).astype(dt)
    y = data.standard_normal((SAMPLES, 2)).astype(dt)
    sampler = DistributedSampler(SAMPLES, num_replicas=world, rank=rank, seed=3)
    loader = DataLoader((x, y), batch_size=2, sampler=sampler)
    # Each rank draws its own dropout masks and noise.
    tl.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    return Run(model, opt, sched, scaler, loader, np.random.default_rng(400 + rank))


def train_step(run: Run, xb: tl.Tensor, yb: tl.Tensor) -> None:
    """One step; every generator is drawn from."""
    noise = 0.01 * np.random.standard_normal(xb.shape) + 0.01 * run.gen.standard_normal(xb.shape)
    noise = noise + 0.01 * random.random()
    xb = xb + tl.tensor(noise.astype(xb.numpy().dtype))
    loss = ((run.model(xb) - yb) ** 2).mean()
    run.opt.zero_grad()
    run.scaler.scale(loss).backward()
    run.scaler.step(run.opt)
    run.scaler.update()
    run.sched.step()


def save(run: Run, path: str, step: int) -> None:
    """A checkpoint of everything this run needs (every rank calls it)."""
    save_checkpoint(
        path,
        run.model,
        run.opt,
        step=step,
        scheduler=run.sched,
        scaler=run.scaler,
        loader=run.loader,
        generators=[run.gen],
    )


def load(run: Run, path: str) -> int:
    """Resume from ``path``; the step to continue after."""
    state = load_checkpoint(
        path,
        run.model,
        run.opt,
        scheduler=run.sched,
        scaler=run.scaler,
        loader=run.loader,
        rng=True,
        generators=[run.gen],
    )
    return int(state["step"])


def train(run: Run, step: int, steps: int, every: int, on_step: Any = None) -> None:
    """Continue from ``step`` to ``steps``, checkpointing through ``on_step(step)``."""
    epoch = run.loader.epoch
    while step < steps:
        run.loader.set_epoch(epoch)  # the restored epoch keeps its position
        for xb, yb in run.loader:
            if on_step is not None:
                on_step("before", step + 1)
            train_step(run, xb, yb)
            step += 1
            if on_step is not None:
                on_step("after", step)
            if step == steps:
                return
        epoch += 1


def params(run: Run) -> dict[str, np.ndarray[Any, Any]]:
    """The parameters and buffers, by name."""
    module = run.model.module if isinstance(run.model, DistributedDataParallel) else run.model
    return {k: v.numpy() for k, v in module.state_dict().items()}


def _arm_kill_in_fsync() -> dict[str, bool]:
    """Make the next ``os.fsync`` while ``armed`` SIGKILL this process (inside tl.save)."""
    flag = {"armed": False}
    real = os.fsync

    def fsync(fd: Any) -> None:
        if flag["armed"]:
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd)

    os.fsync = fsync
    return flag


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--times", default=None, help="a JSON-lines file for the kill/first step times")
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--kill-in-save", action="store_true")
    a = p.parse_args()
    attempt = int(os.environ.get("DPT_RESTART_COUNT") or 0)
    collectives.init_process_group(backend="cpu", timeout=30.0)
    rank, world = collectives.get_rank(), collectives.get_world_size()
    run = build(a.dtype, world, rank)
    if attempt > 0 and Path(a.ckpt).is_file():
        step = load(run, a.ckpt)
    else:
        step = 0
        save(run, a.ckpt, 0)  # this run's own checkpoint: a restart never finds a stale one
    kill = attempt == 0 and a.kill_step > 0
    flag = _arm_kill_in_fsync() if kill and a.kill_in_save and rank == 0 else None
    first = [attempt > 0]

    def note(what: str, **values: Any) -> None:
        if a.times is not None:
            with open(a.times, "a") as f:
                f.write(json.dumps({"what": what, "t": time.time(), **values}) + "\n")

    def on_step(when: str, s: int) -> None:
        if when == "before":
            if kill and not a.kill_in_save and s == a.kill_step and rank == a.kill_rank:
                note("kill", step=s - 1)
                os.kill(os.getpid(), signal.SIGKILL)
            return
        if first[0] and rank == 0:
            note("first_step", step=s)
            first[0] = False
        if s % a.every == 0:
            if flag is not None and s == a.kill_step:
                note("kill", step=s)
                flag["armed"] = True
            save(run, a.ckpt, s)

    train(run, step, a.steps, a.every, on_step)
    if rank == 0:
        np.savez(a.out, **params(run))  # type: ignore[arg-type]
    collectives.barrier()
    collectives.destroy_process_group()


if __name__ == "__main__":
    main()
