"""A fake ``libnccl.so.2`` that really performs collectives over host memory, one thread a rank.

:class:`FakeNccl` has the function names and the C calling convention of the ctypes binding
(``collectives/backends/nccl/_lib.py``): integer results, pointers as ints, out-parameters as
ctypes instances it writes into (where ctypes would pass a pointer), ``ncclUniqueId`` and
``ncclConfig_t`` as the binding's structures. Wrap it with ``Nccl(FakeNccl(), version, "fake")``
and install it with ``_nccl_load.install`` to run the nccl backend without a GPU.

What it models, so that the backend's mistakes show:

* Ranks are threads of one process (as NCCL allows with one GPU per thread); communicators of
  one unique id form a world. "Device memory" is host memory at the addresses the fake CuPy
  (tests/fakes/fake_cupy/) hands out, so every count, offset, root, dtype and in-place
  pointer the backend passes is used for real: a wrong one gives a wrong result.
* Operations are queued on the fake CuPy stream named by their ``cudaStream_t`` and run there
  in order, asynchronously to the host; events recorded after them complete when they ran.
* A collective waits until every rank of its world issued its collective of the same index,
  reads every input, then (after all ranks read) writes every output, so in-place calls are
  exact. Ranks that disagree on the kind, count, dtype, op or root hang, as NCCL may, until
  their communicator is aborted. ``ncclGroupStart``/``End`` collect calls (per thread) and run
  them as one unit at the outermost ``ncclGroupEnd``, each communicator's part on its own
  stream, so one thread may issue every rank's call of a world (NCCL's single-controller
  mode); sends are eager (buffered), receives wait for their message. An error inside a group
  makes ``ncclGroupEnd`` return it and drops the whole group.
* ``ncclCommInitRank*`` inside a group, as in NCCL's ``src/init.cc`` (``ncclCommInitRankDev``
  writes ``*newcomm`` and hands the init to ``ncclAsyncLaunch``) and ``src/group.cc`` (which
  queues it while ``ncclGroupDepth > 0``; ``ncclGroupEndInternal`` runs the group's jobs and,
  for blocking communicators, returns once all completed): the handle is written at the call,
  the init runs at the outermost ``ncclGroupEnd``, so one thread can make every rank of a
  world (``ncclCommInitAll``). Until then the communicator is not ready: a collective on it
  fails (``ncclInvalidArgument``, "Attempt to use communicator before..."; real NCCL checks
  only ``asyncResult`` there, so using it is undefined rather than reported). Blocking and
  non-blocking inits in one group fail, as ``ncclAsyncLaunch`` refuses them.
* Non-blocking communicators (``blocking=0``) report ``ncclInProgress`` from
  ``ncclCommGetAsyncError`` until every rank joined (init) or the queue drained (finalize).
  ``ncclCommAbort`` wakes everything the communicator waits on; a handle used after abort or
  destroy gives ``ncclInvalidArgument`` (a NULL one: "comm argument is NULL", as NCCL's
  ``PtrCheck`` says).
* Out-parameters live as long as the caller keeps them, as with a C pointer: NCCL does not
  keep the storage alive, so the fake holds only a weak reference and records a write (or
  read) through one the caller already dropped in :attr:`FakeNccl.stale_writes` (on a GPU:
  8 bytes written into freed memory). As in NCCL's ``src/init.cc``:

  - ``ncclCommSplit`` sets ``*newcomm`` to NULL at once; the split runs *asynchronously* (a
    thread, once every rank of the parent called it) and only then writes the child's handle
    (NULL for ``NCCL_SPLIT_NOCOLOR``) into the caller's pointer. Whether the call blocks is
    the *parent's* mode (NCCL's group job takes it from the parent communicator); with a
    non-blocking parent it returns ``ncclInProgress`` and the *parent* reports
    ``ncclInProgress`` until the split completed (maintainer's word in NVIDIA/nccl#1472).
    The child's own mode comes from the config passed, else the parent's. Using the parent
    meanwhile gives ``ncclInvalidArgument`` (``ncclCommEnsureReady``).
  - ``ncclCommInitRankConfig`` writes ``*newcomm`` before it returns (inside a group too);
    libraries before 2.18 (``version < 21800``) also dereference the caller's pointer from
    their init thread when the init completes.
  - ``NCCL_COMM_BLOCKING=0|1`` in the environment overrides the config's ``blocking``, as
    NCCL's ``envConfigOverride`` does.
* Test controls: :meth:`FakeNccl.fail_next` makes the next call(s) of a function return an
  error code, :meth:`FakeNccl.inject_async_error` sets a communicator's asynchronous error,
  ``in_progress_ops`` makes operations on non-blocking communicators return ``ncclInProgress``
  for a moment, ``counts`` counts calls and ``trace`` (when a list) logs data operations.

Not modelled: bfloat16 and float8 (refused), NCCL's reduction order (ranks reduce in rank
order), blocking sends (all sends are eager), "Duplicate GPU detected" of NCCL < 2.30.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tests.fakes import fake_cupy

__all__ = ["FakeNccl", "install"]

SUCCESS, UNHANDLED_CUDA, SYSTEM, INTERNAL, INVALID_ARGUMENT, INVALID_USAGE = 0, 1, 2, 3, 4, 5
REMOTE, IN_PROGRESS, TIMEOUT = 6, 7, 8
_STRINGS = {
    0: "no error",
    1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
    3: "internal error - please report this issue to the NCCL developers",
    4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
    5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
    6: "remote process exited or there was a network error",
    7: "NCCL operation in progress",
    8: "NCCL operation timed out",
}
_NP_DTYPES = {
    0: np.int8,
    1: np.uint8,
    2: np.int32,
    3: np.uint32,
    4: np.int64,
    5: np.uint64,
    6: np.float16,
    7: np.float32,
    8: np.float64,
}
_UFUNCS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}
_API_MAGIC = 0xCAFEBEEF
_NOCOLOR = -1


def _view(ptr: int, count: int, dtype: int) -> np.ndarray[Any, Any]:
    """``count`` elements of ``dtype`` at host address ``ptr`` (no copy)."""
    dt = np.dtype(_NP_DTYPES[dtype])
    if count == 0:
        return np.empty(0, dtype=dt)
    raw = (ctypes.c_char * (count * dt.itemsize)).from_address(ptr)
    return np.frombuffer(memoryview(raw), dtype=dt)


@dataclass
class _Op:
    kind: str  # "AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "Send", "Recv"
    send: int
    recv: int
    count: int
    dtype: int
    op: int = -1
    root: int = -1
    peer: int = -1

    def key(self) -> tuple[Any, ...]:
        """What every rank must agree on for a collective."""
        return (self.kind, self.count, self.dtype, self.op, self.root)


@dataclass
class _Slot:
    ops: dict[int, _Op] = field(default_factory=dict)
    read: int = 0
    written: int = 0


class _World:
    """The communicators made from one unique id (or one split)."""

    def __init__(self, nranks: int, name: str) -> None:
        self.nranks = nranks
        self.name = name
        self.cond = threading.Condition()
        self.comms: dict[int, _Comm] = {}
        self.slots: dict[int, _Slot] = {}
        self.mail: dict[tuple[int, int], deque[tuple[int, int, bytes]]] = {}
        self.splits: dict[int, dict[int, _SplitPost]] = {}

    @property
    def ready(self) -> bool:
        return len(self.comms) == self.nranks


class _Out:
    """A ``ncclComm_t*`` out-parameter that NCCL may write (or read) after the call returned.

    NCCL keeps a raw pointer, not the storage: a weak reference here, and a write through a
    pointer whose storage the caller dropped is recorded in ``stale`` instead of done.
    """

    def __init__(self, obj: Any, what: str, stale: list[str]) -> None:
        self._ref = weakref.ref(obj)
        self.what = what
        self.stale = stale

    def write(self, handle: int) -> None:
        obj = self._ref()
        if obj is None:
            self.stale.append(
                f"{self.what} wrote {handle:#x} through a ncclComm_t* whose storage the caller "
                "had freed"
            )
            return
        obj.value = handle or None

    def read(self) -> int:
        obj = self._ref()
        if obj is None:
            self.stale.append(f"{self.what} read a ncclComm_t* whose storage the caller had freed")
            return 0
        return int(obj.value or 0)


@dataclass
class _SplitPost:
    color: int
    key: int
    blocking: bool  # the child's mode
    out: _Out


@dataclass
class _InitJob:
    """An ``ncclCommInitRank*`` made inside a group: it runs at the outermost ncclGroupEnd."""

    comm: _Comm
    key: bytes
    nranks: int
    out: _Out | None


class _Comm:
    def __init__(self, handle: int, world: _World | None, rank: int, device: int, blocking: bool):
        self.handle = handle
        self.world = world
        self.rank = rank
        self.device = device
        self.blocking = blocking
        self.aborted = threading.Event()
        self.destroyed = False
        self.async_error = SUCCESS
        self.busy_until = 0.0  # in_progress_ops: "still enqueuing" until then
        self.coll_index = 0
        self.split_index = 0
        self.inflight = 0
        self.finalizing = False
        self.splitting = False  # a non-blocking split of this parent has not completed
        self.out: _Out | None = None  # NCCL < 2.18: the init thread's pointer to our handle


class _Tls(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.pending: list[tuple[_Comm, fake_cupy.Stream, _Op]] = []
        self.inits: list[_InitJob] = []
        self.blocking: bool | None = None  # the mode of the group's inits (NCCL: one per group)
        self.error = SUCCESS


class FakeNccl:
    """The raw function table (see the module docstring).

    Args:
        version: what ``ncclGetVersion`` reports (``ncclCommSplit`` exists from 21800).
    """

    def __init__(self, version: int = 23203) -> None:
        self.version = version
        self.counts: Counter[str] = Counter()
        self.trace: list[tuple[Any, ...]] | None = None
        self.in_progress_ops = 0.0  # seconds a non-blocking comm stays "enqueuing" after a call
        self._lock = threading.Lock()
        self._handles = itertools.count(0xC0300)
        self._worlds: dict[bytes, _World] = {}
        self._comms: dict[int, _Comm] = {}
        self._tls = _Tls()
        self._last_error = ""
        self._faults: list[list[Any]] = []
        # Writes NCCL would make through pointers the caller had freed (see _Out): each one is
        # memory corruption on a GPU; tests require this to stay empty.
        self.stale_writes: list[str] = []
        if version < 21800:
            # Older libraries have no ncclCommSplit: the binding sees no such attribute.
            self.ncclCommSplit = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ test controls
    def fail_next(
        self, name: str, code: int, message: str = "", comm: int | None = None, times: int = 1
    ) -> None:
        """Make the next ``times`` calls of ``name`` (on communicator handle ``comm`` when
        given) return ``code``, with ``message`` as ``ncclGetLastError``."""
        with self._lock:
            self._faults.append([name, code, message, comm, times])

    def inject_async_error(self, comm: int, code: int, message: str = "") -> bool:
        """Set the asynchronous error of communicator handle ``comm`` (False: no such one)."""
        c = self._comm(comm)
        if c is None:
            return False
        if message:
            self._last_error = message
        c.async_error = code
        return True

    def live_comms(self) -> list[tuple[int, int, int]]:
        """``(handle, rank, nranks)`` of every communicator not destroyed or aborted."""
        with self._lock:
            return [
                (c.handle, c.rank, c.world.nranks if c.world else -1)
                for c in self._comms.values()
                if not c.destroyed
            ]

    def _fault(self, name: str, comm: _Comm | None = None) -> int:
        if not self._faults:
            return SUCCESS
        with self._lock:
            for f in self._faults:
                if f[0] == name and (f[3] is None or (comm is not None and comm.handle == f[3])):
                    f[4] -= 1
                    if f[4] <= 0:
                        self._faults.remove(f)
                    self._last_error = f[2] or f"fake: injected {name} failure"
                    return int(f[1])
        return SUCCESS

    def _enter(self, name: str, comm: Any, faults: bool = True) -> tuple[_Comm | None, int]:
        """Count a call of ``name`` on handle ``comm``: its communicator and SUCCESS, or None
        and the result to return (an invalid handle, or a fault injected for this call)."""
        self.counts[name] += 1
        c = self._comm(comm)
        if c is None:
            return None, self._err(INVALID_ARGUMENT, self._bad_comm(name, comm))
        code = self._fault(name, c) if faults else SUCCESS
        return (None, code) if code else (c, SUCCESS)

    @staticmethod
    def _bad_comm(name: str, handle: Any) -> str:
        if not int(getattr(handle, "value", handle) or 0):
            return f"{name} : comm argument is NULL"  # NCCL's PtrCheck
        return f"{name}: invalid communicator {handle!r}"

    def _err(self, code: int, message: str) -> int:
        self._last_error = message
        return code

    def _comm(self, handle: Any) -> _Comm | None:
        h = int(getattr(handle, "value", handle) or 0)
        c = self._comms.get(h)
        if c is None or c.destroyed:
            return None
        return c

    # ------------------------------------------------------------------ library-wide
    def ncclGetVersion(self, version: ctypes.c_int) -> int:
        self.counts["ncclGetVersion"] += 1
        version.value = self.version
        return SUCCESS

    def ncclGetErrorString(self, code: int) -> bytes:
        return _STRINGS.get(int(code), "unknown result code").encode()

    def ncclGetLastError(self, comm: Any) -> bytes:
        return self._last_error.encode()

    def ncclGetUniqueId(self, uid: Any) -> int:
        self.counts["ncclGetUniqueId"] += 1
        code = self._fault("ncclGetUniqueId")
        if code:
            return code
        ctypes.memmove(ctypes.addressof(uid), os.urandom(128), 128)
        return SUCCESS

    # ------------------------------------------------------------------ communicators
    def ncclCommInitRank(self, comm_out: ctypes.c_void_p, nranks: int, uid: Any, rank: int) -> int:
        return self._init(comm_out, nranks, uid, rank, None)

    def ncclCommInitRankConfig(
        self, comm_out: ctypes.c_void_p, nranks: int, uid: Any, rank: int, config: Any
    ) -> int:
        return self._init(comm_out, nranks, uid, rank, config)

    def _init(self, comm_out: Any, nranks: int, uid: Any, rank: int, config: Any) -> int:
        name = "ncclCommInitRankConfig" if config is not None else "ncclCommInitRank"
        self.counts[name] += 1
        code = self._fault(name)
        if code:
            return self._group_error(code, self._last_error)
        blocking = True
        if config is not None:
            if config.magic != _API_MAGIC:
                return self._group_error(
                    INVALID_ARGUMENT, "ncclConfig_t not initialized (bad magic)"
                )
            if config.version < 21400 or config.size < 20:
                return self._group_error(
                    INVALID_ARGUMENT, f"ncclConfig_t size {config.size} too small"
                )
            blocking = config.blocking != 0
        blocking = _env_blocking(blocking)
        if not 0 <= rank < nranks:
            return self._group_error(
                INVALID_ARGUMENT, f"rank {rank} out of range for {nranks} ranks"
            )
        # The device is the one current at the call (NCCL's cudaGetDevice), even when the
        # init itself runs later, at ncclGroupEnd.
        comm = _Comm(next(self._handles), None, rank, _current_device(), blocking)
        out = None
        if not blocking and self.version < 21800:
            # NCCL 2.14-2.17 keep the caller's ncclComm_t* and use it from the init thread.
            out = _Out(comm_out, name, self.stale_writes)
        job = _InitJob(comm, bytes(uid), nranks, out)
        tls = self._tls
        if tls.depth:
            # Inside a group NCCL writes *newcomm at once but only queues the init as a job
            # of the group (ncclAsyncLaunch); it runs at the outermost ncclGroupEnd.
            if tls.blocking is None:
                tls.blocking = blocking
            elif tls.blocking != blocking:
                return self._group_error(
                    INVALID_ARGUMENT,
                    "Blocking and nonblocking communicators are not allowed in the same group.",
                )
            comm_out.value = comm.handle
            with self._lock:
                self._comms[comm.handle] = comm
            tls.inits.append(job)
            return SUCCESS
        code = self._join(job, comm_out)
        if code:
            return code
        if blocking:
            self._await_ready([comm])
            return SUCCESS
        return IN_PROGRESS if not self._ready(comm) else SUCCESS

    def _join(self, job: _InitJob, comm_out: Any = None) -> int:
        """Run an init: add its communicator to the world of its unique id (0, or the error).
        ``comm_out`` gets the handle, unless a group call wrote it already."""
        comm = job.comm
        with self._lock:
            world = self._worlds.get(job.key)
            if world is None:
                world = self._worlds[job.key] = _World(job.nranks, job.key[:4].hex())
        with world.cond:
            if world.nranks != job.nranks:
                return self._err(
                    INVALID_ARGUMENT, f"nranks {job.nranks} differs from the peers' {world.nranks}"
                )
            if comm.rank in world.comms:
                return self._err(INVALID_USAGE, f"rank {comm.rank} joined twice")
            comm.world = world
            comm.out = job.out
            if comm_out is not None:
                comm_out.value = comm.handle
            world.comms[comm.rank] = comm
            if world.ready:
                for c in world.comms.values():  # the init completes: its thread uses the pointer
                    if c.out is not None:
                        c.out.read()
                        c.out = None
            world.cond.notify_all()
        with self._lock:
            self._comms[comm.handle] = comm
            if world.ready:
                self._worlds.pop(job.key, None)  # a unique id makes one communicator
        return SUCCESS

    @staticmethod
    def _ready(comm: _Comm) -> bool:
        return comm.world is not None and comm.world.ready

    @staticmethod
    def _await_ready(comms: list[_Comm]) -> None:
        """A blocking init returns once its world is complete (or it was aborted)."""
        for comm in comms:
            world = comm.world
            if world is None:
                continue
            with world.cond:
                while not world.ready and not comm.aborted.is_set():
                    world.cond.wait(0.05)

    def _run_inits(self, inits: list[_InitJob], blocking: bool) -> int:
        """The inits of a group, at its outermost ncclGroupEnd (NCCL's groupLaunch: one job
        each, all of them awaited for blocking communicators; a failed one fails the group)."""
        for i, job in enumerate(inits):
            if job.comm.destroyed:
                continue
            code = self._join(job)
            if code:
                self._drop(inits[i:], code)
                return code
        if blocking:
            self._await_ready([job.comm for job in inits])
            return SUCCESS
        return IN_PROGRESS  # a non-blocking group: poll ncclCommGetAsyncError

    @staticmethod
    def _drop(inits: list[_InitJob], code: int) -> None:
        """A group that failed: its inits never run, and their communicators report the error
        (NCCL's groupCleanup sets it on each job's communicator)."""
        for job in inits:
            if job.comm.world is None:
                job.comm.async_error = code

    def ncclCommSplit(
        self, comm: Any, color: int, key: int, newcomm_out: ctypes.c_void_p, config: Any
    ) -> int:
        self.counts["ncclCommSplit"] += 1
        parent = self._comm(comm)
        if parent is None or parent.world is None:
            return self._err(INVALID_ARGUMENT, self._bad_comm("ncclCommSplit", comm))
        code = self._fault("ncclCommSplit", parent)
        if code:
            return code
        if parent.splitting or not parent.world.ready:
            return self._err(
                INVALID_ARGUMENT,
                "ncclCommSplit: Attempt to use communicator before the previous operation "
                "returned ncclSuccess",
            )
        # The child's mode: its config, else the parent's; the call's own mode: the parent's.
        child_blocking = _env_blocking(parent.blocking if config is None else config.blocking != 0)
        newcomm_out.value = None  # NULL until the split completed
        world = parent.world
        idx = parent.split_index
        parent.split_index += 1
        with world.cond:
            parent.splitting = True
            posts = world.splits.setdefault(idx, {})
            out = _Out(newcomm_out, "ncclCommSplit", self.stale_writes)
            posts[parent.rank] = _SplitPost(int(color), int(key), child_blocking, out)
            if len(posts) == world.nranks:
                del world.splits[idx]
                # NCCL's split job runs on a thread of its own, after the call returned.
                threading.Thread(
                    target=self._resolve_split,
                    args=(world, posts),
                    name=f"fake-nccl-split-{world.name}",
                    daemon=True,
                ).start()
        if not parent.blocking:
            return IN_PROGRESS
        with world.cond:
            while parent.splitting and not parent.aborted.is_set():
                world.cond.wait(0.05)
        return SUCCESS

    def _resolve_split(self, world: _World, posts: dict[int, _SplitPost]) -> None:
        time.sleep(0.002)  # the split takes a while: callers see ncclInProgress
        colors: dict[int, list[tuple[int, int]]] = {}
        for rank, post in posts.items():
            if post.color != _NOCOLOR:
                colors.setdefault(post.color, []).append((post.key, rank))
        with world.cond:
            handles: dict[int, int] = {}
            for color, members in colors.items():
                members.sort()
                new = _World(len(members), f"{world.name}/split{color}")
                for new_rank, (_key, rank) in enumerate(members):
                    parent = world.comms[rank]
                    child = _Comm(
                        next(self._handles), new, new_rank, parent.device, posts[rank].blocking
                    )
                    new.comms[new_rank] = child
                    handles[rank] = child.handle
                    with self._lock:
                        self._comms[child.handle] = child
            for rank, post in posts.items():
                post.out.write(handles.get(rank, 0))  # into the caller's pointer, late
                world.comms[rank].splitting = False
            world.cond.notify_all()

    def ncclCommFinalize(self, comm: Any) -> int:
        c, code = self._enter("ncclCommFinalize", comm)
        if c is None:
            return code
        c.finalizing = True
        if c.blocking:
            while c.inflight and not c.aborted.is_set():
                time.sleep(0.001)
            return SUCCESS
        return IN_PROGRESS if c.inflight else SUCCESS

    def ncclCommDestroy(self, comm: Any) -> int:
        c, code = self._enter("ncclCommDestroy", comm)
        if c is None:
            return code
        c.destroyed = True
        return SUCCESS

    def ncclCommAbort(self, comm: Any) -> int:
        c, code = self._enter("ncclCommAbort", comm, faults=False)  # an abort always works
        if c is None:
            return code
        c.aborted.set()
        c.destroyed = True
        if c.world is not None:
            with c.world.cond:
                c.world.cond.notify_all()
        return SUCCESS

    def ncclCommGetAsyncError(self, comm: Any, state: ctypes.c_int) -> int:
        c, code = self._enter("ncclCommGetAsyncError", comm)
        if c is None:
            return code
        if c.async_error not in (SUCCESS, IN_PROGRESS):
            state.value = c.async_error
        elif (
            c.world is None
            or not c.world.ready
            or c.splitting
            or (c.busy_until and time.monotonic() < c.busy_until)
            or (c.finalizing and c.inflight)
        ):
            state.value = IN_PROGRESS
        else:
            state.value = SUCCESS
        return SUCCESS

    def _query(self, name: str, comm: Any, out: ctypes.c_int, what: str) -> int:
        self.counts[name] += 1
        c = self._comm(comm)
        if c is None or c.world is None or not c.world.ready:
            return self._err(INVALID_ARGUMENT, f"{name}: invalid or unready communicator")
        out.value = {"count": c.world.nranks, "device": c.device, "rank": c.rank}[what]
        return SUCCESS

    def ncclCommCount(self, comm: Any, count: ctypes.c_int) -> int:
        return self._query("ncclCommCount", comm, count, "count")

    def ncclCommCuDevice(self, comm: Any, device: ctypes.c_int) -> int:
        return self._query("ncclCommCuDevice", comm, device, "device")

    def ncclCommUserRank(self, comm: Any, rank: ctypes.c_int) -> int:
        return self._query("ncclCommUserRank", comm, rank, "rank")

    # ------------------------------------------------------------------ operations
    def ncclAllReduce(
        self, send: int, recv: int, count: int, dtype: int, op: int, comm: Any, stream: Any
    ) -> int:
        return self._submit(
            "AllReduce", comm, stream, _Op("AllReduce", send, recv, count, dtype, op)
        )

    def ncclBroadcast(
        self, send: int, recv: int, count: int, dtype: int, root: int, comm: Any, stream: Any
    ) -> int:
        return self._submit(
            "Broadcast", comm, stream, _Op("Broadcast", send, recv, count, dtype, root=root)
        )

    def ncclReduce(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: int,
        op: int,
        root: int,
        comm: Any,
        stream: Any,
    ) -> int:
        return self._submit(
            "Reduce", comm, stream, _Op("Reduce", send, recv, count, dtype, op, root=root)
        )

    def ncclAllGather(
        self, send: int, recv: int, sendcount: int, dtype: int, comm: Any, stream: Any
    ) -> int:
        return self._submit(
            "AllGather", comm, stream, _Op("AllGather", send, recv, sendcount, dtype)
        )

    def ncclReduceScatter(
        self, send: int, recv: int, recvcount: int, dtype: int, op: int, comm: Any, stream: Any
    ) -> int:
        return self._submit(
            "ReduceScatter", comm, stream, _Op("ReduceScatter", send, recv, recvcount, dtype, op)
        )

    def ncclSend(self, buf: int, count: int, dtype: int, peer: int, comm: Any, stream: Any) -> int:
        return self._submit("Send", comm, stream, _Op("Send", buf, 0, count, dtype, peer=peer))

    def ncclRecv(self, buf: int, count: int, dtype: int, peer: int, comm: Any, stream: Any) -> int:
        return self._submit("Recv", comm, stream, _Op("Recv", 0, buf, count, dtype, peer=peer))

    def ncclGroupStart(self) -> int:
        self.counts["ncclGroupStart"] += 1
        code = self._fault("ncclGroupStart")
        if code:
            return code
        self._tls.depth += 1
        return SUCCESS

    def ncclGroupEnd(self) -> int:
        self.counts["ncclGroupEnd"] += 1
        tls = self._tls
        if tls.depth == 0:
            return self._err(INVALID_USAGE, "ncclGroupEnd without ncclGroupStart")
        tls.depth -= 1
        if tls.depth:
            return SUCCESS
        pending, tls.pending = tls.pending, []
        inits, tls.inits = tls.inits, []
        blocking, tls.blocking = tls.blocking, None
        error, tls.error = tls.error, SUCCESS
        code = self._fault("ncclGroupEnd")
        if error or code:
            self._drop(inits, error or code)
            return error or code  # NCCL drops the whole group on an error inside it
        if inits:
            # The inits run first (NCCL's groupLaunch: asyncJobLaunch, then the collectives).
            code = self._run_inits(inits, blocking is not False)
            if code not in (SUCCESS, IN_PROGRESS):
                return code
            if pending:
                launched = self._launch(pending)
                return code or launched
            return code
        return self._launch(pending)

    # ------------------------------------------------------------------ plumbing
    def _submit(self, kind: str, comm: Any, stream: Any, op: _Op) -> int:
        name = "nccl" + kind
        self.counts[name] += 1
        c = self._comm(comm)
        if c is None:
            return self._group_error(INVALID_ARGUMENT, f"{name}: invalid communicator {comm!r}")
        code = self._fault(name, c)
        if code:
            return self._group_error(code, self._last_error)
        problem = self._check(c, op)
        if problem:
            return self._group_error(INVALID_ARGUMENT, f"{name}: {problem}")
        try:
            s = fake_cupy._stream_for(stream)
        except fake_cupy.CUDARuntimeError as exc:
            return self._group_error(INVALID_ARGUMENT, f"{name}: {exc}")
        if self.trace is not None:
            self.trace.append((name, c.rank, op))
        if self._tls.depth:
            self._tls.pending.append((c, s, op))
            return SUCCESS
        return self._launch([(c, s, op)])

    def _group_error(self, code: int, message: str) -> int:
        self._last_error = message
        if self._tls.depth and not self._tls.error:
            self._tls.error = code
        return code

    def _check(self, c: _Comm, op: _Op) -> str:
        if c.world is None or not c.world.ready or c.splitting:
            return (
                "Attempt to use communicator before the previous operation returned "
                "ncclSuccess (it is still initializing or splitting)"
            )
        if c.aborted.is_set():
            return "the communicator was aborted"
        if c.async_error not in (SUCCESS, IN_PROGRESS):
            return f"the communicator has an asynchronous error ({c.async_error})"
        if op.dtype not in _NP_DTYPES:
            return f"datatype {op.dtype} is not supported (the fake has no bfloat16/float8)"
        if op.count < 0:
            return f"negative count {op.count}"
        if op.kind in ("AllReduce", "Reduce", "ReduceScatter") and op.op not in _UFUNCS:
            return f"invalid reduction op {op.op}"
        n = c.world.nranks
        if op.kind in ("Broadcast", "Reduce") and not 0 <= op.root < n:
            return f"root {op.root} out of range for {n} ranks"
        if op.kind in ("Send", "Recv") and not 0 <= op.peer < n:
            return f"peer {op.peer} out of range for {n} ranks"
        if op.count > 0:
            needs_send = op.kind != "Recv"
            needs_recv = op.kind not in ("Send",) and not (
                op.kind == "Reduce" and c.rank != op.root
            )
            if (needs_send and not op.send) or (needs_recv and not op.recv):
                return "null buffer pointer"
        return ""

    def _launch(self, items: list[tuple[_Comm, fake_cupy.Stream, _Op]]) -> int:
        by_comm: dict[int, tuple[_Comm, fake_cupy.Stream, list[_Op]]] = {}
        for c, s, op in items:
            by_comm.setdefault(c.handle, (c, s, []))[2].append(op)
        busy = False
        # The fake's null stream runs work at once, in the calling thread. One thread's group
        # over several ranks on it would wait there for itself, where on GPUs each device's
        # default stream runs its rank's part: those run side by side, and the call returns
        # when all have (the host waited for the null stream, as it does for eager kernels).
        eager = sum(1 for _c, s, _o in by_comm.values() if s._is_null) > 1
        side: list[threading.Thread] = []
        for c, s, ops in by_comm.values():
            c.inflight += 1

            def run(c: _Comm = c, ops: list[_Op] = ops) -> None:
                try:
                    self._execute(c, ops)
                finally:
                    c.inflight -= 1

            if eager and s._is_null:
                side.append(threading.Thread(target=run, name="fake-nccl-null-stream", daemon=True))
                side[-1].start()
            else:
                s._enqueue(run)
            if not c.blocking and self.in_progress_ops:
                c.busy_until = time.monotonic() + self.in_progress_ops
                busy = True
        for t in side:
            t.join()
        return IN_PROGRESS if busy else SUCCESS

    def _execute(self, c: _Comm, ops: list[_Op]) -> None:
        """Run one group of one communicator (on its stream's thread)."""
        world = c.world
        if world is None or c.aborted.is_set():
            return
        for op in ops:  # eager sends first: a group's receives may need them
            if op.kind == "Send":
                data = bytes(_view(op.send, op.count, op.dtype).view(np.uint8))
                with world.cond:
                    world.mail.setdefault((c.rank, op.peer), deque()).append(
                        (op.dtype, op.count, data)
                    )
                    world.cond.notify_all()
        for op in ops:
            if op.kind not in ("Send", "Recv"):
                self._collective(c, world, op)
        for op in ops:
            if op.kind == "Recv":
                self._receive(c, world, op)

    def _wait(self, c: _Comm, world: _World, ready: Any) -> bool:
        """Wait (holding ``world.cond``) until ``ready()``; False once ``c`` is aborted."""
        while not ready():
            if c.aborted.is_set():
                return False
            world.cond.wait(0.05)
        return not c.aborted.is_set()

    def _hang(self, c: _Comm, world: _World) -> None:
        """What NCCL may do on mismatched calls: wait forever (until aborted)."""
        with world.cond:
            self._wait(c, world, lambda: False)

    def _collective(self, c: _Comm, world: _World, op: _Op) -> None:
        n = world.nranks
        with world.cond:
            idx = c.coll_index
            c.coll_index += 1
            slot = world.slots.setdefault(idx, _Slot())
            slot.ops[c.rank] = op
            world.cond.notify_all()
            if not self._wait(c, world, lambda: len(slot.ops) == n):
                return
        ops = [slot.ops[r] for r in range(n)]
        if any(o.key() != ops[0].key() for o in ops):
            self._hang(c, world)
            return
        result = self._compute(c.rank, n, op, ops)
        with world.cond:
            slot.read += 1
            world.cond.notify_all()
            # Nobody writes before everyone read: in-place calls overwrite their inputs.
            if not self._wait(c, world, lambda: slot.read == n):
                return
        if result is not None and result.size:
            out_count = result.size
            np.copyto(_view(op.recv, out_count, op.dtype), result)
        with world.cond:
            slot.written += 1
            if slot.written == n:
                world.slots.pop(idx, None)

    @staticmethod
    def _reduce(arrays: list[np.ndarray[Any, Any]], op: int) -> np.ndarray[Any, Any]:
        uf = _UFUNCS[op]
        out = arrays[0].copy()
        with np.errstate(all="ignore"):
            for a in arrays[1:]:
                uf(out, a, out=out)
            if op == 4:  # avg
                n = len(arrays)
                if out.dtype.kind == "f":
                    out = (out / n).astype(out.dtype)
                else:
                    # NCCL's FuncSumPostDiv divides the magnitude: the quotient is truncated
                    # toward zero (-7 / 2 is -3), where NumPy's // floors.
                    rest = out % n
                    out //= n
                    out += ((rest != 0) & (out < 0)).astype(out.dtype)
        return out

    def _compute(self, rank: int, n: int, op: _Op, ops: list[_Op]) -> np.ndarray[Any, Any] | None:
        k, dt = op.count, op.dtype
        if op.kind == "AllReduce":
            return self._reduce([_view(o.send, k, dt) for o in ops], op.op)
        if op.kind == "Broadcast":
            return _view(ops[op.root].send, k, dt).copy()
        if op.kind == "Reduce":
            if rank != op.root:
                return None  # NCCL writes only the root's buffer
            return self._reduce([_view(o.send, k, dt) for o in ops], op.op)
        if op.kind == "AllGather":
            return np.concatenate([_view(o.send, k, dt) for o in ops])
        if op.kind == "ReduceScatter":
            blocks = [_view(o.send, n * k, dt)[rank * k : (rank + 1) * k] for o in ops]
            return self._reduce(blocks, op.op)
        raise AssertionError(f"fake nccl: unknown collective {op.kind}")

    def _receive(self, c: _Comm, world: _World, op: _Op) -> None:
        key = (op.peer, c.rank)
        with world.cond:
            if not self._wait(c, world, lambda: bool(world.mail.get(key))):
                return
            dtype, count, data = world.mail[key].popleft()
        if (dtype, count) != (op.dtype, op.count):
            self._hang(c, world)  # a send and a receive that do not match
            return
        if count:
            dst = _view(op.recv, count, dtype).view(np.uint8)
            dst[...] = np.frombuffer(data, dtype=np.uint8)


def _env_blocking(blocking: bool) -> bool:
    """NCCL_COMM_BLOCKING=0|1 overrides the config's mode (NCCL's envConfigOverride)."""
    env = os.environ.get("NCCL_COMM_BLOCKING", "").strip()
    return {"0": False, "1": True}.get(env, blocking)


def _current_device() -> int:
    cupy = sys.modules.get("cupy")
    try:
        return int(cupy.cuda.runtime.getDevice()) if cupy is not None else 0
    except Exception:
        return 0


def install(version: int = 23203) -> tuple[FakeNccl, Any]:
    """Put a fresh fake in place of the process's NCCL; returns it and the replaced one."""
    from collectives.backends.nccl import _lib as _nccl_lib
    from collectives.backends.nccl import _load as _nccl_load

    fake = FakeNccl(version)
    previous = _nccl_load.install(_nccl_lib.Nccl(fake, version, "fake libnccl (tests/fakes)"))
    return fake, previous
