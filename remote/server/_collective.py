"""The server's side of collectives among its sessions (DDP over remote devices).

A threads job whose ranks are remote devices of one server (``remote.client._engine``)
reduces on that server: each member's session sends one COLLECTIVE record naming only *its
own* tensors, as plain integers (src and dst ids, the group's key, the call's number, the
member, the kind, the reduction, the root, a timeout: the format is ``remote._records``').

The session workers of the members meet on ``(key, seq)`` in this process's memory: the key
is a random 128-bit value the client made for the group and gave its members only (a session
without it cannot join), ``seq`` the group's call number. Once every member arrived, each one
computes its own result from every member's input in member order (so the result is the same
on every member, bit for bit, and equal to the NumPy engine's), waits until every member
finished reading the inputs, and writes its result into its own tensor. Nothing else crosses
sessions: no names, no data from the wire beyond those integers.

A member that never arrives (its client died, or skipped the call) fails the others after the
record's timeout (at most :data:`MAX_TIMEOUT_S`): their outputs are poisoned with an error
naming the missing members, reported at the client's next read. A worker waits in at most one
collective at a time, so the meetings in memory are bounded by the sessions.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from collectives import ReduceOp
from collectives.backends.threads import reduce_in_order

from .._wire import KINDS, REDUCE_OPS

__all__ = ["collective_handler"]

MAX_TIMEOUT_S = 3600.0
# REDUCE_OPS as the engines' reduction names them.
_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
_NARGS = 11
_FAILED_KEPT = 1024  # recently failed meetings, so a late member fails at once


class _Meeting:
    """The members of one collective call, in server memory."""

    def __init__(self, count: int, kind: int, rop: int, root: int) -> None:
        self.count = count
        self.call = (count, kind, rop, root)
        self.inputs: list[Any] = [None] * count
        self.arrived = 0
        self.computed = 0
        self.left = 0
        self.error: str | None = None


_lock = threading.Condition(threading.Lock())
_meetings: dict[tuple[int, int, int], _Meeting] = {}
_failed: OrderedDict[tuple[int, int, int], str] = OrderedDict()


def collective_handler(worker: Any) -> Any:
    """The op-table entry of ``"collective"`` for one session's worker: resolves the
    record's own tensor ids in that session's table (see the module docstring)."""

    def run(a: Sequence[Any], out: Any) -> Any:
        if len(a) != _NARGS or any(type(v) is not int for v in a[:10]) or type(a[10]) is not float:
            raise TypeError(f"a collective record takes {_NARGS} numbers")
        src_id, dst_id, hi, lo, seq, me, count, kind, rop, root = a[:10]
        if not (0 < count <= 1024 and 0 <= me < count and 0 <= kind < len(KINDS)):
            raise ValueError(f"collective: bad member {me} of {count} or kind {kind}")
        if not (0 <= rop < len(REDUCE_OPS) and -1 <= root < count):
            raise ValueError(f"collective: bad reduce op {rop} or root {root}")
        src = worker._array(src_id)
        dst = worker._array(dst_id)
        timeout = min(max(float(a[10]), 0.0), MAX_TIMEOUT_S)
        _run(src, dst, (hi, lo, seq), me, (count, kind, rop, root), timeout)
        return dst

    return run


def _host(x: Any) -> np.ndarray[Any, Any]:
    return x if isinstance(x, np.ndarray) else x.get()  # CuPy: a host copy (this server's)


def _run(
    src: Any,
    dst: Any,
    key: tuple[int, int, int],
    me: int,
    call: tuple[int, int, int, int],
    timeout: float,
) -> None:
    count, kind, rop, root = call
    name = f"{KINDS[kind]} #{key[2]}"
    with _lock:
        gone = _failed.get(key)
        if gone is not None:
            raise RuntimeError(gone)
        m = _meetings.get(key)
        if m is None:
            m = _meetings[key] = _Meeting(*call)
        if m.call != call or m.inputs[me] is not None:
            _fail(key, m, f"{name}: member {me} issued another call than its peers ({call})")
        else:
            m.inputs[me] = _host(src)
            m.arrived += 1
            _lock.notify_all()
        _wait(key, m, lambda: m.arrived == count, timeout, name)
        inputs = list(m.inputs)
    try:
        result = _result(KINDS[kind], rop, root, me, inputs, tuple(dst.shape), dst.dtype)
    except Exception as exc:  # inconsistent shapes from a client: fail every member
        with _lock:
            _fail(key, m, f"{name}: {type(exc).__name__}: {exc}")
            raise RuntimeError(m.error) from None
    with _lock:
        m.computed += 1
        _lock.notify_all()
        # Nobody writes before every member has read the inputs (in-place ops share them).
        _wait(key, m, lambda: m.computed == count, timeout, name)
        m.left += 1
        if m.left == count:
            _meetings.pop(key, None)
    if result is not None:
        if isinstance(dst, np.ndarray):
            dst[...] = result
        else:  # CuPy
            dst.set(np.ascontiguousarray(result))


def _wait(key: tuple[int, int, int], m: _Meeting, done: Any, timeout: float, name: str) -> None:
    """(Lock held.) Until ``done()``; raise if the meeting failed or the deadline passed."""
    end = time.monotonic() + timeout
    while not done():
        if m.error is not None:
            raise RuntimeError(m.error)
        left = end - time.monotonic()
        if left <= 0:
            missing = [q for q in range(m.count) if m.inputs[q] is None]
            _fail(
                key,
                m,
                f"{name}: timed out after {timeout:g} s on the server; members {missing} of "
                f"{m.count} never arrived (their client died, or skipped this collective)",
            )
            raise RuntimeError(m.error)
        _lock.wait(min(left, 0.5))
    if m.error is not None:
        raise RuntimeError(m.error)


def _fail(key: tuple[int, int, int], m: _Meeting, message: str) -> None:
    """(Lock held.) Fail every member of ``m`` (and late ones) with ``message``."""
    if m.error is None:
        m.error = message
    _meetings.pop(key, None)
    _failed[key] = m.error
    while len(_failed) > _FAILED_KEPT:
        _failed.popitem(last=False)
    _lock.notify_all()


def _reduce(xs: list[np.ndarray[Any, Any]], rop: int) -> np.ndarray[Any, Any]:
    """``xs[0] op xs[1] op ...`` in member order: the NumPy engine's own reduction, so the
    bits are the same as rank threads on the CPU."""
    out = np.empty_like(xs[0])
    reduce_in_order(out, xs, _OPS[rop], len(xs))
    return out


def _result(
    kind: str,
    rop: int,
    root: int,
    me: int,
    inputs: list[np.ndarray[Any, Any]],
    shape: tuple[int, ...],
    dtype: Any,
) -> np.ndarray[Any, Any] | None:
    """Member ``me``'s output (None: it keeps its tensor as it is)."""
    n = len(inputs)
    first = inputs[0]
    if any(x.dtype != first.dtype or x.size != first.size for x in inputs):
        raise ValueError("the members' tensors differ in dtype or size")
    flats = [x.reshape(-1) for x in inputs]
    if kind == "all_reduce" or (kind == "reduce" and me == root):
        res = _reduce(flats, rop)
    elif kind == "reduce":
        return None
    elif kind == "broadcast":
        if me == root:
            return None
        res = flats[root]
    elif kind == "all_gather":
        res = np.stack(flats)
    elif kind == "reduce_scatter":
        res = _reduce([f.reshape(n, -1)[me] for f in flats], rop)
    else:  # all_to_all
        res = np.stack([f.reshape(n, -1)[me] for f in flats])
    if res.size != int(np.prod(shape)) or res.dtype != dtype:
        raise ValueError(f"a result of {res.size} {res.dtype} for an output {shape} {dtype}")
    return res.reshape(shape)
