"""``DistributedDataParallel``: bucketed gradient averaging overlapped with backward.

How it works:

* At construction every rank checks that all ranks have the same parameter and buffer names,
  shapes and dtypes (one small exchange; the full lists only when they differ), then copies
  rank 0's parameters and buffers to every rank.
* The gradients are the :class:`~ddp._reducer.Reducer`'s (``ddp/_reducer.py``): it buckets
  them, starts each bucket's all-reduce as backward fills it, and when ``loss.backward()``
  returns every ``.grad`` holds the average over ranks. The wrapper owns it as ``.reducer``.
* Buffers (``broadcast_buffers``): rank 0's are broadcast before a forward that follows a
  synchronizing forward (grad enabled, not under ``no_sync``), and before the first forward;
  a forward under ``tensorlib.no_grad()`` or ``no_sync`` clears the need for the next one.
  This is PyTorch's rule (``require_forward_param_sync``, set after each forward; the
  broadcast happens when it is set, see ``will_sync_module_buffers``). So an evaluation loop
  under ``no_grad`` broadcasts once, at its first forward (every rank then evaluates rank 0's
  buffers), and issues no collective after that: ranks may run different numbers of eval
  batches (uneven shards, ``DistributedSampler(..., even_shards=False)``), as long as every
  rank runs at least one when the model has buffers.
* Under :func:`ddp.join` (``ddp/_join.py``) each forward first tells the other ranks that
  this rank has data, then broadcasts the buffers (every forward, from the lowest rank with
  data: the join's shadow loop mirrors exactly that); ranks that ran out shadow the others'
  collectives, and the buckets are scaled so that they hold the average over the ranks that
  had data in that step. A join block leaves ``require_forward_param_sync`` as it found it,
  so the ranks agree on it afterwards whatever their numbers of forwards.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import collectives
import tensorlib as tl
from collectives import NonMemberGroup, ProcessGroup, where
from tensorlib.nn import Module

from ._reducer import CommHook, Reducer, StepStats
from ._sync import broadcast_module_buffers, broadcast_module_state

if TYPE_CHECKING:
    from ._join import Join

__all__ = ["DistributedDataParallel"]


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
        broadcast_buffers: copy rank 0's buffers to every rank before a forward that
            follows a synchronizing forward (and before the first); see the module docstring.
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
        self.broadcast_buffers = broadcast_buffers
        # PyTorch's flag: the last forward (outside join) synchronized, so the next one
        # broadcasts the buffers. True at first, as in PyTorch.
        self.require_forward_param_sync = True
        named = list(module.named_parameters())
        # Options that decide which collectives DDP issues must agree too: different bucket
        # caps make ranks wait for each other's bucket allocations until the group's timeout.
        self._check_same_model(
            named,
            {
                "bucket_cap_mb": float(bucket_cap_mb),
                "first_bucket_mb": float(first_bucket_mb),
                "find_unused_parameters": bool(find_unused_parameters),
                "broadcast_buffers": bool(broadcast_buffers),
            },
        )
        broadcast_module_state(group, module)
        self.reducer = Reducer(
            group, named, bucket_cap_mb, first_bucket_mb, find_unused_parameters, comm_hook
        )

    # ------------------------------------------------------------------ the reducer's state
    @property
    def stats(self) -> StepStats:
        """What the last synchronized backward did (see :class:`ddp.StepStats`)."""
        return self.reducer.stats

    @property
    def find_unused_parameters(self) -> bool:
        """Whether parameters that get no gradient in a step are allowed (see the class)."""
        return self.reducer.find_unused_parameters

    @find_unused_parameters.setter
    def find_unused_parameters(self, value: bool) -> None:
        self.reducer.find_unused_parameters = value

    # ------------------------------------------------------------------ setup
    def _check_same_model(self, named: list[tuple[str, Any]], options: dict[str, Any]) -> None:
        group = self.process_group
        if group.size == 1:
            return
        desc = [["param", n, list(p.shape), str(p.dtype), bool(p.requires_grad)] for n, p in named]
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
            f"{where(collectives.get_rank(), 'DistributedDataParallel')}: the model differs "
            f"across ranks: {shown}"
        )

    # ------------------------------------------------------------------ per step
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synchronized backward averages the sum."""
        reducer = self.reducer
        prev = reducer.require_sync
        reducer.require_sync = False
        try:
            yield
        finally:
            reducer.require_sync = prev

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Use ``hook(state, bucket) -> Work`` to reduce each bucket (see ddp._hooks).

        Raises:
            TypeError: when ``hook`` is not callable.
        """
        self.reducer.register_comm_hook(state, hook)

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

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (a collective every rank issues).

        Outside :func:`ddp.join`: after a synchronizing forward (grad enabled, not under
        ``no_sync``) and before the first forward (PyTorch's ``will_sync_module_buffers``);
        under join: at every forward. Always with ``broadcast_buffers``, more than one rank
        and at least one buffer.
        """
        if not self.broadcast_buffers or self.process_group.size <= 1:
            return False
        if not any(True for _ in self.module.named_buffers()):
            return False
        return self.reducer.join is not None or self.require_forward_param_sync

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        reducer = self.reducer
        if reducer.in_backward:
            raise RuntimeError(
                f"{where(collectives.get_rank(), 'DistributedDataParallel')}: the previous "
                "backward did not finish synchronizing gradients (did it raise?); the ranks may "
                "now disagree on the order of collectives"
            )
        syncing = reducer.require_sync and tl.is_grad_enabled()
        join = reducer.join
        src = self.process_group.ranks[0]
        if join is not None:
            # Tell the ranks that ran out of data what this step does; under join the buffers
            # come from the lowest rank that still has data (a joined rank's are stale).
            src = join.notify(sync=syncing)
        if self.will_sync_module_buffers():
            broadcast_module_buffers(self.process_group, self.module, src)
        out = self.module(*args, **kwargs)
        if join is None:
            # Set after the forward, as PyTorch's _post_forward does. Under join the flag is
            # left alone: ranks that ran out made fewer forwards and could not agree on it.
            self.require_forward_param_sync = syncing
        return out

    # ------------------------------------------------------------------ axonml's manual calls
    def sync_parameters(self) -> int:
        """Copy the group's first rank's parameters and buffers into every rank's model.

        axonml's loop calls ``ddp.sync_parameters()`` once before training. Construction
        already did this copy, so at that point nothing changes; later (a rank loaded other
        weights, or changed some by hand) it makes every rank's model equal again. It is a
        collective: every rank of the group calls it, at the same point.

        Returns:
            The number of tensors copied (parameters and buffers; 0 at world size 1, where
            there is nothing to copy from).

        Raises:
            RuntimeError: during a backward that did not finish synchronizing, or inside
                :func:`ddp.join` (whose ranks without data could not take part).
        """
        head = where(collectives.get_rank(), "DistributedDataParallel.sync_parameters")
        if self.reducer.in_backward or self.reducer.join is not None:
            raise RuntimeError(
                f"{head}: called "
                + (
                    "after a backward that did not finish synchronizing gradients (did it "
                    "raise?); the ranks may now disagree on the order of collectives"
                    if self.reducer.in_backward
                    else "inside a join block, where ranks that ran out of data only mirror "
                    "the others' forward and backward; call it before or after the block"
                )
            )
        broadcast_module_state(self.process_group, self.module)
        if self.process_group.size == 1:
            return 0
        return sum(1 for _ in self.module.parameters()) + sum(1 for _ in self.module.buffers())

    def sync_gradients(self) -> StepStats:
        """axonml's ``ddp.sync_gradients()`` after backward: check that backward did it.

        axonml's DDP keeps gradients local until the loop calls ``sync_gradients()``. Here
        ``loss.backward()`` itself averages every gradient over the group (bucketed, each
        bucket's all-reduce overlapping the rest of backward), so by the time the loop calls
        this, the gradients already hold the average. Reducing them again would cost a second
        all-reduce of every gradient (and, under a lossy comm hook such as fp16 compression,
        change them), so this method issues no reduction. It verifies instead that the
        gradients the model holds now are the automatic sync's result: that a synchronized
        backward ran to its end and no backward under :meth:`no_sync` added local gradients
        since. On nccl it also waits for that backward's pending check that no rank missed a
        parameter (read at the next backward otherwise). Anything else raises, so
        unsynchronized gradients never reach the optimizer silently.

        Returns:
            What the backward that synchronized the gradients did (:class:`ddp.StepStats`:
            its buckets in launch order, how many launched during backward).

        Raises:
            RuntimeError: when no synchronized backward has run since the model was wrapped
                (call it after ``loss.backward()``); when the last backward raised before it
                finished synchronizing; when gradients were accumulated under ``no_sync()``
                since the last synchronized backward (they are this rank's alone: run the
                accumulation's last backward outside ``no_sync()``, which averages the sum);
                or, on every rank, when some rank missed a parameter in that backward.
        """
        reducer = self.reducer
        head = where(collectives.get_rank(), "DistributedDataParallel.sync_gradients")
        if reducer.in_backward:
            raise RuntimeError(
                f"{head}: the last backward did not finish synchronizing gradients (did it "
                "raise?); its gradients are not averaged"
            )
        if reducer.buckets and not reducer.stats.launch_order:
            raise RuntimeError(
                f"{head}: no synchronized backward has run since the model was wrapped, so no "
                "gradient has been averaged yet; call it after loss.backward() (which averages "
                "the gradients over the group by itself)"
            )
        if reducer._accumulated.any():
            raise RuntimeError(
                f"{head}: gradients were accumulated under no_sync() since the last synchronized "
                "backward and hold this rank's values only; run the last backward of the "
                "accumulation outside no_sync(): it averages the accumulated sum"
            )
        reducer._check_deferred()  # nccl: that backward's check, otherwise read next step
        return reducer.stats

    # ------------------------------------------------------------------ delegation
    def state_dict(self) -> Any:
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> list[str]:
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict)

    def bucket_sizes(self) -> list[int]:
        """Bytes in each bucket, in launch order."""
        return self.reducer.bucket_sizes()

    def extra_repr(self) -> str:
        return f"buckets={len(self.reducer.buckets)}, world_size={self.process_group.size}"
