"""The one in-order reduction of host arrays the cpu backend and the threads NumPy engine share.

Reducing in rank order (``sources[0] op sources[1] op ...``) is what makes results bitwise the
same on every rank, from run to run, and between the two backends.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._types import ReduceOp

__all__ = ["NATIVE_DTYPES", "NATIVE_OPS", "UFUNCS", "native_code", "reduce_in_order"]

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
_CODES: dict[tuple[Any, int], int] = {}  # (dtype, id(op)) -> native_code


def _reduce_into() -> Any:
    global _native
    if _native is False:
        from .cpu._sync import native_module  # here: the cpu backend imports this module

        try:
            module = native_module()
        except (ValueError, RuntimeError):
            module = None  # a bad DPT_CPU_NATIVE: the cpu backend itself reports it
        _native = None if module is None else getattr(module, "reduce_into", None)
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
