"""``ProcessGroup``: argument checks, sequence numbers and dispatch, shared by every backend.

Every collective is checked locally first (array type, dtype, contiguity, writability, shape
constraints, ranks) with an error that names the rank, op and sequence number; then it gets the
group's next sequence number and a :class:`~collectives._types.Signature` that the engine
compares across ranks before any data moves.

Ranks given to ``broadcast(src=)``, ``reduce(dst=)``, ``send(dst=)`` and ``recv(src=)`` are
global ranks (as in ``torch.distributed``), for the default group and subgroups alike.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tensorlib import Tensor, from_array

from ._backend import P2P_OPS, Backend, GroupInfo, Request
from ._errors import where
from ._signature import Signature
from ._types import DTYPE_CODES, SUPPORTED_NAMES, ReduceOp

__all__ = ["NonMemberGroup", "ProcessGroup"]

_MAX_OBJECT_BYTES = 64 << 20
_get_ident = threading.get_ident  # the owner check on every call: one C call and a compare
_REDUCIBLE_KINDS = "iuf"
_CHECKED_MAX = 1024  # (dtype, shape, op) combinations remembered as checked, per group


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


class _Arg:
    """One array argument: the user's object, the array the engine sees, how to map back."""

    __slots__ = ("array", "kind", "staged", "user")

    def __init__(self, user: Any, array: Any, kind: str, staged: bool) -> None:
        self.user = user
        self.array = array  # what the engine reads/writes (host copy when staged)
        self.kind = kind  # "numpy", "cupy" or "tensor"
        self.staged = staged  # a CuPy array copied to the host for an engine without GPU support


class ProcessGroup:
    """A set of ranks that run collectives together.

    Get one from :func:`collectives.init_process_group` (the default group) or
    :func:`collectives.new_group`. Methods mirror the module-level functions.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.info: GroupInfo = backend.info
        self._seq = 0
        self._p2p: dict[tuple[str, int], int] = {}
        # (dtype, shape, op) of host arrays that passed all_reduce's checks -> its signature.
        self._checked: dict[tuple[Any, tuple[int, ...], Any], Signature] = {}
        # The last hit or entry of _checked: (dtype, shape, op, signature).
        self._last_checked: tuple[Any, tuple[int, ...], Any, Signature | None] = (
            None,
            (),
            None,
            None,
        )
        self._lock = threading.RLock()
        # The one thread that issues this group's calls (see _not_owner): the creator, or
        # the thread given the group with bind_thread(). Checked by ident, first thing.
        self._owner_thread: threading.Thread = threading.current_thread()
        self._owner = _get_ident()

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self.info.rank

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return self.info.size

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global rank of each member, in group-rank order."""
        return self.info.ranks

    @property
    def name(self) -> str:
        """The group's name (the same on every member)."""
        return self.info.name

    @property
    def backend_name(self) -> str:
        """Name of the backend serving the group."""
        return self.backend.name

    @property
    def accepts_device_arrays(self) -> bool:
        """True when the backend takes CuPy arrays as they are (nccl, serial); False when the
        group stages them through host memory for it (cpu, mpi)."""
        return bool(self.backend.accepts_device_arrays)

    @property
    def seq(self) -> int:
        """Number of collectives issued on this group so far."""
        return self._seq

    def is_member(self) -> bool:
        """True: this process belongs to the group."""
        return True

    def __repr__(self) -> str:
        return (
            f"<ProcessGroup {self.name!r} backend={self.backend.name} rank={self.rank} "
            f"size={self.size} ranks={list(self.ranks)}>"
        )

    # ------------------------------------------------------------------ helpers
    def _where(self, op: str, seq: int | None = None) -> str:
        """Head of a refusal: the call's number is the one it would have got."""
        return where(self.info.global_rank, op, self._seq + 1 if seq is None else seq)

    def _arg(self, op: str, x: Any, what: str = "input", writable: bool = False) -> _Arg:
        if isinstance(x, Tensor):
            arr, kind = x.data, "tensor"
        elif isinstance(x, np.ndarray):
            arr, kind = x, "numpy"
        elif _is_cupy(x):
            arr, kind = x, "cupy"
        elif isinstance(x, self.backend.array_types):
            arr, kind = x, "engine"  # an engine's own arrays (e.g. remote devices'), as they are
        else:
            raise TypeError(
                f"{self._where(op)}: {what} must be a NumPy array, CuPy array or tensorlib "
                f"Tensor, got {type(x).__name__}"
            )
        if arr.dtype not in DTYPE_CODES:
            raise TypeError(
                f"{self._where(op)}: {what} has unsupported dtype {arr.dtype}; "
                f"supported: {SUPPORTED_NAMES}"
            )
        if not arr.flags.c_contiguous:
            raise ValueError(
                f"{self._where(op)}: {what} of shape {tuple(arr.shape)} is not C-contiguous; "
                "pass a contiguous array (e.g. np.ascontiguousarray) and copy the result back"
            )
        if writable and isinstance(arr, np.ndarray) and not arr.flags.writeable:
            raise ValueError(f"{self._where(op)}: {what} is read-only but {op} writes into it")
        is_dev = _is_cupy(arr)
        staged = is_dev and not self.backend.accepts_device_arrays
        if staged:
            arr = arr.get()  # the cpu/mpi engines work on host memory; copy back after
        elif is_dev:
            problem = self.backend.device_problem(arr)
            if problem is not None:
                raise ValueError(f"{self._where(op)}: {what} {problem}")
        return _Arg(x, arr, kind, staged)

    def _group_rank(self, op: str, global_rank: int, what: str) -> int:
        if isinstance(global_rank, bool) or not isinstance(global_rank, int | np.integer):
            raise TypeError(f"{self._where(op)}: {what} must be an int rank, got {global_rank!r}")
        try:
            return self.info.ranks.index(int(global_rank))
        except ValueError:
            raise ValueError(
                f"{self._where(op)}: {what}={global_rank} is not a member of "
                f"{self.info.describe()} (members: {list(self.info.ranks)})"
            ) from None

    def _reduce_op(self, op: str, reduce_op: Any, arr: Any) -> ReduceOp:
        given = reduce_op  # for the message: the lookup below replaces unknown names by None
        if isinstance(reduce_op, str):
            try:
                reduce_op = ReduceOp[reduce_op.upper()]
            except KeyError:
                reduce_op = None
        if not isinstance(reduce_op, ReduceOp):
            raise ValueError(
                f"{self._where(op)}: op must be a ReduceOp (SUM, PROD, MIN, MAX, AVG), "
                f"got {given!r}"
            )
        if arr.dtype.kind not in _REDUCIBLE_KINDS:
            raise TypeError(
                f"{self._where(op)}: cannot reduce dtype {arr.dtype}; cast bool to uint8 first"
            )
        if reduce_op is ReduceOp.AVG and arr.dtype.kind != "f":
            raise TypeError(
                f"{self._where(op)}: AVG needs a floating dtype, got {arr.dtype}; use SUM and "
                "divide, or cast to float"
            )
        return reduce_op

    def _new_output(self, src: _Arg, shape: tuple[int, ...]) -> Any:
        if isinstance(src.array, np.ndarray):
            return np.empty(shape, dtype=src.array.dtype)
        if not _is_cupy(src.array):  # an engine's own arrays: it makes them on their device
            return self.backend.new_array(src.array, shape)
        # On the input's GPU, not the calling thread's current one (CuPy allocates there).
        with src.array.device:
            return type(src.array)(shape, dtype=src.array.dtype)

    def _check_out(self, op: str, out: Any, shape: tuple[int, ...], dtype: Any) -> _Arg:
        o = self._arg(op, out, "out", writable=True)
        if tuple(o.array.shape) != shape or o.array.dtype != dtype:
            raise ValueError(
                f"{self._where(op)}: out must have shape {shape} and dtype {dtype}, got "
                f"{tuple(o.array.shape)} {o.array.dtype}"
            )
        return o

    def _issue(self, req: Request, async_op: bool, finalize: Callable[[], Any]) -> Any:
        """Number ``req`` and queue it, then wait for it unless ``async_op``.

        Only the group's thread may issue (see :meth:`bind_thread`): calls of two threads
        could reach the ranks in different orders. Numbering and queueing happen under the
        group's lock; a blocking call that runs inline holds it while it runs.
        """
        if _get_ident() != self._owner:
            self._not_owner(req.op, req.peer if req.op in P2P_OPS else None)
        with self._lock:
            if req.op in P2P_OPS:
                key = (req.op, req.peer)  # send and recv are numbered per peer
                req.seq = self._p2p[key] = self._p2p.get(key, 0) + 1
            else:
                self._seq += 1
                req.seq = self._seq
            self.backend.check_usable(req.op, req.seq)
            if not async_op:
                queued = self.backend.call(req)  # inline when idle: no Work, no handoff
                if queued is None:
                    return finalize()
            else:
                queued = self.backend.submit(req, True)
        queued._finalize = lambda _out: finalize()
        if async_op:
            return queued
        return queued.wait()

    def _call(self, req: Request) -> None:
        """:meth:`_issue` of a blocking collective (not point-to-point) whose result is its
        input, on the per-call path: no finalizer to build and call."""
        if _get_ident() != self._owner:
            self._not_owner(req.op, None)
        with self._lock:
            self._seq += 1
            req.seq = self._seq
            backend = self.backend
            backend.check_usable(req.op, req.seq)
            queued = backend.call(req)
        if queued is not None:
            queued.wait()

    # ------------------------------------------------------------------ threads
    def bind_thread(self, thread: threading.Thread | None = None) -> None:
        """Give the group to ``thread`` (default: the calling thread), which alone issues its
        calls from now on; until then the thread that created the group does.

        Calls of two threads on one group could reach the ranks in different orders, and a
        same-shaped call of thread A on one rank would then meet thread B's on another and
        silently mix their data; so a call from any other thread raises RuntimeError (it
        takes no sequence number: the group stays usable). Give each thread its own group
        (``new_group``, created in the same order on every rank) and bind it to its thread,
        here or before the thread starts. Work handles may be waited on from any thread.
        """
        with self._lock:
            target = thread if thread is not None else threading.current_thread()
            self._owner_thread = target
            # A thread not started yet has no ident: _not_owner takes it on its first call.
            self._owner = target.ident if target.ident is not None else -1

    def _not_owner(self, op: str, peer: int | None) -> None:
        """A call from a thread that is not the group's: take it over if it was given this
        group before it started (bind_thread), else refuse it, saying who owns the group."""
        me = threading.current_thread()
        with self._lock:
            owner = self._owner_thread
            if owner is me:
                self._owner = _get_ident()
                return
            seq = self._seq + 1 if peer is None else self._p2p.get((op, peer), 0) + 1
            state = "" if owner.is_alive() else ", which has ended"
            raise RuntimeError(
                f"{where(self.info.global_rank, op, seq, self.info.describe())}: called from "
                f"thread {me.name!r} (ident {me.ident}), but the group belongs to thread "
                f"{owner.name!r} (ident {owner.ident}{state}): the thread that created it or "
                "was given it with bind_thread(). Calls of two threads on one group can reach "
                "the ranks in different orders and silently mix the threads' data, so one "
                "thread issues a group's calls: use one group per thread (new_group(...), "
                "created in the same order on every rank, then group.bind_thread() in the "
                "thread that uses it), or call bind_thread() here once the other thread is "
                "done with this group"
            )

    def _output(
        self, op: str, src: _Arg, out: Any, shape: tuple[int, ...]
    ) -> tuple[Any, Callable[[], Any]]:
        """The array an op with a separate output writes (the user's ``out``, checked, or a
        new one like ``src``), and what the call returns once it finished."""
        if out is not None:
            o = self._check_out(op, out, shape, src.array.dtype)
            return o.array, lambda: self._give_back(o)
        fresh = self._new_output(src, shape)
        return fresh, lambda: self._new_result(src, fresh)

    @staticmethod
    def _give_back(arg: _Arg) -> Any:
        """After an in-place op: copy a staged host result into the user's CuPy array."""
        if arg.staged:
            dev = arg.user.data if arg.kind == "tensor" else arg.user
            dev.set(arg.array)
        return arg.user

    @staticmethod
    def _new_result(like: _Arg, host_or_dev: Any) -> Any:
        """Wrap a freshly made output in the input's kind (Tensor, CuPy or NumPy)."""
        out = host_or_dev
        if like.staged:
            import cupy

            dev_in = like.user.data if like.kind == "tensor" else like.user
            with dev_in.device:
                out = cupy.asarray(out)
        if like.kind == "tensor":
            return from_array(out)
        return out

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False) -> Any:
        """Reduce ``x`` across ranks in place; every rank gets the result.

        Returns:
            ``x`` (or a Work whose ``wait()`` returns it).
        """
        # The per-call path of small messages: a host array whose dtype, shape and op this
        # group checked before needs only the checks that can change between calls.
        arr = x.data if type(x) is Tensor else x
        if type(arr) is np.ndarray:
            # The same objects as the last call's first (a dict lookup hashes the ReduceOp, a
            # Python-level call), then any checked before.
            last = self._last_checked
            if arr.dtype is last[0] and op is last[2] and arr.shape == last[1]:
                sig = last[3]
            else:
                sig = self._checked.get((arr.dtype, arr.shape, op))
                if sig is not None:
                    self._last_checked = (arr.dtype, arr.shape, op, sig)
            if sig is not None:
                flags = arr.flags
                if flags.c_contiguous and flags.writeable:
                    # Positional: a dataclass built from keywords costs ~3x as much.
                    req = Request("all_reduce", 0, sig, arr, None, sig.reduce_op)
                    if async_op:
                        return self._issue(req, True, lambda: x)
                    self._call(req)
                    return x
        a = self._arg("all_reduce", x, writable=True)
        rop = self._reduce_op("all_reduce", op, a.array)
        sig = Signature("all_reduce", a.array.dtype, tuple(a.array.shape), -1, rop)
        if type(a.array) is np.ndarray and len(self._checked) < _CHECKED_MAX:
            self._checked[(a.array.dtype, a.array.shape, op)] = sig
            self._last_checked = (a.array.dtype, a.array.shape, op, sig)
        req = Request("all_reduce", 0, sig, array=a.array, reduce_op=rop)
        return self._issue(req, async_op, lambda: self._give_back(a))

    def broadcast(self, x: Any, src: int, async_op: bool = False) -> Any:
        """Copy ``x`` from global rank ``src`` into ``x`` on every rank (in place)."""
        a = self._arg("broadcast", x, writable=True)
        root = self._group_rank("broadcast", src, "src")
        sig = Signature("broadcast", a.array.dtype, tuple(a.array.shape), root)
        req = Request("broadcast", 0, sig, array=a.array, root=root)
        return self._issue(req, async_op, lambda: self._give_back(a))

    def reduce(
        self, x: Any, dst: int, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False
    ) -> Any:
        """Reduce ``x`` across ranks into ``x`` on global rank ``dst`` (others keep theirs)."""
        a = self._arg("reduce", x, writable=True)
        rop = self._reduce_op("reduce", op, a.array)
        root = self._group_rank("reduce", dst, "dst")
        sig = Signature("reduce", a.array.dtype, tuple(a.array.shape), root, rop)
        req = Request("reduce", 0, sig, array=a.array, reduce_op=rop, root=root)
        return self._issue(req, async_op, lambda: self._give_back(a))

    def all_gather(self, x: Any, out: Any = None, async_op: bool = False) -> Any:
        """Gather ``x`` from every rank into an array of shape ``(size, *x.shape)``.

        Args:
            x: this rank's contribution.
            out: optional output of that shape and dtype (filled in place).
        """
        a = self._arg("all_gather", x)
        dest, finalize = self._output("all_gather", a, out, (self.size, *a.array.shape))
        sig = Signature("all_gather", a.array.dtype, tuple(a.array.shape))
        req = Request("all_gather", 0, sig, array=a.array, out=dest)
        return self._issue(req, async_op, finalize)

    def reduce_scatter(
        self, x: Any, op: ReduceOp | str = ReduceOp.SUM, out: Any = None, async_op: bool = False
    ) -> Any:
        """Reduce ``x`` across ranks and give rank r the r-th block along the first axis.

        ``x.shape[0]`` must be divisible by the group size; the output has shape
        ``(x.shape[0] // size, *x.shape[1:])``.
        """
        a = self._arg("reduce_scatter", x)
        rop = self._reduce_op("reduce_scatter", op, a.array)
        shape = self._blocked_shape("reduce_scatter", a.array)
        dest, finalize = self._output("reduce_scatter", a, out, shape)
        sig = Signature("reduce_scatter", a.array.dtype, tuple(a.array.shape), -1, rop)
        req = Request("reduce_scatter", 0, sig, array=a.array, out=dest, reduce_op=rop)
        return self._issue(req, async_op, finalize)

    def all_to_all(self, x: Any, out: Any = None, async_op: bool = False) -> Any:
        """Send block j of ``x`` (along the first axis) to rank j; block i of the output came
        from rank i. ``x.shape[0]`` must be divisible by the group size.
        """
        a = self._arg("all_to_all", x)
        self._blocked_shape("all_to_all", a.array)
        shape = tuple(a.array.shape)
        dest, finalize = self._output("all_to_all", a, out, shape)
        sig = Signature("all_to_all", a.array.dtype, shape)
        req = Request("all_to_all", 0, sig, array=a.array, out=dest)
        return self._issue(req, async_op, finalize)

    def _blocked_shape(self, op: str, arr: Any) -> tuple[int, ...]:
        if arr.ndim == 0 or arr.shape[0] % self.size != 0:
            raise ValueError(
                f"{self._where(op)}: the input's first dimension must be divisible by the group "
                f"size {self.size}, got shape {tuple(arr.shape)}"
            )
        return (arr.shape[0] // self.size, *arr.shape[1:])

    def barrier(self, async_op: bool = False) -> Any:
        """Wait until every rank of the group reached this barrier."""
        req = Request("barrier", 0, Signature("barrier", None, ()))
        return self._issue(req, async_op, lambda: None)

    def send(self, x: Any, dst: int, async_op: bool = False) -> Any:
        """Send ``x`` to global rank ``dst`` (which must ``recv`` the same shape and dtype)."""
        a = self._arg("send", x)
        peer = self._peer("send", dst, "dst")
        sig = Signature("send", a.array.dtype, tuple(a.array.shape), peer)
        req = Request("send", 0, sig, array=a.array, peer=peer)
        return self._issue(req, async_op, lambda: None)

    def recv(self, x: Any, src: int, async_op: bool = False) -> Any:
        """Receive into ``x`` (in place) what global rank ``src`` sends."""
        a = self._arg("recv", x, writable=True)
        peer = self._peer("recv", src, "src")
        sig = Signature("recv", a.array.dtype, tuple(a.array.shape), peer)
        req = Request("recv", 0, sig, array=a.array, peer=peer)
        return self._issue(req, async_op, lambda: self._give_back(a))

    def _peer(self, op: str, rank: int, what: str) -> int:
        peer = self._group_rank(op, rank, what)
        if peer == self.rank:
            raise ValueError(f"{self._where(op)}: {what}={rank} is this rank itself")
        return peer

    # ------------------------------------------------------------------ shared memory
    def alloc(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray[Any, Any]:
        """Collectively allocate a zeroed array that the backend reduces without copies.

        On the cpu backend it lives in shared memory that every rank of the group maps, so
        ``all_reduce`` on it moves no data in or out. Every rank must call ``alloc`` with the
        same shape and dtype, in the same order relative to the group's collectives.
        """
        shp = (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        if dt not in DTYPE_CODES:
            raise TypeError(f"{self._where('alloc')}: unsupported dtype {dt}")
        if _get_ident() != self._owner:
            self._not_owner("alloc", None)
        with self._lock:
            self._seq += 1
            self.backend.check_usable("alloc", self._seq)
            self.backend.drain()
            return self.backend.alloc(shp, dt, self._seq)

    # ------------------------------------------------------------------ objects
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Send a small JSON-able value (dict/list/str/number/bool/None) from ``src`` to all.

        Tuples arrive as lists. Nothing is pickled.
        """
        root = self._group_rank("broadcast_object", src, "src")
        if self.rank == root:
            try:
                payload = _encode_object("broadcast_object", obj)
            except (TypeError, ValueError):
                # Tell the other ranks (length -1) so they fail now instead of waiting, until
                # the timeout, for data that never comes; the root raises its own error.
                self.broadcast(np.array([-1], dtype=np.int64), src)
                raise
            n = np.array([len(payload)], dtype=np.int64)
        else:
            payload = b""
            n = np.zeros(1, dtype=np.int64)
        self.broadcast(n, src)
        if n[0] < 0:
            raise ValueError(
                f"{self._where('broadcast_object', self._seq)}: the source rank {src} could not "
                "encode its value as JSON (it raised TypeError/ValueError there)"
            )
        buf = np.zeros(int(n[0]), dtype=np.uint8)
        if self.rank == root:
            buf[:] = np.frombuffer(payload, dtype=np.uint8)
        self.broadcast(buf, src)
        return json.loads(buf.tobytes().decode("utf-8"))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one small JSON-able value from every rank into a list (rank order)."""
        payload = _encode_object("all_gather_object", obj)
        lengths = self.all_gather(np.array([len(payload)], dtype=np.int64))
        width = max(int(lengths.max()), 1)
        buf = np.zeros(width, dtype=np.uint8)
        buf[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        rows = self.all_gather(buf)
        return [
            json.loads(rows[i, : int(lengths[i, 0])].tobytes().decode("utf-8"))
            for i in range(self.size)
        ]

    # ------------------------------------------------------------------ lifecycle
    def synchronize(self, timeout: float | None = None) -> bool:
        """Wait until every queued async collective of this group finished."""
        return self.backend.drain(timeout)

    def destroy(self) -> None:
        """Release the backend's resources (idempotent)."""
        self.backend.close()


def _encode_object(op: str, obj: Any) -> bytes:
    try:
        data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{op}: the value must be JSON-serializable (dict/list/str/int/float/bool/None; "
            f"no pickle): {exc}"
        ) from None
    if len(data) > _MAX_OBJECT_BYTES:
        raise ValueError(
            f"{op}: the value is {len(data)} bytes as JSON; object collectives are for small "
            f"values (at most {_MAX_OBJECT_BYTES} bytes): send arrays instead"
        )
    return data


class NonMemberGroup:
    """What ``new_group`` returns on ranks outside the group: every collective raises."""

    def __init__(self, ranks: tuple[int, ...], global_rank: int) -> None:
        self.ranks = ranks
        self.global_rank = global_rank

    def is_member(self) -> bool:
        """False: this process is not in the group."""
        return False

    def destroy(self) -> None:
        """Nothing to release. Every rank may call ``destroy_process_group(g)`` on the group it
        got from ``new_group``; refusing it here (like the collectives) broke that idiom."""

    def bind_thread(self, thread: threading.Thread | None = None) -> None:
        """Nothing to bind; every rank may give what ``new_group`` returned to a thread."""

    def __getattr__(self, name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{where(self.global_rank, name)}: this rank is not a member of the group "
                f"with ranks {list(self.ranks)}"
            )

        if name.startswith("_"):
            raise AttributeError(name)
        return refuse

    def __repr__(self) -> str:
        return f"<NonMemberGroup ranks={list(self.ranks)} (rank {self.global_rank} not in it)>"
