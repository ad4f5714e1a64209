"""Burn-style device-list all-reduce against the process backends, side by side in one run.

    python -m benchmarks.context_allreduce [--devices 2,4] [-b 4K] [-e 64M] [-f 4] [--runs 3]

Per device count and size (4 KiB to 64 MiB, x4 a step by default), the time of one all-reduce
of every device's float32 buffer:

* ``context``: one thread holds every logical CPU device's tensor and calls
  ``collectives.distributed.all_reduce`` for each, then ``resolve()`` for each (the seed page's
  code); the figure is the time for the whole group's call.
* ``threads``: the threads backend, one rank thread per device (``allreduce-bench --backend
  threads``).
* ``cpu`` and ``cpu-zc``: the cpu backend, one process per device, staged and zero-copy
  (``allreduce-bench``'s figures: slowest rank, median block).

Each figure is taken ``--runs`` times (every engine in each run, interleaved, so the machine's
noise hits all of them alike); the table gives the best and the median, and the ratios of the
median to the cpu backend's median (below 1: faster than cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ENGINES = ("context", "threads", "cpu", "cpu-zc")


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def _iters(nbytes: int) -> int:
    return max(5, min(1000, (256 << 20) // (nbytes * 8)))


def context_times(n: int, sizes: list[int]) -> dict[int, float]:
    """Microseconds per all-reduce of ``n`` logical CPU devices from one thread (median of 5
    blocks, each after a warm-up)."""
    import tensorlib as tl
    from collectives.distributed import DistributedContext, ReduceOperation, all_reduce

    tl.set_cpu_device_count(max(n, tl.cpu_device_count()))
    devs = list(tl.Device.enumerate("cpu"))[:n]
    out: dict[int, float] = {}
    s = ReduceOperation.Sum
    with DistributedContext(devs):
        for nbytes in sizes:
            rng = np.random.default_rng(nbytes)
            ts = [tl.tensor(rng.random(nbytes // 4, dtype=np.float32), device=d) for d in devs]
            iters = _iters(nbytes)
            results: list[Any] = []
            for _ in range(3):
                results = [p.resolve() for p in [all_reduce(t, s, devs) for t in ts]]
            blocks = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(iters):
                    results = [p.resolve() for p in [all_reduce(t, s, devs) for t in ts]]
                blocks.append((time.perf_counter() - t0) / iters * 1e6)
            want = np.sum([t.numpy() for t in ts], axis=0, dtype=np.float64)
            np.testing.assert_allclose(results[-1].numpy(), want, rtol=1e-5)
            out[nbytes] = statistics.median(blocks)
    return out


def bench_times(n: int, args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """``allreduce-bench --backend threads --compare cpu,cpu-zc`` at ``n`` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "benchmarks.allreduce", "--backend", "threads"]
        cmd += ["--nproc", str(n), "--compare", "cpu,cpu-zc", "-b", args.min_bytes]
        cmd += ["-e", args.max_bytes, "-f", str(args.step_factor), "--blocks", "5"]
        cmd += ["--no-check", "--json", path]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        with open(path) as f:
            data = json.load(f)
    return {
        name: {row["size"]: row["time_us"] for row in res["rows"]}
        for name, res in data["results"].items()
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table (and ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", default="2,4", help="device counts, comma-separated")
    p.add_argument("-b", "--min-bytes", default="4K")
    p.add_argument("-e", "--max-bytes", default="64M")
    p.add_argument("-f", "--step-factor", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument("--context-only", type=int, help=argparse.SUPPRESS)  # a run's child
    args = p.parse_args(argv)
    sizes = _sizes(_bytes(args.min_bytes), _bytes(args.max_bytes), args.step_factor)
    if args.context_only:
        print(json.dumps(context_times(args.context_only, sizes)))
        return 0
    counts = [int(x) for x in args.devices.split(",")]
    runs: dict[int, dict[str, dict[int, list[float]]]] = {
        n: {e: {s: [] for s in sizes} for e in ENGINES} for n in counts
    }
    for r in range(args.runs):
        for n in counts:
            print(f"run {r + 1}/{args.runs}, {n} devices ...", file=sys.stderr, flush=True)
            # The context in a fresh process too, as the others are.
            child = [sys.executable, "-m", "benchmarks.context_allreduce", "--context-only"]
            child += [str(n), "-b", args.min_bytes, "-e", args.max_bytes]
            child += ["-f", str(args.step_factor)]
            done = subprocess.run(child, check=True, capture_output=True, text=True, timeout=1800)
            ctx = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
            figures = {"context": ctx, **bench_times(n, args)}
            for e in ENGINES:
                for s in sizes:
                    runs[n][e][s].append(figures[e][s])
    _print(runs, sizes, args.runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(n): v for n, v in runs.items()}, f, indent=1)
    return 0


def _print(runs: dict[int, dict[str, dict[int, list[float]]]], sizes: list[int], k: int) -> None:
    print(f"# all-reduce of float32, us per call: best / median of {k} runs; x = median / cpu's")
    head = f"{'devices':>7} {'size':>9}"
    for e in ENGINES:
        head += f" | {e + ' best':>13} {'median':>9} {'x cpu':>6}"
    print(head)
    for n, engines in runs.items():
        for s in sizes:
            cpu = statistics.median(engines["cpu"][s])
            line = f"{n:>7} {_show(s):>9}"
            for e in ENGINES:
                vals = engines[e][s]
                med = statistics.median(vals)
                line += f" | {min(vals):>13.1f} {med:>9.1f} {med / cpu:>6.2f}"
            print(line)


def _show(nbytes: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


if __name__ == "__main__":
    raise SystemExit(main())
