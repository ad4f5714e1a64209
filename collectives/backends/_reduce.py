"""The one in-order reduction of host arrays the cpu backend and the threads NumPy engine share.

Reducing in rank order (``sources[0] op sources[1] op ...``) is what makes results bitwise the
same on every rank, from run to run, and between the two backends.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._types import ReduceOp

__all__ = ["UFUNCS", "reduce_in_order"]

UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}

# By identity: an Enum member's hash is a Python-level call, and this runs on every call.
_UFUNC_OF = {id(op): uf for op, uf in UFUNCS.items()}


def reduce_in_order(out: Any, sources: list[Any], op: ReduceOp, n: int) -> None:
    """``out = sources[0] op sources[1] op ...`` in order (then ``/ n`` for AVG); ``out`` may
    be the first or second source itself (elementwise in place), never a later one."""
    uf = _UFUNC_OF[id(op)]
    if len(sources) == 1:
        np.copyto(out, sources[0])
    else:
        uf(sources[0], sources[1], out=out)
        for s in sources[2:]:
            uf(out, s, out=out)
    if op is ReduceOp.AVG and n > 1:
        np.true_divide(out, n, out=out, casting="unsafe")
