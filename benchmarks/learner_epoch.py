"""Epoch time of ``ddp.learner`` under each strategy against a hand-written loop, same run.

    python -m benchmarks.learner_epoch                  # 8192 samples, MLP 64-256-256-10
    python -m benchmarks.learner_epoch --samples 2048 --hidden 128 --runs 5 --json out.json

Every row trains the same model from the same initial weights on the same global batches
(float32, Adam, a StepLR stepped per batch) and validates on a held-out set each epoch:

* ``hand loop``: the loop one writes by hand (tensors from the batch, forward, loss,
  backward, step, scheduler step, the loss read per batch for logging, a no_grad validation
  pass); ``hand loop + checkpoint`` adds ``ddp.save_checkpoint`` per epoch, as the learner does;
* ``single_device``, ``ddp`` over 2 logical CPU devices (two rank threads), and
  ``multi_device`` over the same 2 devices in both optimizer modes.

A run is a fresh start of ``--epochs`` epochs (model, optimizer, for the learner a
``launch`` with its replicas, rank threads and checkpoints); its figure is its wall time per
epoch. The table gives the best and median of ``--runs`` runs (3), the median's ratio to the
hand loop's, and the learner's own per-epoch figure (training and validation only, the median
over every epoch of every run). Rows run one after the other, so on a shared machine read
the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import tensorlib as tl
import tensorlib.functional as F
from ddp import save_checkpoint
from ddp.learner import ExecutionStrategy, Learner, SupervisedTraining
from tensorlib import nn, optim

Batches = list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]


def _data(args: argparse.Namespace) -> tuple[Batches, Batches]:
    rng = np.random.default_rng(0)
    n, valid = args.samples, max(args.batch, args.samples // 8)
    w = rng.normal(size=(64, 10))
    x = rng.normal(size=(n + valid, 64)).astype(np.float32)
    y = (x @ w + rng.normal(size=(n + valid, 10))).argmax(1).astype(np.int64)
    cut = [(x[i : i + args.batch], y[i : i + args.batch]) for i in range(0, n + valid, args.batch)]
    k = n // args.batch
    return cut[:k], cut[k:]


def _model(hidden: int) -> nn.Module:
    tl.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )  # fmt: skip


def _parts(hidden: int, device: Any = "cpu") -> tuple[nn.Module, optim.Optimizer, Any]:
    model = _model(hidden).to(device)
    opt = optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)


def hand_loop(args: argparse.Namespace, checkpoint: bool) -> tuple[float, list[float]]:
    """The loop written by hand: seconds per epoch of one run (setup included), and each
    epoch's seconds."""
    train, valid = _data(args)
    start = time.perf_counter()
    model, opt, sched = _parts(args.hidden)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for epoch in range(args.epochs):
            t0 = time.perf_counter()
            model.train()
            total = 0.0
            for xb, yb in train:
                x, y = tl.tensor(xb), tl.tensor(yb)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total += float(loss.item()) * len(xb)
            model.eval()
            with tl.no_grad():
                for xb, yb in valid:
                    out = model(tl.tensor(xb))
                    float(F.cross_entropy(out, tl.tensor(yb)).item())
                    int(np.count_nonzero(out.argmax(axis=1).numpy() == yb))
            times.append(time.perf_counter() - t0)
            if checkpoint:
                save_checkpoint(Path(tmp) / "c.npz", model, opt, scheduler=sched, epoch=epoch + 1)
    return (time.perf_counter() - start) / args.epochs, times


def learner(args: argparse.Namespace, strategy: ExecutionStrategy) -> tuple[float, list[float]]:
    """One launch of ``--epochs`` epochs under ``strategy``: seconds per epoch (setup and
    checkpoints included), and the learner's own per-epoch figures."""
    train, valid = _data(args)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model, opt, sched = _parts(args.hidden, strategy.main_device())
        result = (
            SupervisedTraining(tmp, train, valid, loss_fn=F.cross_entropy)
            .with_training_strategy(strategy)
            .num_epochs(args.epochs)
            .with_progress(False)
            .launch(Learner(model, opt, sched))
        )
        per_epoch = (time.perf_counter() - start) / args.epochs
    return per_epoch, [m.seconds for m in result.history]


def rows(args: argparse.Namespace) -> list[tuple[str, Callable[[], tuple[float, list[float]]]]]:
    """The rows: name and a function returning its epoch times."""
    two = [tl.Device("cpu:0"), tl.Device("cpu:1")]
    return [
        ("hand loop", lambda: hand_loop(args, checkpoint=False)),
        ("hand loop + checkpoint", lambda: hand_loop(args, checkpoint=True)),
        ("single_device(cpu)", lambda: learner(args, ExecutionStrategy.single_device("cpu"))),
        ("ddp(2 cpu devices)", lambda: learner(args, ExecutionStrategy.ddp(two))),
        (
            "multi_device(2, main_device)",
            lambda: learner(args, ExecutionStrategy.multi_device(two)),
        ),
        (
            "multi_device(2, sharded)",
            lambda: learner(args, ExecutionStrategy.multi_device(two, optim="sharded")),
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run every row and print the table (and write ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--samples", type=int, default=8192, help="training samples per epoch")
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--hidden", type=int, default=256, help="hidden width of the MLP")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run")
    p.add_argument("--runs", type=int, default=3, help="runs per row (best and median)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    if args.batch % 2 or args.samples < args.batch or args.epochs < 1 or args.runs < 1:
        p.error("--batch must be even (2 devices) and at most --samples; --epochs, --runs >= 1")
    steps = args.samples // args.batch
    print(
        f"# learner epoch: {steps} steps of batch {args.batch}, MLP 64-{args.hidden}-"
        f"{args.hidden}-10 float32, Adam; {args.runs} runs of {args.epochs} epochs per row"
    )
    print(f"{'row (s per epoch)':<30} {'best':>8} {'median':>8} {'vs hand':>8} {'in-loop':>8}")
    figures: dict[str, dict[str, float]] = {}
    base = None
    for name, run in rows(args):
        got = [run() for _ in range(args.runs)]
        walls = [g[0] for g in got]
        inner = statistics.median(t for g in got for t in g[1])
        best, med = min(walls), statistics.median(walls)
        base = med if base is None else base
        figures[name] = {"best_s": best, "median_s": med, "ratio": med / base, "in_loop_s": inner}
        print(f"{name:<30} {best:>8.4f} {med:>8.4f} {med / base:>7.2f}x {inner:>8.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
