"""Collective signatures: what every rank must agree on, and the one record format for them.

A :class:`Signature` is made by the group for every call. Before any data moves, each backend
compares the signatures of all ranks (cpu: in shared memory; nccl and mpi: with a tiny
all-gather, or sent ahead of a point-to-point message) using one fixed-size **record** of 16
little-endian int64 words (128 bytes):

====  ======================================================================
word  meaning
====  ======================================================================
0     the call's sequence number in its group (per peer for send/recv)
1     op code (``OP_CODES``)
2     dtype code (``DTYPE_CODES``; 0 for none)
3     reduce-op code (``REDUCE_CODES``; 0 for none)
4     root (group rank) for broadcast/reduce, the peer for send/recv, else -1
5     number of dimensions
6-13  the first eight dimensions (0 beyond ``ndim``)
14    CRC-32 of the whole shape when ``ndim`` > 8, else 0
15    ``SIG_MAGIC`` (format and version)
====  ======================================================================

Records are compared as bytes (one comparison per collective). :func:`describe_record` is the
one renderer of a record in error messages.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, NamedTuple

import numpy as np

from ._types import (
    CODE_DTYPES,
    CODE_OPS,
    CODE_REDUCES,
    DTYPE_CODES,
    OP_CODES,
    REDUCE_CODES,
    ReduceOp,
)

__all__ = [
    "MAX_DIMS",
    "SIG_BYTES",
    "SIG_MAGIC",
    "SIG_WORDS",
    "Signature",
    "describe_record",
    "mismatch_text",
    "record",
    "record_bytes",
    "record_nbytes",
    "same_p2p_call",
    "template",
]

SIG_WORDS = 16  # int64 words per signature record
SIG_BYTES = SIG_WORDS * 8
SIG_MAGIC = 0x4450545349470001  # "DPTSIG" v1, last word of every record
MAX_DIMS = 8
# Words a send and its recv must agree on: seq, dtype, ndim, dims, crc (not op or root, which
# hold "send"/"recv" and the *other* side's rank on each end).
_P2P_WORDS = [0, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
_COMPARED = 15 * 8  # bytes of a record that calls must share (all but the magic word)
_PAD = bytes(SIG_BYTES - _COMPARED)


class Signature(NamedTuple):
    """What every rank must agree on for one collective: compared across ranks before data moves.

    ``shape`` is the per-rank input shape; ``root`` is the group rank of the root (or of the
    peer, for send/recv; else -1). (A NamedTuple: immutable, hashable for the record cache, and
    made on every call, where it is about three times cheaper than a frozen dataclass.)
    """

    op: str
    dtype: np.dtype[Any] | None
    shape: tuple[int, ...]
    root: int = -1
    reduce_op: ReduceOp | None = None


@functools.lru_cache(maxsize=4096)
def template(sig: Signature) -> np.ndarray[Any, Any]:
    """The (read-only, cached) record of ``sig`` with word 0, the sequence number, left at 0."""
    words = np.zeros(SIG_WORDS, dtype=np.int64)
    shape = list(sig.shape)
    words[1] = OP_CODES[sig.op]
    words[2] = DTYPE_CODES.get(sig.dtype, 0) if sig.dtype is not None else 0
    words[3] = REDUCE_CODES[sig.reduce_op]
    words[4] = sig.root
    words[5] = len(shape)
    dims = shape[:MAX_DIMS]
    words[6 : 6 + len(dims)] = dims
    if len(shape) > MAX_DIMS:
        words[14] = zlib.crc32(repr(tuple(shape)).encode())
    words[15] = SIG_MAGIC
    words.flags.writeable = False
    return words


def record(sig: Signature, seq: int) -> np.ndarray[Any, Any]:
    """A fresh (writable) record of ``sig`` issued as call number ``seq``."""
    rec = template(sig).copy()
    rec[0] = seq
    return rec


def record_bytes(sig: Signature, seq: int) -> bytes:
    """The record of ``sig`` issued as call number ``seq``, as its 128 bytes."""
    return (seq & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little") + _template_tail(sig)


@functools.lru_cache(maxsize=4096)
def _template_tail(sig: Signature) -> bytes:
    return template(sig).tobytes()[8:]


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


def same_p2p_call(theirs: np.ndarray[Any, Any], mine: np.ndarray[Any, Any]) -> bool:
    """Whether a send's record and its receive's describe the same message."""
    return bool(np.array_equal(theirs[_P2P_WORDS], mine[_P2P_WORDS]))


def describe_record(rec: np.ndarray[Any, Any] | bytes) -> str:
    """``all_reduce #2(dtype=float32, shape=(16,), op=SUM)`` from a signature record."""
    if isinstance(rec, bytes | bytearray | memoryview):
        rec = np.frombuffer(bytes(rec[:SIG_BYTES]), dtype=np.int64)
    seq, op, dtype, red, root, ndim = (int(v) for v in rec[:6])
    name = CODE_OPS.get(op, "?")
    shape = tuple(int(v) for v in rec[6 : 6 + min(max(ndim, 0), MAX_DIMS)])
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
    rows = records[:, :15]
    if rows.tobytes() == rows[0].tobytes() * records.shape[0]:  # the common case, ~1 us
        return None
    groups: dict[bytes, list[int]] = {}
    for r in range(records.shape[0]):
        groups.setdefault(records[r].tobytes()[:_COMPARED], []).append(ranks[r])
    return "; ".join(
        f"ranks {members} called {describe_record(raw + _PAD)}" for raw, members in groups.items()
    )
