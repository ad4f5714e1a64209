"""``DistributedDataParallel``: bucketed gradient averaging overlapped with backward.

How it works:

* At construction every rank checks that all ranks have the same parameter and buffer names,
  shapes and dtypes (one small exchange; the full lists only when they differ), then copies
  rank 0's parameters and buffers to every rank.
* Gradients live in flat bucket buffers, one set per (dtype, device), filled in reverse
  parameter order (the order backward produces them); the first bucket is small so that
  communication starts early. Each parameter's ``.grad`` is a view into its bucket. On the
  cpu backend the buffers come from ``group.alloc`` (shared memory every rank maps), so the
  all-reduce moves no data in or out.
* tensorlib calls a hook right after each parameter's gradient was accumulated. When a
  bucket's last gradient arrives, its asynchronous all-reduce starts on the group's
  communication thread (in bucket order on every rank) while backward goes on. A callback
  queued for the end of ``backward()`` launches what is left, waits for every bucket, and
  checks (with one tiny all-reduce) that no rank missed a parameter, so that when
  ``loss.backward()`` returns every ``.grad`` holds the average over ranks. On nccl with the
  buckets on a GPU that check is read at the next synchronized backward instead (see
  ``_defers_control``), so that a step makes no host synchronization.
* Under :func:`ddp.join` (``ddp/_join.py``) each forward first tells the other ranks that this
  rank has data, ranks that ran out shadow the others' collectives, and the buckets are scaled
  so that they hold the average over the ranks that had data in that step.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import collectives
import tensorlib as tl
from collectives import NonMemberGroup, ProcessGroup, ReduceOp, Work
from tensorlib import Tensor
from tensorlib.nn import Module

from ._hooks import GradBucket, allreduce_hook

if TYPE_CHECKING:
    from ._join import Join

__all__ = ["DistributedDataParallel"]

CommHook = Callable[[Any, GradBucket], Work]


@dataclass
class _Bucket:
    index: int
    dtype: Any
    device: Any
    params: list[Any] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    buffer: Any = None
    views: list[Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize


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


class DistributedDataParallel(Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves gradients averaged over all ranks.

    Args:
        module: the model; every rank must build the same architecture.
        process_group: group to average over (default: the default group).
        bucket_cap_mb: size of buckets after the first, in MiB.
        first_bucket_mb: size of the first bucket, in MiB (small, to start communicating early).
        find_unused_parameters: allow parameters that get no gradient in a step (their
            contribution is zero; parameters unused on every rank keep ``grad`` None).
            Without it such a parameter is an error, on every rank, naming it.
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        comm_hook: ``hook(state, bucket) -> Work`` reducing each bucket (state: the group);
            default :func:`ddp.allreduce_hook`; :func:`ddp.fp16_compress_hook` halves traffic.

    Raises:
        ValueError: if ranks disagree on parameter or buffer names, shapes, dtypes or
            requires_grad, or on the bucket sizes, ``find_unused_parameters`` or
            ``broadcast_buffers`` (every rank raises, listing the first differences and the
            ranks).
    """

    def __init__(
        self,
        module: Module,
        process_group: ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        comm_hook: CommHook | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps a tensorlib nn.Module, got {module!r}")
        group = process_group if process_group is not None else collectives.get_default_group()
        if isinstance(group, NonMemberGroup) or not isinstance(group, ProcessGroup):
            raise ValueError("DistributedDataParallel: this rank is not a member of the group")
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(
                f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb}, "
                f"first_bucket_mb={first_bucket_mb}"
            )
        if getattr(module, "_wrapped_by_ddp", False):
            raise ValueError(
                "this module is already wrapped in a DistributedDataParallel (its gradient hooks "
                "would fire twice); wrap it once"
            )
        self.module = module
        object.__setattr__(module, "_wrapped_by_ddp", True)
        object.__setattr__(self, "process_group", group)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._hook: CommHook = comm_hook if comm_hook is not None else allreduce_hook
        self._hook_state: Any = group
        self._require_sync = True
        # The active ddp.join context, if any (it sets _grad_scale for each synchronized step).
        self._join: Join | None = None
        # nccl: the last control check, read at the next backward (see _defers_control).
        self._deferred: tuple[Work, np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None
        self._grad_scale = 1.0
        self._named = list(module.named_parameters())
        # Options that decide which collectives DDP issues must agree too: different bucket
        # caps make ranks wait for each other's bucket allocations until the group's timeout.
        self._check_same_model(
            {
                "bucket_cap_mb": float(bucket_cap_mb),
                "first_bucket_mb": float(first_bucket_mb),
                "find_unused_parameters": bool(find_unused_parameters),
                "broadcast_buffers": bool(broadcast_buffers),
            }
        )
        self._sync_module_state()
        self._build_buckets(bucket_cap_mb, first_bucket_mb)
        self._reset_step()
        self.stats = StepStats(num_params=len(self._params))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params
        ]

    # ------------------------------------------------------------------ setup
    def _check_same_model(self, options: dict[str, Any]) -> None:
        group = self.process_group
        if group.size == 1:
            return
        desc = [
            ["param", n, list(p.shape), str(p.dtype), bool(p.requires_grad)] for n, p in self._named
        ]
        desc += [
            ["buffer", n, list(b.shape), str(b.dtype), False]
            for n, b in self.module.named_buffers()
        ]
        desc += [["option", k, [], str(v), False] for k, v in options.items()]
        text = json.dumps(desc)
        digests = group.all_gather_object([zlib.crc32(text.encode()), len(desc)])
        if all(d == digests[0] for d in digests):
            return
        every = group.all_gather_object(desc)
        ref = {tuple(e[:2]): e for e in every[0]}
        problems: list[str] = []
        r0 = group.ranks[0]

        def what(e: list[Any]) -> str:
            if e[0] == "option":
                return str(e[3])
            # requires_grad is part of the check, so the message must show it when it differs.
            frozen = "" if e[0] != "param" or e[4] else " requires_grad=False"
            return f"shape {tuple(e[2])} {e[3]}{frozen}"

        for r, theirs in enumerate(every[1:], start=1):
            mine = {tuple(e[:2]): e for e in theirs}
            global_r = group.ranks[r]
            before = len(problems)
            for key in ref:
                if key not in mine:
                    problems.append(f"rank {global_r} lacks {key[0]} {key[1]!r} (rank {r0} has it)")
                elif mine[key] != ref[key]:
                    a, b = ref[key], mine[key]
                    problems.append(
                        f"{key[0]} {key[1]!r}: rank {r0} has {what(a)}, "
                        f"rank {global_r} has {what(b)}"
                    )
            problems += [
                f"rank {global_r} has an extra {k[0]} {k[1]!r} (not on rank {r0})"
                for k in mine
                if k not in ref
            ]
            if len(problems) == before and theirs != every[0]:
                # Same entries in another order: buckets would pair up different parameters.
                problems.append(
                    f"rank {global_r} registers its parameters/buffers in another order than "
                    f"rank {r0}: {[e[1] for e in theirs][:6]} vs {[e[1] for e in every[0]][:6]}"
                )
        shown = "; ".join(problems[:8]) + (
            f"; ... {len(problems) - 8} more" if len(problems) > 8 else ""
        )
        raise ValueError(
            f"[rank {collectives.get_rank()}] DistributedDataParallel: the model differs across "
            f"ranks: {shown}"
        )

    def _sync_module_state(self, src: int | None = None) -> None:
        """Copy global rank ``src``'s (default: the group's first rank's) parameters and
        buffers to every rank, one broadcast per dtype."""
        group = self.process_group
        if group.size == 1:
            return
        src = group.ranks[0] if src is None else src
        tensors = [p for _, p in self._named] + [b for _, b in self.module.named_buffers()]
        by_kind: dict[tuple[Any, Any], list[Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for (_dtype, device), ts in by_kind.items():
            xp = device.xp
            flat = xp.concatenate([t.data.reshape(-1) for t in ts]) if ts else None
            if flat is None or flat.size == 0:
                continue
            group.broadcast(flat, src=src)
            start = 0
            for t in ts:
                n = t.data.size
                # Assign through the array's own shape: reshape(-1) of a non-contiguous array (a
                # Parameter made from a transpose) is a copy, and the write would be lost.
                t.data[...] = flat[start : start + n].reshape(t.data.shape)
                start += n

    def _build_buckets(self, cap_mb: float, first_mb: float) -> None:
        params = [p for _, p in self._named if p.requires_grad]
        self._params = params
        self._names = {id(p): n for n, p in self._named}
        self._index = {id(p): k for k, p in enumerate(params)}
        cap = int(cap_mb * (1 << 20))
        first_cap = int(first_mb * (1 << 20))
        buckets: list[_Bucket] = []
        open_by_kind: dict[tuple[Any, Any], _Bucket] = {}
        counts: dict[tuple[Any, Any], int] = {}
        for p in reversed(params):
            kind = (p.dtype, p.device)
            b = open_by_kind.get(kind)
            # The first bucket of each kind is small so its all-reduce starts early.
            limit = first_cap if counts.get(kind, 0) <= 1 else cap
            size = p.size * p.dtype.itemsize
            if b is None or (b.numel and b.nbytes + size > limit):
                b = _Bucket(index=len(buckets), dtype=p.dtype, device=p.device)
                buckets.append(b)
                open_by_kind[kind] = b
                counts[kind] = counts.get(kind, 0) + 1
            b.params.append(p)
            b.offsets.append(b.numel)
            b.numel += p.size
        group = self.process_group
        self._loc: dict[int, tuple[int, int]] = {}
        for b in buckets:
            if b.device.type == "cpu":
                buf = group.alloc(b.numel, b.dtype)
            else:
                with b.device:
                    buf = b.device.xp.zeros(b.numel, dtype=b.dtype)
            b.buffer = buf
            for j, (p, off) in enumerate(zip(b.params, b.offsets, strict=True)):
                view = tl.from_array(buf[off : off + p.size].reshape(p.shape))
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
        self._grad_scale = 1.0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synchronized backward averages the sum."""
        prev = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = prev

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Use ``hook(state, bucket) -> Work`` to reduce each bucket (see ddp._hooks)."""
        if not callable(hook):
            raise TypeError(f"comm hook must be callable, got {hook!r}")
        self._hook, self._hook_state = hook, state

    def join(
        self,
        *,
        optimizers: Any = (),
        throw_on_early_termination: bool = False,
        enable: bool = True,
    ) -> Join:
        """The same as :func:`ddp.join` on this model (PyTorch's ``model.join()`` spelling)."""
        from ._join import join  # _join imports this module

        return join(
            self,
            optimizers=optimizers,
            throw_on_early_termination=throw_on_early_termination,
            enable=enable,
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_backward:
            raise RuntimeError(
                f"[rank {collectives.get_rank()}] DistributedDataParallel: the previous backward "
                "did not finish synchronizing gradients (did it raise?); the ranks may now "
                "disagree on the order of collectives"
            )
        src = self.process_group.ranks[0]
        if self._join is not None:
            # Tell the ranks that ran out of data what this step does; under join the buffers
            # come from the lowest rank that still has data (a joined rank's are stale).
            src = self._join.notify(sync=self._require_sync and tl.is_grad_enabled())
        if self.broadcast_buffers and self.process_group.size > 1:
            self._broadcast_buffers(src)
        return self.module(*args, **kwargs)

    def _broadcast_buffers(self, src: int) -> None:
        for _, b in self.module.named_buffers():
            data = b.data
            if data.flags.c_contiguous:
                self.process_group.broadcast(data, src=src)
            else:
                # Collectives take contiguous arrays only; a transposed buffer goes through
                # a contiguous copy.
                tmp = b.device.xp.ascontiguousarray(data)
                self.process_group.broadcast(tmp, src=src)
                data[...] = tmp

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
        if not self._require_sync:
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
                if self._grad_scale != 1.0:
                    # Under join with k of N ranks active: the hook averaged over N, the
                    # average over the k ranks that had data is N/k times that.
                    b.buffer *= b.buffer.dtype.type(self._grad_scale)
            self._check_deferred()
            if self._defers_control():
                # nccl: issue the check now, read it at the next synchronized backward (the
                # stream runs it before that step's buckets): no host sync in this step.
                sent = control.copy()
                work = self.process_group.all_reduce(sent, ReduceOp.SUM, async_op=True)
                self._deferred = (work, sent, self._used.copy())
                control[:] = 0
            else:
                self.process_group.all_reduce(control, ReduceOp.SUM)
        except BaseException as exc:
            return exc
        return None

    def _defers_control(self) -> bool:
        """Whether the control check waits for the next backward: on a backend that takes
        device arrays (nccl) with every bucket on a GPU, a host wait for it would wait for
        every bucket; not with find_unused_parameters (it needs the result now) nor under
        join (whose shadow steps check at once)."""
        backend = getattr(self.process_group, "backend", None)
        return (
            bool(getattr(backend, "accepts_device_arrays", False))
            and not self.find_unused_parameters
            and self._join is None
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
        group = self.process_group
        names = [
            self._names[id(self._params[k])] for k in range(len(self._params)) if not used_local[k]
        ]
        every = group.all_gather_object(names)
        detail = "; ".join(f"rank {group.ranks[r]}: {lst}" for r, lst in enumerate(every) if lst)
        raise RuntimeError(
            f"[rank {collectives.get_rank()}] DistributedDataParallel: parameters received "
            f"no gradient in {when} ({detail}). Pass find_unused_parameters=True if "
            "some parameters are legitimately unused in a step"
        )

    # ------------------------------------------------------------------ delegation
    def state_dict(self) -> Any:
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> list[str]:
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict)

    def bucket_sizes(self) -> list[int]:
        """Bytes in each bucket, in launch order."""
        return [b.nbytes for b in self._buckets]

    def extra_repr(self) -> str:
        return f"buckets={len(self._buckets)}, world_size={self.process_group.size}"
