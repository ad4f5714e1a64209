"""allreduce-bench in one rank: the size sweep, its timed blocks and its correctness check.

Per size: ``--warmup-iters`` untimed calls, then ``--blocks`` timed blocks of ``--iters``
calls, each after a barrier; a block's time is the slowest rank's, the figure the median
block divided by its calls. The timed calls run on data whose result stays put however
often it is reduced in place (a sum or average of zero across ranks, a product of ones,
min and max of fixed values), so nothing overflows, and afterwards the timed all-reduce's
buffer is checked against that fixed point. ``check`` then runs the collective on data that
differs per rank and per iteration (small positive integers, exact in every dtype, never
zeros) and counts the elements that differ from the expected value computed here in float64.

The limit at each size (``_bench_math.limit_pass``) is timed the same way in the same ranks:
the same blocks and calls, every rank at once, the slowest rank's block.

``--busy-main``: each call is issued asynchronously; rank 0's main thread then runs pure
Python until the call completed (polling ``is_completed`` between small units of work), the
other ranks wait idly (one rank per core leaves no core for a second busy rank). Blocks
alternate with the same calls where rank 0 waits idly too, and the row gives both.
"""

from __future__ import annotations

import argparse
import functools
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
    limit_buffer,
    limit_pass,
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


def _timed_data(rank: int, n: int, rop: str, count: int, dtype: np.dtype[Any]) -> Any:
    """Rank ``rank``'s input for the timed calls: reduced in place any number of times, the
    result stays finite and known (see :func:`_timed_expect`)."""
    base = _data(0, 0, 0, count, np.dtype(np.int64))
    if rop in ("sum", "avg"):  # the ranks' values sum to zero: the result is 0 from call 1 on
        return (base * (-(n - 1) if rank == n - 1 else 1)).astype(dtype)
    if rop == "prod":
        return np.ones(count, dtype=dtype)
    return _data(rank, 0, 0, count, dtype)  # min, max: the first call's result is a fixed point


def _timed_expect(rop: str, n: int, lo: int, hi: int) -> np.ndarray[Any, Any]:
    """Elements lo..hi of an all-reduce buffer after one or more timed calls (float64)."""
    if rop in ("sum", "avg"):
        return np.zeros(hi - lo)
    if rop == "prod":
        return np.ones(hi - lo)
    return _reduce_expect(rop, n, 0, lo, hi - lo)


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
        wrong += _count_wrong_chunked(
            res, lambda lo, hi, it=it: _expect(op, rop, n, r, it, blk, lo, hi), dtype
        )
    return wrong


def _count_wrong_chunked(got: Any, expect: Any, dtype: np.dtype[Any]) -> int:
    """:func:`_count_wrong` over ``got`` in chunks; ``expect(lo, hi)`` gives the values."""
    res = _to_host(got).reshape(-1)
    wrong = 0
    for lo in range(0, res.size, _CHUNK):  # in chunks: float64 copies of 256M would be big
        hi = min(lo + _CHUNK, res.size)
        wrong += _count_wrong(res[lo:hi], expect(lo, hi), dtype)
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


def _done(handle: Any) -> bool:
    """Whether an async call completed (our Work and torch's: is_completed; mpi4py: Test)."""
    test = getattr(handle, "is_completed", None) or handle.Test
    return bool(test())


def _python_work() -> int:
    """A small unit (a few microseconds) of pure-Python work that holds the GIL."""
    total = 0
    for i in range(32):
        total += i * i
    return total


def _busy_blocks(
    eng: Engine, args: argparse.Namespace, x: Any, out: Any, iters: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``--busy-main``: seconds per async call of each block with rank 0's main thread busy
    in Python until the call completed, and of blocks where it waits idly (alternating)."""
    for _ in range(args.warmup_iters):
        eng.run(args.op, x, out, args.reduce_op, True).wait()
    busy_rank = eng.rank == 0
    idle = np.zeros(args.blocks, dtype=np.float64)
    busy = np.zeros(args.blocks, dtype=np.float64)
    for b in range(args.blocks):
        for keep_busy, dest in ((False, idle), (True, busy)):
            eng.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                w = eng.run(args.op, x, out, args.reduce_op, True)
                if keep_busy and busy_rank:
                    while not _done(w):
                        _python_work()
                w.wait()
            eng.synchronize()
            dest[b] = (time.perf_counter() - t0) / iters
    return idle, busy


def _limit_blocks(
    eng: Engine, args: argparse.Namespace, nbytes: int, iters: int, device: bool
) -> np.ndarray[Any, Any]:
    """Seconds per limit pass over ``nbytes`` (see ``_bench_math``), per block, timed like
    the collective: every rank at once after a barrier, ``iters`` passes a block."""
    blocks = np.zeros(args.blocks, dtype=np.float64)
    if device:  # a device-to-device copy of this size, timed on the GPU
        blocks[:] = nbytes / (gpu_copy_bandwidth(nbytes) * 1e9)
        return blocks
    buf = limit_buffer(nbytes)
    for _ in range(args.warmup_iters):
        limit_pass(buf)
    for b in range(args.blocks):
        eng.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            limit_pass(buf)
        blocks[b] = (time.perf_counter() - t0) / iters
    return blocks


def run_sweep(eng: Engine, args: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    """The sweep in this rank; every rank returns the same rows."""
    dtype = np.dtype(args.dtype)
    n = eng.size
    root = 0 if args.op in ("broadcast", "reduce") else -1
    rop = args.reduce_op if args.op in ("all_reduce", "reduce_scatter", "reduce") else "none"
    device = args.device == "cuda" or label == "nccl"
    rows = []
    sweep = sizes(args.min_bytes, args.max_bytes, args.step_factor)
    for i, nbytes in enumerate(sweep):
        count = element_count(args.op, nbytes, dtype.itemsize, n)
        size = count * dtype.itemsize
        x, out = _buffers(eng, args.op, count, dtype)
        x[...] = eng.xp.asarray(_timed_data(eng.rank, n, args.reduce_op, x.size, dtype))
        iters = args.iters or auto_iters(nbytes)
        idle = None
        if args.busy_main:
            idle, blocks = _busy_blocks(eng, args, x, out, iters)
            idle = eng.reduce_host(idle, "max")
        else:
            blocks = _timed_blocks(eng, args, x, out, iters)
        blocks = eng.reduce_host(blocks, "max")  # a block lasts as long as its slowest rank
        limit = eng.reduce_host(_limit_blocks(eng, args, size, iters, device), "max")
        wrong = np.zeros(1, dtype=np.float64)
        if args.check:
            if args.op == "all_reduce":  # the timed calls' result: the fixed point, finite
                expect = functools.partial(_timed_expect, args.reduce_op, n)
                wrong[0] = _count_wrong_chunked(x, expect, dtype)
            wrong[0] += check(eng, args.op, x, out, count, dtype, args.reduce_op)
        wrong = eng.reduce_host(wrong, "sum")
        t = float(np.median(blocks))
        t_lim = float(np.median(limit))
        algbw = size / t / 1e9
        row = {
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
            "limit_us": t_lim * 1e6,
            "limit_busbw": size / t_lim / 1e9 * bus_factor(args.op, n),
            "share": t_lim / t,
        }
        if idle is not None:
            row["idle_us"] = float(np.median(idle)) * 1e6
        rows.append(row)
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
    if getattr(args, "bind_cores", False):
        # After joining: the cpu backend sizes its spin from the cores it may use at init.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[eng.rank % len(cores)]})
    try:
        rows = run_sweep(eng, args, engine)
        res = {"engine": engine, "world": eng.size, "rank": eng.rank, "rows": rows}
        return {**res, **eng.describe()}
    finally:
        eng.close()
