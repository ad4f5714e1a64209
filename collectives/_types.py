"""Reduction ops, supported dtypes and collective signatures."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np

__all__ = ["DTYPE_CODES", "ReduceOp", "Signature", "dtype_code"]


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


def dtype_code(dtype: np.dtype[Any]) -> int:
    """The signature code of a supported dtype (0 for none)."""
    return DTYPE_CODES.get(np.dtype(dtype), 0)


class Signature(NamedTuple):
    """What every rank must agree on for one collective: compared across ranks before data moves.

    ``shape`` is the per-rank input shape; ``root`` is the group rank of the root (or -1).
    (A NamedTuple: immutable, hashable for the backends' caches, and made on every call, where
    it is about three times cheaper than a frozen dataclass.)
    """

    op: str
    dtype: np.dtype[Any] | None
    shape: tuple[int, ...]
    root: int = -1
    reduce_op: ReduceOp | None = None

    def describe(self) -> str:
        """Human-readable form used in error messages."""
        parts = [f"{self.op}", f"dtype={self.dtype}", f"shape={self.shape}"]
        if self.root >= 0:
            parts.append(f"root={self.root}")
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op}")
        return "(" + ", ".join(parts) + ")"
