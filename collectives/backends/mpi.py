"""The ``mpi`` backend: every collective over mpi4py, for CPU jobs that span several hosts.

Processes are started by ``mpiexec``/``mpirun`` (Open MPI or MPICH); ``init_process_group("mpi")``
takes rank and size from MPI itself and needs no store. Each group owns a duplicate of its
MPI communicator (``COMM_WORLD.Dup()``, ``Split`` for ``new_group``), so user MPI traffic
never meets ours.

Every call is a non-blocking MPI operation (``Iallreduce``, ``Ibcast``, ``Iallgather``...) that
the group's executor polls with ``Test`` until it completes or the group's timeout passes:
blocking calls run in the caller's thread, ``async_op=True`` calls on the group's
communication thread, which keeps polling (and so progressing) them while the caller computes.
Before the data moves, ranks exchange a 128-byte signature record (op, dtype, shape, root,
reduce op) so that mismatched calls fail on every rank instead of corrupting data; with up to
``DPT_MPI_P2P_CHECK_MAX`` ranks (default 32) the records travel point to point, which lets a
timeout name the ranks that never arrived. ``DPT_MPI_CHECK=0`` turns the check off.

MPI cannot cancel a collective: after a timeout the group is unusable and, because its
operations are still pending inside MPI, the process calls ``MPI_Abort`` when it exits (an
uncaught exception too), which makes ``mpiexec`` end every rank instead of leaving them to hang.
A rank killed by a signal makes ``mpiexec`` end the job the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import sys
import threading
import time
import zlib
from typing import Any

import numpy as np

from .._backend import P2P_OPS, Backend, GroupInfo, Request
from .._errors import CollectiveMismatchError, CollectiveTimeoutError, collective_error, where
from .._exit import on_uncaught
from .._registry import register_backend
from .._signature import (
    SIG_WORDS,
    Signature,
    describe_record,
    mismatch_text,
    record,
    record_nbytes,
    same_p2p_call,
)
from .._types import ReduceOp

__all__ = ["MpiBackend", "mpi_world"]

_TAG_SIG = 1  # signature records of collectives
_TAG_HDR = 2  # the record that goes ahead of a send
_TAG_DATA = 3  # a send's payload
_SPIN = 200  # Test() calls before polling starts to yield the CPU between calls
_CHECK_EVERY = 64  # Test() calls between deadline checks

_DEFAULT_ENGINE = "blocking"  # 1.7-3x faster than libnbc's non-blocking collectives (Open MPI 5)
_INSTALL_HINT = "pip install '.[mpi]' (mpi4py and Open MPI), or an MPI library and mpi4py"


def _flag(name: str, default: str = "1") -> bool:
    return os.environ.get(name, default).strip().lower() not in ("0", "false", "no")


def _p2p_check_max() -> int:
    try:
        return int(os.environ.get("DPT_MPI_P2P_CHECK_MAX", "32"))
    except ValueError:
        return 32


def _mpi() -> Any:
    """mpi4py's ``MPI`` module (importing it initializes MPI with MPI_THREAD_MULTIPLE)."""
    try:
        from mpi4py import MPI
    except Exception as exc:  # ImportError, or RuntimeError when libmpi cannot be loaded
        raise RuntimeError(
            f"backend 'mpi' could not load mpi4py/MPI ({type(exc).__name__}: {exc}); "
            f"{_INSTALL_HINT}"
        ) from exc
    return MPI


def _probe() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed ({_INSTALL_HINT})"
    return None


_world_view: tuple[int, int, int, int] | None = None


def mpi_world() -> tuple[int, int, int, int]:
    """This process's ``(rank, size, local_rank, local_size)`` in ``MPI.COMM_WORLD``.

    The first call initializes MPI and splits the world by shared-memory node (a collective
    over every process ``mpiexec`` started, which all call ``init_process_group``).
    """
    global _world_view
    if _world_view is None:
        MPI = _mpi()
        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        try:
            _world_view = (world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size())
        finally:
            node.Free()
        _install_exit_hooks(world.Get_size())
    return _world_view


# ---------------------------------------------------------------------------- exit handling
_LIVE: set[MpiBackend] = set()
_hooks_installed = False


def _install_exit_hooks(size: int) -> None:
    """Abort the MPI job when this process ends with MPI operations it cannot finish."""
    global _hooks_installed
    if _hooks_installed or size == 1:
        return
    _hooks_installed = True
    # After the traceback is printed, end the job: the other ranks would otherwise wait for
    # this one inside their next collective (until their timeout, or forever in MPI_Finalize).
    on_uncaught(_abort_uncaught, after_print=True)
    atexit.register(_abort_if_stuck)


def _abort_uncaught(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    _abort(f"uncaught {tp.__name__}: {value}")


def _abort_if_stuck() -> None:
    stuck = [b for b in list(_LIVE) if b.stuck]
    if stuck:
        b = stuck[0]
        _abort(f"{b.info.describe()} failed with operations pending inside MPI: {b.error}")


def _abort(why: str) -> None:
    """``MPI_Abort`` on COMM_WORLD (ends every rank of the job) after saying why."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    rank = MPI.COMM_WORLD.Get_rank()
    with contextlib.suppress(Exception):
        sys.stderr.write(f"[rank {rank}] collectives: calling MPI_Abort: {why}\n")
        sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


# ---------------------------------------------------------------------------- the backend
class MpiBackend(Backend):
    """One group's MPI communicator and the engine that runs its calls.

    Args:
        info: the group.
        comm: its communicator when built by :meth:`split`; else the world's duplicate (the
            default group) or ``Create_group`` over ``info.ranks`` (a group of another
            backend's job that mpiexec started).
    """

    name = "mpi"

    def __init__(self, info: GroupInfo, comm: Any = None) -> None:
        MPI = _mpi()
        if comm is None:
            comm = _make_comm(MPI, info)
        super().__init__(info)
        self.MPI = MPI
        self.comm = comm
        self.size = info.size
        self.rank = info.rank  # in the group
        self.check = _flag("DPT_MPI_CHECK") and self.size > 1
        self.p2p_check = self.size <= _p2p_check_max()
        engine = os.environ.get("DPT_MPI_ENGINE", _DEFAULT_ENGINE).strip().lower()
        if engine not in ("blocking", "nonblocking"):
            raise ValueError(f"DPT_MPI_ENGINE must be 'blocking' or 'nonblocking', got {engine!r}")
        self.blocking = engine == "blocking"
        self._watched: Request | None = None
        self._watchdog: threading.Thread | None = None
        self.stuck: list[Any] = []  # (requests, buffers) MPI still owns after a failure
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.AVG: MPI.SUM,
            ReduceOp.PROD: MPI.PROD,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
        }
        # Without MPI_THREAD_MULTIPLE only one thread may be inside MPI at a time.
        multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._mpi_lock: Any = contextlib.nullcontext() if multiple else _GLOBAL_LOCK
        _LIVE.add(self)

    # ------------------------------------------------------------------ engine
    def run(self, req: Request) -> None:
        if self.check and req.op not in P2P_OPS:
            self._check(req)  # a send's record travels with it (see _do_send)
        super().run(req)

    def _complete(self, reqs: list[Any], req: Request, what: str, keep: Any = None) -> None:
        """Poll ``reqs`` with Test until all completed; past the deadline, fail the group.

        Spins first (a small collective completes in microseconds), then yields the CPU
        between polls so that computing threads get it; every poll progresses MPI.
        """
        testall = self.MPI.Request.Testall
        lock = self._mpi_lock
        polls = 0
        while True:
            with lock:
                if testall(reqs):
                    return
            polls += 1
            if polls > _SPIN:
                os.sched_yield()
            if polls % _CHECK_EVERY == 0 and time.monotonic() > req.deadline:
                self.stuck.append((reqs, keep, req))
                raise self._timeout(req, what, reqs)

    def _timeout(self, req: Request, what: str, reqs: list[Any]) -> CollectiveTimeoutError:
        if what == "new_group":
            detail = "some rank of the group did not call new_group"
        elif req.op in ("send", "recv"):
            peer = self.info.ranks[req.peer]
            detail = f"rank {peer} never matched it"
        elif what == "signature" and self.p2p_check:
            # reqs = the n-1 record sends, then the n-1 record receives (peer order).
            missing = []
            for i, r in enumerate(reqs[self.size - 1 :]):
                peer = i if i < self.rank else i + 1
                with self._mpi_lock:
                    if not r.Test():
                        missing.append(self.info.ranks[peer])
            detail = (
                f"ranks {missing} never arrived"
                if missing
                else "every rank arrived, then a peer stopped answering"
            )
        elif what == "signature":
            detail = (
                "some rank never arrived (with more than DPT_MPI_P2P_CHECK_MAX ranks MPI "
                "cannot say which)"
            )
        elif self.check:
            detail = "every rank arrived, but the data transfer did not finish"
        else:
            detail = (
                "a rank did not call it, or the transfer stalled (DPT_MPI_CHECK=0: without the "
                "signature exchange MPI cannot say which)"
            )
        return self.info.error(
            CollectiveTimeoutError,
            req.op,
            req.seq,
            f"timed out after {self.info.timeout:g} s; {detail}. MPI cannot cancel the call: "
            "this group is unusable, and the job is aborted (MPI_Abort) when this process exits",
        )

    def _check(self, req: Request) -> None:
        """Exchange signature records; raise CollectiveMismatchError on every rank if they
        differ (before any data moved)."""
        mine = record(req.signature, req.seq)
        records = np.empty((self.size, SIG_WORDS), dtype=np.int64)
        records[self.rank] = mine
        comm = self.comm
        with self._mpi_lock:
            if self.p2p_check:
                peers = [p for p in range(self.size) if p != self.rank]
                reqs = [comm.Isend(mine, dest=p, tag=_TAG_SIG) for p in peers]
                reqs += [comm.Irecv(records[p], source=p, tag=_TAG_SIG) for p in peers]
            else:
                reqs = [comm.Iallgather(mine, records)]
        self._complete(reqs, req, "signature", keep=(mine, records))
        text = mismatch_text(records, self.info.ranks)
        if text is not None:
            raise self.info.error(
                CollectiveMismatchError,
                req.op,
                req.seq,
                f"ranks issued different collectives at the same point: {text} (no data was moved)",
            )

    def _op(self, req: Request) -> Any:
        assert req.reduce_op is not None  # the group validated it for every reducing op
        return self._ops[req.reduce_op]

    def _average(self, req: Request, arr: np.ndarray[Any, Any]) -> None:
        if req.reduce_op is ReduceOp.AVG:
            np.divide(arr, self.size, out=arr, casting="unsafe")

    # ------------------------------------------------------------------ collectives
    def _transfer(self, req: Request, keep: Any, blocking: Any, nonblocking: Any) -> None:
        """Move the data: a blocking MPI call under the watchdog (``blocking`` engine), or
        the non-blocking one polled under the deadline."""
        if self.blocking:
            self._watch(req)
            try:
                with self._mpi_lock:
                    blocking(self.comm)
            finally:
                self._watched = None
            return
        with self._mpi_lock:
            r = nonblocking(self.comm)
        self._complete([r], req, "data", keep=keep)

    def _do_all_reduce(self, req: Request) -> None:
        arr, op, IN_PLACE = req.array, self._op(req), self.MPI.IN_PLACE
        self._transfer(
            req,
            arr,
            lambda c: c.Allreduce(IN_PLACE, arr, op=op),
            lambda c: c.Iallreduce(IN_PLACE, arr, op=op),
        )
        self._average(req, arr)

    def _do_broadcast(self, req: Request) -> None:
        buf, root = _bytes(req.array), req.root
        self._transfer(
            req, buf, lambda c: c.Bcast(buf, root=root), lambda c: c.Ibcast(buf, root=root)
        )

    def _do_reduce(self, req: Request) -> None:
        arr, op, root = req.array, self._op(req), req.root
        if self.rank == root:
            src, dst = self.MPI.IN_PLACE, arr
        else:
            src, dst = arr, None
        self._transfer(
            req,
            arr,
            lambda c: c.Reduce(src, dst, op=op, root=root),
            lambda c: c.Ireduce(src, dst, op=op, root=root),
        )
        if self.rank == root:
            self._average(req, arr)

    def _do_all_gather(self, req: Request) -> None:
        a, o = _bytes(req.array), _bytes(req.out)
        self._transfer(req, (a, o), lambda c: c.Allgather(a, o), lambda c: c.Iallgather(a, o))

    def _do_reduce_scatter(self, req: Request) -> None:
        a, o, op = req.array, req.out, self._op(req)
        self._transfer(
            req,
            (a, o),
            lambda c: c.Reduce_scatter_block(a, o, op=op),
            lambda c: c.Ireduce_scatter_block(a, o, op=op),
        )
        self._average(req, o)

    def _do_all_to_all(self, req: Request) -> None:
        a, o = _bytes(req.array), _bytes(req.out)
        self._transfer(req, (a, o), lambda c: c.Alltoall(a, o), lambda c: c.Ialltoall(a, o))

    def _do_barrier(self, req: Request) -> None:
        self._transfer(req, None, lambda c: c.Barrier(), lambda c: c.Ibarrier())

    # ------------------------------------------------------------------ watchdog
    def _watch(self, req: Request) -> None:
        """Guard a blocking MPI call: past its deadline the watchdog aborts the job (a
        blocking call cannot be interrupted; the signature check before it already turned a
        rank that never arrived into an exception)."""
        self._watched = req
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch_loop,
                name=f"collectives-mpi-watchdog-{self.info.name}",
                daemon=True,
            )
            self._watchdog.start()

    def _watch_loop(self) -> None:
        while self.comm is not None:
            req = self._watched
            if req is not None and time.monotonic() > req.deadline and self._watched is req:
                _abort(
                    f"{self.info.where(req.op, req.seq)}: the MPI call did not finish within the "
                    f"group's timeout of {self.info.timeout:g} s (every rank had arrived; a "
                    "peer is stuck or its host is unreachable)"
                )
                return
            time.sleep(0.05)

    # ------------------------------------------------------------------ point to point
    def _do_send(self, req: Request) -> None:
        """A send goes as its signature record, then its payload (see :meth:`_do_recv`)."""
        comm, peer = self.comm, req.peer
        rec = record(req.signature, req.seq)
        with self._mpi_lock:
            reqs = [
                comm.Isend(rec, dest=peer, tag=_TAG_HDR),
                comm.Isend(_bytes(req.array), dest=peer, tag=_TAG_DATA),
            ]
        self._complete(reqs, req, "data", keep=(rec, req.array))

    def _do_recv(self, req: Request) -> None:
        """The receiver checks the sender's record before posting the payload's receive (a
        mismatch drains the payload into a scratch buffer, so the sender is not left waiting,
        and fails the receive)."""
        comm, peer = self.comm, req.peer
        mine = record(req.signature, req.seq)
        theirs = np.empty(SIG_WORDS, dtype=np.int64)
        with self._mpi_lock:
            r = comm.Irecv(theirs, source=peer, tag=_TAG_HDR)
        self._complete([r], req, "data", keep=theirs)
        if not same_p2p_call(theirs, mine):
            nbytes = record_nbytes(theirs)
            if nbytes >= 0:
                scratch = np.empty(nbytes, dtype=np.uint8)
                with self._mpi_lock:
                    r = comm.Irecv(scratch, source=peer, tag=_TAG_DATA)
                self._complete([r], req, "data", keep=scratch)
            raise self.info.error(
                CollectiveMismatchError,
                req.op,
                req.seq,
                f"rank {self.info.ranks[peer]} sent {describe_record(theirs)} but this rank "
                f"expects {describe_record(mine)} (nothing was written)",
            )
        with self._mpi_lock:
            r = comm.Irecv(_bytes(req.array), source=peer, tag=_TAG_DATA)
        self._complete([r], req, "data", keep=req.array)

    # ------------------------------------------------------------------ groups, lifecycle
    def split(self, info: GroupInfo | None) -> Backend | None:
        """``new_group`` from this group: every rank meets at a barrier under the timeout
        (so a rank that never calls ``new_group`` is a clear error, not a hang), then
        ``Comm.Split`` (members: color 0, ordered by their rank in the new group)."""
        MPI = self.MPI
        me = self.info.global_rank
        if not self.drain(self.info.timeout):
            raise collective_error(
                CollectiveTimeoutError,
                f"this group's earlier calls did not finish within {self.info.timeout:g} s",
                rank=me,
                op="new_group",
            )
        self.check_usable("new_group", None)
        # Every rank must agree on the members: compare a digest, under the timeout.
        digest = np.array(
            [zlib.crc32(repr(info.ranks if info else None).encode()), 1 if info else 0],
            dtype=np.int64,
        )
        seen = np.empty((self.size, 2), dtype=np.int64)
        req = Request("new_group", 0, Signature("new_group", None, ()))
        req.deadline = time.monotonic() + self.info.timeout
        with self._mpi_lock:
            r = self.comm.Iallgather(digest, seen)
        try:
            self._complete([r], req, "new_group", keep=(digest, seen))
        except CollectiveTimeoutError as exc:
            self.abort(exc)
            raise
        members = [int(seen[i, 1]) for i in range(self.size)]
        member_digests = {int(seen[i, 0]) for i in range(self.size) if members[i]}
        if len(member_digests) > 1:
            raise ValueError(
                f"{where(me, 'new_group')}: the ranks disagree on the new group's members "
                "(every rank must pass the same ranks, in the same order)"
            )
        color = 0 if info is not None else MPI.UNDEFINED
        with self._mpi_lock:
            comm = self.comm.Split(color, info.rank if info is not None else 0)
        if info is None:
            return None
        return MpiBackend(info, comm)

    def close(self) -> None:
        super().close()
        if not self.stuck:
            _LIVE.discard(self)  # a stuck group still makes the process abort at exit
        comm, self.comm = self.comm, None
        if comm is not None and not self.stuck and self.error is None:
            MPI = self.MPI
            if not MPI.Is_finalized():
                with contextlib.suppress(Exception), self._mpi_lock:
                    comm.Free()


_GLOBAL_LOCK = threading.RLock()


def _bytes(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The array's memory as bytes (moves any dtype, bool included, without MPI types)."""
    return arr.reshape(-1).view(np.uint8)


def _make_comm(MPI: Any, info: GroupInfo) -> Any:
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    if info.name == "world":
        if (size, rank) != (info.size, info.rank):
            raise RuntimeError(
                f"backend 'mpi': this process is rank {info.rank} of {info.size} but MPI "
                f"started it as rank {rank} of {size}; start the job with mpiexec"
            )
        return world.Dup()
    # A new group of a job whose default group uses another backend: its global ranks must be
    # MPI's ranks (the job was started by mpiexec).
    if rank != info.global_rank or max(info.ranks) >= size:
        raise RuntimeError(
            f"backend 'mpi': cannot build {info.describe()}: this process is global rank "
            f"{info.global_rank} but MPI rank {rank} of {size} (start the job with mpiexec)"
        )
    group = world.Get_group().Incl(list(info.ranks))
    try:
        tag = zlib.crc32(info.name.encode()) % 32768
        return world.Create_group(group, tag)
    finally:
        group.Free()


register_backend(
    "mpi",
    MpiBackend,
    probe=_probe,
    description="MPI through mpi4py (Open MPI or MPICH): CPU jobs started by mpiexec, one or "
    "many hosts (CuPy staged through the host)",
    world=mpi_world,
)
