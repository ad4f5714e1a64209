"""One ``fully_shard`` unit: its shards, its full buffer, and the forward hooks that gather
and free them."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import tensorlib as tl
from collectives import ProcessGroup, ReduceOp, Work
from tensorlib import Tensor
from tensorlib.nn import Module, Parameter

from ._mp import MixedPrecisionPolicy, cast_floating
from ._param import FullBuffer, GatherParams, PreBackward, ShardedParam, shard_rows
from ._stats import Ledger, ShardStats

__all__ = ["Unit", "shard_of"]


def shard_of(module: Module, attr: str) -> tuple[Unit, ShardedParam] | None:
    """The unit and layout of the parameter ``module`` registers as ``attr`` when it is a
    ``fully_shard`` shard, else None. (Kept on the module that registers it, so that it lives
    as long as the model does.)"""
    entry = module.__dict__.get("_fsdp_shards", {}).get(attr)
    return entry if entry is not None and module._parameters.get(attr) is entry[1].shard else None


class Unit:
    """The parameters of ``module`` that no inner unit manages, sharded on dim 0 over ``group``.

    Args:
        module: the unit's module (its hooks are registered here).
        group: the group the shards are spread over.
        places: ``(qualified name, [(module, attribute), ...], parameter)`` for each parameter,
            already checked (one dtype, on the CPU, at least one dimension) and equal on every
            rank (the group's first rank's values).
        reshard_after_forward: free the full parameters after forward (ZeRO-3) rather than
            after backward (ZeRO-2).
        mp_policy: the dtypes to gather, reduce and return in (the shards keep theirs).
    """

    def __init__(
        self,
        module: Module,
        group: ProcessGroup,
        places: list[tuple[str, list[tuple[Module, str]], Parameter]],
        reshard_after_forward: bool,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.module = module
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        # False (set_requires_gradient_sync, no_sync): backward adds the full gradient into
        # ``accumulated`` instead of reduce-scattering it; the next synced backward sends the sum.
        self.requires_gradient_sync = True
        self.accumulated: Any = None
        self.label = type(module).__name__
        world, rank = group.size, group.rank
        self.params: list[ShardedParam] = []
        shard_off = full_off = 0
        dtype: Any = np.float32
        for name, where, p in places:
            full = np.asarray(p.data)
            rows = shard_rows(full.shape[0], world)
            mine = np.zeros((rows, *full.shape[1:]), dtype=full.dtype)
            got = full[rank * rows : (rank + 1) * rows]
            mine[: got.shape[0]] = got  # the rest is padding (zeros, and they stay zero)
            shard = Parameter(tl.from_array(mine, p.device), requires_grad=p.requires_grad)
            sp = ShardedParam(name, tuple(full.shape), rows, shard_off, full_off, shard, where)
            self.params.append(sp)
            shard_off += sp.shard_numel
            full_off += sp.shard_numel * world
            dtype = full.dtype
            for mod, attr in where:
                mod._parameters[attr] = shard
                if "_fsdp_shards" not in mod.__dict__:
                    object.__setattr__(mod, "_fsdp_shards", {})
                mod.__dict__["_fsdp_shards"][attr] = (self, sp)
        self.shard_numel = shard_off
        self.dtype = np.dtype(dtype)  # the shards' (master weights') dtype
        self.gather_dtype, self.reduce_dtype = mp_policy.dtypes(dtype)
        self.buffer = FullBuffer(full_off, self.gather_dtype)
        # Set by the outermost fully_shard over this unit (see Schedule).
        self.schedule = Schedule(self)
        self._prefetched: Work | None = None
        # How many gathers found their all-gather already issued by a prefetch (for tests).
        self.prefetch_hits = 0
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)

    # ------------------------------------------------------------------ data movement
    def _all_gather(self, async_op: bool) -> Any:
        # Copying into the send buffer casts to the gather dtype (the shards keep theirs).
        stage = np.empty(self.shard_numel, dtype=self.gather_dtype)
        for sp in self.params:
            stage[sp.shard_off : sp.shard_off + sp.shard_numel] = sp.shard.data.reshape(-1)
        self.schedule.stats.bytes_sent += (self.group.size - 1) * stage.nbytes
        return self.group.all_gather(stage, async_op=async_op)  # (N, S), rank-major

    def prefetch(self) -> None:
        """Start this unit's all-gather now (on the group's communication thread), for the
        next :meth:`gather` to find done; nothing when one is already under way. Only the
        schedule calls it, alike on every rank, so the ranks' collectives stay in order."""
        if self.params and self._prefetched is None:
            self._prefetched = self._all_gather(async_op=True)
            self.schedule.ledger.add(self._gather_bytes)

    @property
    def _gather_bytes(self) -> int:
        """An all-gather's send and receive buffers."""
        return (1 + self.group.size) * self.shard_numel * self.gather_dtype.itemsize

    def drop_prefetch(self) -> None:
        """Finish and discard a prefetch no gather used: its shards may change before the
        next one (an optimizer step)."""
        work, self._prefetched = self._prefetched, None
        if work is not None:
            work.wait()
            self.schedule.ledger.sub(self._gather_bytes)

    def gather(self) -> None:
        """All-gather every rank's shards into the full buffer (parameter-major), or take the
        prefetched all-gather; then start the next unit's, in the schedule's order."""
        world = self.group.size
        work, self._prefetched = self._prefetched, None
        ledger = self.schedule.ledger
        stats = self.schedule.stats
        stats.all_gathers += 1
        t0 = time.perf_counter()
        if work is not None:
            self.prefetch_hits += 1
            stats.prefetched += 1
            ranks = work.wait()
        else:
            ledger.add(self._gather_bytes)
            ranks = self._all_gather(async_op=False)
        stats.gather_wait_s += time.perf_counter() - t0
        if not self.buffer.gathered:
            ledger.add(self.buffer.array.nbytes)
        full = self.buffer.array
        for sp in self.params:
            n = sp.shard_numel
            full[sp.full_off : sp.full_off + n * world].reshape(world, n)[...] = ranks[
                :, sp.shard_off : sp.shard_off + n
            ]
        self.buffer.gathered = True
        ledger.sub(self._gather_bytes)

    def free(self) -> None:
        """Free the full parameters (their pages go back to the system)."""
        if self.buffer.gathered:
            self.schedule.ledger.sub(self.buffer.array.nbytes)
        self.buffer.free()

    def reduce_scatter_grad(self, grad: Any) -> None:
        """Start averaging the full buffer's gradient ``grad`` over the group, each rank
        receiving its shards' rows; then free the full buffer (backward is done with it).

        The reduce-scatter runs asynchronously, so it overlaps the backward of the units
        below. As FSDP2 does, one stays in flight: the next unit's, before it issues its
        own, waits for this one and adds its rows to the shards' ``.grad``, and a callback
        queued for the end of this ``backward()`` lands the last (the shards' gradients are
        set by this code, not by backward's accumulation, so shards' post-accumulate-grad
        hooks do not fire). So one unit's reduce-scatter buffers are held at a time.

        Without gradient sync the gradient is added (in the reduce dtype) to
        :attr:`accumulated` instead, and the next synced backward reduce-scatters the sum.
        """
        ledger = self.schedule.ledger
        ledger.add(grad.nbytes)  # backward's full gradient, alive while this runs
        if not self.requires_gradient_sync:
            if self.accumulated is None:
                self.accumulated = grad.astype(self.reduce_dtype, copy=True)
                ledger.add(self.accumulated.nbytes)
            else:
                self.accumulated += grad
            self.free()
            ledger.sub(grad.nbytes)
            return
        acc, self.accumulated = self.accumulated, None
        if acc is not None:
            acc += grad
        # Memory first: backward is done with the full parameters, and the previous unit's
        # reduce-scatter has had this unit's whole backward to finish: land it now, before
        # this one's buffers exist (as FSDP2 waits for it), so at most one is held.
        self.free()
        self.schedule.settle()
        world = self.group.size
        stage = np.empty((world, self.shard_numel), dtype=self.reduce_dtype)
        held = stage.nbytes + stage[0].nbytes  # the send buffer and the receive buffer
        ledger.add(held)
        src = grad if acc is None else acc
        for sp in self.params:
            n = sp.shard_numel
            stage[:, sp.shard_off : sp.shard_off + n] = src[
                sp.full_off : sp.full_off + n * world
            ].reshape(world, n)
        work = self.group.reduce_scatter(stage, ReduceOp.AVG, async_op=True)
        self.schedule.stats.reduce_scatters += 1
        self.schedule.stats.bytes_sent += (world - 1) * stage[0].nbytes
        ledger.sub(grad.nbytes + (0 if acc is None else acc.nbytes))
        self.schedule.track(_Reduce(self, work, held))

    def land(self, work: Work) -> None:
        """Wait for a reduce-scatter and add its rows to the shards' gradients."""
        t0 = time.perf_counter()
        mine = work.wait().reshape(-1)
        self.schedule.stats.reduce_wait_s += time.perf_counter() - t0
        for sp in self.params:
            shard = sp.shard
            if not shard.requires_grad:
                continue
            rows = mine[sp.shard_off : sp.shard_off + sp.shard_numel].reshape(shard.shape)
            if shard.grad is None:  # in the shard's dtype (a copy: ``mine`` is the receive buffer)
                shard.grad = tl.from_array(rows.astype(shard.dtype, copy=True), shard.device)
            else:
                shard.grad.data[...] += rows

    # ------------------------------------------------------------------ forward hooks
    def _pre_forward(self, module: Module, args: tuple[Any, ...]) -> Any:
        self.schedule.started(self)
        if self.params:
            self._unshard()
        mp = self.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            return cast_floating(args, mp.param_dtype)
        return None

    def _unshard(self) -> None:
        """Gather the full parameters and put them where the shards are registered."""
        # The full parameters are views of one recorded node, so backward through any of them
        # reaches GatherParams.backward once, with the whole buffer's gradient.
        flat = GatherParams.apply(*(sp.shard for sp in self.params), unit=self)
        nxt = self.schedule.next_forward(self)
        if nxt is not None:
            nxt.prefetch()  # its all-gather runs while this unit computes
        for sp in self.params:
            full = sp.full_view(flat, self.group.size)
            for mod, attr in sp.places:
                mod._parameters[attr] = full

    def _post_forward(self, module: Module, args: tuple[Any, ...], out: Any) -> Any:
        self.schedule.finished(self)
        if self.mp_policy.output_dtype is not None:
            out = cast_floating(out, self.mp_policy.output_dtype)
        if not self.params:
            return out
        for sp in self.params:
            for mod, attr in sp.places:
                mod._parameters[attr] = sp.shard
        grad = tl.is_grad_enabled() and any(sp.shard.requires_grad for sp in self.params)
        # Without grad no backward will free it: ZeRO-2 frees after such a forward too.
        if self.reshard_after_forward or not grad:
            self.free()
        return _wrap_outputs(out, self) if grad else out


class Schedule:
    """The order a model's units ran in at its last complete forward, which decides what to
    prefetch: the next unit to start in forward, and in backward (ZeRO-3) the next unit to
    regather, the reverse of the order forwards ended in. One per outermost ``fully_shard``,
    shared by the units under it; the order is each rank's own, the same on every rank of a
    model that runs the same units in the same order.
    """

    def __init__(self, root: Unit) -> None:
        self.root = root
        self.forward: list[Unit] = []
        self.backward: list[Unit] = []
        self._started: list[Unit] = []
        self._finished: list[Unit] = []
        self._recording = False  # inside the root's forward (a unit called alone records nothing)
        self.ledger = Ledger()
        self._reducing: _Reduce | None = None  # the reduce-scatter in flight

    @property
    def stats(self) -> ShardStats:
        return self.ledger.stats

    def settle(self) -> None:
        """Land the reduce-scatter in flight when this backward issued it; discard it when
        a backward that raised did (nothing of it may reach ``.grad`` then)."""
        prev, self._reducing = self._reducing, None
        if prev is not None:
            if prev.backward == tl.current_backward_id():
                prev.land()
            else:
                prev.discard()

    def track(self, new: _Reduce) -> None:
        """Keep ``new`` as the reduce-scatter in flight; a callback lands it at the end of
        backward if the next unit's does not first."""
        self._reducing = new
        tl.queue_callback(new.land)

    def landed(self, done: _Reduce) -> None:
        if self._reducing is done:
            self._reducing = None

    def started(self, unit: Unit) -> None:
        if unit is self.root:
            self._started, self._finished, self._recording = [], [], True
            self.ledger.new_step()
        if self._recording:
            self._started.append(unit)

    def finished(self, unit: Unit) -> None:
        if not self._recording:
            return
        self._finished.append(unit)
        if unit is self.root:
            self._recording = False
            # A prefetch (from the previous order) for a unit this forward did not run.
            for u in self.forward:
                u.drop_prefetch()
            self.forward, self.backward = self._started, self._finished[::-1]

    def next_forward(self, unit: Unit) -> Unit | None:
        return _after(self.forward, unit)

    def next_backward(self, unit: Unit) -> Unit | None:
        return _after(self.backward, unit)


class _Reduce:
    """One unit's reduce-scatter in flight, landed once (by the next unit's, or at the end of
    the backward that issued it)."""

    def __init__(self, unit: Unit, work: Work, held: int) -> None:
        self.unit, self.held = unit, held
        self.work: Work | None = work
        self.backward = tl.current_backward_id()

    def land(self) -> None:
        work, self.work = self.work, None
        if work is None:
            return
        self.unit.land(work)
        self._release()

    def discard(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            work.wait()
            self._release()

    def _release(self) -> None:
        self.unit.schedule.ledger.sub(self.held)
        self.unit.schedule.landed(self)


def _after(order: list[Unit], unit: Unit) -> Unit | None:
    for i, u in enumerate(order[:-1]):
        if u is unit:
            return order[i + 1]
    return None


def _wrap_outputs(out: Any, unit: Unit) -> Any:
    """``out`` with every Tensor that requires grad passed through :class:`PreBackward`."""
    if isinstance(out, Tensor):
        return PreBackward.apply(out, unit=unit) if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap_outputs(o, unit) for o in out)
    return out
