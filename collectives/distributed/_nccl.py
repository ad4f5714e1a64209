"""The context engine of GPUs: one NCCL communicator per device, one group call per all-reduce.

NCCL's single-controller mode, driven from the one thread that launches a context's calls: at
construction one ``ncclGetUniqueId``, then ``ncclGroupStart``, one ``ncclCommInitRankConfig``
per device (rank ``i`` is the context's ``i``-th device, made current for the call) and
``ncclGroupEnd``, which runs the inits together and returns once all completed (what
``ncclCommInitAll`` does); and a non-blocking CUDA stream per device.

An all-reduce, when the last device submitted call ``seq``: an output array per device (the
inputs are not written); each device's stream waits for an event recorded on that device's
current stream in the submitting thread (the inputs are ready once its earlier work is); then
``ncclGroupStart``, one ``ncclAllReduce`` per device on its communicator and stream,
``ncclGroupEnd``, and an end event per device. Nothing waits on the host: the completion's
``done()`` queries the end events, ``wait()`` makes each device's current stream wait on its
end event. The engine keeps every call's arrays until its end events completed (CuPy's pool
would otherwise hand their memory out while NCCL still reads or writes it).

The binding (``backends.nccl._lib``), its loading and the CUDA seam (``_cuda``, through CuPy)
are the nccl backend's; neither CuPy nor libnccl is touched before an engine is made.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any

from .._errors import CollectiveError, CollectiveTimeoutError, PeerFailureError, collective_error
from .._types import ReduceOp
from ..backends.nccl import _lib as nccl_lib
from ..backends.nccl import load_library
from ..backends.nccl._cuda import Cuda, device_count
from ..backends.nccl._lib import NcclError, PendingComm
from ._config import DistributedConfig

__all__ = ["NcclContextEngine", "make_nccl_engine"]

_OP = "all_reduce"
_AVG_SINCE = nccl_lib.version_code(2, 10, 0)  # ncclAvg
_INTERNAL = 3  # ncclInternalError: what a communicator NCCL made wrong is reported as
# NumPy's sum (and mean) of bools is a logical or, its product a logical and: as the NumPy
# engine computes them, where NCCL's uint8 sum would leave bytes of 2 or more in a bool array.
_BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.MAX,
    ReduceOp.AVG: ReduceOp.MAX,
    ReduceOp.PROD: ReduceOp.MIN,
    ReduceOp.MIN: ReduceOp.MIN,
    ReduceOp.MAX: ReduceOp.MAX,
}


class _Launched:
    """One all-reduce queued on the devices' streams (a :class:`~._engines.Completion`).

    Holds the inputs and outputs until its end events completed; the engine holds it until
    then too, in case the caller lets go first.
    """

    __slots__ = ("_ends", "_engine", "_finished", "_inputs", "outputs", "seq")

    def __init__(
        self, engine: NcclContextEngine, seq: int, inputs: list[Any], outputs: list[Any]
    ) -> None:
        self._engine = engine
        self.seq = seq
        self._inputs: list[Any] | None = inputs
        self.outputs = outputs
        self._ends: list[Any] = []
        self._finished = False

    def done(self) -> bool:
        """Whether every device's part completed (queries events; never waits)."""
        if self._finished:
            return True
        if not all(ev.done for ev in self._ends):
            return False
        self._finished = True
        self._inputs = None  # NCCL is done reading them
        return True

    def wait(self, timeout: float) -> None:
        """Make each device's current stream wait for its part (no host wait).

        ``timeout`` is not waited: the reduction is queued on the devices, and only a failure
        NCCL already reported (``ncclCommGetAsyncError``) is raised here.

        Raises:
            CollectiveError: NCCL reported an asynchronous error on a device's communicator.
        """
        if self.done():
            return
        self._engine.check_async(self.seq)
        for cuda, end in zip(self._engine.cudas, self._ends, strict=True):
            with cuda.on_device():  # the caller's stream *of that device* waits
                cuda.current_stream().wait_event(end)


class NcclContextEngine:
    """All-reduces CuPy arrays of ``cuda:N`` devices with NCCL group calls (module docstring).

    Args:
        devices: the context's GPUs (``cuda:N``), each once; rank ``i`` is ``devices[i]``.
        config: the context's settings (its ``timeout`` bounds a non-blocking init's and
            enqueue's wait, and :meth:`close`'s wait for outstanding work).

    Raises:
        ValueError: a device that is not a GPU, is listed twice, or that this process cannot
            see.
        NcclUnavailableError: no usable libnccl.so.2 (the message lists every path tried).
        CudaUnavailableError: CuPy or a CUDA driver is missing.
        CollectiveError: NCCL failed to make the communicators (with NCCL's error string).
    """

    def __init__(self, devices: list[Any], config: DistributedConfig) -> None:
        shown = ", ".join(str(d) for d in devices)
        if not devices:
            raise ValueError("NCCL context engine: give at least one cuda:N device")
        not_gpu = [str(d) for d in devices if getattr(d, "type", None) != "cuda"]
        if not_gpu:
            raise ValueError(
                f"NCCL context engine: {', '.join(not_gpu)} are not GPUs; expected cuda:N devices"
            )
        index = [int(getattr(d, "index", 0) or 0) for d in devices]
        if len(set(index)) != len(index):
            twice = sorted({f"cuda:{i}" for i in index if index.count(i) > 1})
            raise ValueError(
                f"DistributedContext: {', '.join(twice)} listed twice in ({shown}); one NCCL "
                "rank per GPU, each GPU once"
            )
        self.lib = load_library()  # first, so a missing NCCL is said before any CUDA call
        count = device_count()
        seen = f"sees {count} GPU(s) (cuda:0 to cuda:{count - 1})" if count else "sees no GPU"
        for d, i in zip(devices, index, strict=True):
            if not 0 <= i < count:
                raise ValueError(
                    f"DistributedContext: device {d} is not visible to this process, which "
                    f"{seen}; list only visible GPUs (CUDA_VISIBLE_DEVICES decides which)"
                )
        self.devices = list(devices)
        self.size = len(devices)
        self.names = f"DistributedContext of {shown}"
        self.timeout = float(config.timeout)
        self.ops = frozenset(
            op for op in nccl_lib.OPS if op is not ReduceOp.AVG or self.lib.version >= _AVG_SINCE
        )
        self.cudas = [Cuda(i) for i in index]  # each makes its device's non-blocking stream
        self._streams = [int(c.stream.ptr) for c in self.cudas]
        self._dtypes: dict[Any, int] = {}
        self._inflight: deque[_Launched] = deque()
        self._failed: str | None = None
        self._closed = False
        self._lock = threading.Lock()  # the communicators' lifetime: close vs check_async
        self.comms = self._init_comms()

    # ------------------------------------------------------------------ setup
    def _init_comms(self) -> list[int]:
        """One communicator per device from this thread: the inits in one NCCL group."""
        lib = self.lib
        try:
            uid = lib.get_unique_id()
        except NcclError as exc:
            raise self._init_error(exc) from exc
        pending: list[PendingComm] = []  # NCCL writes each handle at its call
        failure: Exception | None = None
        rc = nccl_lib.SUCCESS
        lib.group_start()
        try:
            for rank, cuda in enumerate(self.cudas):
                with cuda.on_device():  # NCCL takes the rank's GPU from the current device
                    pending.append(lib.comm_init_rank(self.size, uid, rank, blocking=True))
        except Exception as exc:
            failure = exc
        finally:
            try:
                rc = lib.group_end()  # runs the inits (after a failed one: NCCL cleans up)
            except NcclError as exc:
                failure = failure or exc
        comms = [p.handle for p in pending]
        try:
            if failure is not None:
                raise failure
            if rc == nccl_lib.IN_PROGRESS:  # NCCL_COMM_BLOCKING=0 made them non-blocking
                self._settle(comms, "ncclCommInitRankConfig")
            for rank, (comm, cuda) in enumerate(zip(comms, self.cudas, strict=True)):
                got = (lib.comm_user_rank(comm), lib.comm_cu_device(comm))
                if got != (rank, cuda.device):
                    raise NcclError(
                        _INTERNAL,
                        "ncclCommInitRankConfig",
                        f"made rank {got[0]} on cuda:{got[1]}; expected rank {rank} on "
                        f"cuda:{cuda.device}",
                    )
        except Exception as exc:
            for comm in comms:
                if comm:
                    with contextlib.suppress(NcclError):
                        lib.comm_abort(comm)
            if isinstance(exc, NcclError):
                raise self._init_error(exc) from exc
            raise
        return comms

    def _settle(self, comms: list[int], call: str) -> None:
        """Wait until non-blocking communicators left ncclInProgress (within the timeout)."""
        deadline = time.monotonic() + self.timeout
        pause = 0.0001
        for comm in comms:
            while (state := self.lib.comm_get_async_error(comm)) == nccl_lib.IN_PROGRESS:
                if time.monotonic() >= deadline:
                    detail = f"still in progress after {self.timeout:g} s"
                    raise NcclError(nccl_lib.TIMEOUT, call, detail)
                time.sleep(pause)
                pause = min(pause * 2, 0.005)
            if state != nccl_lib.SUCCESS:
                raise self.lib.error(state, call, comm)

    # ------------------------------------------------------------------ the call
    def all_reduce(self, arrays: list[Any], op: ReduceOp, seq: int) -> _Launched:
        """Queue call ``seq``: one NCCL group of ``ncclAllReduce`` s, one per device.

        The context turns what this raises into the call's CollectiveError, naming it.

        Raises:
            TypeError: a dtype NCCL cannot reduce, or an array that is not a CuPy array.
            ValueError: an array not on its device, or an op this engine lacks.
            RuntimeError: the engine is closed, or broken by an earlier NCCL failure.
            NcclError: NCCL failed (its result, error string and last error).
        """
        if self._closed or self._failed is not None:
            why = "closed" if self._closed else f"broken by an earlier failure: {self._failed}"
            raise RuntimeError(f"the NCCL context engine is {why}")
        while self._inflight and self._inflight[0].done():  # let go of finished calls
            self._inflight.popleft()
        if op not in self.ops:
            have = ", ".join(sorted(o.name for o in self.ops))
            raise ValueError(f"NCCL has no {op.name} reduction here; it has {have}")
        first = arrays[0]
        dtype = self._dtypes.get(first.dtype)
        if dtype is None:
            dtype = self._dtypes[first.dtype] = nccl_lib.nccl_dtype(first.dtype)
        if first.dtype.kind == "b":  # bools move as uint8: keep their bytes 0 or 1
            op = _BOOL_OPS[op]
        inputs = [self._contiguous(i, a) for i, a in enumerate(arrays)]
        outputs = [c.empty(first.shape, first.dtype) for c in self.cudas]
        call = _Launched(self, seq, inputs, outputs)
        if first.size:
            self._enqueue(call, dtype, nccl_lib.nccl_op(op))
        self._inflight.append(call)
        return call

    def _contiguous(self, i: int, a: Any) -> Any:
        """Device ``i``'s input as NCCL reads it: contiguous, on that device."""
        where = getattr(getattr(a, "device", None), "id", None)
        if where is None or not hasattr(a, "data"):
            raise TypeError(
                f"device {self.devices[i]}'s tensor must be a CuPy array, got {type(a).__name__}"
            )
        if where != self.cudas[i].device:
            raise ValueError(
                f"device {self.devices[i]}'s tensor is on cuda:{where}; move it to "
                f"{self.devices[i]} first"
            )
        if a.flags.c_contiguous:
            return a
        with self.cudas[i].on_device():  # a copy kernel on the caller's stream, before ours
            return self.cudas[i].cp.ascontiguousarray(a)

    def _enqueue(self, call: _Launched, dtype: int, rop: int) -> None:
        """The group call on the devices' streams, after the caller's work; end events."""
        lib, cudas, comms, streams = self.lib, self.cudas, self.comms, self._streams
        for cuda in cudas:
            with cuda.on_device():
                ready = cuda.event()
                ready.record(cuda.current_stream())
                cuda.stream.wait_event(ready)
        count = int(call.outputs[0].size)
        inputs = call._inputs or []
        failure: Exception | None = None
        rc = nccl_lib.SUCCESS
        lib.group_start()
        try:
            for i, cuda in enumerate(cudas):
                with cuda.on_device():
                    lib.all_reduce(
                        int(inputs[i].data.ptr),
                        int(call.outputs[i].data.ptr),
                        count,
                        dtype,
                        rop,
                        comms[i],
                        streams[i],
                    )
        except Exception as exc:
            failure = exc
        finally:
            try:  # always: NCCL drops a group with an error in it at its ncclGroupEnd
                rc = lib.group_end()
            except NcclError as exc:
                failure = failure or exc
        try:
            if failure is not None:
                raise failure
            if rc == nccl_lib.IN_PROGRESS:  # non-blocking communicators (NCCL_COMM_BLOCKING=0)
                self._settle(comms, "ncclGroupEnd")
        except Exception as exc:
            # A group cut short outside NCCL may have launched some ranks' parts, which
            # wait for the others for ever: the communicators are aborted at close.
            self._failed = f"{type(exc).__name__}: {exc}"
            raise
        for cuda in cudas:
            with cuda.on_device():
                end = cuda.event()
                end.record(cuda.stream)
                call._ends.append(end)

    # ------------------------------------------------------------------ failures
    def _init_error(self, exc: NcclError) -> CollectiveError:
        """The error of a failed setup (its class from NCCL's result code)."""
        cls: type[CollectiveError] = (
            CollectiveTimeoutError if exc.code == nccl_lib.TIMEOUT else CollectiveError
        )
        return collective_error(
            cls,
            f"making the NCCL communicators failed: {exc}",
            rank=-1,
            op="init",
            group=self.names,
            cause=exc,
            who="NCCL",
        )

    def check_async(self, seq: int) -> None:
        """Raise the asynchronous error NCCL reported on any device's communicator.

        Raises:
            CollectiveError: naming the device, the call and NCCL's error string.
        """
        for i, comm in enumerate(self.comms):
            with self._lock:  # not while close destroys it
                if not comm or comm not in self.comms:
                    return
                try:
                    state = self.lib.comm_get_async_error(comm)
                except NcclError as exc:
                    state = exc.code
            if state in (nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS):
                continue
            err = self.lib.error(state, "ncclCommGetAsyncError", comm)
            self._failed = str(err)
            raise collective_error(
                PeerFailureError,
                f"NCCL reported an asynchronous error: {err}",
                rank=i,
                op=_OP,
                seq=seq,
                group=self.names,
                cause=err,
                who=str(self.devices[i]),
            )

    def _has_error(self, comm: int) -> bool:
        try:
            state = self.lib.comm_get_async_error(comm)
        except NcclError:
            return True
        return state not in (nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait (up to the timeout) for the calls in flight, then destroy the communicators;
        abort them instead after a failure or when the calls do not finish (idempotent)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.timeout
        inflight = self._inflight
        while inflight:
            if inflight[0].done():
                inflight.popleft()
            elif self._failed is not None or time.monotonic() >= deadline:
                break
            else:
                with contextlib.suppress(CollectiveError):
                    self.check_async(inflight[0].seq)  # a failure ends the wait
                time.sleep(0.001)
        with self._lock:
            comms, self.comms = self.comms, []
            broken = bool(inflight) or self._failed is not None
            for comm in comms:
                broken = broken or self._has_error(comm)
            for comm in comms:
                with contextlib.suppress(NcclError):
                    if broken:  # never a blocking destroy of a communicator in trouble
                        self.lib.comm_abort(comm)
                    else:
                        self.lib.comm_destroy(comm)
        # Arrays of calls that never finished stay referenced: their memory is not reused.
        _KEPT.extend(inflight)
        inflight.clear()


_KEPT: list[_Launched] = []  # calls abandoned at close while NCCL may still use their arrays


def make_nccl_engine(devices: list[Any], config: DistributedConfig) -> NcclContextEngine:
    """The factory registered for devices of type ``cuda``."""
    return NcclContextEngine(devices, config)
