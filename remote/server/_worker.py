"""The server's side of one session: its table of arrays, run in order on one thread.

A session is one client connection to one device. The connection's thread (``_server``),
bound to the device once the handshake is done, receives each frame, reads its records and
runs them one by one through the fixed op table (``_ops.handlers``). An op that fails
poisons its result (and what is computed from it later); the first failure since the last
reply is reported with the next reply. Arrays are counted by the buffer they own (a view
costs nothing more) against ``max_session_bytes``, and refused before they exist: an op's
result by its size from shapes and dtypes (``_ops``), a frame by its header, before its body
is read (``_wire``: a session reads a frame over ``SMALL_FRAME_BYTES`` only while it could
hold it twice; a longer one ends the session with a message that says why).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from .._conn import Framed, FrameTooLongError
from .._records import (
    FLAG_OUT,
    closing,
    frame_waits,
    raw_values,
    read_target,
    records,
    reply,
)
from .._wire import ADAM, DROP, OP_CODES, OPS, OUTPUTS, READ, SMALL_FRAME_BYTES, SYNC, Ref
from ._collective import collective_handler
from ._ops import ADAM_WRITTEN, adam_writes, handlers

__all__ = ["Worker"]


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
        peak_bytes: the most they held at once since the session began.
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
        self.peak_bytes = 0
        self.waiting = 0
        self.busy_since: float | None = None
        self.closed = False
        self._seq = 0
        self._failed: list[int] = []
        self._first: Poison | None = None
        self._table = handlers(xp, None if limit is None else self._guard)
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
                try:
                    payload = self.framed.recv(room=self._room())
                except FrameTooLongError as exc:
                    self._refuse_frame(exc)
                    return
                waits = frame_waits(payload)
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

    def _room(self) -> int | None:
        """The longest frame this session reads now (None: no limit): a small one always,
        a longer one while the session could hold it twice (the frame, and the arrays
        decoded from it)."""
        if self.limit is None:
            return None
        return max(SMALL_FRAME_BYTES, (self.limit - self.bytes) // 2)

    def _refuse_frame(self, exc: FrameTooLongError) -> None:
        """End the session over a frame too long for its memory limit, from its header: say
        why, then read the rest of the frame without keeping it (so the client finishes
        sending it and reads the reason), and return (the connection closes)."""
        message = (
            f"the session's memory limit: a frame of {exc.length} bytes is more than the "
            f"session may take now (max_session_bytes={self.limit}, {self.bytes} bytes held; "
            f"a frame over {SMALL_FRAME_BYTES} bytes is read only while the session could "
            "hold it twice), so the server closed the session before reading it"
        )
        self.framed.send(closing(message))
        self.framed.discard(exc.unread)

    def add_waiting(self, n: int) -> None:
        with self._lock:
            self.waiting += n

    # ------------------------------------------------------------------ one frame
    def _frame(self, payload: memoryview) -> None:
        """Run a RECORDS frame's records, in order, as ``_records.records`` decodes them
        (each against the table as the records before it left it)."""
        deferred: tuple[int, Any, memoryview, int] | None = None
        for op, flags, oid, args, bad, start, end in records(payload, self.table, Poison):
            if self.closed:
                return
            if op <= SYNC:  # DROP, READ, SYNC
                self._session_record(op, oid, args)
                if deferred is not None:  # the update the READ did not need to wait for
                    self._run_update(*deferred)
                    deferred = None
                continue
            seq = self._seq
            self._seq = seq + 1
            if op == ADAM:
                read = self._read_next(payload, end)
                deferred = self._adam(seq, args, bad, payload, start, read)
            elif bad is not None:
                self._fail_input(seq, op, _results(op, oid), bad)
            else:
                self._op(seq, op, flags, oid, args)

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
                    if self.bytes > self.peak_bytes:
                        self.peak_bytes = self.bytes
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

    def _session_record(self, op: int, oid: int, raw: list[Any]) -> None:
        """DROP (``oid``, or the ids of its one IDS value), READ and SYNC."""
        self._seq += 1
        if op == DROP:
            self._drop(raw[0] if raw and type(raw[0]) is tuple else (oid,))
        else:
            self._reply(op, oid, raw)

    def _drop(self, ids: tuple[int, ...]) -> None:
        """Free ``ids`` (``_free``, inlined: a step frees dozens)."""
        table, owner, buffers = self.table, self._owner, self._buffers
        for i in ids:
            table.pop(i, None)
            key = owner.pop(i, None)
            if key is not None:
                entry = buffers[key]
                entry[0] -= 1
                if entry[0] == 0:
                    del buffers[key]
                    self.bytes -= entry[1]

    def _adam(
        self, seq: int, args: list[Any], bad: Any, payload: memoryview, rec: int, read: Any
    ) -> tuple[int, Any, memoryview, int] | None:
        """ADAM writes many arrays in place: a failure poisons every one it writes (the ids
        of the record at offset ``rec`` of ``payload``).

        Its checks run now; the update too, unless ``read`` (the array the next record, a
        READ, reads: ``_read_next``) is not one it writes: then the update is returned, to
        run right after that READ's reply (the client goes on with its next step while the
        server updates). An update that passed its checks fails only if NumPy does (out of
        memory): that failure is reported at the next reply, naming ADAM's call site.
        """
        if bad is not None:
            self._fail_input(seq, ADAM, adam_writes(raw_values(payload, rec)), bad)
            return None
        try:
            update = self._table[ADAM](args, None)  # type: ignore[misc]  # always in the table
        except Exception as exc:
            self._adam_failed(seq, payload, rec, exc)
            return None
        if read is not None and not _writes(args, read):
            return (seq, update, payload, rec)
        self._run_update(seq, update, payload, rec)
        return None

    def _run_update(self, seq: int, update: Any, payload: memoryview, rec: int) -> None:
        try:
            update()
        except Exception as exc:
            self._adam_failed(seq, payload, rec, exc)

    def _adam_failed(self, seq: int, payload: memoryview, rec: int, exc: Exception) -> None:
        self._fail(seq, ADAM, adam_writes(raw_values(payload, rec)), f"{type(exc).__name__}: {exc}")

    def _read_next(self, payload: memoryview, pos: int) -> Any:
        """The array the record at ``pos`` reads, if it is a READ of one (else None)."""
        i = read_target(payload, pos)
        x = None if i is None else self.table.get(i)
        return x if isinstance(x, self._array_type) else None

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
            self._fail(seq, op, ids, f"KeyError: {_missing(bad)!r}")  # bad: the id

    def _array(self, i: int) -> Any:
        x = self.table.get(i)
        if x is None:
            raise KeyError(_missing(i))
        if type(x) is Poison:
            raise _PoisonedError(x)
        return x

    def _reply(self, op: int, req: int, args: list[Any]) -> None:
        failed, first = self._failed, self._first
        self._failed, self._first = [], None
        error = None if first is None else (first.seq, first.op, first.message)
        array = None
        if op == READ and error is None:
            x = self.table.get(args[0]) if args and type(args[0]) is Ref else None
            if type(x) is Poison:
                error = (x.seq, x.op, x.message)
            elif x is None:
                error = (self._seq - 1, READ, f"no array {args[0] if args else '?'} to read")
            else:
                array = x if isinstance(x, np.ndarray) else x.get()
        self.framed.send(*reply(req, failed, error, array))
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
            if self.bytes > self.peak_bytes:
                self.peak_bytes = self.bytes
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
