"""Reduction ops, and the stable codes of dtypes, ops and reductions that signatures carry."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = [
    "CODE_DTYPES",
    "CODE_OPS",
    "CODE_REDUCES",
    "DTYPE_CODES",
    "OP_CODES",
    "REDUCE_CODES",
    "SUPPORTED_NAMES",
    "ReduceOp",
]


class ReduceOp(enum.Enum):
    """How ``all_reduce``, ``reduce`` and ``reduce_scatter`` combine values."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    def __str__(self) -> str:
        return self.name


# Dtypes the collectives move and reduce, with stable codes that go into signatures.
DTYPE_CODES: dict[np.dtype[Any], int] = {
    np.dtype(np.int8): 1,
    np.dtype(np.uint8): 2,
    np.dtype(np.int32): 3,
    np.dtype(np.uint32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.uint64): 6,
    np.dtype(np.float16): 7,
    np.dtype(np.float32): 8,
    np.dtype(np.float64): 9,
    np.dtype(np.bool_): 10,
}
CODE_DTYPES: dict[int, np.dtype[Any]] = {v: k for k, v in DTYPE_CODES.items()}
SUPPORTED_NAMES = ", ".join(str(d) for d in DTYPE_CODES)

# Ops get small integer codes for the same reason.
OP_CODES: dict[str, int] = {
    "all_reduce": 1,
    "broadcast": 2,
    "reduce": 3,
    "all_gather": 4,
    "reduce_scatter": 5,
    "all_to_all": 6,
    "barrier": 7,
    "send": 8,
    "recv": 9,
    "alloc": 10,
}
CODE_OPS: dict[int, str] = {v: k for k, v in OP_CODES.items()}
REDUCE_CODES: dict[ReduceOp | None, int] = {
    None: 0,
    ReduceOp.SUM: 1,
    ReduceOp.PROD: 2,
    ReduceOp.MIN: 3,
    ReduceOp.MAX: 4,
    ReduceOp.AVG: 5,
}
CODE_REDUCES: dict[int, ReduceOp | None] = {v: k for k, v in REDUCE_CODES.items()}
