"""allreduce-bench's arithmetic: the size sweep, busbw factors, element and iteration counts,
and the memory limit each row is compared against.

Pure functions of their arguments (the limit's pass excepted: it moves memory), so
the CLI, the sweep in each rank and the report agree on every number.

The limit at a size is one in-place pass over the buffer per rank, all ranks at once: every
byte read once and written back where it was. An all-reduce of S bytes writes S bytes of
result into each rank's buffer and reads at least S (its slice of every rank's input), so it
cannot beat reading S and writing S, and no pass reads and writes S for less than this one:
a line it writes was just read, so the cache needs no read-for-ownership of it. (A copy
into other lines, the limit before, pays that extra read: out of cache it moves 1.5 times the
bytes, and collectives that write most of their result onto lines they had just read beat it,
127-168% of it at 64 MiB. A copy from a second buffer would also touch 2S, falling out of a
cache level that the collective's own working set still fits in.)
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4K' -> 4096, '256M' -> 268435456, '1.5G', '64KiB' (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = t[-1] if t[-1] in _UNITS else ""
    num = t[:-1] if unit else t
    try:
        value = int(float(num) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4K, 1M, 256M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def human(n: float, whole_within: float = 0.0) -> str:
    """Bytes as a short binary-unit string (4K, 1.5M).

    Args:
        n: a byte count.
        whole_within: a value within this of a whole number of units prints as that whole
            number (0.05: ``4.02M`` -> ``4M``); 0 keeps one decimal unless exactly whole.

    Returns:
        The string, e.g. ``"4K"``, ``"1.5M"`` or ``"512B"``.
    """
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            v = n / div
            whole = v == int(v) or abs(v - round(v)) < whole_within
            return f"{v:.0f}{unit}" if whole else f"{v:.1f}{unit}"
    return f"{int(n)}B"


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    """Geometric sweep lo, lo*f, ... <= hi (just lo when factor is 1 or lo >= hi)."""
    out = [lo]
    while factor > 1 and out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` at world size ``n``."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def element_count(op: str, nbytes: int, itemsize: int, n: int) -> int:
    """Elements of the full buffer for ``nbytes``: at least one per rank, and for all_gather
    and reduce_scatter a multiple of the world size (rounded down, as nccl-tests does)."""
    count = max(nbytes // itemsize, 1)
    if op in ("all_gather", "reduce_scatter"):
        count = max(count // n, 1) * n
    return count


def auto_iters(nbytes: int) -> int:
    """Calls per timed block: many for small messages so a block is long enough to time."""
    return int(max(2, min(200, 32e6 // max(nbytes, 1))))


def limit_pass(buf: np.ndarray[Any, Any]) -> None:
    """One limit pass over ``buf`` (see :func:`limit_buffer`): read every word and write it
    back in place, unchanged (one ufunc call, vectorized)."""
    np.bitwise_or(buf, 0, out=buf)


def limit_buffer(nbytes: int) -> np.ndarray[Any, Any]:
    """A warm buffer of ``nbytes`` (rounded up to whole 8-byte words: at most 7 more) for
    :func:`limit_pass`."""
    buf = np.ones(max(-(-nbytes // 8), 1), dtype=np.uint64)
    limit_pass(buf)  # warm: pages touched and, where it fits, cached
    return buf


def gpu_copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """GB/s of one device-to-device copy (CuPy, best of 5, GPU time)."""
    import cupy as cp

    a = cp.ones(max(nbytes // 4, 1), dtype=cp.float32)
    b = cp.empty_like(a)
    best = float("inf")
    for _ in range(6):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        cp.copyto(b, a)
        e1.record()
        e1.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return a.nbytes / max(best, 1e-9) / 1e9
