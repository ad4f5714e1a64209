"""The ``nccl`` backend: NCCL through ctypes on CuPy streams, without host synchronization.

One communicator per group, on GPU ``local_rank % device_count`` (which init makes the calling
thread's current device). Rank 0 makes the ``ncclUniqueId`` and shares it through the store;
every rank starts a *non-blocking* ``ncclCommInitRankConfig`` and polls
``ncclCommGetAsyncError``, so init honours the group's timeout. ``new_group`` splits the
default group's communicator (``ncclCommSplit``, NCCL 2.18+) or, on older libraries, makes a
fresh unique id for the members.

A collective, issued from any thread:

1. records an event on the caller's current stream and makes the group's stream wait for it
   (the inputs are ready when the caller's earlier work is);
2. *signature check*: copies a 128-byte record of the call (sequence number, op, dtype, shape,
   root, reduce op) from pinned memory to the device, all-gathers the records of every rank
   (``ncclAllGather``, n x 128 bytes) and copies them back to pinned memory, then records an
   event (point-to-point calls send/receive one record instead);
3. enqueues the NCCL call itself on the group's stream (all-to-all as ``ncclSend``/``ncclRecv``
   pairs between ``ncclGroupStart``/``End``) and records an end event.

Nothing waits on the host. The :class:`Work` keeps the arrays alive until the end event
completed (CuPy's pool would otherwise reuse them). ``wait()`` makes the caller's current
stream wait for the end event and returns the output; ``wait(timeout=...)``, ``barrier``,
and any call on NumPy arrays (staged through the GPU: uploaded on the group's stream, copied
back once the end event completed) wait on the host, polling the events, the signature records,
``ncclCommGetAsyncError`` and the group's deadline.

A watchdog thread per group does the same polling for collectives nobody waits on: it releases
finished calls, compares signature records as soon as they arrive, and turns a mismatch, an
asynchronous NCCL error, an expired timeout, a peer's failure (published in the store), a peer
that left the group, or a local peer process that died into an error: the communicator is
aborted (``ncclCommAbort``, never a blocking destroy), every pending call fails with an error
naming the op and the sequence number, the reason goes to the store for the other ranks, and
the group refuses further calls. A mismatch is found by every rank (they gathered the same
records) before its data call can hang; the data call may already have run, so the output of
a mismatched call is undefined, as the error says.

The signature check costs one extra small all-gather, two 128-byte copies and one event per
collective (host: a few microseconds; GPU: one more small-message latency). ``DPT_NCCL_CHECK=0``
turns it off: mismatched calls then hang until the timeout, as with plain NCCL.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from .._backend import Backend, Executor, GroupInfo, Request
from .._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupAbortedError,
    PeerFailureError,
)
from .._registry import register_backend
from .._sigrec import (
    P2P_WORDS,
    SIG_BYTES,
    SIG_WORDS,
    describe_record,
    mismatch_text,
    pack_signature,
)
from .._work import Work
from . import _nccl_lib as L
from ._proc import pid_alive

__all__ = ["NcclBackend"]

_RING = 64  # signature slots in flight
_REMOTE_AGE = 0.25  # a call pending this long makes the watchdog look at the store
_REMOTE_EVERY = 0.25  # ...at most this often
_POLL_MIN, _POLL_MAX = 0.002, 0.02  # watchdog poll interval bounds (seconds)
_CLOSE_LIMIT = 30.0  # at most this long to flush a communicator on destroy
_H2D, _D2H = 1, 2  # cudaMemcpyKind


def _check_enabled() -> bool:
    return os.environ.get("DPT_NCCL_CHECK", "1").strip().lower() not in ("0", "false", "no")


def _split_enabled() -> bool:
    return os.environ.get("DPT_NCCL_SPLIT", "1").strip().lower() not in ("0", "false", "no")


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{os.uname().nodename}/{boot}"


# ---------------------------------------------------------------------------- the CUDA seam
def _cupy() -> Any:
    """CuPy, through tensorlib (one clear error when CuPy, a driver or a GPU is missing)."""
    from tensorlib import device

    return device("cuda").xp


class _Cuda:
    """The CUDA calls the backend makes, all through CuPy (the fake CuPy in tests): streams,
    events, pinned memory, asynchronous copies, device arrays."""

    def __init__(self, device: int) -> None:
        cp = _cupy()
        self.cp = cp
        self.device = device
        self.runtime = cp.cuda.runtime
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self._events: list[Any] = []

    def device_count(self) -> int:
        return int(self.runtime.getDeviceCount())

    def use(self) -> None:
        """Make the group's GPU the calling thread's current device."""
        self.cp.cuda.Device(self.device).use()

    def current_stream(self) -> Any:
        try:
            return self.cp.cuda.get_current_stream(self.device)
        except TypeError:  # CuPy < 12 takes no device argument
            return self.cp.cuda.get_current_stream()

    def event(self) -> Any:
        if self._events:
            return self._events.pop()
        with self.cp.cuda.Device(self.device):
            return self.cp.cuda.Event(block=False, disable_timing=True)

    def recycle(self, ev: Any) -> None:
        # Safe once complete: a stream that waits on it captured the record it waited for.
        if ev is not None and len(self._events) < 256:
            self._events.append(ev)

    def pinned(self, nbytes: int) -> tuple[Any, np.ndarray[Any, Any]]:
        mem = self.cp.cuda.alloc_pinned_memory(nbytes)
        return mem, np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def empty(self, shape: Any, dtype: Any) -> Any:
        with self.cp.cuda.Device(self.device):
            return self.cp.empty(shape, dtype=dtype)

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
        self.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)

    def download(self, dev: Any, host: np.ndarray[Any, Any]) -> None:
        """Copy a finished device array into the user's NumPy array."""
        with self.cp.cuda.Device(self.device):
            dev.get(stream=self.copy_stream, out=host)


# ---------------------------------------------------------------------------- work
class _NcclWork(Work):
    """A collective enqueued on the group's stream (see the module docstring)."""

    __slots__ = (
        "_backend",
        "deadline",
        "end",
        "host_sync",
        "peer",
        "refs",
        "sig_checked",
        "sig_ev",
        "sig_words",
        "slot",
        "start",
        "submitted",
        "writebacks",
    )

    def __init__(self, backend: NcclBackend, req: Request) -> None:
        super().__init__(req.op, req.seq, backend.info.global_rank, threaded=False)
        self._backend = backend
        now = time.monotonic()
        self.submitted = now
        self.deadline = now + backend.info.timeout
        self.start: Any = None
        self.sig_ev: Any = None
        self.end: Any = None
        self.slot = -1
        self.sig_words: np.ndarray[Any, Any] | None = None
        self.sig_checked = True
        self.refs: list[Any] = []
        self.writebacks: list[tuple[Any, np.ndarray[Any, Any]]] = []
        self.host_sync = False
        self.peer = req.peer

    def wait(self, timeout: float | None = None) -> Any:
        """Return the output once it is safe to use from the caller's current stream.

        Device arrays without ``timeout``: the caller's stream waits for the collective (no
        host synchronization). With ``timeout``, for NumPy arrays and for barriers the host
        waits, at most ``timeout`` seconds (CollectiveTimeoutError; the collective goes on).
        """
        b = self._backend
        if not self._done:
            if timeout is not None or self.host_sync:
                if not b._block(self, timeout):
                    raise CollectiveTimeoutError(
                        f"[rank {self.rank}] {self.op} #{self.seq}: Work.wait(timeout={timeout}) "
                        "expired before the collective completed (it is still in flight)",
                        rank=self.rank,
                        op=self.op,
                        seq=self.seq,
                    )
            else:
                b._stream_wait(self)
        return self._deliver()

    def is_completed(self) -> bool:
        """True once the collective finished (or failed); polls the GPU and the group."""
        if not self._done:
            self._backend._poll()
        return self._done

    def is_success(self) -> bool:
        """True once the collective finished without error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The collective's error if it failed (polls; never blocks)."""
        return self._error if self.is_completed() else None


class _NcclExecutor(Executor):
    """The group's queue is its CUDA stream: ``drain`` waits for every pending call."""

    def __init__(self, backend: NcclBackend) -> None:
        super().__init__(backend)
        self.nccl = backend

    def submit(self, req: Request, async_op: bool) -> Work:
        return self.nccl.submit(req, async_op)

    def pending(self) -> int:
        with self.nccl._lock:
            return len(self.nccl._pending)

    def drain(self, timeout: float | None = None) -> bool:
        with self.nccl._lock:
            last = self.nccl._pending[-1] if self.nccl._pending else None
        if last is None:
            return True
        return self.nccl._block(last, timeout)

    def close(self) -> None:
        self._closed = True


# ---------------------------------------------------------------------------- the backend
class NcclBackend(Backend):
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
        self.lib = L.load()
        count = int(_cupy().cuda.runtime.getDeviceCount())
        self.device = info.local_rank % count if count else 0
        self.cuda = _Cuda(self.device)
        self.cuda.use()
        self.executor = _NcclExecutor(self)
        self.check = _check_enabled()
        self.n = info.size
        self.me = info.rank
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._pending: deque[_NcclWork] = deque()
        self._issued = 0  # last collective sequence number enqueued
        self._published = -1
        self._closed = False
        self._closing = False
        self._watchdog: threading.Thread | None = None
        self._watch_idle = False
        self._next_remote = 0.0
        self._closed_seen = 0
        self._peer_closed: dict[int, int] = {}
        self._peers: dict[int, tuple[int, str]] | None = None
        self._dtype_cache: dict[Any, int] = {}
        self._sig_cache: dict[Any, np.ndarray[Any, Any]] = {}
        self.comm = 0
        self._announce()
        self.comm = self._make_comm(parent)
        try:
            self._setup_buffers()
        except BaseException:
            self._abort_comm()
            raise
        _LIVE.add(self)

    # ------------------------------------------------------------------ setup
    def _key(self, what: str) -> str:
        return f"{self.info.name}/nccl/{what}"

    def _announce(self) -> None:
        """Publish this rank's pid and host (liveness checks; who joined, for init timeouts)."""
        store = self.info.store
        if store is not None and self.n > 1:
            store.set(self._key(f"joined/{self.me}"), f"{os.getpid()} {_host_id()}")

    def _where(self, op: str = "", seq: int | None = None) -> str:
        head = f"[rank {self.info.global_rank}]"
        if op:
            head += f" {op}" + (f" #{seq}" if seq is not None else "")
        return f"{head} ({self.info.describe()})"

    def _unique_id(self, deadline: float) -> bytes:
        info = self.info
        if self.n == 1:
            return self.lib.get_unique_id()
        key = self._key("uid")
        if self.me == 0:
            uid = self.lib.get_unique_id()
            info.store.set(key, uid)
            return uid
        try:
            return bytes(info.store.get(key, timeout=max(0.01, deadline - time.monotonic())))
        except TimeoutError as exc:
            raise CollectiveTimeoutError(
                f"{self._where('init')}: group rank 0 (global rank {info.ranks[0]}) did not "
                f"publish the NCCL unique id within {info.timeout:g} s",
                rank=info.global_rank,
                op="init",
            ) from exc

    def _make_comm(self, parent: NcclBackend | None) -> int:
        deadline = time.monotonic() + self.info.timeout
        if parent is not None:
            with parent._lock:
                parent.check_usable("new_group", parent._issued)
                comm = self._call_init(
                    lambda: self.lib.comm_split(parent.comm, 0, self.me, blocking=False),
                    "ncclCommSplit",
                )
                self._settle_init(comm, "ncclCommSplit", deadline)
                parent._settle_init(parent.comm, "ncclCommSplit (parent)", deadline, abort=False)
        else:
            uid = self._unique_id(deadline)
            comm = self._call_init(
                lambda: self.lib.comm_init_rank(self.n, uid, self.me, blocking=False),
                "ncclCommInitRankConfig",
            )
            self._settle_init(comm, "ncclCommInitRankConfig", deadline)
        try:
            count = self.lib.comm_count(comm)
            rank = self.lib.comm_user_rank(comm)
            dev = self.lib.comm_cu_device(comm)
        except L.NcclError as exc:
            self.lib.comm_abort(comm)
            raise self._error_from(exc, "init") from exc
        if (count, rank) != (self.n, self.me) or dev != self.device:
            self.lib.comm_abort(comm)
            raise CollectiveError(
                f"{self._where('init')}: NCCL made a communicator of {count} ranks with this "
                f"rank as {rank} on cuda:{dev}; expected {self.n} ranks, rank {self.me}, "
                f"cuda:{self.device}",
                rank=self.info.global_rank,
                op="init",
            )
        return comm

    def _call_init(self, start: Any, call: str) -> int:
        try:
            return int(start())
        except L.NcclError as exc:
            raise self._error_from(exc, "init") from exc

    def _settle_init(self, comm: int, call: str, deadline: float, abort: bool = True) -> None:
        """Poll a communicator that is initializing (or splitting) until it is ready."""
        pause = 0.0002
        while True:
            try:
                state = self.lib.comm_get_async_error(comm)
            except L.NcclError as exc:
                raise self._error_from(exc, "init") from exc
            if state == L.SUCCESS:
                return
            if state != L.IN_PROGRESS:
                err = self.lib.error(state, call, comm)
                if abort:
                    self.lib.comm_abort(comm)
                raise self._error_from(err, "init") from err
            if time.monotonic() >= deadline:
                if abort:
                    self.lib.comm_abort(comm)
                missing = self._not_joined()
                detail = f"; ranks {missing} never joined" if missing else ""
                raise CollectiveTimeoutError(
                    f"{self._where('init')}: {call} did not complete within "
                    f"{self.info.timeout:g} s{detail}",
                    rank=self.info.global_rank,
                    op="init",
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _not_joined(self) -> list[int]:
        store = self.info.store
        if store is None or self.n == 1:
            return []
        try:
            return [
                self.info.ranks[r]
                for r in range(self.n)
                if not store.check([self._key(f"joined/{r}")])
            ]
        except Exception:
            return []

    def _setup_buffers(self) -> None:
        cuda, n = self.cuda, self.n
        self._send_mem, send = cuda.pinned(_RING * SIG_BYTES)
        self._recv_mem, recv = cuda.pinned(_RING * n * SIG_BYTES)
        self._sig_send = send.view(np.int64).reshape(_RING, SIG_WORDS)
        self._sig_recv = recv.view(np.int64).reshape(_RING, n, SIG_WORDS)
        self._send_ptr = int(self._send_mem.ptr)
        self._recv_ptr = int(self._recv_mem.ptr)
        self._dev_send = cuda.empty(_RING * SIG_BYTES, np.uint8)
        self._dev_recv = cuda.empty(_RING * n * SIG_BYTES, np.uint8)
        self._dev_send_ptr = int(self._dev_send.data.ptr)
        self._dev_recv_ptr = int(self._dev_recv.data.ptr)
        self._scratch = cuda.empty(1, np.int32)
        self._slot = 0
        self._slot_owner: list[_NcclWork | None] = [None] * _RING

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
        if not (self.lib.can_split and _split_enabled()):
            return None
        if info is not None:
            return NcclBackend(info, parent=self)
        deadline = time.monotonic() + self.info.timeout
        with self._lock:
            self.check_usable("new_group", self._issued)
            self._call_init(
                lambda: self.lib.comm_split(self.comm, L.SPLIT_NOCOLOR, self.me, blocking=False),
                "ncclCommSplit",
            )
            self._settle_init(self.comm, "ncclCommSplit (not a member)", deadline, abort=False)
        return None

    # ------------------------------------------------------------------ enqueue
    def submit(self, req: Request, async_op: bool) -> Work:
        """Enqueue ``req`` on the group's stream; return its Work (see the module docstring)."""
        with self._lock:
            work = _NcclWork(self, req)
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
                err = CollectiveError(
                    f"{self._where(req.op, req.seq)} failed: {type(exc).__name__}: {exc}",
                    rank=self.info.global_rank,
                    op=req.op,
                    seq=req.seq,
                )
                err.__cause__ = exc
                self._fail(err, work)
                return work
            self._pending.append(work)
            if req.op not in ("send", "recv"):
                self._issued = req.seq
            self._start_watchdog()
            return work

    def _dtype(self, dtype: Any) -> int:
        code = self._dtype_cache.get(dtype)
        if code is None:
            code = self._dtype_cache[dtype] = L.nccl_dtype(dtype)
        return code

    def _device_array(self, work: _NcclWork, arr: Any, upload: bool, download: bool) -> Any:
        """The device array the NCCL call uses for ``arr`` (a NumPy array is staged)."""
        if not isinstance(arr, np.ndarray):
            work.refs.append(arr)
            return arr
        dev = self.cuda.empty(arr.shape, arr.dtype)
        if upload and arr.size:
            dev.set(arr, stream=self.cuda.stream)
        work.refs.append(dev)
        work.host_sync = True
        if download and arr.size:
            work.writebacks.append((dev, arr))
        return dev

    def _settle(self, rc: int, call: str, req: Request) -> None:
        """After a call returned ncclInProgress (non-blocking communicator): wait until NCCL
        finished enqueuing it, within the collective's deadline."""
        if rc == L.SUCCESS:
            return
        pause = 0.0001
        while True:
            state = self.lib.comm_get_async_error(self.comm)
            if state == L.SUCCESS:
                return
            if state != L.IN_PROGRESS:
                raise self._error_from(self.lib.error(state, call, self.comm), req.op, req.seq)
            if time.monotonic() >= req.deadline:
                raise CollectiveTimeoutError(
                    f"{self._where(req.op, req.seq)}: NCCL did not finish enqueuing {call} "
                    f"within {self.info.timeout:g} s (peers not connecting?)",
                    rank=self.info.global_rank,
                    op=req.op,
                    seq=req.seq,
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _enqueue(self, req: Request, work: _NcclWork) -> None:
        op, cuda = req.op, self.cuda
        stream = cuda.stream
        sptr = stream.ptr
        req.deadline = work.deadline
        # 1. After the caller's earlier work on its current stream.
        start = cuda.event()
        start.record(cuda.current_stream())
        stream.wait_event(start)
        work.start = start
        try:
            # 2. The signature check (a collective's record is all-gathered).
            if self.check or op == "barrier":
                self._enqueue_signature(req, work)
            # 3. The call.
            self._enqueue_call(req, work, sptr)
        except L.NcclError as exc:
            raise self._error_from(exc, req.op, req.seq) from exc
        end = cuda.event()
        end.record(stream)
        work.end = end
        if op == "barrier":
            work.host_sync = True  # nobody leaves before everyone arrived

    def _enqueue_signature(self, req: Request, work: _NcclWork) -> None:
        cuda, lib, stream = self.cuda, self.lib, self.cuda.stream
        op = req.op
        if not self.check:
            # Barrier without the check: a one-element all-reduce.
            p = int(self._scratch.data.ptr)
            self._settle(lib.all_reduce(p, p, 1, 2, 0, self.comm, stream.ptr), "ncclAllReduce", req)
            return
        slot = self._take_slot(work)
        words = self._sig_cache.get(req.signature)
        if words is None:
            words = self._sig_cache[req.signature] = pack_signature(req)
            if len(self._sig_cache) > 4096:
                self._sig_cache.clear()
        row = self._sig_send[slot]
        row[:] = words
        row[0] = req.seq
        work.sig_words = words  # the cached template; the record is it with word 0 = seq
        send_dev = self._dev_send_ptr + slot * SIG_BYTES
        recv_dev = self._dev_recv_ptr + slot * self.n * SIG_BYTES
        recv_host = self._recv_ptr + slot * self.n * SIG_BYTES
        cuda.memcpy(send_dev, self._send_ptr + slot * SIG_BYTES, SIG_BYTES, _H2D, stream)
        sptr = stream.ptr
        if op == "send":
            rc = lib.send(send_dev, SIG_BYTES, L.UINT8, req.peer, self.comm, sptr)
            self._settle(rc, "ncclSend", req)
        elif op == "recv":
            rc = lib.recv(recv_dev, SIG_BYTES, L.UINT8, req.peer, self.comm, sptr)
            self._settle(rc, "ncclRecv", req)
            cuda.memcpy(recv_host, recv_dev, SIG_BYTES, _D2H, stream)
            work.sig_checked = False
        else:
            rc = lib.all_gather(send_dev, recv_dev, SIG_BYTES, L.UINT8, self.comm, sptr)
            self._settle(rc, "ncclAllGather", req)
            cuda.memcpy(recv_host, recv_dev, self.n * SIG_BYTES, _D2H, stream)
            work.sig_checked = False
        ev = cuda.event()
        ev.record(stream)
        work.sig_ev = ev

    def _take_slot(self, work: _NcclWork) -> int:
        """The next signature slot, once its previous user's record was copied and checked."""
        slot = self._slot
        self._slot = (slot + 1) % _RING
        prev = self._slot_owner[slot]
        if prev is not None and prev.sig_ev is not None and not prev.sig_ev.done:
            self._block(prev, None, sig_only=True)
        if prev is not None and not prev.sig_checked and self.error is None:
            self._check_signature(prev)
        if self.error is not None:
            raise GroupAbortedError(
                f"{self._where(work.op, work.seq)} is unusable after an earlier failure: "
                f"{self.error}",
                rank=self.info.global_rank,
                op=work.op,
                seq=work.seq,
            )
        work.slot = slot
        self._slot_owner[slot] = work
        return slot

    def _enqueue_call(self, req: Request, work: _NcclWork, sptr: int) -> None:
        lib, comm, op, n = self.lib, self.comm, req.op, self.n
        if op == "barrier":
            return  # the signature all-gather is the barrier
        arr = req.array
        if op == "all_reduce":
            a = self._device_array(work, arr, True, True)
            if a.size:
                p = int(a.data.ptr)
                dt, rop = self._dtype(a.dtype), L.nccl_op(req.reduce_op)  # type: ignore[arg-type]
                self._settle(
                    lib.all_reduce(p, p, a.size, dt, rop, comm, sptr), "ncclAllReduce", req
                )
        elif op == "broadcast":
            root = req.root == self.me
            a = self._device_array(work, arr, root, not root)
            if a.size:
                p = int(a.data.ptr)
                rc = lib.broadcast(p, p, a.size, self._dtype(a.dtype), req.root, comm, sptr)
                self._settle(rc, "ncclBroadcast", req)
        elif op == "reduce":
            root = req.root == self.me
            a = self._device_array(work, arr, True, root)
            if a.size:
                p = int(a.data.ptr)
                rop = L.nccl_op(req.reduce_op)  # type: ignore[arg-type]
                rc = lib.reduce(p, p, a.size, self._dtype(a.dtype), rop, req.root, comm, sptr)
                self._settle(rc, "ncclReduce", req)
        elif op == "all_gather":
            a = self._device_array(work, arr, True, False)
            o = self._device_array(work, req.out, False, True)
            if a.size:
                rc = lib.all_gather(
                    int(a.data.ptr), int(o.data.ptr), a.size, self._dtype(a.dtype), comm, sptr
                )
                self._settle(rc, "ncclAllGather", req)
        elif op == "reduce_scatter":
            a = self._device_array(work, arr, True, False)
            o = self._device_array(work, req.out, False, True)
            if o.size:
                rop = L.nccl_op(req.reduce_op)  # type: ignore[arg-type]
                rc = lib.reduce_scatter(
                    int(a.data.ptr), int(o.data.ptr), o.size, self._dtype(a.dtype), rop, comm, sptr
                )
                self._settle(rc, "ncclReduceScatter", req)
        elif op == "all_to_all":
            a = self._device_array(work, arr, True, False)
            o = self._device_array(work, req.out, False, True)
            block = a.size // n
            if block:
                dt = self._dtype(a.dtype)
                step = block * a.itemsize
                pa, po = int(a.data.ptr), int(o.data.ptr)
                lib.group_start()
                try:
                    for j in range(n):
                        lib.send(pa + j * step, block, dt, j, comm, sptr)
                        lib.recv(po + j * step, block, dt, j, comm, sptr)
                finally:
                    rc = lib.group_end()
                self._settle(rc, "ncclGroupEnd", req)
        elif op == "send":
            a = self._device_array(work, arr, True, False)
            if a.size:
                rc = lib.send(int(a.data.ptr), a.size, self._dtype(a.dtype), req.peer, comm, sptr)
                self._settle(rc, "ncclSend", req)
        elif op == "recv":
            a = self._device_array(work, arr, False, True)
            if a.size:
                rc = lib.recv(int(a.data.ptr), a.size, self._dtype(a.dtype), req.peer, comm, sptr)
                self._settle(rc, "ncclRecv", req)
        else:
            raise ValueError(f"the nccl backend has no operation {op!r}")

    # ------------------------------------------------------------------ completion
    def _poll(self) -> None:
        """Advance completions, checks and deadlines once (any thread)."""
        timed_out: _NcclWork | None = None
        with self._lock:
            timed_out = self._progress(time.monotonic())
        if timed_out is not None:
            self._timeout(timed_out)

    def _progress(self, now: float) -> _NcclWork | None:
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
        except L.NcclError as exc:
            state = exc.code
        if state not in (L.SUCCESS, L.IN_PROGRESS):
            oldest = pending[0]
            err = self.lib.error(state, "ncclCommGetAsyncError", self.comm)
            self._fail(
                PeerFailureError(
                    f"{self._where(oldest.op, oldest.seq)}: NCCL reported an asynchronous "
                    f"error: {err}",
                    rank=self.info.global_rank,
                    op=oldest.op,
                    seq=oldest.seq,
                )
            )
            return None
        if now >= pending[0].deadline:
            return pending[0]
        return None

    def _finish(self, w: _NcclWork) -> None:
        try:
            for dev, host in w.writebacks:
                self.cuda.download(dev, host)
        except Exception as exc:
            w.set_error(
                CollectiveError(
                    f"{self._where(w.op, w.seq)}: copying the result back to the host failed: "
                    f"{type(exc).__name__}: {exc}",
                    rank=self.info.global_rank,
                    op=w.op,
                    seq=w.seq,
                )
            )
        else:
            w.set_result(None)
        self._release(w)

    def _release(self, w: _NcclWork) -> None:
        cuda = self.cuda
        for ev in (w.start, w.sig_ev, w.end):
            cuda.recycle(ev)
        w.start = w.sig_ev = w.end = None
        w.refs = []
        w.writebacks = []

    def _block(self, w: _NcclWork, timeout: float | None, sig_only: bool = False) -> bool:
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

    def _stream_wait(self, w: _NcclWork) -> None:
        """``wait()`` on device arrays: the caller's stream waits for the end event.

        Nothing is polled here (the watchdog does that), to keep a blocking call cheap."""
        with self._lock:
            end = w.end
        if w._done or end is None:
            return
        self.cuda.current_stream().wait_event(end)
        # (The fake CuPy's null stream waits on the host here; a failure found meanwhile is
        # in w._error, which the caller checks next.)

    # ------------------------------------------------------------------ checks
    def _check_signature(self, w: _NcclWork) -> None:
        """Compare the records that arrived for ``w``; a mismatch fails the group."""
        w.sig_checked = True
        if w.sig_words is None or w.slot < 0:
            return
        mine = w.sig_words.copy()
        mine[0] = w.seq
        recs = self._sig_recv[w.slot]
        if w.op == "recv":
            theirs = recs[0]
            if not np.array_equal(theirs[P2P_WORDS], mine[P2P_WORDS]):
                src = self.info.ranks[w.peer]
                err = CollectiveMismatchError(
                    f"{self._where(w.op, w.seq)}: rank {src} sent {describe_record(theirs)} but "
                    f"this rank expects {describe_record(mine)}",
                    rank=self.info.global_rank,
                    op=w.op,
                    seq=w.seq,
                )
                self._fail(err, w)
            return
        # One bytes comparison of every rank's record: ~0.7 us where np.array_equal over a
        # broadcast took ~6 us, on every collective.
        if recs[:, :15].tobytes() == mine[:15].tobytes() * self.n:
            return
        text = mismatch_text(recs, self.info.ranks) or "records differ"
        err = CollectiveMismatchError(
            f"{self._where(w.op, w.seq)}: ranks issued different collectives at the same "
            f"point: {text} (the call's output is undefined)",
            rank=self.info.global_rank,
            op=w.op,
            seq=w.seq,
        )
        self._fail(err, w)

    def _timeout(self, w: _NcclWork) -> None:
        """``w`` passed its deadline: name the ranks that never arrived, then fail."""
        if w._done or self.error is not None:
            return
        if w.op in ("send", "recv"):
            detail = f"rank {self.info.ranks[w.peer]} never matched it"
        else:
            missing = self._missing(w.seq)
            detail = (
                f"ranks {missing} never arrived"
                if missing
                else "every rank reached it (a peer is stuck in NCCL, or an earlier call hangs)"
            )
        err = CollectiveTimeoutError(
            f"{self._where(w.op, w.seq)}: timed out after {self.info.timeout:g} s; {detail}",
            rank=self.info.global_rank,
            op=w.op,
            seq=w.seq,
        )
        with self._lock:
            if not w._done and self.error is None:
                self._fail(err, w)

    def _missing(self, seq: int) -> list[int]:
        """Global ranks whose last published collective is before ``seq``."""
        store = self.info.store
        if store is None or self.n == 1:
            return []
        self._publish(force=True)
        grace = time.monotonic() + min(1.0, self.info.timeout / 2)
        missing: list[int] = []
        while True:
            missing = []
            for r in range(self.n):
                if r == self.me:
                    continue
                key = self._key(f"progress/{r}")
                try:
                    seen = int(store.get(key, timeout=0.01)) if store.check([key]) else 0
                except Exception:
                    seen = 0
                if seen < seq:
                    missing.append(self.info.ranks[r])
            if not missing or time.monotonic() >= grace:
                return missing
            time.sleep(0.05)

    def _publish(self, force: bool = False) -> None:
        store = self.info.store
        if store is None or self.n == 1:
            return
        if force or self._issued != self._published:
            issued = self._issued
            with contextlib.suppress(Exception):
                store.set(self._key(f"progress/{self.me}"), str(issued))
                self._published = issued

    # ------------------------------------------------------------------ failure
    def _error_from(self, exc: L.NcclError, op: str, seq: int | None = None) -> CollectiveError:
        cls = CollectiveTimeoutError if exc.code == 8 else CollectiveError
        if exc.code == 6:  # ncclRemoteError
            cls = PeerFailureError
        err = cls(f"{self._where(op, seq)}: {exc}", rank=self.info.global_rank, op=op, seq=seq)
        err.__cause__ = exc
        return err

    def _fail(self, err: CollectiveError, culprit: _NcclWork | None = None) -> None:
        """Record the first failure, fail every pending call, abort, tell the peers."""
        with self._lock:
            first = self.error is None
            if first:
                self.error = err
            works = list(self._pending)
            self._pending.clear()
            if culprit is not None and culprit not in works:
                works.insert(0, culprit)
            for i, w in enumerate(works):
                if w._done:
                    continue
                if w is culprit or (culprit is None and i == 0):
                    w.set_error(err)
                else:
                    w.set_error(
                        GroupAbortedError(
                            f"{self._where(w.op, w.seq)} is unusable after an earlier failure: "
                            f"{err}",
                            rank=self.info.global_rank,
                            op=w.op,
                            seq=w.seq,
                        )
                    )
                w.refs = []  # the aborted communicator no longer touches them
                w.writebacks = []
            if first:
                self._abort_comm()
        if first:
            self._tell_peers(err)

    def _abort_comm(self) -> None:
        comm, self.comm = self.comm, 0
        if comm:
            with contextlib.suppress(L.NcclError):
                self.lib.comm_abort(comm)

    def _tell_peers(self, err: CollectiveError) -> None:
        store = self.info.store
        if store is None or self.n == 1:
            return
        if isinstance(err, CollectiveTimeoutError):
            kind = "timeout"
        elif isinstance(err, CollectiveMismatchError):
            kind = "mismatch"
        else:
            kind = "failed"
        payload = f"{kind}|{self.info.global_rank}|{err}"[:4000]
        with contextlib.suppress(Exception):
            store.compare_set(self._key("abort"), b"", payload)

    def abort(self, reason: CollectiveError) -> None:
        """Mark the group broken (and abort the communicator)."""
        self._fail(reason)

    # ------------------------------------------------------------------ watchdog
    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name=f"collectives-nccl-{self.info.name}", daemon=True
            )
            self._watchdog.start()
        elif self._watch_idle:
            self._wake.notify_all()

    def _watch(self) -> None:
        pause = _POLL_MIN
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._watch_idle = True
                    self._wake.wait(1.0)
                    pause = _POLL_MIN
                self._watch_idle = False
                if self._closing:
                    return
                before = len(self._pending)
                now = time.monotonic()
                try:
                    timed_out = self._progress(now)
                except Exception:  # never let the watchdog die silently
                    timed_out = None
                oldest = self._pending[0] if self._pending else None
                progressed = len(self._pending) < before
            if timed_out is not None:
                self._timeout(timed_out)
            elif (
                oldest is not None
                and now - oldest.submitted >= _REMOTE_AGE
                and now >= self._next_remote
            ):
                self._next_remote = now + _REMOTE_EVERY
                self._remote_checks(oldest)
            pause = _POLL_MIN if progressed else min(pause * 2, _POLL_MAX)
            time.sleep(pause)

    def _remote_checks(self, oldest: _NcclWork) -> None:
        """A call is slow: publish our progress, and look for failed, departed or dead peers."""
        store = self.info.store
        if store is None or self.n == 1 or self.error is not None:
            return
        self._publish()
        try:
            aborted = store.check([self._key("abort")])
            payload = store.get(self._key("abort"), timeout=1.0) if aborted else b""
            closed = store.add(self._key("closed"), 0)
            if closed > self._closed_seen:
                for r in range(self.n):
                    key = self._key(f"closed/{r}")
                    if r != self.me and r not in self._peer_closed and store.check([key]):
                        self._peer_closed[r] = int(store.get(key, timeout=1.0))
                self._closed_seen = closed
            if self._peers is None:
                peers = {}
                for r in range(self.n):
                    raw = store.get(self._key(f"joined/{r}"), timeout=1.0).decode().split()
                    peers[r] = (int(raw[0]), raw[1])
                self._peers = peers
        except Exception as exc:
            if time.monotonic() - oldest.submitted > 2.0:
                self._peer_error(
                    oldest,
                    PeerFailureError,
                    f"the rendezvous store (hosted by global rank {self.info.ranks[0]}) is "
                    f"unreachable ({type(exc).__name__}: {exc}): is that rank gone?",
                )
            return
        with self._lock:
            self._progress(time.monotonic())  # our own findings come first
            if oldest._done or self.error is not None:
                return
        if payload:
            kind, _, rest = payload.decode("utf-8", "replace").partition("|")
            who, _, message = rest.partition("|")
            cls = CollectiveTimeoutError if kind == "timeout" else PeerFailureError
            verb = "timed out" if kind == "timeout" else "failed"
            self._peer_error(oldest, cls, f"rank {who} {verb}: {message}")
            return
        for r, last in self._peer_closed.items():
            if oldest.op in ("send", "recv"):
                gone = oldest.peer == r
            else:
                gone = oldest.seq > last
            if gone:
                self._peer_error(
                    oldest,
                    PeerFailureError,
                    f"rank {self.info.ranks[r]} left the group (destroy_process_group) before "
                    "reaching this collective",
                )
                return
        host = _host_id()
        for r, (pid, peer_host) in (self._peers or {}).items():
            if r != self.me and peer_host == host and not pid_alive(pid):
                self._peer_error(
                    oldest,
                    PeerFailureError,
                    f"rank {self.info.ranks[r]} (pid {pid}) is gone: its process exited or was "
                    "killed",
                )
                return

    def _peer_error(self, w: _NcclWork, cls: type[CollectiveError], text: str) -> None:
        err = cls(
            f"{self._where(w.op, w.seq)}: {text}", rank=self.info.global_rank, op=w.op, seq=w.seq
        )
        with self._lock:
            if not w._done and self.error is None:
                self._fail(err, w)

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
        self.executor.close()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        if self.error is None and self.comm:
            # First say which collectives this rank still took part in, so that peers waiting
            # in later ones fail at once even while the flush below waits for them.
            self._say_goodbye()
            self._flush()
            with self._lock:
                for w in list(self._pending):
                    self._finish(w)
                self._pending.clear()
        elif self.comm:
            with self._lock:
                self._abort_comm()

    def _flush(self) -> bool:
        """ncclCommFinalize, polled; then ncclCommDestroy. Abort if it fails or hangs."""
        comm = self.comm
        deadline = time.monotonic() + min(self.info.timeout, _CLOSE_LIMIT)
        try:
            self.lib.comm_finalize(comm)
            pause = 0.0002
            while True:
                state = self.lib.comm_get_async_error(comm)
                if state == L.SUCCESS:
                    break
                if state != L.IN_PROGRESS:
                    raise self.lib.error(state, "ncclCommFinalize", comm)
                if time.monotonic() >= deadline:
                    raise L.NcclError(
                        state,
                        "ncclCommFinalize",
                        f"not finished after {min(self.info.timeout, _CLOSE_LIMIT):g} s "
                        "(peers still in a collective with this rank?)",
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
            self.cuda.stream.synchronize()
            self.lib.comm_destroy(comm)
            self.comm = 0
            return True
        except L.NcclError as exc:
            with self._lock:
                self._fail(
                    PeerFailureError(
                        f"{self._where('destroy')}: flushing the communicator failed: {exc}",
                        rank=self.info.global_rank,
                        op="destroy",
                    )
                )
            return False

    def _say_goodbye(self) -> None:
        store = self.info.store
        if store is None or self.n == 1:
            return
        with contextlib.suppress(Exception):
            store.set(self._key(f"closed/{self.me}"), str(self._issued))
            store.add(self._key("closed"), 1)


def _probe() -> str | None:
    reason = L.unavailable_reason()
    if reason is not None:
        return reason
    from tensorlib import cuda_unavailable_reason

    cuda = cuda_unavailable_reason()
    return None if cuda is None else f"no usable CUDA GPU: {cuda}"


_LIVE: set[NcclBackend] = set()
_prev_excepthook = sys.excepthook


def _excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    # An uncaught exception is about to end this process: tell the peers why, so they report
    # "rank 1 failed: ValueError: ..." instead of waiting for their timeout.
    for b in list(_LIVE):
        if b.error is None:
            with contextlib.suppress(Exception):
                b._tell_peers(
                    CollectiveError(f"[rank {b.info.global_rank}] uncaught {tp.__name__}: {value}")
                )
    _prev_excepthook(tp, value, tb)


sys.excepthook = _excepthook

register_backend(
    "nccl",
    NcclBackend,
    probe=_probe,
    description="NCCL through ctypes on CuPy streams, one or many hosts (CuPy; NumPy staged "
    "through the GPU)",
)
