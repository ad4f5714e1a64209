"""The server's side of one session: its table of arrays, run in order on one thread.

A session is one client connection to one device. The connection's thread (``_server``),
bound to the device once the handshake is done, receives each frame, reads its records and
runs them one by one through the fixed op table (``_ops.handlers``). An op that fails
poisons its result (and what is computed from it later); the first failure since the last
reply is reported with the next reply. Arrays are counted by the buffer they own (a view
costs nothing more) against ``max_session_bytes``.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

import numpy as np

from .._conn import Framed
from .._wire import (
    ADAM,
    DROP,
    F64,
    FLAG_OUT,
    I64,
    OP_CODES,
    OPS,
    OUTPUTS,
    READ,
    RECORD_HEAD,
    RECORDS,
    RECORDS_HEAD,
    SYNC,
    T_FLOAT,
    T_IDS,
    T_INT,
    T_REF,
    T_TRUE,
    U32,
    ProtocolError,
    Reader,
    Ref,
    put_array,
    reply,
)
from ._collective import collective_handler
from ._ops import ADAM_WRITTEN, adam_writes, handlers

__all__ = ["Worker"]

_SMALL = (None, False, True)


class Poison:
    """What the table holds for an array whose op failed."""

    __slots__ = ("message", "op", "seq")

    def __init__(self, seq: int, op: int, message: str) -> None:
        self.seq, self.op, self.message = seq, op, message


class _PoisonedError(Exception):
    def __init__(self, poison: Poison) -> None:
        self.poison = poison


class Worker:
    """One session: its table, and the loop that receives and runs its frames.

    Attributes:
        bytes: what its arrays hold now.
        waiting: replies due (the heartbeat thread keeps the client posted while > 0).
        busy_since: when the frame being run started (None between frames): a frame that
            runs long gets heartbeats too, since the client may be waiting on a later one.
    """

    def __init__(self, framed: Framed, xp: Any, device: Any, limit: int | None) -> None:
        self.framed = framed
        self.xp = xp
        self.device = device
        self.limit = limit
        self.table: dict[int, Any] = {}
        self._owner: dict[int, int] = {}  # id -> key of the buffer it is (a view of)
        self._buffers: dict[int, list[Any]] = {}  # key -> [users, nbytes, the buffer]
        self.bytes = 0
        self.waiting = 0
        self.busy_since: float | None = None
        self.closed = False
        self._seq = 0
        self._failed: list[int] = []
        self._first: Poison | None = None
        self._table = handlers(xp, self._guard)
        self._table[OP_CODES["collective"]] = collective_handler(self)  # needs the table
        self._array_type = xp.ndarray
        self._lock = threading.Lock()

    def run(self) -> None:
        """Receive the session's frames and run them, on the calling thread (the
        connection's), until the client goes or the server closes; then free the session.

        One thread does it all, so no frame waits for a hand-over between threads (nor the
        GIL to change hands). What waits is bounded by the kernel's socket buffers: a client
        faster than its device blocks in its send (TCP backpressure); the server's memory
        does not grow.
        """
        if self.device is not None:
            self.device.__enter__()  # this thread's current GPU
        try:
            while not self.closed:
                payload = self.framed.recv()
                if len(payload) < RECORDS_HEAD.size:
                    raise ProtocolError("a frame too short for records")
                waits = RECORDS_HEAD.unpack_from(payload)[1]
                if waits:
                    self.add_waiting(waits)
                self.busy_since = time.monotonic()
                self._frame(payload)
                self.busy_since = None
        finally:
            self.closed = True
            self.table.clear()
            self._owner.clear()
            self._buffers.clear()
            self.bytes = 0

    def add_waiting(self, n: int) -> None:
        with self._lock:
            self.waiting += n

    # ------------------------------------------------------------------ one frame
    def _frame(self, payload: memoryview) -> None:
        """Read and run a RECORDS frame's records, in order, in one pass.

        The record format is ``_wire``'s; this loop reads its common values (REF, FLOAT,
        INT, NONE, booleans) inline, a REF straight into the array it names, and every other
        value through ``Reader.value``, since it runs for every record of every op.
        """
        r = Reader(payload)
        kind, _, count = r.unpack(RECORDS_HEAD)
        if kind != RECORDS:
            raise ProtocolError(f"a session may only send records, got frame kind {kind}")
        buf, pos, end = r.buf, r.pos, len(r.buf)
        head, u32 = RECORD_HEAD.unpack_from, U32.unpack_from
        f64, i64 = F64.unpack_from, I64.unpack_from
        table, nops, n = self.table, len(OPS), 0
        deferred: tuple[int, Any, Reader, int] | None = None
        while pos < end:
            if self.closed:
                return
            if pos + 8 > end:
                raise ProtocolError(f"truncated record at offset {pos}")
            rec = pos
            op, flags, oid, nargs = head(buf, pos)
            pos += 8
            n += 1
            if op >= nops:
                raise ProtocolError(f"unknown op code {op}")
            if op <= SYNC:  # DROP, READ, SYNC: their REFs are ids, not operands
                if op == DROP and nargs == 1 and pos + 5 <= end and buf[pos] == T_IDS:
                    pos = self._drop_ids(buf, pos, end)  # a frame's frees: the common DROP
                    continue
                raw: list[Any] = []
                r.pos = pos
                for _ in range(nargs):
                    raw.append(r.value())
                pos = r.pos
                self._session_record(op, oid, tuple(raw))
                if deferred is not None:  # the update the READ did not need to wait for
                    self._run_update(*deferred)
                    deferred = None
                continue
            seq = self._seq
            self._seq = seq + 1
            args: list[Any] = []
            bad: Any = None  # a poisoned input (Poison) or a missing one (its id)
            for _ in range(nargs):
                if pos >= end:
                    raise ProtocolError(f"truncated record at offset {pos}")
                tag = buf[pos]
                if tag == T_REF and pos + 5 <= end:
                    i = u32(buf, pos + 1)[0]
                    x = table.get(i)
                    if x is None or type(x) is Poison:
                        bad = bad if bad is not None else (i if x is None else x)
                    args.append(x)
                    pos += 5
                elif tag == T_FLOAT and pos + 9 <= end:
                    args.append(f64(buf, pos + 1)[0])
                    pos += 9
                elif tag == T_INT and pos + 9 <= end:
                    args.append(i64(buf, pos + 1)[0])
                    pos += 9
                elif tag <= T_TRUE:
                    args.append(_SMALL[tag])
                    pos += 1
                elif tag == T_IDS and pos + 5 <= end:  # packed REFs (ADAM's), resolved here
                    k = u32(buf, pos + 1)[0]
                    stop = pos + 5 + 4 * k
                    if stop > end:
                        raise ProtocolError(f"truncated frame: {k} ids at offset {pos}")
                    ids = struct.unpack_from(f"<{k}I", buf, pos + 5)
                    xs = tuple(map(table.get, ids))
                    if bad is None:
                        for i, x in zip(ids, xs, strict=True):
                            if x is None or type(x) is Poison:
                                bad = _missing(i) if x is None else x
                                break
                    args.append(xs)
                    pos = stop
                else:
                    r.pos = pos
                    v = r.value()
                    pos = r.pos
                    if type(v) is tuple:
                        try:
                            v = self._resolve(v)
                        except (KeyError, _PoisonedError) as exc:
                            bad = bad if bad is not None else _why(exc)
                    args.append(v)
            if op == ADAM:
                deferred = self._adam(seq, args, bad, r, rec, self._read_next(buf, pos, end))
            elif bad is not None:
                self._fail_input(seq, op, _results(op, oid), bad)
            else:
                self._op(seq, op, flags, oid, args)
        if n != count:
            raise ProtocolError(f"a frame announced {count} records and held {n}")

    def _op(self, seq: int, op: int, flags: int, oid: int, args: list[Any]) -> None:
        """Run one op on resolved arguments; store its result or poison it."""
        fn = self._table[op]
        try:
            if fn is None:
                raise TypeError(f"op {OPS[op]!r} is not available on this device")
            if flags & FLAG_OUT:
                fn(args, self._array(oid))
                return
            result = fn(args, None)
            if type(result) is not np.ndarray and not isinstance(result, self._array_type):
                if type(result) is tuple and len(result) == OUTPUTS[op] > 1:
                    for k, x in enumerate(result):
                        if x is not None:  # a result not asked for (LINEAR_GRAD's)
                            self._store(oid + k, self._as_array(op, x))
                    return
                result = self._as_array(op, result)
            if result.base is None and oid not in self.table:  # _store's common case
                key = id(result)
                if key not in self._buffers:
                    nbytes = result.nbytes
                    if self.limit is not None:
                        self._guard(nbytes)
                    self._buffers[key] = [1, nbytes, result]
                    self.bytes += nbytes
                    self.table[oid] = result
                    self._owner[oid] = key
                    return
            self._store(oid, result)
        except _PoisonedError as p:
            for i in _results(op, oid):
                self._poison(i, p.poison)
        except Exception as exc:  # any failure of the op: poison its results, report later
            self._fail(seq, op, _results(op, oid), f"{type(exc).__name__}: {exc}")

    def _as_array(self, op: int, x: Any) -> Any:
        """An op's result as an array of this device (a NumPy scalar becomes a 0-d one)."""
        if type(x) is np.ndarray or isinstance(x, self._array_type):
            return x
        if isinstance(x, np.generic) or np.isscalar(x):
            return self.xp.asarray(x)
        raise TypeError(f"op {OPS[op]!r} produced a {type(x).__name__}")

    def _session_record(self, op: int, oid: int, raw: tuple[Any, ...]) -> None:
        """DROP (``oid``, or the ids of its one IDS value), READ and SYNC."""
        self._seq += 1
        if op == DROP:
            ids = raw[0] if raw and type(raw[0]) is tuple else (oid,)
            for i in ids:
                self._free(i)
        else:
            self._reply(op, oid, raw)

    def _drop_ids(self, buf: memoryview, pos: int, end: int) -> int:
        """Free the ids of the DROP record's IDS value at ``pos``; the offset after it
        (``_free``, inlined: a step frees dozens)."""
        k = U32.unpack_from(buf, pos + 1)[0]
        stop = pos + 5 + 4 * k
        if stop > end:
            raise ProtocolError(f"truncated frame: {k} ids at offset {pos}")
        self._seq += 1
        table, owner, buffers = self.table, self._owner, self._buffers
        for i in struct.unpack_from(f"<{k}I", buf, pos + 5):
            table.pop(i, None)
            key = owner.pop(i, None)
            if key is not None:
                entry = buffers[key]
                entry[0] -= 1
                if entry[0] == 0:
                    del buffers[key]
                    self.bytes -= entry[1]
        return stop

    def _adam(
        self, seq: int, args: list[Any], bad: Any, r: Reader, rec: int, read: Any
    ) -> tuple[int, Any, Reader, int] | None:
        """ADAM writes many arrays in place: a failure poisons every one it writes.

        Its checks run now; the update too, unless ``read`` (the array the next record, a
        READ, reads: ``_read_next``) is not one it writes: then the update is returned, to
        run right after that READ's reply (the client goes on with its next step while the
        server updates). An update that passed its checks fails only if NumPy does (out of
        memory): that failure is reported at the next reply, naming ADAM's call site.
        """
        if bad is not None:
            self._fail_input(seq, ADAM, adam_writes(self._raw(r, rec)), bad)
            return None
        try:
            update = self._table[ADAM](args, None)  # type: ignore[misc]  # always in the table
        except Exception as exc:
            self._fail(seq, ADAM, adam_writes(self._raw(r, rec)), f"{type(exc).__name__}: {exc}")
            return None
        if read is not None and not _writes(args, read):
            return (seq, update, r, rec)
        self._run_update(seq, update, r, rec)
        return None

    def _run_update(self, seq: int, update: Any, r: Reader, rec: int) -> None:
        try:
            update()
        except Exception as exc:
            self._fail(seq, ADAM, adam_writes(self._raw(r, rec)), f"{type(exc).__name__}: {exc}")

    def _read_next(self, buf: memoryview, pos: int, end: int) -> Any:
        """The array the record at ``pos`` reads, if it is a READ of one (else None)."""
        if pos + 13 > end:
            return None
        op, _, _, nargs = RECORD_HEAD.unpack_from(buf, pos)
        if op == READ and nargs == 1 and buf[pos + 8] == T_REF:
            x = self.table.get(U32.unpack_from(buf, pos + 9)[0])
            return x if isinstance(x, self._array_type) else None
        return None

    @staticmethod
    def _raw(r: Reader, rec: int) -> tuple[Any, ...]:
        """The values of the record at offset ``rec``, REFs as ids (it decoded once)."""
        r.pos = rec
        nargs = r.unpack(RECORD_HEAD)[3]
        return tuple(r.value() for _ in range(nargs))

    def _fail(self, seq: int, op: int, ids: list[int], message: str) -> None:
        poison = Poison(seq, op, message)
        self._failed.append(seq)
        if self._first is None:
            self._first = poison
        for i in ids:
            self._poison(i, poison)

    def _fail_input(self, seq: int, op: int, ids: list[int], bad: Any) -> None:
        if type(bad) is Poison:  # computed from a failed op: fails the same way
            for i in ids:
                self._poison(i, bad)
        else:
            message = bad if type(bad) is str else _missing(bad)
            self._fail(seq, op, ids, f"KeyError: {message!r}")

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
            raise KeyError(_missing(i))
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
        table = self.table
        if i in table:
            self._free(i)
        root = x
        while isinstance(root.base, self._array_type):
            root = root.base
        key = id(root)
        entry = self._buffers.get(key)
        if entry is None:
            nbytes = int(root.nbytes) if root.base is None else 0  # not ours: 0
            if self.limit is not None:
                self._guard(nbytes)
            entry = [0, nbytes, root]
            self._buffers[key] = entry
            self.bytes += nbytes
        entry[0] += 1
        table[i] = x
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


def _root(x: Any) -> Any:
    while x.base is not None and hasattr(x.base, "base"):
        x = x.base
    return x


def _writes(args: list[Any], x: Any) -> bool:
    """Whether an ADAM record (its resolved values) writes ``x`` or memory ``x`` views."""
    root = _root(x)
    return any(_root(a) is root for k in ADAM_WRITTEN for a in args[k])


def _results(op: int, oid: int) -> list[int]:
    """The ids op ``op`` of a record with ``out`` = ``oid`` makes (``_wire.OUTPUTS``)."""
    n = OUTPUTS[op]
    return [oid] if n == 1 else list(range(oid, oid + n))


def _missing(i: int) -> str:
    return f"no array {i} in this session (freed, or never made)"


def _why(exc: Exception) -> Any:
    if isinstance(exc, _PoisonedError):
        return exc.poison
    return str(exc.args[0]) if exc.args else "a missing array"
