"""The ``nccl`` backend: NCCL through ctypes on CuPy streams, without host synchronization.

One communicator per group, on GPU ``local_rank % device_count`` (which init makes the calling
thread's current device). Rank 0 makes the ``ncclUniqueId`` and shares it through the store;
every rank starts a *non-blocking* ``ncclCommInitRankConfig`` and polls
``ncclCommGetAsyncError``, so init honours the group's timeout. ``new_group`` splits the
default group's communicator (``ncclCommSplit``, NCCL 2.18+) or, on older libraries, makes a
fresh unique id for the members. Setup, and why the handles' storage outlives the calls, is
``_setup``.

A collective, issued from the group's thread (see ``ProcessGroup.bind_thread``):

1. records an event on the caller's current stream and makes the group's stream wait for it
   (the inputs are ready when the caller's earlier work is);
2. *signature check* (``_sigring``): the call's 128-byte record is exchanged with every
   rank on the group's stream, then an event is recorded;
3. enqueues the NCCL call itself on the group's stream (``_ops``) and records an end event.

Nothing waits on the host. The :class:`~._work.NcclWork` keeps the arrays alive until
the end event completed (CuPy's pool would otherwise reuse them). ``wait()`` makes the caller's
current stream wait for the end event and returns the output; ``wait(timeout=...)``,
``barrier``, and any call on NumPy arrays (staged through the GPU: uploaded on the group's
stream, copied back once the end event completed) wait on the host, polling the events, the
signature records, ``ncclCommGetAsyncError`` and the group's deadline.

A watchdog thread per group does the same polling for collectives nobody waits on: it releases
finished calls, compares signature records as soon as they arrive, and turns a mismatch, an
asynchronous NCCL error, an expired timeout, a peer's failure (published in the store, see
``_peers``), a peer that left the group, or a local peer process that died into an error:
the communicator is aborted (``ncclCommAbort``, never a blocking destroy), every pending call
fails with an error naming the op and the sequence number, the reason goes to the store for
the other ranks, and the group refuses further calls. A mismatch is found by every rank (they
gathered the same records) before its data call can hang; the data call may already have run,
so the output of a mismatched call is undefined, as the error says.

The signature check costs one extra small all-gather, two 128-byte copies and one event per
collective (host: a few microseconds; GPU: one more small-message latency). ``DPT_NCCL_CHECK=0``
turns it off: mismatched calls then hang until the timeout, as with plain NCCL.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ..._backend import P2P_OPS, Backend, GroupInfo, Request
from ..._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerFailureError,
    collective_error,
)
from ..._exit import on_uncaught
from ..._registry import register_backend
from ..._setup_wait import register_last_words
from ..._work import Work
from . import _lib as nccl_lib
from . import _load
from ._cuda import D2H, Cuda, device_count
from ._lib import Nccl, NcclError
from ._ops import NcclOps, error_from
from ._peers import UNCAUGHT, PeerBoard, last_words
from ._setup import NcclSetup
from ._sigring import SignatureRing
from ._watch import NcclWatchdog
from ._work import NcclWork

__all__ = ["NcclBackend", "load_library"]

_CLOSE_LIMIT = 30.0  # at most this long to flush a communicator on destroy


def load_library() -> Nccl:
    """The process's NCCL library (loaded on first use), for tools that call it directly.

    Its ``version``, ``version_string`` and ``path`` say which library it is; its methods are
    NCCL's functions (``all_reduce(send, recv, count, dtype, op, comm, stream)``...), whose
    codes are in :mod:`binding <collectives.backends.nccl._lib>` (``binding.FLOAT32``,
    ``binding.nccl_op(ReduceOp.SUM)``, ``binding.IN_PROGRESS``).

    Raises:
        NcclUnavailableError: no usable libnccl.so.2 (the message lists every path tried).
    """
    return _load.load()


def _flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no")


class NcclBackend(NcclSetup, NcclOps, NcclWatchdog, Backend):
    """NCCL collectives on CuPy arrays (NumPy arrays staged through the GPU).

    Args:
        info: the group.
        parent: split the communicator from this group's (``new_group``), else make a new
            one from a unique id shared through the store.
    """

    name = "nccl"
    accepts_device_arrays = True

    def __init__(self, info: GroupInfo, parent: NcclBackend | None = None) -> None:
        super().__init__(info)
        if info.size > 1 and info.store is None and parent is None:
            raise ValueError("the nccl backend needs a rendezvous store for world size > 1")
        self.lib = _load.load()
        count = device_count()
        self.device = info.local_rank % count if count else 0
        self.cuda = Cuda(self.device)
        self.cuda.use()
        self.check = _flag("DPT_NCCL_CHECK")
        self.size = info.size
        self.rank = info.rank  # in the group
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._pending: deque[NcclWork] = deque()
        self._issued = 0  # last collective sequence number enqueued
        self._closed = False
        self._closing = False
        self._watchdog: threading.Thread | None = None
        self._watch_idle = False
        self._next_remote = 0.0
        self._dtype_cache: dict[Any, int] = {}
        self._graves: list[tuple[Any, list[Any]]] = []  # (event, arrays): see _bury
        self.board = PeerBoard(info)
        self.comm = 0
        self.board.announce()
        self.comm = self._make_comm(parent)
        try:
            self.ring = SignatureRing(self.cuda, self.size)
            self._scratch = self.cuda.empty(1, np.int32)
        except BaseException:
            self._abort_comm()
            raise
        _LIVE.add(self)
        if self.size > 1:
            on_uncaught(_tell_peers_uncaught)

    # ------------------------------------------------------------------ contract hooks
    def device_problem(self, array: Any) -> str | None:
        """Why a CuPy array cannot be used by this group (another GPU), or None."""
        dev = getattr(getattr(array, "device", None), "id", self.device)
        if dev != self.device:
            return (
                f"is on cuda:{dev} but this group communicates on cuda:{self.device} (its GPU "
                "is local_rank % device_count): move it there first"
            )
        return None

    def split(self, info: GroupInfo | None) -> Backend | None:
        """``ncclCommSplit`` for ``new_group`` (every rank of this group calls it)."""
        if not (self.lib.can_split and _flag("DPT_NCCL_SPLIT")):
            return None
        if info is not None:
            return NcclBackend(info, parent=self)
        self._split_out()
        return None

    # ------------------------------------------------------------------ enqueue
    def submit(self, req: Request, async_op: bool) -> Work:
        """Enqueue ``req`` on the group's stream; return its Work (see the module docstring)."""
        with self._lock, self.cuda.on_device():  # whichever GPU the calling thread is on
            work = NcclWork(self, req)
            try:
                self.check_usable(req.op, req.seq)
                self._enqueue(req, work)
            except CollectiveError as exc:
                if self.error is None:
                    self._fail(exc, work)
                else:
                    work.set_error(exc)
                return work
            except BaseException as exc:
                detail = f"the enqueue raised {type(exc).__name__}: {exc}"
                self._fail(self.info.error(CollectiveError, req.op, req.seq, detail, exc), work)
                return work
            self._pending.append(work)
            if req.op not in P2P_OPS:
                self._issued = req.seq
            self._start_watchdog()
            return work

    def _enqueue(self, req: Request, work: NcclWork) -> None:
        cuda = self.cuda
        stream = cuda.stream
        req.deadline = work.deadline
        # 1. After the caller's earlier work on its current stream.
        start = cuda.event()
        start.record(cuda.current_stream())
        stream.wait_event(start)
        work.start = start
        try:
            # 2. The signature check (a collective's record is all-gathered).
            if self.check:
                self._enqueue_signature(req, work)
            # 3. The call.
            self.handler(req.op)(req, work)
        except NcclError as exc:
            raise error_from(self.info, exc, req.op, req.seq) from exc
        if work.writebacks:
            self._stage_down(work)
        end = cuda.event()
        end.record(stream)
        work.end = end
        if req.op == "barrier":
            work.host_sync = True  # nobody leaves before everyone arrived

    def _stage_down(self, work: NcclWork) -> None:
        """Results for NumPy arrays go to pinned memory on the stream, after the call; once
        it completed the host copies them out (no device access, so no host wait then)."""
        staged = []
        for dev, host in work.writebacks:
            mem, pinned = self.cuda.pinned(host.nbytes)
            self.cuda.memcpy(int(mem.ptr), int(dev.data.ptr), host.nbytes, D2H, self.cuda.stream)
            work.refs.append(mem)
            staged.append((pinned, host))
        work.writebacks = staged

    def _enqueue_signature(self, req: Request, work: NcclWork) -> None:
        """Exchange ``req``'s record, once the slot's previous call was checked."""
        slot, prev = self.ring.claim()
        if prev is not None and prev.sig_ev is not None and not prev.sig_ev.done:
            self.block(prev, None, sig_only=True)
        if prev is not None and not prev.sig_checked and self.error is None:
            self._check_signature(prev)
        if self.error is not None:
            raise self.info.unusable(work.op, work.seq, self.error)
        self.ring.enqueue(slot, req, work, self.lib, self.comm, self._settle)

    def _check_signature(self, w: NcclWork) -> None:
        """Compare the records that arrived for ``w``; a mismatch fails the group."""
        w.sig_checked = True
        problem = self.ring.problem(w, self.info.ranks)
        if problem is not None:
            self._fail(self.info.error(CollectiveMismatchError, w.op, w.seq, problem), w)

    # ------------------------------------------------------------------ completion
    def poll(self) -> None:
        """Advance completions, checks and deadlines once (any thread)."""
        with self._lock:
            if self._graves:
                self._bury([])
            timed_out = self._progress(time.monotonic())
        if timed_out is not None:
            self._timeout(timed_out)

    def _progress(self, now: float) -> NcclWork | None:
        """Under the lock: finish completed calls in order, check signatures that arrived,
        look at NCCL's asynchronous error. Returns the oldest call if its deadline passed."""
        pending = self._pending
        while pending:
            w = pending[0]
            if not w.sig_checked and w.sig_ev is not None and w.sig_ev.done:
                self._check_signature(w)
                if self.error is not None:
                    return None
            if w.end is not None and w.end.done:
                pending.popleft()
                self._finish(w)
                if pending:
                    nxt = pending[0]
                    nxt.deadline = max(nxt.deadline, now + self.info.timeout)
                continue
            break
        if not pending or self.error is not None:
            return None
        # Later calls' records may have arrived too (a mismatch there must not wait).
        for w in itertools.islice(pending, 1, 4):
            if not w.sig_checked and w.sig_ev is not None and w.sig_ev.done:
                self._check_signature(w)
                if self.error is not None:
                    return None
        try:
            state = self.lib.comm_get_async_error(self.comm)
        except NcclError as exc:
            state = exc.code
        if state not in (nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS):
            oldest = pending[0]
            err = self.lib.error(state, "ncclCommGetAsyncError", self.comm)
            detail = f"NCCL reported an asynchronous error: {err}"
            self._fail(self.info.error(PeerFailureError, oldest.op, oldest.seq, detail))
            return None
        if now >= pending[0].deadline:
            return pending[0]
        return None

    def _finish(self, w: NcclWork) -> None:
        try:
            for pinned, host in w.writebacks:
                host.reshape(-1).view(np.uint8)[...] = pinned
        except Exception as exc:
            detail = f"copying the result back to the host failed: {type(exc).__name__}: {exc}"
            w.set_error(self.info.error(CollectiveError, w.op, w.seq, detail))
        else:
            w.set_result(None)
        self._release(w)

    def _release(self, w: NcclWork) -> None:
        cuda = self.cuda
        for ev in (w.start, w.sig_ev, w.end):
            cuda.recycle(ev)
        w.start = w.sig_ev = w.end = None
        w.refs = []
        w.writebacks = []

    def block(self, w: NcclWork, timeout: float | None, sig_only: bool = False) -> bool:
        """Wait on the host until ``w`` finished (or only its signature arrived); False when
        ``timeout`` expired first. Honours the group's deadline and failures meanwhile."""
        user_end = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        while True:
            timed_out = None
            with self._lock:
                now = time.monotonic()
                if w._done:
                    return True
                if sig_only and (w.sig_ev is None or w.sig_ev.done):
                    return True
                timed_out = self._progress(now)
                if w._done:
                    return True
            if timed_out is not None:
                self._timeout(timed_out)
                continue
            if user_end is not None and now >= user_end:
                return False
            time.sleep(pause)
            pause = min(max(pause * 2, 0.00005), 0.002)

    def stream_wait(self, w: NcclWork) -> None:
        """``wait()`` on device arrays: the caller's stream waits for the end event.

        Nothing is polled here (the watchdog does that), to keep a blocking call cheap."""
        with self._lock:
            end = w.end
        if w._done or end is None:
            return
        with self.cuda.on_device():  # the caller's stream *of the group's GPU* waits
            self.cuda.current_stream().wait_event(end)
        # (The fake CuPy's null stream waits on the host here; a failure found meanwhile is
        # in w._error, which the caller checks next.)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every enqueued call finished; False if ``timeout`` passed first."""
        with self._lock:
            last = self._pending[-1] if self._pending else None
        return last is None or self.block(last, timeout)

    # ------------------------------------------------------------------ failure
    def _timeout(self, w: NcclWork) -> None:
        """``w`` passed its deadline: name the ranks that never arrived, then fail."""
        if w._done or self.error is not None:
            return
        if w.op in P2P_OPS:
            detail = f"rank {self.info.ranks[w.peer]} never matched it"
        else:
            self.board.publish(self._issued, force=True)
            missing = self.board.behind(w.seq)
            detail = (
                f"ranks {missing} never arrived"
                if missing
                else "every rank reached it (a peer is stuck in NCCL, or an earlier call hangs)"
            )
        detail = f"timed out after {self.info.timeout:g} s; {detail}"
        self._fail_call(w, self.info.error(CollectiveTimeoutError, w.op, w.seq, detail))

    def _fail_call(self, w: NcclWork, err: CollectiveError) -> None:
        """Fail the group with ``err`` caused by ``w``, unless ``w`` or the group ended first."""
        with self._lock:
            if not w._done and self.error is None:
                self._fail(err, w)

    def _fail(self, err: CollectiveError, culprit: NcclWork | None = None) -> None:
        """Record the first failure, fail every pending call, abort, tell the peers."""
        with self._lock:
            first = self.error is None
            if first:
                self.error = err
            works = list(self._pending)
            self._pending.clear()
            if culprit is not None and culprit not in works:
                works.insert(0, culprit)
            held: list[Any] = []
            for i, w in enumerate(works):
                if w._done:
                    continue
                if w is culprit or (culprit is None and i == 0):
                    w.set_error(err)
                else:
                    w.set_error(self.info.unusable(w.op, w.seq, err))
                held += w.refs  # copies may still be queued on the stream: see _bury
                w.refs = []
                w.writebacks = []
            if first:
                self._abort_comm()
            self._bury(held)
        if first:
            self.board.tell_abort(err)

    def _bury(self, held: list[Any]) -> None:
        """Keep ``held`` (arrays of failed calls) until the group's stream is idle: the abort
        stops NCCL, but copies queued before it may still run, and CuPy's pool would hand
        their memory out again. Released by :meth:`poll` and :meth:`close`."""
        self._graves = [(ev, arrs) for ev, arrs in self._graves if not ev.done]
        if held:
            with self.cuda.on_device():
                ev = self.cuda.event()
                ev.record(self.cuda.stream)
            self._graves.append((ev, held))

    def _abort_comm(self) -> None:
        comm, self.comm = self.comm, 0
        if comm:
            with contextlib.suppress(NcclError):
                self.lib.comm_abort(comm)

    def abort(self, reason: CollectiveError) -> None:
        """Mark the group broken (and abort the communicator)."""
        self._fail(reason)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Flush and free the communicator (abort it after a failure or when flushing hangs)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing = True
            self._wake.notify_all()
        _LIVE.discard(self)
        super().close()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        if self.error is None and self.comm:
            # First say which collectives this rank still took part in, so that peers waiting
            # in later ones fail at once even while the flush below waits for them.
            self.board.say_goodbye(self._issued)
            self._flush()
            with self._lock:
                for w in list(self._pending):
                    self._finish(w)
                self._pending.clear()
        elif self.comm:
            with self._lock:
                self._abort_comm()
        self._release_graves()

    def _release_graves(self) -> None:
        """At close: wait (a little) for the stream, then let go; arrays of a stream that
        never drains are kept for good (a leak, rather than memory reused under a copy)."""
        end = time.monotonic() + 5.0
        while self._graves and time.monotonic() < end:
            self._bury([])
            time.sleep(0.01)
        _KEPT.extend(arrs for _ev, arrs in self._graves)
        self._graves = []

    def _flush(self) -> bool:
        """ncclCommFinalize, polled; then ncclCommDestroy. Abort if it fails or hangs."""
        comm = self.comm
        limit = min(self.info.timeout, _CLOSE_LIMIT)
        deadline = time.monotonic() + limit
        try:
            self.lib.comm_finalize(comm)
            pause = 0.0002
            while True:
                state = self.lib.comm_get_async_error(comm)
                if state == nccl_lib.SUCCESS:
                    break
                if state != nccl_lib.IN_PROGRESS:
                    raise self.lib.error(state, "ncclCommFinalize", comm)
                if time.monotonic() >= deadline:
                    raise NcclError(
                        state,
                        "ncclCommFinalize",
                        f"not finished after {limit:g} s (peers still in a collective with "
                        "this rank?)",
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
            self.cuda.stream.synchronize()
            self.lib.comm_destroy(comm)
            self.comm = 0
            return True
        except NcclError as exc:
            detail = f"flushing the communicator failed: {exc}"
            with self._lock:
                self._fail(self.info.error(PeerFailureError, "destroy", None, detail))
            return False


def _probe() -> str | None:
    reason = _load.unavailable_reason()
    if reason is not None:
        return reason
    from tensorlib import cuda_unavailable_reason

    cuda = cuda_unavailable_reason()
    return None if cuda is None else f"no usable CUDA GPU: {cuda}"


_LIVE: set[NcclBackend] = set()
_KEPT: list[list[Any]] = []  # arrays of closed groups whose stream never drained


# What ranks published on ending, in groups this process shares with them: setup waits quote it.
register_last_words(lambda: last_words([b.board for b in list(_LIVE)]))


def _tell_peers_uncaught(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    # An uncaught exception is about to end this process: tell the peers why, so they report
    # "rank 1 failed: ValueError: ..." instead of waiting for their timeout.
    for b in list(_LIVE):
        if b.error is None:
            with contextlib.suppress(Exception):
                detail = f"{UNCAUGHT}{tp.__name__}: {value}"
                rank = b.info.global_rank
                b.board.tell_abort(collective_error(CollectiveError, detail, rank=rank))


register_backend(
    "nccl",
    NcclBackend,
    probe=_probe,
    description="NCCL through ctypes on CuPy streams, one or many hosts (CuPy; NumPy staged "
    "through the GPU)",
)
