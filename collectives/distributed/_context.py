"""Burn's ``DistributedContext``: a device list whose devices reduce tensors together.

The context numbers each device's calls (the k-th call a device submits is call ``#k`` of the
context), collects every device's contribution to a call, checks that they agree (shape,
dtype, op: a device that called in another order disagrees too), and launches the call on its
engine (:mod:`._engines`) from the thread that submitted the last device's contribution.
Callers may submit every device from one thread, or each device from its own thread.

A call that cannot complete is an error, never a wait without end: resolving a call whose
missing devices only this thread could submit fails at once (see :meth:`DistributedContext.
missing_submitters`), any other wait ends at the config's timeout naming the devices missing,
and closing the context fails the calls still waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any, cast

from tensorlib import Device

from .._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupAbortedError,
    collective_error,
)
from .._types import ReduceOp
from ._config import DistributedConfig, ReduceOperation
from ._engines import Completion, ContextEngine, make_context_engine

__all__ = ["DistributedContext", "context_of"]

# How long a resolve that looks like it would wait for ever gives other live threads to show
# that they submit for the missing devices (a worker thread that has not reached its first
# call yet). With no other thread alive the error is immediate.
_GRACE_S = 1.0

_OPEN_LOCK = threading.Lock()
# id(device) of each device of an open context -> the context (devices are interned: one
# object per name, so the id is the device; a dict keyed by it skips Device.__hash__).
_OPEN: dict[int, DistributedContext] = {}


def context_of(devices: Any, device: Device, op: str) -> tuple[DistributedContext, int]:
    """The open context of ``devices`` (any order) or, without them, of ``device``; and the
    index of ``device`` in it.

    Raises:
        CollectiveError: no open context has those devices, or ``device`` is not one of them.
    """
    ctx = _OPEN.get(id(device))
    # The per-call path: the context's own device list (or a copy of it, in its order).
    if ctx is not None and (
        devices is None
        or (type(devices) is list and devices == ctx._device_list)
        or (isinstance(devices, list | tuple) and tuple(devices) == ctx._devices)
    ):
        return ctx, ctx._index[id(device)]
    return _context_slow(devices, device, op, ctx)


def _context_slow(
    devices: Iterable[Any] | None, device: Device, op: str, ctx: DistributedContext | None
) -> tuple[DistributedContext, int]:
    shown = str(device)
    if devices is not None:
        wanted = _normalize(devices, op)
        names = ", ".join(str(d) for d in wanted)
        if ctx is None or frozenset(wanted) != frozenset(ctx.devices):
            ctx = _OPEN.get(id(wanted[0])) if wanted else None
            if ctx is None or frozenset(wanted) != frozenset(ctx.devices):
                raise collective_error(
                    CollectiveError,
                    f"no open DistributedContext over ({names}); open one first with "
                    "`with DistributedContext(devices):` (a context ends when its with block "
                    "is left or close() is called)",
                    rank=-1,
                    op=op,
                    who=shown,
                )
            raise collective_error(
                CollectiveError,
                f"the tensor is on {shown}, which is not one of the context's devices "
                f"({names}); move it there first (tensor.to(device))",
                rank=-1,
                op=op,
                who=shown,
            )
    if ctx is None:
        raise collective_error(
            CollectiveError,
            f"no open DistributedContext has device {shown}; open one first with "
            "`with DistributedContext(devices):`, and pass the same device list to every call",
            rank=-1,
            op=op,
            who=shown,
        )
    return ctx, ctx._index[id(device)]


def _normalize(devices: Iterable[Any], what: str) -> tuple[Device, ...]:
    if isinstance(devices, str | Device):
        raise TypeError(
            f"{what}: devices must be a list of devices (tensorlib.Device.enumerate(...)), "
            f"got the single device {devices!r}; pass [{devices!r}] for a context of one"
        )
    try:
        out = tuple(Device(d) for d in devices)
    except TypeError as exc:
        raise TypeError(
            f"{what}: devices must be a list of devices (tensorlib.Device.enumerate(...)), "
            f"got {type(devices).__name__}: {exc}"
        ) from exc
    return out


class _Call:
    """One all-reduce of the context: the devices' contributions, then its completion."""

    __slots__ = ("arrays", "completion", "failure", "op", "seq", "signature", "submitted")

    def __init__(self, seq: int, n: int) -> None:
        self.seq = seq
        self.arrays: list[Any] = [None] * n
        self.submitted = 0
        self.signature: tuple[Any, ...] | None = None
        self.op: ReduceOp = ReduceOp.SUM
        self.completion: Completion | None = None
        # (error class, detail, cause): each device's error is built from it with its name.
        self.failure: tuple[type[CollectiveError], str, BaseException | None] | None = None


class DistributedContext:
    """A group of devices that reduce tensors together (Burn's ``DistributedContext``).

    Open it over a device list (``with DistributedContext(devices, config):``, or keep the
    object and call :meth:`close`); inside, :func:`~collectives.distributed.all_reduce` with
    the same list combines one tensor from every device. Every device must submit the same
    calls in the same order (shapes, dtypes and ops agreeing), from one thread or from one
    thread per device.

    Args:
        devices: the devices (tensorlib devices or their names), each listed once, all of one
            kind: logical CPU devices (``tensorlib.Device.enumerate("cpu")``), GPUs (one NCCL
            communicator each), or remote devices of one server.
        config: :class:`DistributedConfig` (default: Mean, 300 s timeout).

    Raises:
        ValueError: an empty list, a device listed twice, devices of two kinds or two servers,
            or a device already in another open context.
        TypeError: ``devices`` is not a list of devices, ``config`` not a DistributedConfig.
    """

    def __init__(self, devices: Iterable[Any], config: DistributedConfig | None = None) -> None:
        devs = _normalize(devices, "DistributedContext")
        if not devs:
            raise ValueError("DistributedContext: the device list is empty; expected 1 or more")
        seen: dict[Device, int] = {}
        for i, d in enumerate(devs):
            if d in seen:
                raise ValueError(
                    f"DistributedContext: device {d} is listed twice (positions {seen[d]} and "
                    f"{i}); each device takes part once"
                )
            seen[d] = i
        if config is None:
            config = DistributedConfig()
        elif not isinstance(config, DistributedConfig):
            raise TypeError(
                f"DistributedContext: config must be a DistributedConfig, got "
                f"{type(config).__name__}"
            )
        self._devices = devs
        self._device_list = list(devs)  # context_of compares a list to it without a copy
        self._index = {id(d): i for i, d in enumerate(devs)}
        self._config = config
        self._names = ", ".join(str(d) for d in devs)
        self._engine: ContextEngine = make_context_engine(list(devs), config)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads waiting on the condition (notify only when some are)
        # id(ReduceOperation) -> its ReduceOp, for the ops the engine has (by identity: an
        # Enum's hash and its ``op`` property are Python-level calls, and submit runs per call).
        self._ops = {id(r): r.op for r in ReduceOperation if r.op in self._engine.ops}
        self._launch = threading.Lock()  # one launch at a time: engines are not re-entrant
        self._next = [0] * len(devs)
        self._calls: dict[int, _Call] = {}  # calls some but not every device submitted
        self._owner: list[int | None] = [None] * len(devs)  # the thread submitting each device
        self._creator = threading.get_ident()
        self._closed = False
        self._broken: str | None = None
        with _OPEN_LOCK:
            taken = [d for d in devs if id(d) in _OPEN]
            if not taken:
                for d in devs:
                    _OPEN[id(d)] = self
        if taken:
            self._engine.close()
            raise ValueError(
                f"DistributedContext: device(s) {', '.join(map(str, taken))} are already in an "
                f"open context ({_OPEN[id(taken[0])]!r}); close it first"
            )

    @classmethod
    def init(
        cls, devices: Iterable[Any], config: DistributedConfig | None = None
    ) -> DistributedContext:
        """Burn's ``DistributedContext::init(devices, config)``: the same as the constructor."""
        return cls(devices, config)

    # ------------------------------------------------------------------ properties
    @property
    def devices(self) -> tuple[Device, ...]:
        """The devices, in the order the reduction combines them."""
        return self._devices

    @property
    def config(self) -> DistributedConfig:
        """The context's :class:`DistributedConfig`."""
        return self._config

    @property
    def default_op(self) -> ReduceOperation:
        """The reduction of a call given no op (the config's ``all_reduce_op``)."""
        return self._config.all_reduce_op

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ended the context."""
        return self._closed

    def describe(self) -> str:
        """``DistributedContext of cpu, cpu:1`` (the context's part of error messages)."""
        return f"DistributedContext of {self._names}"

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "open"
        return f"DistributedContext([{self._names}], {state})"

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> DistributedContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the context: its engine's resources are freed, calls still waiting for other
        devices fail, and a collective over these devices is an error until a new context
        opens (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        with _OPEN_LOCK:
            for d in self._devices:
                if _OPEN.get(id(d)) is self:
                    del _OPEN[id(d)]
        with self._launch:
            self._engine.close()

    # ------------------------------------------------------------------ calls
    def error(
        self,
        cls: type[CollectiveError],
        index: int,
        op: str,
        seq: int | None,
        detail: str,
        cause: BaseException | None = None,
    ) -> CollectiveError:
        """The error of device ``index`` in call ``seq``, in the one collective format."""
        return collective_error(
            cls,
            detail,
            rank=index,
            op=op,
            seq=seq,
            group=self.describe(),
            cause=cause,
            who=str(self._devices[index]),
        )

    def submit(self, index: int, array: Any, reduction: ReduceOperation, name: str) -> _Call:
        """Add device ``index``'s ``array`` to its next call; launch the call when it is the
        last device's. Returns the call.

        Raises:
            CollectiveMismatchError: the devices' calls disagree (the context is then broken).
            CollectiveError: the context is closed or broken, or the engine failed.
        """
        op = self._ops.get(id(reduction))
        if op is None:
            supported = [r.name for r in ReduceOperation if r.op in self._engine.ops]
            raise self.error(
                CollectiveError,
                index,
                name,
                self._next[index],
                f"ReduceOperation.{reduction.name} is not supported by this context's engine "
                f"({type(self._engine).__name__}); supported: {', '.join(supported)}",
            )
        with self._lock:
            seq = self._next[index]
            if self._closed or self._broken is not None:
                self._check_usable(index, name, seq)
            if self._owner[index] is None:
                self._owner[index] = threading.get_ident()
            call = self._calls.get(seq)
            if call is None:
                call = self._calls[seq] = _Call(seq, len(self._devices))
            self._next[index] = seq + 1
            sig = (array.shape, array.dtype, reduction)
            if call.signature is None:
                call.signature, call.op = sig, op
            elif sig != call.signature:
                first = next(i for i, a in enumerate(call.arrays) if a is not None)
                detail = (
                    f"the devices' calls disagree: {self._devices[index]} submitted "
                    f"{_show(sig)} but {self._devices[first]} submitted "
                    f"{_show(call.signature)}; every device must submit the same calls in "
                    "the same order"
                )
                self._fail(call, CollectiveMismatchError, detail, None)
                raise self.error(CollectiveMismatchError, index, name, seq, detail)
            call.arrays[index] = array
            call.submitted += 1
            if self._waiting:
                self._cond.notify_all()
            if call.submitted < len(self._devices):
                return call
            del self._calls[seq]
            arrays, call.arrays = call.arrays, []
        self._start(call, arrays, name)
        return call

    def _start(self, call: _Call, arrays: list[Any], name: str) -> None:
        try:
            with self._launch:
                if self._closed:
                    raise RuntimeError("the context was closed")
                completion = self._engine.all_reduce(arrays, call.op, call.seq)
        except Exception as exc:
            detail = f"the {type(self._engine).__name__} failed: {type(exc).__name__}: {exc}"
            with self._cond:
                self._fail(call, CollectiveError, detail, exc)
            raise self.error(CollectiveError, len(arrays) - 1, name, call.seq, detail, exc) from exc
        with self._lock:
            call.completion = completion
            if self._waiting:
                self._cond.notify_all()

    def _fail(
        self, call: _Call, cls: type[CollectiveError], detail: str, cause: BaseException | None
    ) -> None:
        """Fail ``call`` for every device and break the context (the lock is held)."""
        call.failure = (cls, detail, cause)
        self._broken = f"call #{call.seq} failed: {detail}"
        self._calls.pop(call.seq, None)
        self._cond.notify_all()

    def _check_usable(self, index: int, name: str, seq: int | None) -> None:
        if self._closed:
            raise self.error(
                CollectiveError,
                index,
                name,
                seq,
                "the context is closed (its with block was left or close() was called); "
                "open a new DistributedContext for more collectives",
            )
        if self._broken is not None:
            raise self.error(
                GroupAbortedError,
                index,
                name,
                seq,
                f"the context is unusable after an earlier failure: {self._broken}",
            )

    def wait(self, call: _Call, index: int, name: str, timeout: float | None) -> Any:
        """Wait until every device submitted ``call`` and its engine completed it; return
        device ``index``'s output.

        Raises:
            CollectiveError: resolving now would wait for ever (this thread is the one that
                would submit the missing devices), the call failed, or the context closed.
            CollectiveTimeoutError: the missing devices did not submit within the timeout.
        """
        completion = call.completion
        if completion is not None and completion.done():  # the per-call path: nothing to wait
            return completion.outputs[index]
        limit = self._config.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        grace: float | None = None
        with self._cond:
            while call.completion is None and call.failure is None:
                if self._closed:
                    self._check_usable(index, name, call.seq)
                missing = [i for i, a in enumerate(call.arrays) if a is None]
                if self.missing_submitters(missing):
                    if grace is None:
                        grace = time.monotonic() + (_GRACE_S if threading.active_count() > 1 else 0)
                    if time.monotonic() >= grace:
                        raise self.error(
                            CollectiveError,
                            index,
                            name,
                            call.seq,
                            f"resolve() before {self._show(missing)} submitted this call, from "
                            "the only thread that submits for them: it would wait for ever. "
                            "Submit the call for every device first (all_reduce for each "
                            "device's tensor), then resolve",
                        )
                else:
                    grace = None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.error(
                        CollectiveTimeoutError,
                        index,
                        name,
                        call.seq,
                        f"timed out after {limit:g} s waiting for {self._show(missing)} to "
                        "submit this call (every device must make the same calls)",
                    )
                self._waiting += 1
                try:
                    self._cond.wait(min(left, 0.05) if grace is not None else left)
                finally:
                    self._waiting -= 1
            if call.failure is not None:
                cls, detail, cause = call.failure
                raise self.error(cls, index, name, call.seq, detail, cause)
            completion = cast(Completion, call.completion)  # the loop ended on it
        try:
            completion.wait(max(deadline - time.monotonic(), 0.0))
        except CollectiveError:
            raise
        except Exception as exc:
            raise self.error(
                CollectiveError, index, name, call.seq, f"the reduction failed: {exc}", exc
            ) from exc
        return completion.outputs[index]

    def missing_submitters(self, missing: list[int]) -> bool:
        """Whether only the calling thread could submit the ``missing`` devices: each has been
        submitted by this thread before, or none has any submitter yet while every submission
        so far came from this thread and this thread opened the context (Burn's one-thread
        form). Then waiting for them would never end."""
        me = threading.get_ident()
        owners = self._owner
        if any(owners[i] is not None and owners[i] != me for i in missing):
            return False
        if all(owners[i] == me for i in missing):
            return True
        return me == self._creator and all(o in (None, me) for o in owners)

    def _show(self, indices: list[int]) -> str:
        names = ", ".join(str(self._devices[i]) for i in indices)
        return f"device {names}" if len(indices) == 1 else f"devices {names}"


def _show(sig: tuple[Any, ...]) -> str:
    shape, dtype, op = sig
    return f"shape {tuple(shape)}, dtype {dtype}, op {op.name}"
