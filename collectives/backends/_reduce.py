"""The one in-order reduction of host arrays the cpu backend and the threads NumPy engine share.

Reducing in rank order (``sources[0] op sources[1] op ...``) is what makes results bitwise the
same on every rank, from run to run, and between the two backends. :func:`reduce_in_order`
writes one output; :func:`reduce_to_all` the same bits into several (one array per device:
the device-list context's NumPy engine, the threads backend's), on every core when large.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import numpy as np

from .._types import ReduceOp

__all__ = [
    "NATIVE_DTYPES",
    "NATIVE_OPS",
    "UFUNCS",
    "native_code",
    "reduce_in_order",
    "reduce_to_all",
    "reduces_on_cores",
]

# The compiled reductions of the cpu backend's helper (_cshm.c's REDUCERS): dtype index * 4 +
# op index. Floats have no compiled min/max (NumPy's NaN and signed-zero rules are its own).
NATIVE_DTYPES = ["float32", "float64", "int8", "int32", "int64", "uint8", "uint32", "uint64"]
NATIVE_OPS = {ReduceOp.SUM: 0, ReduceOp.AVG: 0, ReduceOp.PROD: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3}

UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}

# By identity: an Enum member's hash is a Python-level call, and this runs on every call.
_UFUNC_OF = {id(op): uf for op, uf in UFUNCS.items()}


def native_code(dtype: Any, op: ReduceOp) -> int:
    """The compiled reduction of ``dtype`` and ``op`` (an index into _cshm.c's table), or -1
    (NumPy reduces)."""
    dt = np.dtype(dtype)
    if not dt.isnative or dt.name not in NATIVE_DTYPES:
        return -1
    k, o = NATIVE_DTYPES.index(dt.name), NATIVE_OPS[op]
    if k < 2 and o >= 2:
        return -1
    return 4 * k + o


_native: Any = False  # the helper's reduce_into once looked up (None: not built or disabled)
_native_many: Any = False  # its reduce_into_many, likewise
_CODES: dict[tuple[Any, int], int] = {}  # (dtype, id(op)) -> native_code


def _reduce_into() -> Any:
    global _native, _native_many
    if _native is False:
        from .cpu._sync import native_module  # here: the cpu backend imports this module

        try:
            module = native_module()
        except (ValueError, RuntimeError):
            module = None  # a bad DPT_CPU_NATIVE: the cpu backend itself reports it
        _native = None if module is None else getattr(module, "reduce_into", None)
        _native_many = None if module is None else getattr(module, "reduce_into_many", None)
    return _native


def reduce_in_order(out: Any, sources: list[Any], op: ReduceOp, n: int) -> None:
    """``out = sources[0] op sources[1] op ...`` in order (then ``/ n`` for AVG); ``out`` may
    be the first or second source itself (elementwise in place), never a later one.

    Contiguous host arrays of one dtype go through the cpu backend's compiled loop when it is
    built (the same operations in the same order, so the same bits; without the GIL, and
    vectorized where this NumPy's loops are not), anything else through NumPy's ufuncs.
    """
    if len(sources) > 1 and type(out) is np.ndarray and out.flags.c_contiguous:
        native = _native if _native is not False else _reduce_into()
        key = (out.dtype, id(op))
        code = _CODES.get(key)
        if code is None:
            code = _CODES[key] = native_code(out.dtype, op)
        avg = op is ReduceOp.AVG and n > 1
        if avg and (code not in (0, 4) or n != len(sources)):
            code = -1  # the compiled AVG divides floats by the number of sources only
        if (
            native is not None
            and code >= 0
            and all(
                type(s) is np.ndarray
                and s.dtype is out.dtype
                and s.flags.c_contiguous
                and s.shape == out.shape
                for s in sources
            )
        ):
            native(code, avg, out, sources)
            return
    uf = _UFUNC_OF[id(op)]
    if len(sources) == 1:
        np.copyto(out, sources[0])
    else:
        uf(sources[0], sources[1], out=out)
        for s in sources[2:]:
            uf(out, s, out=out)
    if op is ReduceOp.AVG and n > 1:
        np.true_divide(out, n, out=out, casting="unsafe")


# reduce_to_all's choices, by measurement (benchmarks/context_allreduce.py, 2 and 4 outputs):
# below this many bytes read and written a worker's wake-up costs more than its share saves
# (one thread: 20 us at 2 x 256 KiB; two: 14, 4 x 256 KiB 62 and 30 us).
_PARALLEL_BYTES = 1 << 20
# From this many bytes of outputs, streaming stores (no read of the lines first, no eviction
# of the inputs): 2 x 16 MiB 2.9 ms plain, 1.4 streaming; at 2 x 8 MiB and 4 x 4 MiB plain
# stores won (what fits the caches is read back from them).
_STREAM_BYTES = 32 << 20
_MAX_WORKERS = 8  # threads (the caller among them) that share one reduction
_workers = 0  # this process's, once computed
_stop_registered = False


def _pool_workers() -> int:
    """How many threads a parallel reduction uses: the cores this process may run on, capped
    (the caller and ``workers - 1`` of the helper's pool threads, started on first use)."""
    global _workers, _stop_registered
    if not _workers:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        _workers = max(1, min(cores, _MAX_WORKERS))
    if _workers > 1 and not _stop_registered:
        from .cpu import _cshm  # built: reduce_into_many was found

        atexit.register(_cshm.pool_stop)  # end the pool's threads before the interpreter
        _stop_registered = True
    return _workers


def reduce_to_all(
    outs: list[Any],
    sources: list[Any],
    op: ReduceOp,
    n: int,
    lo: int = 0,
    hi: int | None = None,
    *,
    parallel: bool = False,
) -> None:
    """Items ``[lo, hi)`` (of the flattened arrays) of every output = ``sources[0] op
    sources[1] op ...`` in order (then ``/ n`` for AVG): the bits of :func:`reduce_in_order`.

    Contiguous host arrays of one dtype and shape with a compiled loop go through the cpu
    helper's ``reduce_into_many``: each block is reduced once and copied to every other
    output while in cache (one pass over the outputs, not a reduction into the first and a
    second pass to copy it; streaming stores for outputs too large to stay in cache), without
    the GIL; with ``parallel`` and enough bytes, the helper's worker threads share the blocks,
    one thread per core. Anything else: :func:`reduce_in_order` into one output, then copies.

    Args:
        outs: the outputs (1 or more, of the sources' shape); each is one of ``sources``
            itself (the same object) or shares no memory with any source or other output.
        sources: the operands, in order.
        op: the reduction.
        n: AVG's divisor (the group's size).
        lo: the first item.
        hi: the item after the last (None: the arrays' size).
        parallel: whether the helper's worker threads may share the work (the caller is the
            only thread working on this reduction: other threads wait for it).
    """
    first = outs[0]
    hi = first.size if hi is None else hi
    if type(first) is np.ndarray:
        key = (first.dtype, id(op), n, len(sources))
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _plan(first.dtype, op, n, len(sources))
        if plan[0] >= 0:
            nbytes = first.nbytes
            workers = 1
            if (
                parallel
                and (len(outs) + len(sources)) * (hi - lo) * first.itemsize >= _PARALLEL_BYTES
            ):
                workers = _pool_workers()
            stream = len(outs) * nbytes >= _STREAM_BYTES
            # False: some array is not contiguous or of another dtype (NumPy's loops then).
            if _native_many(plan[0], plan[1], outs, sources, lo, hi, workers, stream):
                return
    _numpy_to_all(outs, sources, op, n, lo, hi)


_PLANS: dict[tuple[Any, int, int, int], tuple[int, bool]] = {}  # reduce_to_all's, by call kind


def reduces_on_cores(dtype: Any, op: ReduceOp, n: int, count: int) -> bool:
    """Whether :func:`reduce_to_all` with ``parallel`` reduces ``count`` contiguous sources of
    ``dtype`` with ``op`` (AVG's divisor ``n``) in the helper's compiled loop on more than one
    thread, when they are large enough."""
    key = (np.dtype(dtype), id(op), n, count)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(key[0], op, n, count)
    return plan[0] >= 0 and _pool_workers() > 1


def _plan(dtype: Any, op: ReduceOp, n: int, count: int) -> tuple[int, bool]:
    """(code, avg) of reduce_into_many for ``count`` sources of ``dtype`` reduced with ``op``
    (AVG's divisor ``n``); code -1: reduce_in_order's NumPy loops (or no helper)."""
    if _native_many is False:
        _reduce_into()
    avg = op is ReduceOp.AVG and n > 1
    code = native_code(dtype, op) if _native_many is not None and count > 1 else -1
    if avg and (code not in (0, 4) or n != count):
        code = -1  # the compiled AVG divides floats by the number of sources only
    return code, avg


def _numpy_to_all(
    outs: list[Any], sources: list[Any], op: ReduceOp, n: int, lo: int, hi: int
) -> None:
    """reduce_to_all() through reduce_in_order: into the first output that is not a later
    source (reduce_in_order reads those after writing its output), then copies."""
    if hi <= lo:
        return
    later = {id(s) for s in sources[2:]}
    into = next((i for i, o in enumerate(outs) if id(o) not in later), None)
    views = [_items(o, lo, hi) for o in outs]
    target = views[into] if into is not None else np.empty_like(views[0])
    reduce_in_order(target, [_items(s, lo, hi) for s in sources], op, n)
    for v in views:
        if v is not target:
            np.copyto(v, target)


def _items(a: Any, lo: int, hi: int) -> Any:
    """Items ``[lo, hi)`` of ``a`` flattened, as a view (written through)."""
    if lo == 0 and hi == a.size:
        return a
    if a.ndim == 1:
        return a[lo:hi]
    if not a.flags.c_contiguous:
        raise ValueError("reduce_to_all: a part of an array must be 1-D or C-contiguous")
    return a.reshape(-1)[lo:hi]
