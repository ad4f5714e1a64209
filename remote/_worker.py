"""The server's side of one session: its table of arrays, run in order on one thread.

A session is one client connection to one device. Its records arrive in frames (the
connection's thread decodes them, ``_server``) and wait in a bounded queue; the session's
worker thread, bound to the device, runs them one by one through the fixed op table
(``handlers``). An op that fails poisons its result (and what is computed from it later);
the first failure since the last reply is reported with the next reply. Arrays are counted
by the buffer they own (a view costs nothing more) against ``max_session_bytes``.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._collective import collective_handler
from ._conn import Framed
from ._wire import (
    BINARY_UFUNCS,
    DROP,
    FLAG_OUT,
    OP_CODES,
    OPS,
    READ,
    REDUCTIONS,
    SYNC,
    UNARY_UFUNCS,
    ProtocolError,
    Ref,
    put_array,
    read_records,
    reply,
)

__all__ = ["Worker", "handlers"]

# Frames a session may have waiting: a client that sends faster than its device computes
# blocks (TCP backpressure) instead of growing the server's memory.
QUEUE_FRAMES = 16
Handler = Callable[[Sequence[Any], Any], Any]


def handlers(xp: Any, guard: Callable[[int], None] = lambda n: None) -> list[Handler | None]:
    """The op table for array module ``xp``: ``OPS[i]`` runs as ``table[i](args, out)``;
    ``guard(nbytes)`` vets what a creation op would allocate before it does.

    Names come from the fixed table in ``_wire``, never from the wire.
    """
    table: list[Handler | None] = [None] * len(OPS)

    def set_(name: str, fn: Handler) -> None:
        table[OP_CODES[name]] = fn

    for name in BINARY_UFUNCS:
        f = getattr(xp, name, None)
        if f is not None:
            set_(name, _binary(f))
    for name in UNARY_UFUNCS:
        f = getattr(xp, name, None)
        if f is not None:
            set_(name, _unary(f))
    for name in REDUCTIONS:
        set_(name, _reduction(name, with_dtype=name in ("sum", "mean", "prod")))
    set_("upload", lambda a, out: xp.asarray(a[0]))

    def full(a: Sequence[Any], out: Any) -> Any:
        guard(math.prod(a[0]) * np.dtype(a[2]).itemsize)
        return xp.full(a[0], a[1], dtype=a[2])

    def arange(a: Sequence[Any], out: Any) -> Any:
        guard(max(0, math.ceil((a[1] - a[0]) / a[2])) * np.dtype(a[3]).itemsize)
        return xp.arange(a[0], a[1], a[2], dtype=a[3])

    set_("full", full)
    set_("arange", arange)
    set_("matmul", lambda a, out: xp.matmul(a[0], a[1], out=out))
    set_("reshape", lambda a, out: a[0].reshape(a[1]))
    set_("transpose", lambda a, out: a[0].transpose(a[1]))
    set_("broadcast_to", lambda a, out: xp.broadcast_to(a[0], a[1]))
    set_("expand_dims", lambda a, out: xp.expand_dims(a[0], a[1]))
    set_("squeeze", lambda a, out: a[0].squeeze(axis=a[1]))
    set_("swapaxes", lambda a, out: a[0].swapaxes(a[1], a[2]))
    set_("getitem", lambda a, out: a[0][a[1]])
    set_("setitem", lambda a, out: out.__setitem__(a[0], a[1]))
    set_("concatenate", lambda a, out: xp.concatenate(a[0], axis=a[1]))
    set_("stack", lambda a, out: xp.stack(a[0], axis=a[1]))
    set_("copy", lambda a, out: a[0].copy())
    set_("astype", lambda a, out: a[0].astype(a[1]))
    set_("fill", lambda a, out: out.fill(a[0]))
    set_("where", lambda a, out: xp.where(a[0], a[1], a[2]))
    set_("clip", lambda a, out: xp.clip(a[0], a[1], a[2], out=out))
    set_("add_at", lambda a, out: _add_at(xp, out, a[0], a[1]))
    return table


def _binary(f: Any) -> Handler:
    def run(a: Sequence[Any], out: Any) -> Any:
        return f(a[0], a[1]) if out is None else f(a[0], a[1], out=out)

    return run


def _unary(f: Any) -> Handler:
    def run(a: Sequence[Any], out: Any) -> Any:
        return f(a[0]) if out is None else f(a[0], out=out)

    return run


def _reduction(name: str, with_dtype: bool) -> Handler:
    def run(a: Sequence[Any], out: Any) -> Any:
        method = getattr(a[0], name)  # a fixed name from OPS, on an array from the table
        if with_dtype:
            return method(axis=a[1], keepdims=a[2], dtype=a[3], out=out)
        return method(axis=a[1], keepdims=a[2], out=out)

    return run


def _add_at(xp: Any, a: Any, index: Any, values: Any) -> None:
    if xp is np:
        np.add.at(a, index, values)
    else:  # CuPy
        import cupyx

        cupyx.scatter_add(a, index, values)


class Poison:
    """What the table holds for an array whose op failed."""

    __slots__ = ("message", "op", "seq")

    def __init__(self, seq: int, op: int, message: str) -> None:
        self.seq, self.op, self.message = seq, op, message


class _PoisonedError(Exception):
    def __init__(self, poison: Poison) -> None:
        self.poison = poison


class Worker:
    """One session: its table, its queue of frames, and the thread that runs them.

    Attributes:
        bytes: what its arrays hold now.
        waiting: replies due (the heartbeat thread keeps the client posted while > 0).
    """

    def __init__(self, framed: Framed, xp: Any, device: Any, limit: int | None, name: str) -> None:
        self.framed = framed
        self.xp = xp
        self.device = device
        self.limit = limit
        self.table: dict[int, Any] = {}
        self._owner: dict[int, int] = {}  # id -> key of the buffer it is (a view of)
        self._buffers: dict[int, list[Any]] = {}  # key -> [users, nbytes, the buffer]
        self.bytes = 0
        self.waiting = 0
        self.closed = False
        self._seq = 0
        self._failed: list[int] = []
        self._first: Poison | None = None
        self._table = handlers(xp, self._guard)
        self._table[OP_CODES["collective"]] = collective_handler(self)  # needs the table
        self._array_type = xp.ndarray
        self.queue: queue.Queue[memoryview | None] = queue.Queue(QUEUE_FRAMES)
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def add_waiting(self, n: int) -> None:
        with self._lock:
            self.waiting += n

    def _main(self) -> None:
        if self.device is not None:
            self.device.__enter__()  # this thread's current GPU
        try:
            while True:
                frame = self.queue.get()
                if frame is None or self.closed:
                    break
                for rec in read_records(frame):
                    if self.closed:
                        break
                    self._run(*rec)
        except (OSError, ProtocolError):  # a malformed frame, or the client went away
            self.framed.close()  # the connection's thread sees it and frees the session
        finally:
            self.closed = True
            self.table.clear()
            self._owner.clear()
            self._buffers.clear()
            self.bytes = 0

    # ------------------------------------------------------------------ one record
    def _run(self, op: int, flags: int, out: int, args: tuple[Any, ...]) -> None:
        seq = self._seq
        self._seq = seq + 1
        if op <= SYNC:
            if op == DROP:
                self._free(out)
            else:
                self._reply(op, out, args)
            return
        fn = self._table[op]
        try:
            if fn is None:
                raise TypeError(f"op {OPS[op]!r} is not available on this device")
            table = self.table
            resolved: list[Any] = []
            for a in args:  # _resolve, with the common case (a live array) inlined
                t = type(a)
                if t is Ref:
                    x = table.get(a)
                    resolved.append(
                        x if x is not None and type(x) is not Poison else self._array(a)
                    )
                elif t is tuple:
                    resolved.append(self._resolve(a))
                else:
                    resolved.append(a)
            if flags & FLAG_OUT:
                fn(resolved, self._array(out))
                return
            result = fn(resolved, None)
            if not isinstance(result, self._array_type):
                if isinstance(result, np.generic) or np.isscalar(result):
                    result = self.xp.asarray(result)
                else:
                    raise TypeError(f"op {OPS[op]!r} produced a {type(result).__name__}")
            self._store(out, result)
        except _PoisonedError as p:
            self._poison(out, p.poison)
        except Exception as exc:  # any failure of the op: poison its result, report later
            poison = Poison(seq, op, f"{type(exc).__name__}: {exc}")
            self._failed.append(seq)
            if self._first is None:
                self._first = poison
            self._poison(out, poison)

    def _resolve(self, v: Any) -> Any:
        t = type(v)
        if t is Ref:
            return self._array(v)
        if t is tuple:
            return tuple(self._resolve(x) for x in v)
        return v

    def _array(self, i: int) -> Any:
        x = self.table.get(i)
        if x is None:
            raise KeyError(f"no array {i} in this session (freed, or never made)")
        if type(x) is Poison:
            raise _PoisonedError(x)
        return x

    def _reply(self, op: int, req: int, args: tuple[Any, ...]) -> None:
        failed, first = self._failed, self._first
        self._failed, self._first = [], None
        error = None if first is None else (first.seq, first.op, first.message)
        parts: list[bytes] = []
        if op == READ and error is None:
            x = self.table.get(args[0]) if args and type(args[0]) is Ref else None
            if type(x) is Poison:
                error = (x.seq, x.op, x.message)
            elif x is None:
                error = (self._seq - 1, READ, f"no array {args[0] if args else '?'} to read")
            else:
                parts = []
                put_array(parts, x if isinstance(x, np.ndarray) else x.get())
        self.framed.send(reply(req, failed, error), *parts)
        with self._lock:
            self.waiting -= 1

    # ------------------------------------------------------------------ memory
    def _store(self, i: int, x: Any) -> None:
        if i in self.table:
            self._free(i)
        root = x
        while isinstance(root.base, self._array_type):
            root = root.base
        key = id(root)
        entry = self._buffers.get(key)
        if entry is None:
            nbytes = int(root.nbytes) if root.base is None else 0  # not ours: 0
            self._guard(nbytes)
            entry = [0, nbytes, root]
            self._buffers[key] = entry
            self.bytes += nbytes
        entry[0] += 1
        self.table[i] = x
        self._owner[i] = key

    def _free(self, i: int) -> None:
        self.table.pop(i, None)
        key = self._owner.pop(i, None)
        if key is None:
            return
        entry = self._buffers[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._buffers[key]
            self.bytes -= entry[1]

    def _poison(self, i: int, poison: Poison) -> None:
        self._free(i)
        self.table[i] = poison

    def _guard(self, nbytes: int) -> None:
        if self.limit is not None and self.bytes + nbytes > self.limit:
            raise MemoryError(
                f"the session's memory limit: {nbytes} bytes more on top of the {self.bytes} "
                f"held would exceed max_session_bytes={self.limit}"
            )
