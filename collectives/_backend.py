"""The backend contract, the request a collective becomes, and the per-group executor.

A backend implements narrow primitives on host or device arrays that were already validated
by :class:`~collectives._group.ProcessGroup`. Synchronous engines (serial, cpu, mpi) implement
:meth:`Backend.run`, which executes one request to completion in the calling thread; the
group's :class:`Executor` runs it inline for blocking calls when nothing is queued, or on the
group's communication thread for ``async_op=True``, always in submission order. Engines with
their own asynchrony (nccl) override :meth:`Backend.submit`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ._errors import CollectiveError, GroupAbortedError
from ._types import ReduceOp, Signature
from ._work import Work

__all__ = ["Backend", "Executor", "GroupInfo", "Request"]


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
        """``group 'name' (n ranks)`` for messages."""
        return f"group {self.name!r} of {self.size} rank(s)"


@dataclass(slots=True)
class Request:
    """One validated collective (or point-to-point) call.

    Attributes:
        op: collective name (``"all_reduce"``...).
        seq: the group's sequence number (per-peer counter for send/recv).
        signature: what all ranks must agree on.
        array: the input (and, for in-place ops, output) host or device array.
        out: preallocated output array (all_gather, reduce_scatter, all_to_all), or None.
        reduce_op: the reduction, for reducing ops.
        root: group rank of the root (broadcast, reduce), or -1.
        peer: group rank of the peer (send, recv), or -1.
        deadline: ``time.monotonic()`` by which the engine must have finished or failed,
            set when the engine starts it.
        result: what ``Work.wait()`` returns.
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
    extra: dict[str, Any] = field(default_factory=dict)


class Backend:
    """Base class of backends. Subclasses set ``name`` and implement ``run`` (or ``submit``).

    Args:
        info: the group this backend serves.
    """

    name = "base"
    #: Whether ``run`` accepts CuPy arrays; otherwise the group stages them through the host.
    accepts_device_arrays = False

    def __init__(self, info: GroupInfo) -> None:
        self.info = info
        self.error: CollectiveError | None = None
        self.executor = Executor(self)

    # ------------------------------------------------------------------ what engines implement
    def run(self, req: Request) -> None:
        """Execute ``req`` to completion in this thread; raise CollectiveError on failure."""
        raise NotImplementedError

    def alloc(self, shape: tuple[int, ...], dtype: Any, seq: int) -> Any:
        """Collective allocation of an array the engine can reduce without copies.

        The default is a plain NumPy array. Every rank calls it with the same arguments.
        """
        import numpy as np

        return np.zeros(shape, dtype=dtype)

    def close(self) -> None:
        """Release resources (segments, threads, communicators). Idempotent."""
        self.executor.close()

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

    # ------------------------------------------------------------------ dispatch
    def submit(self, req: Request, async_op: bool) -> Work:
        """Queue ``req`` in submission order; return its Work."""
        return self.executor.submit(req, async_op)

    def check_usable(self, op: str, seq: int) -> None:
        """Raise GroupAbortedError if an earlier failure broke this group."""
        if self.error is not None:
            raise GroupAbortedError(
                f"[rank {self.info.global_rank}] {op} #{seq}: {self.info.describe()} is unusable "
                f"after an earlier failure: {self.error}",
                rank=self.info.global_rank,
                op=op,
                seq=seq,
            )


class Executor:
    """Runs a backend's requests in order: inline when idle, else on one background thread."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # The hot path (a blocking call run inline) takes the lock directly, which is cheaper
        # than the Condition's Python-level methods, and notifies only when someone waits.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads inside self._cond.wait()
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
                self._queue.append((req, work))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop,
                        name=f"collectives-{self.backend.info.name}",
                        daemon=True,
                    )
                    self._thread.start()
                self._cond.notify_all()
        if inline:
            try:
                self._execute(req, work)
            finally:
                with self._lock:
                    self._running = False
                    if self._waiting:
                        self._cond.notify_all()
        return work

    def _execute(self, req: Request, work: Work) -> None:
        backend = self.backend
        try:
            backend.check_usable(req.op, req.seq)
            req.deadline = time.monotonic() + backend.info.timeout
            backend.run(req)
        except CollectiveError as exc:
            backend.abort(exc)
            work.set_error(exc)
        except BaseException as exc:  # a bug or bad state in an engine: never leave Work pending
            backend.abort(
                CollectiveError(
                    f"[rank {backend.info.global_rank}] {req.op} #{req.seq} failed: "
                    f"{type(exc).__name__}: {exc}",
                    rank=backend.info.global_rank,
                    op=req.op,
                    seq=req.seq,
                )
            )
            work.set_error(exc)
        else:
            work.set_result(req.result)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._running) and not self._closed:
                    self._wait(None)
                if self._closed and not self._queue:
                    return
                req, work = self._queue.popleft()
                self._running = True
            try:
                self._execute(req, work)
            finally:
                with self._lock:
                    self._running = False
                    if self._waiting:
                        self._cond.notify_all()

    def _wait(self, timeout: float | None) -> None:
        """``self._cond.wait`` (lock held), counted so that notifiers can skip empty rooms."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def pending(self) -> int:
        """Number of queued or running requests."""
        with self._cond:
            return len(self._queue) + (1 if self._running else 0)

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
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.backend.info.timeout + 5)
