"""allreduce-bench's report: the nccl-tests table on stdout, its notes, the JSON and the plot.

The table's columns are nccl-tests' (size, count, type, redop, root, time, algbw, busbw,
#wrong), then the limit at that size (one in-place pass over the buffer per rank, timed in the
same ranks: ``_bench_math``) and the row's share of it, with ``--busy-main`` the idle-main
time and busy/idle, then per peer its time, busbw, #wrong, share of its own limit and its
time as a ratio of ours. The footer states average and peak busbw per engine and the range
of its shares of the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._bench_math import bus_factor, element_count, human, sizes

SCHEMA = "allreduce-bench/1"
_SHORT_TYPES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16"}
# The options that shape the figures, as the JSON's "config".
_CONFIG_KEYS = (
    "op",
    "dtype",
    "reduce_op",
    "min_bytes",
    "max_bytes",
    "step_factor",
    "iters",
    "warmup_iters",
    "blocks",
    "check",
    "async_op",
    "busy_main",
    "device",
    "zero_copy",
)


# ---------------------------------------------------------------------------- environment
def _env_info(args: argparse.Namespace, n: int) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "world_size": n,
        "device": args.device,
    }
    from importlib import metadata

    for pkg in ("dpt", "torch", "mpi4py", "cupy"):
        try:
            info[pkg] = metadata.version(pkg) if pkg != "cupy" else _cupy_version()
        except metadata.PackageNotFoundError:
            info[pkg] = None
    return info


def _cupy_version() -> str | None:
    from importlib import metadata

    for name in ("cupy-cuda12x", "cupy-cuda13x", "cupy"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---------------------------------------------------------------------------- text
def table(ours: str, results: dict[str, Any], args: argparse.Namespace, n: int) -> list[str]:
    """The nccl-tests table for ``ours`` with each peer's time, busbw, #wrong and ratio."""
    rows = results[ours]["rows"]
    peers = [e for e in results if e != ours]
    factor = bus_factor(args.op, n)
    busy = bool(getattr(args, "busy_main", False))
    mode = (
        "async, rank 0 busy in Python until each call completed (others idle)"
        if busy
        else ("async" if args.async_op else "blocking")
    )
    lim = (
        "device-to-device copy"
        if args.device == "cuda" or ours == "nccl"
        else "in-place pass (read and write every byte)"
    )
    lines = [
        f"# allreduce-bench: {args.op}, engine {ours}, {n} ranks, {args.dtype}, {mode}, "
        f"busbw = algbw * {factor:g}, time = slowest rank, median of {args.blocks} blocks; "
        f"limit = one {lim} of the buffer per rank at that size, all ranks at once",
        f"# {'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'root':>4} "
        f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'lim(us)':>8} {'%lim':>5}"
        + (f" {'idle(us)':>9} {'busy/idle':>9}" if busy else "")
        + "".join(
            f" | {p + ' us':>11} {'busbw':>7} {'#wrong':>6} {'%lim':>5} {'ratio':>7}" for p in peers
        ),
    ]
    for i, r in enumerate(rows):
        wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
        line = (
            f"  {r['size']:>10} {r['count']:>10} {_SHORT_TYPES.get(r['type'], r['type']):>8} "
            f"{r['redop']:>6} {r['root']:>4} {r['time_us']:>10.1f} {r['algbw']:>7.2f} "
            f"{r['busbw']:>7.2f} {wrong:>6} {r['limit_us']:>8.1f} {r['share']:>5.0%}"
        )
        if busy:
            line += f" {r['idle_us']:>9.1f} {r['time_us'] / r['idle_us']:>8.2f}x"
        for p in peers:
            q = results[p]["rows"][i]
            qw = "N/A" if q["wrong"] is None else str(q["wrong"])
            ratio = q["time_us"] / r["time_us"]
            line += (
                f" | {q['time_us']:>11.1f} {q['busbw']:>7.2f} {qw:>6} {q['share']:>5.0%} "
                f"{ratio:>6.2f}x"
            )
        lines.append(line)
    if peers:
        lines.append(f"# ratio = peer's time / {ours}'s time (above 1: {ours} is faster)")
    lines.append(
        "# %lim = the limit's time / the row's time (each engine against the limit timed in "
        "its own ranks); the limit reads and writes the buffer once, in place, as an "
        "all-reduce must at least, and writes only lines it just read (no read for ownership)"
    )
    over = []
    for e, res in results.items():
        bus = [r["busbw"] for r in res["rows"]]
        shares = [r["share"] for r in res["rows"]]
        top = int(np.argmax(shares))
        lines.append(
            f"# {e:>7}: avg busbw {np.mean(bus):.2f} GB/s, peak busbw {max(bus):.2f} GB/s; "
            f"share of the limit {min(shares):.0%}-{max(shares):.0%}, highest at "
            f"{human(res['rows'][top]['size'])} (limit there {res['rows'][top]['limit_us']:.1f} "
            "us)"
        )
        over += [f"{e} at {human(r['size'])}" for r in res["rows"] if r["share"] > 1]
    if over:
        lines.append(
            "# above 100%: " + ", ".join(over) + ": the limit's blocks ran right after the "
            "collective's, at another moment of this machine's load (other processes, "
            "frequency): compare such rows across runs"
        )
    return lines


def rounding_notes(args: argparse.Namespace, n: int, itemsize: int) -> list[str]:
    """What the table does not show by itself: sizes rounded to fit the world size."""
    if args.op not in ("all_gather", "reduce_scatter"):
        return []
    changed = [
        s
        for s in sizes(args.min_bytes, args.max_bytes, args.step_factor)
        if element_count(args.op, s, itemsize, n) * itemsize != s
    ]
    if not changed:
        return []
    return [
        f"{args.op} sizes rounded to a multiple of world size * itemsize ({n} * {itemsize} B): "
        + ", ".join(str(s) for s in changed[:6])
        + (" ..." if len(changed) > 6 else "")
    ]


# ---------------------------------------------------------------------------- files
def plot(path: str, results: dict[str, Any], args: argparse.Namespace, n: int) -> None:
    """busbw against size (log x), one line per engine, and the limit per size (the highest
    of the engines' own limits, in busbw terms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e, res in results.items():
        xs = [r["size"] for r in res["rows"]]
        ax.plot(xs, [r["busbw"] for r in res["rows"]], marker="o", label=e)
    first = next(iter(results.values()))["rows"]
    limit = [
        max(res["rows"][i]["limit_busbw"] for res in results.values()) for i in range(len(first))
    ]
    ax.plot([r["size"] for r in first], limit, "k--", label="limit: one in-place pass per rank")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{args.op}, {n} ranks, {args.dtype}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(
    results: dict[str, Any],
    skipped: dict[str, str],
    ours: str,
    args: argparse.Namespace,
    n: int,
    notes: list[str],
) -> int:
    """Print the table (stdout), write JSON and plot; the exit status."""
    for line in table(ours, results, args, n):
        print(line)
    for note in notes:
        print(f"# note: {note}")
    for e, why in skipped.items():
        print(f"# {e}: not run ({why})")
    if args.json:
        env = _env_info(args, n)
        env["backend"] = ours
        doc = {
            "schema": SCHEMA,
            "config": {k: getattr(args, k) for k in _CONFIG_KEYS},
            "engine": ours,
            "env": env,
            "results": results,
            "skipped": skipped,
            "notes": notes,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(args.plot, results, args, n)
        print(f"wrote {args.plot}", file=sys.stderr)
    bad = any(r["wrong"] for res in results.values() for r in res["rows"])
    return 1 if bad else 0
