"""allreduce-bench in one rank: the size sweep, its timed blocks and its correctness check.

Per size: ``--warmup-iters`` untimed calls, then ``--blocks`` timed blocks of ``--iters``
calls, each after a barrier; a block's time is the slowest rank's, the figure the median
block divided by its calls. ``check`` then runs the collective on data that differs per rank
and per iteration (small positive integers, exact in every dtype, never zeros) and counts
the elements that differ from the expected value computed here in float64.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

from benchmarks._bench_engines import Engine, UsageError, make_engine
from benchmarks._bench_math import (
    auto_iters,
    bus_factor,
    element_count,
    gpu_copy_bandwidth,
    human,
    memcpy_bandwidth,
    sizes,
)

CORRUPT_ENV = "DPT_BENCH_CORRUPT"  # test hook: rank 0 spoils this many result elements
CHECK_ITERS = 2
_CHUNK = 1 << 22


# ---------------------------------------------------------------------------- expected values
def _data(rank: int, it: int, start: int, count: int, dtype: np.dtype[Any]) -> Any:
    """Rank ``rank``'s input at iteration ``it`` for global elements start..start+count:
    small positive integers (exact in every dtype), different per rank and per iteration."""
    idx = np.arange(start, start + count, dtype=np.int64)
    return ((idx % 7) + 1 + rank + 2 * it).astype(dtype)


def _reduce_expect(rop: str, n: int, it: int, start: int, count: int) -> np.ndarray[Any, Any]:
    """Reduction over ranks of ``_data`` in float64."""
    parts = [_data(r, it, start, count, np.dtype(np.float64)) for r in range(n)]
    if rop in ("sum", "avg"):
        acc = np.sum(parts, axis=0)
        return acc / n if rop == "avg" else acc
    if rop == "prod":
        return np.prod(parts, axis=0)
    return np.min(parts, axis=0) if rop == "min" else np.max(parts, axis=0)


def _expect(
    op: str, rop: str, n: int, r: int, it: int, blk: int, lo: int, hi: int
) -> np.ndarray[Any, Any]:
    """Expected result elements lo..hi of ``op`` on rank ``r`` (float64)."""
    f64 = np.dtype(np.float64)
    if op in ("all_reduce", "reduce"):
        return _reduce_expect(rop, n, it, lo, hi - lo)
    if op == "broadcast":
        return _data(0, it, lo, hi - lo, f64)
    if op == "reduce_scatter":
        return _reduce_expect(rop, n, it, r * blk + lo, hi - lo)
    idx = np.arange(lo, hi, dtype=np.int64)  # all_gather: element i came from rank i // blk
    return ((idx % 7) + 1 + idx // blk + 2 * it).astype(f64)


def _count_wrong(got: Any, expect: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> int:
    """Elements of ``got`` (cast to ``dtype`` for the expected value) that differ."""
    g = np.asarray(got, dtype=np.float64)
    e = expect.astype(dtype).astype(np.float64)  # the dtype's own rounding (wrap for ints)
    if dtype.kind == "f":
        tol = {2: 1e-2, 4: 1e-5}.get(dtype.itemsize, 1e-12)
        return int(np.count_nonzero(~np.isclose(g, e, rtol=tol, atol=0)))
    return int(np.count_nonzero(g != e))


def _to_host(a: Any) -> np.ndarray[Any, Any]:
    return np.asarray(a.get() if hasattr(a, "get") else a)


# ---------------------------------------------------------------------------- check
def check(
    eng: Engine, op: str, x: Any, out: Any, count: int, dtype: np.dtype[Any], rop: str
) -> int:
    """Run ``op`` on fresh data CHECK_ITERS times; wrong elements on this rank."""
    n, r = eng.size, eng.rank
    corrupt = int(os.environ.get(CORRUPT_ENV, "0") or 0) if r == 0 else 0
    blk = count // n if op in ("all_gather", "reduce_scatter") else count
    wrong = 0
    for it in range(CHECK_ITERS):
        if op == "all_gather":
            x[...] = eng.xp.asarray(_data(r, it, r * blk, blk, dtype))
        else:
            x[...] = eng.xp.asarray(_data(r, it, 0, count, dtype))
        eng.run(op, x, out, rop, async_op=False)
        eng.synchronize()
        res = _to_host(out if op in ("all_gather", "reduce_scatter") else x).reshape(-1).copy()
        if corrupt:
            res[: min(corrupt, res.size)] += 1
        if op == "reduce" and r != 0:
            continue  # non-roots' buffers are unspecified after a reduce
        for lo in range(0, res.size, _CHUNK):  # in chunks: float64 copies of 256M would be big
            hi = min(lo + _CHUNK, res.size)
            wrong += _count_wrong(res[lo:hi], _expect(op, rop, n, r, it, blk, lo, hi), dtype)
    return wrong


# ---------------------------------------------------------------------------- timed sweep
def _buffers(eng: Engine, op: str, count: int, dtype: np.dtype[Any]) -> tuple[Any, Any]:
    """Input and output for ``op`` with ``count`` elements in the full buffer."""
    n = eng.size
    if op == "all_gather":
        x = eng.buffer(count // n, dtype)
        out = eng.buffer(count, dtype).reshape(n, count // n)
    elif op == "reduce_scatter":
        x, out = eng.buffer(count, dtype), eng.buffer(count // n, dtype)
    else:
        x, out = eng.buffer(count, dtype), None
    return x, out


def _timed_blocks(
    eng: Engine, args: argparse.Namespace, x: Any, out: Any, iters: int
) -> np.ndarray[Any, Any]:
    """Warm up, then seconds per call of each of ``args.blocks`` blocks of ``iters`` calls."""
    for _ in range(args.warmup_iters):
        eng.run(args.op, x, out, args.reduce_op, async_op=False)
    eng.synchronize()
    blocks = np.zeros(args.blocks, dtype=np.float64)
    for b in range(args.blocks):
        eng.barrier()
        t0 = time.perf_counter()
        if args.async_op:
            works = [eng.run(args.op, x, out, args.reduce_op, True) for _ in range(iters)]
            for w in works:
                w.wait()
        else:
            for _ in range(iters):
                eng.run(args.op, x, out, args.reduce_op, False)
        eng.synchronize()
        blocks[b] = (time.perf_counter() - t0) / iters
    return blocks


def run_sweep(eng: Engine, args: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    """The sweep in this rank; every rank returns the same rows."""
    dtype = np.dtype(args.dtype)
    n = eng.size
    root = 0 if args.op in ("broadcast", "reduce") else -1
    rop = args.reduce_op if args.op in ("all_reduce", "reduce_scatter", "reduce") else "none"
    rows = []
    sweep = sizes(args.min_bytes, args.max_bytes, args.step_factor)
    for i, nbytes in enumerate(sweep):
        count = element_count(args.op, nbytes, dtype.itemsize, n)
        x, out = _buffers(eng, args.op, count, dtype)
        x[...] = eng.xp.asarray(_data(eng.rank, 0, 0, x.size, dtype))
        iters = args.iters or auto_iters(nbytes)
        blocks = _timed_blocks(eng, args, x, out, iters)
        blocks = eng.reduce_host(blocks, "max")  # a block lasts as long as its slowest rank
        wrong = np.zeros(1, dtype=np.float64)
        if args.check:
            wrong[0] = check(eng, args.op, x, out, count, dtype, args.reduce_op)
        wrong = eng.reduce_host(wrong, "sum")
        t = float(np.median(blocks))
        size = count * dtype.itemsize
        algbw = size / t / 1e9
        rows.append(
            {
                "size": size,
                "count": count,
                "type": str(dtype),
                "redop": rop,
                "root": root,
                "time_us": t * 1e6,
                "algbw": algbw,
                "busbw": algbw * bus_factor(args.op, n),
                "wrong": int(wrong[0]) if args.check else None,
                "iters": iters,
            }
        )
        if eng.rank == 0:
            print(
                f"[{label}] {i + 1}/{len(sweep)} {human(size)}: {t * 1e6:.1f} us",
                file=sys.stderr,
                flush=True,
            )
        del x, out
    return rows


def worker(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the sweep through ``engine`` in the current ranks; rank 0 gets the result."""
    try:
        eng = make_engine(engine, args.device)
    except ImportError as e:
        raise UsageError(f"{engine}: {e}") from e
    try:
        rows = run_sweep(eng, args, engine)
        copy_bw = (
            gpu_copy_bandwidth()
            if args.device == "cuda" or engine == "nccl"
            else memcpy_bandwidth(min(256 << 20, max(args.max_bytes, 16 << 20)))
        )
        return {
            "engine": engine,
            "world": eng.size,
            "rank": eng.rank,
            "copy_GBps": copy_bw,
            "rows": rows,
        }
    finally:
        eng.close()
