"""The gradient reducer: DDP's buckets, and what a synchronized backward does with them.

``DistributedDataParallel`` (``ddp/_ddp.py``) sets the model up and owns one
:class:`Reducer`, as PyTorch's DDP owns a c10d ``Reducer``. How the reducer works:

* Gradients live in flat bucket buffers, one set per (dtype, device), filled in reverse
  parameter order (the order backward produces them); the first bucket is small so that
  communication starts early. The plan and the layout are the package's one bucketing
  (``ddp/_buckets.py``, which :func:`ddp.sync_gradients` uses too). Each parameter's
  ``.grad`` is a view into its bucket. On the cpu backend the buffers come from
  ``group.alloc`` (shared memory every rank maps), so the all-reduce moves no data in or out.
* tensorlib calls a hook right after each parameter's gradient was accumulated. When a
  bucket's last gradient arrives, its asynchronous all-reduce starts on the group's
  communication thread (in bucket order on every rank) while backward goes on. A callback
  queued for the end of ``backward()`` launches what is left, waits for every bucket, and
  checks (with one tiny all-reduce) that no rank missed a parameter, so that when
  ``loss.backward()`` returns every ``.grad`` holds the average over ranks. On nccl with the
  buckets on a GPU that check is read at the next synchronized backward instead (see
  ``_defers_control``), so that a step makes no host synchronization.
* Under :func:`ddp.join` (``ddp/_join.py``) the join sets :attr:`Reducer.grad_scale` for each
  synchronized step, so that the buckets hold the average over the ranks that had data, and a
  rank that ran out calls :meth:`Reducer.shadow_backward` to issue what the others' backward
  issues.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import collectives
import tensorlib as tl
from collectives import ProcessGroup, ReduceOp, Work, where
from tensorlib import Tensor

from ._buckets import FlatBucket, plan_buckets
from ._hooks import GradBucket, allreduce_hook

if TYPE_CHECKING:
    from ._join import Join

__all__ = ["Bucket", "CommHook", "Reducer", "StepStats"]

CommHook = Callable[[Any, GradBucket], Work]


@dataclass
class Bucket(FlatBucket):
    """One flat gradient buffer (its layout: :class:`~ddp._buckets.FlatBucket`) and the
    parameters whose gradients are views into it."""

    index: int = 0
    params: list[Any] = field(default_factory=list)
    views: list[Tensor] = field(default_factory=list)


@dataclass
class StepStats:
    """What the last synchronized backward did (for tests, tuning and benchmarks).

    Attributes:
        launch_order: bucket indexes in the order their all-reduce started.
        ready_at_launch: for each launch, how many parameters had their gradient by then.
        launched_in_backward: buckets started from gradient hooks (overlapping backward).
        wait_s: seconds the end of backward spent waiting for communication.
        num_params: parameters taking part.
    """

    launch_order: list[int] = field(default_factory=list)
    ready_at_launch: list[int] = field(default_factory=list)
    launched_in_backward: int = 0
    wait_s: float = 0.0
    num_params: int = 0


class Reducer:
    """Buckets the gradients of ``named``'s trainable parameters and averages them over
    ``group`` during each synchronized backward.

    Building one allocates the buckets and registers a gradient hook on every trainable
    parameter; from then on every ``backward()`` through them is reduced.

    Args:
        group: the group to average over.
        named: the model's ``(name, parameter)`` pairs, in registration order (names are for
            error messages; parameters with ``requires_grad=False`` take no part).
        bucket_cap_mb: size of buckets after the first, in MiB.
        first_bucket_mb: size of the first bucket of each kind, in MiB.
        find_unused_parameters: allow parameters that get no gradient in a step.
        comm_hook: ``hook(state, bucket) -> Work`` reducing each bucket (state: ``group``);
            None for :func:`ddp.allreduce_hook`.

    Attributes:
        require_sync: False while gradients only accumulate locally (DDP's ``no_sync()``).
        join: the active :class:`ddp.Join` block, or None. The owner's forward notifies it;
            under it the end-of-backward check is never deferred.
        grad_scale: the factor the buckets are multiplied by after the next synchronized
            backward's reduction (set by ``join``; back to 1 after every backward).
        stats: what the last synchronized backward did.
    """

    def __init__(
        self,
        group: ProcessGroup,
        named: Sequence[tuple[str, Any]],
        bucket_cap_mb: float,
        first_bucket_mb: float,
        find_unused_parameters: bool = False,
        comm_hook: CommHook | None = None,
    ) -> None:
        self.group = group
        self.find_unused_parameters = find_unused_parameters
        self._hook: CommHook = comm_hook if comm_hook is not None else allreduce_hook
        self._hook_state: Any = group
        self.require_sync = True
        self.join: Join | None = None
        # nccl: the last control check, read at the next backward (see _defers_control).
        self._deferred: tuple[Work, np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None
        self.grad_scale = 1.0
        self._build_buckets(named, bucket_cap_mb, first_bucket_mb)
        self._reset_step()
        self.stats = StepStats(num_params=len(self._params))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params
        ]

    # ------------------------------------------------------------------ what the owner reads
    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets, in launch order (bucket 0 holds the last layers' gradients)."""
        return tuple(self._buckets)

    @property
    def params(self) -> tuple[Any, ...]:
        """The parameters taking part (``requires_grad``), in registration order."""
        return tuple(self._params)

    @property
    def in_backward(self) -> bool:
        """True between a synchronized backward's first gradient and its end-of-backward
        callback (still True after a backward that raised before the callback ran)."""
        return self._in_backward

    def bucket_sizes(self) -> list[int]:
        """Bytes in each bucket, in launch order."""
        return [b.nbytes for b in self._buckets]

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Use ``hook(state, bucket) -> Work`` to reduce each bucket (see ddp._hooks).

        Raises:
            TypeError: when ``hook`` is not callable.
        """
        if not callable(hook):
            raise TypeError(f"comm hook must be callable, got {hook!r}")
        self._hook, self._hook_state = hook, state

    # ------------------------------------------------------------------ setup
    def _build_buckets(
        self, named: Sequence[tuple[str, Any]], cap_mb: float, first_mb: float
    ) -> None:
        params = [p for _, p in named if p.requires_grad]
        self._params = params
        self._names = {id(p): n for n, p in named}
        self._index = {id(p): k for k, p in enumerate(params)}
        # Reverse order, the order backward produces gradients in; the first bucket of each
        # kind is small so that its all-reduce starts early.
        order = params[::-1]
        plan = plan_buckets(
            [(p.dtype, p.device) for p in order],
            [p.size * p.dtype.itemsize for p in order],
            cap=max(1, int(cap_mb * (1 << 20))),
            first_cap=max(1, int(first_mb * (1 << 20))),
        )
        buckets: list[Bucket] = []
        for members in plan:
            first = order[members[0]]
            b = Bucket(first.dtype, first.device, index=len(buckets))
            for i in members:
                b.params.append(order[i])
                b.add(order[i].shape)
            buckets.append(b)
        group = self.group
        self._loc: dict[int, tuple[int, int]] = {}
        for b in buckets:
            if b.device.type == "cpu":
                buf = group.alloc(b.numel, b.dtype)
            else:
                with b.device:
                    buf = b.device.xp.zeros(b.numel, dtype=b.dtype)
            b.buffer = buf
            for j, (p, chunk) in enumerate(zip(b.params, b.chunks(), strict=True)):
                # On the bucket's device: a logical CPU device (cpu:1) is not NumPy's own.
                view = tl.from_array(chunk, b.device)
                # An existing gradient moves into its bucket; a missing one stays None (as in
                # a plain model, so an optimizer step before any backward changes nothing)
                # until backward produces it and the hook moves it into the view.
                if p.grad is not None:
                    view.data[...] = p.grad.data
                    p.grad = view
                b.views.append(view)
                # Backward computes the gradient straight into the view when it can (linear
                # layers), so no copy into the bucket is needed before communication.
                p.set_grad_buffer(view)
                self._loc[id(p)] = (b.index, j)
        self._buckets = buckets

    # ------------------------------------------------------------------ per step
    def _reset_step(self) -> None:
        self._pending = [len(b.params) for b in self._buckets]
        self._used = np.zeros(len(self._params), dtype=bool)
        self._accumulated = np.zeros(len(self._params), dtype=bool)
        self._works: list[Work | None] = [None] * len(self._buckets)
        self._next = 0
        self._in_backward = False
        self._launched_in_backward = 0
        self._ready_total = 0
        self._launch_log: list[int] = []
        self._ready_log: list[int] = []
        self.grad_scale = 1.0

    def _on_grad_ready(self, p: Any) -> None:
        bi, j = self._loc[id(p)]
        bucket = self._buckets[bi]
        view = bucket.views[j]
        grad = p.grad
        if grad is not view:
            # The grad was cleared (zero_grad set it to None), so backward made a new array:
            # move it into the bucket so communication and accumulation use the view again.
            view.data[...] = grad.data
            p.use_grad_buffer()
        if not self.require_sync:
            # Remember it: a parameter used only in no_sync backwards still has a gradient to
            # reduce, so find_unused_parameters must not count it as unused (and drop it).
            self._accumulated[self._index[id(p)]] = True
            return
        if not self._in_backward:
            self._in_backward = True
            tl.queue_callback(self._finish_backward)
        k = self._index[id(p)]
        if self._used[k]:
            return
        self._used[k] = True
        self._ready_total += 1
        self._pending[bi] -= 1
        if self._pending[bi] == 0:
            self._launch_ready(in_backward=True)

    def _launch_ready(self, in_backward: bool) -> None:
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            b = self._buckets[self._next]
            gb = GradBucket(b.index, b.buffer, b.params, b.index == len(self._buckets) - 1)
            self._works[b.index] = self._hook(self._hook_state, gb)
            self._launch_log.append(b.index)
            self._ready_log.append(self._ready_total)
            if in_backward:
                self._launched_in_backward += 1
            self._next += 1

    def _finish_backward(self) -> None:
        """End of backward: launch what is left, wait for every bucket, check nobody missed."""
        missing = self._contribute_missing()
        self._launch_ready(in_backward=False)
        control = self._control(missing)
        t0 = time.perf_counter()
        error = self._wait_all(control)
        self._record_stats(wait_s=time.perf_counter() - t0)
        used_local = self._used.copy()
        self._reset_step()
        if error is not None:
            raise error
        if self.find_unused_parameters:
            self._drop_unused(control)
        elif control[0] > 0:
            self._raise_missing(used_local)

    def shadow_backward(self) -> None:
        """What a synchronized backward issues, with zero gradients, for a rank that ran out
        of data under :func:`ddp.join`: every bucket through the comm hook in bucket order,
        then the control all-reduce (nothing missing, none used).

        Raises:
            RuntimeError: when a rank with data missed a parameter (every rank raises alike),
                or what a collective raised.
        """
        last = len(self._buckets) - 1
        for b in self._buckets:
            b.buffer[...] = 0
            gb = GradBucket(b.index, b.buffer, b.params, b.index == last)
            self._works[b.index] = self._hook(self._hook_state, gb)
        control = np.zeros(
            1 + (len(self._params) if self.find_unused_parameters else 0), dtype=np.float64
        )
        error = self._wait_all(control)
        self._reset_step()
        if error is not None:
            raise error
        if control[0] > 0 and not self.find_unused_parameters:
            # An active rank missed a parameter and gathers every rank's list: take part.
            self._raise_missing(np.ones(len(self._params), dtype=bool))

    def _contribute_missing(self) -> list[int]:
        """Give each parameter that got no gradient in this backward its bucket view as
        ``.grad`` (zeros, unless no_sync steps accumulated into it) and count it as ready.

        Returns:
            The indexes (into ``self._params``) of those parameters.
        """
        missing = [k for k in range(len(self._params)) if not self._used[k]]
        for k in missing:
            p = self._params[k]
            bi, j = self._loc[id(p)]
            view = self._buckets[bi].views[j]
            if p.grad is not view:
                # No gradient at all: contribute zeros. (A view keeps what no_sync steps
                # accumulated, which is this rank's contribution.)
                view.data[...] = 0
                p.use_grad_buffer()
            self._pending[bi] -= 1
        return missing

    def _control(self, missing: list[int]) -> np.ndarray[Any, Any]:
        """The tiny vector all-reduced after the buckets: how many parameters this rank
        missed, and, with find_unused_parameters, which parameters it used."""
        control = np.zeros(
            1 + (len(self._params) if self.find_unused_parameters else 0), dtype=np.float64
        )
        control[0] = len(missing)
        if self.find_unused_parameters:
            control[1:] = self._used | self._accumulated
        return control

    def _wait_all(self, control: np.ndarray[Any, Any]) -> BaseException | None:
        """Wait for every bucket (copying a result that is not the bucket itself into it),
        then all-reduce ``control`` in place; return what raised, if anything, so that the
        step's state is reset before it propagates."""
        try:
            for b in self._buckets:
                work = self._works[b.index]
                assert work is not None
                out = work.wait()
                if out is not b.buffer:
                    b.buffer[...] = out if b.device.type == "cpu" else b.device.xp.asarray(out)
                if self.grad_scale != 1.0:
                    # Under join with k of N ranks active: the hook averaged over N, the
                    # average over the k ranks that had data is N/k times that.
                    b.buffer *= b.buffer.dtype.type(self.grad_scale)
            self._check_deferred()
            if self._defers_control():
                # nccl: issue the check now, read it at the next synchronized backward (the
                # stream runs it before that step's buckets): no host sync in this step.
                sent = control.copy()
                work = self.group.all_reduce(sent, ReduceOp.SUM, async_op=True)
                self._deferred = (work, sent, self._used.copy())
                control[:] = 0
            else:
                self.group.all_reduce(control, ReduceOp.SUM)
        except BaseException as exc:
            return exc
        return None

    def _defers_control(self) -> bool:
        """Whether the control check waits for the next backward: on a backend that takes
        device arrays (nccl) with every bucket on a GPU, a host wait for it would wait for
        every bucket; not with find_unused_parameters (it needs the result now) nor under
        join (whose shadow steps check at once)."""
        return (
            self.group.accepts_device_arrays
            and not self.find_unused_parameters
            and self.join is None
            and all(b.device.type == "cuda" for b in self._buckets)
        )

    def _check_deferred(self) -> None:
        """Read the previous backward's deferred control check (every rank does, at the same
        step) and raise, naming the parameters, when some rank missed one then."""
        if self._deferred is None:
            return
        work, sent, used = self._deferred
        self._deferred = None
        work.wait()  # ran before this step's buckets, which were just waited for
        if sent[0] > 0:
            self._raise_missing(used, "the previous backward")

    def _record_stats(self, wait_s: float) -> None:
        self.stats = StepStats(
            launch_order=list(self._launch_log),
            ready_at_launch=list(self._ready_log),
            launched_in_backward=self._launched_in_backward,
            wait_s=wait_s,
            num_params=len(self._params),
        )

    def _drop_unused(self, control: np.ndarray[Any, Any]) -> None:
        """find_unused_parameters: a parameter unused on every rank keeps no gradient, as
        without DDP."""
        for k, p in enumerate(self._params):
            if control[1 + k] == 0:
                p.grad = None

    def _raise_missing(self, used_local: np.ndarray[Any, Any], when: str = "this backward") -> None:
        """Some rank missed a parameter (without find_unused_parameters): raise on every rank,
        naming each rank's missing parameters."""
        group = self.group
        names = [
            self._names[id(self._params[k])] for k in range(len(self._params)) if not used_local[k]
        ]
        every = group.all_gather_object(names)
        detail = "; ".join(f"rank {group.ranks[r]}: {lst}" for r, lst in enumerate(every) if lst)
        raise RuntimeError(
            f"{where(collectives.get_rank(), 'DistributedDataParallel')}: parameters received "
            f"no gradient in {when} ({detail}). Pass find_unused_parameters=True if "
            "some parameters are legitimately unused in a step"
        )
