"""Time an MLP training step and per-op overhead: tensorlib against PyTorch eager, same run.

    python -m benchmarks.mlp_step                       # CPU, 784-1024-1024-10, batch 256
    python -m benchmarks.mlp_step --device cuda         # CuPy (and torch.cuda if present)
    python -m benchmarks.mlp_step --amp                 # float16 autocast + GradScaler in both
    python -m benchmarks.mlp_step --json out.json
    python -m benchmarks.mlp_step --per-op-only         # only the chain of tiny adds

A step is forward, cross-entropy, backward and an SGD-with-momentum update, on identical
shapes, initial weights and batches for both libraries. The two are timed in alternating
rounds (ABAB...) so that noise from a shared machine hits both alike; the figure to read is
the ratio of medians. PyTorch is optional: without it only tensorlib's times are printed.
With ``--amp`` each library runs its step the mixed-precision way: the forward and the loss
under ``autocast`` to float16 (``tl.autocast`` / ``torch.autocast``), backward and the update
through a ``GradScaler``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import tensorlib as tl
import tensorlib.functional as F
from benchmarks._bench_mlp import mlp
from tensorlib import nn, optim


def _try_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _sync(device: str, torch: Any) -> None:
    if device.startswith("cuda"):
        tl.device(device).synchronize()
        if torch is not None and torch.cuda.is_available():
            torch.cuda.synchronize()


def _time(fn: Callable[[], None], iters: int, sync: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def build_tensorlib_step(
    sizes: list[int], batch: int, device: str, seed: int, amp: bool = False
) -> tuple[
    Callable[[], None], list[np.ndarray[Any, Any]], np.ndarray[Any, Any], np.ndarray[Any, Any]
]:
    """Return (step, initial weights as arrays, x, y) for tensorlib."""
    tl.manual_seed(seed)
    model = mlp(nn, sizes, device=device)
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(seed)
    x_np = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y_np = rng.integers(0, sizes[-1], size=batch).astype(np.int64)
    x, y = tl.tensor(x_np, device=device), tl.tensor(y_np, device=device)
    init = [p.numpy().copy() for p in model.parameters()]
    scaler = tl.amp.GradScaler(enabled=amp)

    def step() -> None:
        with tl.autocast(dtype=tl.float16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step, init, x_np, y_np


def build_torch_step(
    torch: Any,
    sizes: list[int],
    init: list[np.ndarray[Any, Any]],
    x_np: Any,
    y_np: Any,
    device: str,
    amp: bool = False,
) -> Callable[[], None]:
    """The same model, weights, batch and optimizer in PyTorch eager."""
    dev = "cuda" if device.startswith("cuda") else "cpu"
    model = mlp(torch.nn, sizes).to(dev)
    with torch.no_grad():
        for p, w in zip(model.parameters(), init, strict=True):
            p.copy_(torch.from_numpy(w))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.from_numpy(x_np).to(dev)
    y = torch.from_numpy(y_np).to(dev)
    loss_fn = torch.nn.functional.cross_entropy
    scaler = torch.amp.GradScaler(dev, enabled=amp)

    def step() -> None:
        with torch.autocast(dev, dtype=torch.float16, enabled=amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def _adds(x0: Any, b: Any, n_ops: int, backward: bool) -> Callable[[], None]:
    """``n_ops`` tiny adds starting from ``x0``, then (``backward``) a backward pass: the same
    code for a tensorlib or a torch tensor."""

    def run() -> None:
        x = x0
        for _ in range(n_ops):
            x = x + b
        if backward:
            x.sum().backward()

    return run


def op_chain(n_ops: int, device: str, torch: Any, rounds: int = 15) -> dict[str, float]:
    """Microseconds per tiny add, forward only and forward+backward, for both libraries."""
    res: dict[str, float] = {}
    a = tl.ones(4, device=device)
    b = tl.ones(4, device=device)
    bg = tl.ones(4, device=device, requires_grad=True)
    fns: dict[str, Callable[[], None]] = {
        "tensorlib_fwd": _adds(a, b, n_ops, backward=False),
        "tensorlib_fwd_bwd": _adds(bg, b, n_ops, backward=True),
    }
    if torch is not None:
        dev = "cuda" if device.startswith("cuda") else "cpu"
        ta = torch.ones(4, device=dev)
        tb = torch.ones(4, device=dev)
        tg = torch.ones(4, device=dev, requires_grad=True)
        fns["torch_fwd"] = _adds(ta, tb, n_ops, backward=False)
        fns["torch_fwd_bwd"] = _adds(tg, tb, n_ops, backward=True)
    sync = lambda: _sync(device, torch)  # noqa: E731
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):  # alternate the libraries so machine noise hits both alike
        for name, fn in fns.items():
            times[name].extend(_time(fn, 2, sync))
    for name, ts in times.items():
        res[f"{name}_us"] = statistics.median(ts) / n_ops * 1e6
    return res


def _step_report(
    args: argparse.Namespace, sizes: list[int], device: str, torch: Any, result: dict[str, Any]
) -> None:
    """Time the MLP step in both libraries, print it and add it to ``result``."""
    tl_step, init, x_np, y_np = build_tensorlib_step(sizes, args.batch, device, 0, args.amp)
    steps: dict[str, Callable[[], None]] = {"tensorlib": tl_step}
    if torch is not None:
        steps["torch"] = build_torch_step(torch, sizes, init, x_np, y_np, device, args.amp)
    sync = lambda: _sync(device, torch)  # noqa: E731
    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            times[name].extend(_time(fn, args.iters, sync))

    flops = 6 * args.batch * sum(a * b for a, b in itertools.pairwise(sizes))
    result["step_ms"] = {}
    print(
        f"MLP {'-'.join(map(str, sizes))}, batch {args.batch}, "
        f"{'float16 autocast + GradScaler' if args.amp else 'float32'}, {device}, "
        f"SGD momentum; median of {args.rounds * args.iters} steps"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        result["step_ms"][name] = med * 1e3
        print(f"  {name:10s} {med * 1e3:8.2f} ms/step   {flops / med / 1e9:7.1f} GFLOP/s")
    if "torch" in times:
        ratio = result["step_ms"]["tensorlib"] / result["step_ms"]["torch"]
        result["ratio_tensorlib_over_torch"] = ratio
        print(f"  ratio tensorlib/torch: {ratio:.2f}x  (target <= 1.2x)")


def _chain_report(n_ops: int, rounds: int, device: str, torch: Any, result: dict[str, Any]) -> None:
    """Time the chain of tiny adds in both libraries, print it and add it to ``result``."""
    chain = op_chain(n_ops, device, torch, rounds)
    result["op_chain"] = chain
    print(f"Chain of {n_ops} adds on 4-element tensors, per add:")
    print(
        f"  tensorlib  {chain['tensorlib_fwd_us']:6.2f} us forward   "
        f"{chain['tensorlib_fwd_bwd_us']:6.2f} us forward+backward"
    )
    if "torch_fwd_us" in chain:
        print(
            f"  torch      {chain['torch_fwd_us']:6.2f} us forward   "
            f"{chain['torch_fwd_bwd_us']:6.2f} us forward+backward"
        )
        print(
            f"  ratio tensorlib/torch: {chain['tensorlib_fwd_us'] / chain['torch_fwd_us']:.2f}x "
            f"forward, {chain['tensorlib_fwd_bwd_us'] / chain['torch_fwd_bwd_us']:.2f}x "
            f"forward+backward"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a small report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="784,1024,1024,10", help="layer widths, comma-separated")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    p.add_argument("--iters", type=int, default=5, help="steps timed per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chain", type=int, default=1000, help="tiny adds in the overhead test")
    p.add_argument(
        "--chain-rounds", type=int, default=15, help="alternating rounds of the overhead test"
    )
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    p.add_argument(
        "--per-op-only", action="store_true", help="only the per-op overhead (chain of tiny adds)"
    )
    p.add_argument("--amp", action="store_true", help="float16 autocast + GradScaler in both")
    p.add_argument("--json", help="write the results to this path")
    args = p.parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else args.device
    sizes = [int(s) for s in args.sizes.split(",")]
    torch = None if args.no_torch else _try_torch()
    if device.startswith("cuda") and torch is not None and not torch.cuda.is_available():
        print("torch has no CUDA here; comparing against tensorlib only", file=sys.stderr)
        torch = None

    result: dict[str, Any] = {
        "benchmark": "mlp_step",
        "sizes": sizes,
        "batch": args.batch,
        "device": device,
        "amp": args.amp,
        "numpy": np.__version__,
        "tensorlib": tl.__version__,
        "torch": getattr(torch, "__version__", None),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    if torch is not None:
        result["torch_threads"] = torch.get_num_threads()
    if not args.per_op_only:
        _step_report(args, sizes, device, torch, result)
    _chain_report(args.chain, args.chain_rounds, device, torch, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
