"""The backend contract, the request a collective becomes, and the per-group executor.

:class:`~collectives._group.ProcessGroup` checks every call once (array type, dtype,
contiguity, shapes, ranks, reduce op), numbers it and turns it into a :class:`Request`; a
backend only moves data. What a backend implements (see also docs/design.md):

* ``name`` (what users pass as ``backend=``) and ``accepts_device_arrays`` (False: the group
  stages CuPy arrays through host memory, so the engine only ever sees NumPy arrays).
* **Synchronous engines** (serial, cpu, mpi) implement one method per op, ``_do_<op>(req)``
  for ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter``,
  ``all_to_all``, ``barrier``, ``send`` and ``recv``: run the request to completion in the
  calling thread and raise a :class:`~collectives.CollectiveError` on failure. The base
  :meth:`Backend.run` dispatches to them; at world size 1 it runs the identity itself, so no
  engine writes that case. Requests run in submission order through the group's
  :class:`Executor`: inline for blocking calls when nothing is queued, else on the group's
  communication thread.
* **Engines with their own asynchrony** (nccl) override :meth:`Backend.submit`,
  :meth:`Backend.drain` and :meth:`Backend.close` instead (and keep the ``_do_<op>`` naming for
  their per-op enqueue functions).
* Optionally: :meth:`Backend.alloc` (memory the engine reduces without copies),
  :meth:`Backend.split` (build a subgroup from this group, e.g. ``ncclCommSplit``),
  :meth:`Backend.device_problem` (refuse a CuPy array on the wrong GPU), :meth:`Backend.abort`
  (tell the peers about a failure).
* The module registers the backend: :func:`collectives.register_backend`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import CollectiveError, ErrorT, collective_error, unusable_error, where
from ._signature import Signature
from ._types import ReduceOp
from ._work import Work

__all__ = ["Backend", "Executor", "GroupInfo", "Request", "run_alone"]

# Ops whose output is a separate array (``Request.out``); the rest work in place.
OUT_OPS = ("all_gather", "reduce_scatter", "all_to_all")
P2P_OPS = ("send", "recv")


@dataclass(frozen=True)
class GroupInfo:
    """What a backend knows about its group.

    Attributes:
        rank: this process's rank in the group.
        size: number of ranks in the group.
        ranks: global rank of each group rank.
        global_rank: this process's global rank.
        name: unique group name, the same on every member (prefix for store keys).
        store: the rendezvous store (None for world size 1).
        timeout: seconds a collective may take before it fails.
        local_rank: rank on this host (for device selection).
    """

    rank: int
    size: int
    ranks: tuple[int, ...]
    global_rank: int
    name: str
    store: Any
    timeout: float
    local_rank: int = 0

    def describe(self) -> str:
        """``group 'name' of n rank(s)`` for messages."""
        return f"group {self.name!r} of {self.size} rank(s)"

    def where(self, op: str = "", seq: int | None = None) -> str:
        """``[rank 3] all_reduce #7 (group 'world' of 4 rank(s))``: the head of a message."""
        return where(self.global_rank, op, seq, self.describe())

    def error(
        self,
        cls: type[ErrorT],
        op: str,
        seq: int | None,
        detail: str,
        cause: BaseException | None = None,
    ) -> ErrorT:
        """An error of class ``cls`` about call ``op`` #``seq`` of this group on this rank."""
        return collective_error(
            cls, detail, rank=self.global_rank, op=op, seq=seq, group=self.describe(), cause=cause
        )

    def unusable(self, op: str, seq: int | None, cause: BaseException) -> CollectiveError:
        """The error of a call on this group after ``cause`` broke it."""
        return unusable_error(cause, rank=self.global_rank, op=op, seq=seq, group=self.describe())


@dataclass(slots=True)
class Request:
    """One validated collective (or point-to-point) call.

    Attributes:
        op: collective name (``"all_reduce"``...).
        seq: the group's sequence number (per-peer counter for send/recv), set when the group
            queues the request.
        signature: what all ranks must agree on.
        array: the input (and, for in-place ops, output) host or device array.
        out: preallocated output array (all_gather, reduce_scatter, all_to_all), or None.
        reduce_op: the reduction, for reducing ops.
        root: group rank of the root (broadcast, reduce), or -1.
        peer: group rank of the peer (send, recv), or -1.
        deadline: ``time.monotonic()`` by which the engine must have finished or failed,
            set when the engine starts it.
        result: what ``Work.wait()`` returns.
        on_thread: it runs on the group's communication thread (not in the caller's): an
            engine's waits then give the GIL away once, rather than polling for it.
    """

    op: str
    seq: int
    signature: Signature
    array: Any = None
    out: Any = None
    reduce_op: ReduceOp | None = None
    root: int = -1
    peer: int = -1
    deadline: float = 0.0
    result: Any = None
    on_thread: bool = False


def run_alone(req: Request) -> None:
    """Run ``req`` in a group of one: every collective is the identity.

    all_reduce, broadcast and reduce leave the array as it is (AVG over one rank is itself);
    the only block of a gathered or scattered output is this rank's own input; a barrier has
    nobody to wait for. (send/recv need a peer, which the group checked.)
    """
    if req.op in OUT_OPS:
        req.out[...] = req.array.reshape(req.out.shape)


class Backend:
    """Base class of backends (the contract is in the module docstring).

    Args:
        info: the group this backend serves.
    """

    name = "base"
    #: Whether ``run`` accepts CuPy arrays; otherwise the group stages them through the host.
    accepts_device_arrays = False
    #: Array types of a registered engine's own devices (a remote device's handles) that the
    #: group passes through as they are; it asks :meth:`new_array` for their outputs.
    array_types: tuple[type, ...] = ()

    def __init__(self, info: GroupInfo) -> None:
        self.info = info
        self.error: CollectiveError | None = None
        self._executor = Executor(self)
        # An engine with its own asynchrony (it overrides submit) never runs through the
        # executor, so blocking calls go through its submit too.
        self._own_queue = type(self).submit is not Backend.submit

    # ------------------------------------------------------------------ what engines implement
    def run(self, req: Request) -> None:
        """Execute ``req`` to completion in this thread; raise CollectiveError on failure."""
        if self.info.size == 1:
            run_alone(req)
            return
        self.handler(req.op)(req)

    def handler(self, op: str) -> Callable[..., None]:
        """The engine's ``_do_<op>`` method (the one dispatch convention of every backend)."""
        fn = getattr(self, "_do_" + op, None)
        if fn is None:
            raise NotImplementedError(f"the {self.name} backend has no operation {op!r}")
        return fn

    def alloc(self, shape: tuple[int, ...], dtype: Any, seq: int) -> Any:
        """Collective allocation of an array the engine can reduce without copies.

        The default is a plain NumPy array. Every rank calls it with the same arguments.
        """
        import numpy as np

        return np.zeros(shape, dtype=dtype)

    def new_array(self, like: Any, shape: tuple[int, ...]) -> Any:
        """An output of ``shape`` for one of :attr:`array_types`, on ``like``'s device and of
        its dtype (only asked for when ``array_types`` is not empty)."""
        raise NotImplementedError(f"the {self.name} backend makes no arrays of {type(like)}")

    def abort(self, reason: CollectiveError) -> None:
        """Mark the group broken so that later calls fail at once with ``reason``."""
        if self.error is None:
            self.error = reason

    def device_problem(self, array: Any) -> str | None:
        """Why this backend cannot use a CuPy ``array`` given to a collective (e.g. it lives
        on another GPU than the group's), or None. Called only when ``accepts_device_arrays``."""
        return None

    def split(self, info: GroupInfo | None) -> Backend | None:
        """Build a new group's backend from this one (e.g. ``ncclCommSplit``).

        ``new_group`` calls it on *every* rank of this group, in the same order, when the new
        group uses this group's backend: with the new group's ``info`` on its members and None
        on the other ranks. Return None to let the registry's factory build the backend (the
        default: nothing is split).
        """
        return None

    # ------------------------------------------------------------------ queueing
    def submit(self, req: Request, async_op: bool) -> Work:
        """Queue ``req`` in submission order; return its Work."""
        return self._executor.submit(req, async_op)

    def call(self, req: Request) -> Work | None:
        """A blocking ``req``: run it inline when nothing is queued (None once done; raises its
        error), else queue it and return its Work to wait on. Engines that override
        :meth:`submit` get its Work."""
        if self._own_queue:
            return self.submit(req, async_op=False)
        return self._executor.call(req)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted request finished; False if ``timeout`` passed first."""
        return self._executor.drain(timeout)

    def close(self) -> None:
        """Release resources (segments, threads, communicators). Idempotent."""
        self._executor.close()

    def check_usable(self, op: str, seq: int | None) -> None:
        """Raise GroupAbortedError if an earlier failure broke this group."""
        if self.error is not None:
            raise self.info.unusable(op, seq, self.error)


def _switch_interval() -> float:
    raw = os.environ.get("DPT_COMM_SWITCH_INTERVAL", "")
    try:
        value = float(raw) if raw else 50e-6
    except ValueError:
        raise ValueError(
            f"DPT_COMM_SWITCH_INTERVAL must be seconds (e.g. 5e-5), got {raw!r}"
        ) from None
    return value


class _ShortSwitch:
    """While requests are queued for or run on a communication thread, the interpreter's
    switch interval is short (``DPT_COMM_SWITCH_INTERVAL``, 50 us; 0 leaves it alone).

    A thread that wants the GIL back (waking up for a request, after a NumPy copy or a wait
    that released it) waits until the holder drops it, and a main thread running Python
    holds it for a whole switch interval (5 ms by default): one all-reduce takes the GIL back
    several times. The interval is process-wide, so the first queued request shortens it
    and the last one to finish restores what it was.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._saved = 0.0

    def enter(self) -> None:
        """One more request queued for a communication thread."""
        with self._lock:
            self._active += 1
            if self._active == 1:
                self._saved = sys.getswitchinterval()
                short = _switch_interval()
                if 0 < short < self._saved:
                    sys.setswitchinterval(short)

    def leave(self) -> None:
        """A queued request finished; the last one restores the interval."""
        with self._lock:
            self._active -= 1
            if self._active == 0:
                sys.setswitchinterval(self._saved)


_SHORT_SWITCH = _ShortSwitch()


class Executor:
    """Runs a backend's requests in order: inline when idle, else on one background thread."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # The hot path (a blocking call run inline) takes the lock directly, which is cheaper
        # than the Condition's Python-level methods, and notifies only when someone waits.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # drain()'s waiters
        self._waiting = 0  # threads inside self._cond.wait()
        # The communication thread's: notified only when it has something to do (a request
        # queued, the one running done with more queued, or closing), so a call a waiter ran
        # itself (help) does not wake it for nothing.
        self._ready = threading.Condition(self._lock)
        self._queue: deque[tuple[Request, Work]] = deque()
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, req: Request, async_op: bool) -> Work:
        """Run now (blocking call, nothing queued) or queue for the communication thread."""
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"{req.op}: the process group was destroyed; call init_process_group again"
                )
            inline = not async_op and not self._queue and not self._running
            work = Work(req.op, req.seq, self.backend.info.global_rank, threaded=not inline)
            if inline:
                self._running = True
            else:
                # From now until it finished, the thread must get the GIL back quickly: to
                # wake up for it, and after each copy or wait that released it.
                _SHORT_SWITCH.enter()
                work._help = self.help
                self._queue.append((req, work))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop,
                        name=f"collectives-{self.backend.info.name}",
                        daemon=True,
                    )
                    self._thread.start()
                self._ready.notify()
        if inline:
            try:
                self._execute(req, work)
            finally:
                self._idle()
        return work

    def help(self, work: Work) -> None:
        """Run queued requests in order on this (waiting) thread, up to and including
        ``work``, while nothing else runs: a call waited on right after it was issued then
        costs what a blocking one does, not two wake-ups of threads. Returns as soon as the
        communication thread runs (or ran) one of them; the caller then waits as usual."""
        while not work.is_completed():
            with self._lock:
                if self._running or not any(w is work for _, w in self._queue):
                    return
                req, queued = self._queue.popleft()
                self._running = True
            self._run_queued(req, queued)

    def _run_queued(self, req: Request, work: Work) -> None:
        """Run a request taken from the queue (``_running`` set), then let the next go."""
        try:
            self._execute(req, work)
        finally:
            _SHORT_SWITCH.leave()  # entered when the request was queued
            self._idle()

    def _idle(self) -> None:
        with self._lock:
            self._running = False
            if self._queue:
                self._ready.notify()
            if self._waiting:
                self._cond.notify_all()

    def call(self, req: Request) -> Work | None:
        """A blocking ``req``: inline when nothing is queued or running (no Work, no thread
        handoff: the small-message path; None once done), else queued behind the others (its
        Work, to wait on).

        Raises what ``Work.wait()`` would: the collective's error, or the engine's exception.
        """
        with self._lock:
            if self._closed or self._queue or self._running:
                inline = False
            else:
                inline = self._running = True
        if not inline:
            return self.submit(req, async_op=False)
        try:
            # The caller (the group, under its lock) has just checked the group is usable.
            self._run(req, checked=True)
        finally:
            self._idle()
        return None

    def _run(self, req: Request, checked: bool = False) -> None:
        """Run ``req`` here (``checked``: the group is known usable); a failure breaks the
        group (abort) and is raised."""
        backend = self.backend
        try:
            if not checked:
                backend.check_usable(req.op, req.seq)
            req.deadline = time.monotonic() + backend.info.timeout
            backend.run(req)
        except CollectiveError as exc:
            backend.abort(exc)
            raise
        except BaseException as exc:  # a bug or bad state in an engine: never leave Work pending
            info = backend.info
            backend.abort(
                collective_error(
                    CollectiveError,
                    f"the engine raised {type(exc).__name__}: {exc}",
                    rank=info.global_rank,
                    op=req.op,
                    seq=req.seq,
                )
            )
            raise

    def _execute(self, req: Request, work: Work) -> None:
        try:
            self._run(req)
        except BaseException as exc:
            work.set_error(exc)
        else:
            work.set_result(req.result)

    def _loop(self) -> None:
        while True:
            with self._cond:
                # (Running: a waiter runs a request here, see help; even once closed, wait.)
                while self._running or (not self._queue and not self._closed):
                    self._ready.wait()
                if self._closed and not self._queue:
                    return
                req, work = self._queue.popleft()
                self._running = True
            req.on_thread = True
            self._run_queued(req, work)

    def _wait(self, timeout: float | None) -> None:
        """``self._cond.wait`` (lock held), counted so that notifiers can skip empty rooms."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wait(left)
        return True

    def close(self) -> None:
        """Stop the thread once queued work finished (or failed); idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._ready.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.backend.info.timeout + 5)
