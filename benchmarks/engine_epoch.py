"""Epoch time of ``ddp.engine.create_supervised_trainer`` against the hand-written loop.

    python -m benchmarks.engine_epoch                   # 1437 samples, batch 64, MLP 64-64-10
    python -m benchmarks.engine_epoch --hidden 256 --runs 9 --json out.json

The hand loop is examples/train_ignite_style.py's (forward, loss, zero_grad, backward, step,
``loss.item()`` per batch, ``set_epoch`` per epoch); the engine rows train the same model
from the same weights on the same batches (the loader of ``idist.auto_dataloader``, shuffled,
at world size 1) with ``create_supervised_trainer(...).run(loader, max_epochs=E)``, bare and
with the handlers a script typically has (a filtered logger every 100 iterations and an
epoch-end handler). Defaults match the digits example's shapes (1,437 training samples, so
22 steps of 64 per epoch), where the engine's per-iteration cost is the largest share.

The peer, when torch and pytorch-ignite are installed (the ``parity`` extra): Ignite's own
``create_supervised_trainer`` against the same hand loop written in torch (CPU, one thread,
the same shapes, batches cut beforehand), its ratio read beside ours.

A run is ``--epochs`` epochs from a fresh model; the table gives each row's best and median
seconds per epoch over ``--runs`` runs, the median's ratio to the hand loop's and the
engine's cost per iteration (median difference / iterations). Rows alternate run by run, so
a slow spell of the shared machine hits every row alike; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import ddp.idist as idist
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import Events, create_supervised_trainer
from tensorlib import nn, optim


def _data(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 10))
    x = rng.normal(size=(args.samples, 64)).astype(np.float32)
    return x, (x @ w).argmax(1).astype(np.int64)


def _parts(args: argparse.Namespace) -> tuple[nn.Module, Any, Any]:
    tl.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    opt = optim.Adam(model.parameters(), lr=3e-3)
    loader = idist.auto_dataloader(_data(args), batch_size=args.batch, shuffle=True, drop_last=True)
    return model, opt, loader


def hand_loop(args: argparse.Namespace) -> tuple[float, list[np.ndarray]]:
    """examples/train_ignite_style.py's loop: seconds per epoch, final parameters."""
    model, opt, loader = _parts(args)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        total = 0.0
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
    return (time.perf_counter() - start) / args.epochs, [p.numpy() for p in model.parameters()]


def engine(args: argparse.Namespace, handlers: bool) -> tuple[float, list[np.ndarray]]:
    """``create_supervised_trainer`` over the same loader: seconds per epoch, parameters."""
    model, opt, loader = _parts(args)
    trainer = create_supervised_trainer(model, opt, F.cross_entropy)
    if handlers:
        seen: list[float] = []
        trainer.add_event_handler(
            Events.ITERATION_COMPLETED(every=100), lambda e: seen.append(e.state.output)
        )
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen.append(e.state.epoch))
    start = time.perf_counter()
    trainer.run(loader, max_epochs=args.epochs)
    return (time.perf_counter() - start) / args.epochs, [p.numpy() for p in model.parameters()]


def rows(args: argparse.Namespace) -> list[tuple[str, Callable[[], tuple[float, list[Any]]]]]:
    """The rows: name and a function returning (seconds per epoch, final parameters)."""
    return [
        ("hand loop", lambda: hand_loop(args)),
        ("create_supervised_trainer", lambda: engine(args, handlers=False)),
        ("  + 2 handlers", lambda: engine(args, handlers=True)),
    ]


def ignite_rows(args: argparse.Namespace) -> list[tuple[str, Callable[[], float]]] | str:
    """The peer: PyTorch Ignite's trainer against the same hand loop in torch (CPU), same
    shapes and batches; or why it cannot run (torch or pytorch-ignite missing)."""
    try:
        import ignite.engine as ie
        import torch
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install -e '.[parity]' brings torch and ignite)"
    torch.set_num_threads(1)
    x, y = (torch.from_numpy(a) for a in _data(args))
    n = len(x) - len(x) % args.batch

    def parts() -> tuple[Any, Any, list[tuple[Any, Any]]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 10)
        )
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:n]
        batches = [(x[i], y[i]) for i in order.split(args.batch)]
        return model, torch.optim.Adam(model.parameters(), lr=3e-3), batches

    def torch_hand() -> float:
        model, opt, batches = parts()
        loss_fn = torch.nn.functional.cross_entropy
        start = time.perf_counter()
        for _ in range(args.epochs):
            total = 0.0
            for xb, yb in batches:
                model.train()
                loss = loss_fn(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item()
        return (time.perf_counter() - start) / args.epochs

    def ignite_trainer() -> float:
        model, opt, batches = parts()
        trainer = ie.create_supervised_trainer(model, opt, torch.nn.functional.cross_entropy)
        start = time.perf_counter()
        trainer.run(batches, max_epochs=args.epochs)
        return (time.perf_counter() - start) / args.epochs

    return [("torch hand loop", torch_hand), ("ignite create_supervised_trainer", ignite_trainer)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rows (alternating) and print the table (and write ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--samples", type=int, default=1437, help="training samples per epoch")
    p.add_argument("--batch", type=int, default=64, help="batch size")
    p.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run")
    p.add_argument("--runs", type=int, default=7, help="runs per row (best and median)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    if args.samples < args.batch or min(args.batch, args.epochs, args.runs) < 1:
        p.error("--batch must be at most --samples; --epochs, --runs >= 1")
    steps = args.samples // args.batch
    print(
        f"# engine epoch: {steps} steps of batch {args.batch}, MLP 64-{args.hidden}-10 float32, "
        f"Adam; {args.runs} runs of {args.epochs} epochs per row, rows alternating"
    )
    table = rows(args)
    walls: dict[str, list[float]] = {name: [] for name, _ in table}
    for _ in range(args.runs):
        params = None
        for name, run in table:
            seconds, got = run()
            walls[name].append(seconds)
            if params is None:
                params = got
            elif not all(np.array_equal(a, b) for a, b in zip(params, got, strict=True)):
                raise SystemExit(f"engine_epoch: {name!r} trained to other parameters")
    print(f"{'row (s per epoch)':<32} {'best':>9} {'median':>9} {'vs hand':>8} {'us/iter':>8}")
    base = statistics.median(walls["hand loop"])
    figures: dict[str, dict[str, float]] = {}
    for name, w in walls.items():
        best, med = min(w), statistics.median(w)
        extra = (med - base) / steps * 1e6
        figures[name.strip()] = {"best_s": best, "median_s": med, "ratio": med / base,
                                 "extra_us_per_iter": extra}  # fmt: skip
        print(f"{name:<32} {best:>9.5f} {med:>9.5f} {med / base:>7.3f}x {extra:>8.1f}")
    peer = ignite_rows(args)
    if isinstance(peer, str):
        print(f"# peer: PyTorch Ignite skipped: {peer}")
    else:
        # Same alternation; batches pre-cut in both torch rows (no loader on either side).
        pw: dict[str, list[float]] = {name: [] for name, _ in peer}
        for _ in range(args.runs):
            for name, prun in peer:
                pw[name].append(prun())
        pbase = statistics.median(pw["torch hand loop"])
        for name, w in pw.items():
            best, med = min(w), statistics.median(w)
            extra = (med - pbase) / steps * 1e6
            figures[name] = {"best_s": best, "median_s": med, "ratio": med / pbase,
                             "extra_us_per_iter": extra}  # fmt: skip
            print(f"{name:<32} {best:>9.5f} {med:>9.5f} {med / pbase:>7.3f}x {extra:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
