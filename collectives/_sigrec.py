"""Fixed-size signature records: what a rank is about to call, as 16 int64 words.

Backends whose engine cannot compare signatures in shared memory (nccl, mpi) exchange these
records with a tiny all-gather (or send them ahead of a point-to-point message) and compare
them before the real data moves. Word 0 is the sequence number; the rest describe the call.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ._backend import Request
from ._types import CODE_DTYPES, CODE_OPS, CODE_REDUCES, DTYPE_CODES, OP_CODES, REDUCE_CODES

__all__ = [
    "MAX_DIMS",
    "P2P_WORDS",
    "SIG_BYTES",
    "SIG_MAGIC",
    "SIG_WORDS",
    "describe_record",
    "mismatch_text",
    "pack_signature",
]

SIG_WORDS = 16  # int64 words per signature record
SIG_BYTES = SIG_WORDS * 8
SIG_MAGIC = 0x4450545349470001  # "DPTSIG" v1, last word of every record
MAX_DIMS = 8
# Words a send and its recv must agree on: seq, dtype, ndim, dims, crc (not op or root).
P2P_WORDS = [0, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def pack_signature(req: Request) -> np.ndarray[Any, Any]:
    """The record of ``req`` with word 0 (the sequence number) left at 0."""
    sig = req.signature
    words = np.zeros(SIG_WORDS, dtype=np.int64)
    shape = list(sig.shape)
    words[1] = OP_CODES[req.op]
    words[2] = DTYPE_CODES.get(sig.dtype, 0) if sig.dtype is not None else 0
    words[3] = REDUCE_CODES[sig.reduce_op]
    words[4] = sig.root
    words[5] = len(shape)
    dims = shape[:MAX_DIMS]
    words[6 : 6 + len(dims)] = dims
    if len(shape) > MAX_DIMS:
        words[14] = zlib.crc32(repr(tuple(shape)).encode())
    words[15] = SIG_MAGIC
    return words


def record_nbytes(rec: np.ndarray[Any, Any]) -> int:
    """Bytes of the (per-rank) array a record describes; -1 if it cannot say (> MAX_DIMS)."""
    ndim = int(rec[5])
    dt = CODE_DTYPES.get(int(rec[2]))
    if dt is None or ndim > MAX_DIMS or ndim < 0:
        return -1
    count = 1
    for d in rec[6 : 6 + ndim]:
        count *= int(d)
    return count * dt.itemsize


def describe_record(rec: np.ndarray[Any, Any]) -> str:
    """``all_reduce #2(dtype=float32, shape=(16,), op=SUM)`` from a signature record."""
    seq, op, dtype, red, root, ndim = (int(v) for v in rec[:6])
    name = CODE_OPS.get(op, "?")
    shape = tuple(int(v) for v in rec[6 : 6 + min(ndim, MAX_DIMS)])
    dt = CODE_DTYPES.get(dtype)
    parts = [f"dtype={dt if dt is not None else None}", f"shape={shape}"]
    if root >= 0 and name in ("broadcast", "reduce"):
        parts.append(f"root={root}")
    if CODE_REDUCES.get(red) is not None:
        parts.append(f"op={CODE_REDUCES[red]}")
    if name == "barrier":
        parts = []
    return f"{name} #{seq}(" + ", ".join(parts) + ")"


def mismatch_text(records: np.ndarray[Any, Any], ranks: tuple[int, ...]) -> str | None:
    """None if every row of ``records`` (one per group rank) is the same call, else
    ``ranks [0, 1] called ...; ranks [2] called ...`` (global ranks)."""
    row = records[0].tobytes()
    if records.tobytes() == row * records.shape[0]:  # the common case, in about a microsecond
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(records.shape[0]):
        groups.setdefault(tuple(int(v) for v in records[r]), []).append(ranks[r])
    return "; ".join(
        f"ranks {members} called {describe_record(np.array(rec, dtype=np.int64))}"
        for rec, members in groups.items()
    )
