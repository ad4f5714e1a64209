"""DDP over a device list: one rank thread and one model replica per device (Burn's DDP).

:func:`run_ddp` starts ``collectives.spawn(..., backend="threads", devices=...)``; every rank
thread runs :func:`~ddp.learner._loop.run_epochs` over a :class:`DdpWorker`, which wraps its
replica in :class:`~ddp.DistributedDataParallel` (bucketed all-reduce overlapped with
backward) and takes its shard of each global batch. Rank 0 alone iterates the loaders and
hands each batch to the other ranks (:class:`_Feed`), so a loader is never iterated from two
threads. Rank 0's replica, optimizer and scheduler are copied back into the user's objects.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import collectives
from collectives import ProcessGroup, ReduceOp, Work
from tensorlib import Device, nn, optim

from .._ddp import DistributedDataParallel
from .._hooks import GradBucket
from .._sync import broadcast_module_buffers
from ._batches import batch_size, shard, shard_bounds
from ._loop import Plan, Worker, check_train_batch, run_epochs
from ._outputs import EpochMetrics, Tally
from ._progress import Progress
from ._replicas import clone_scheduler, gather_optimizer, optimizer_over, replicate, sync_hyper
from ._step import correct_count, run_step

__all__ = ["DdpWorker", "run_ddp"]

_END = object()  # the end of one phase's batches in a feed
_POLL_S = 0.1


class _PeerStoppedError(RuntimeError):
    """This rank stopped because another failed (never the root cause of a run's failure)."""


class _Feed:
    """Rank 0's batches, handed to the other ranks through one bounded queue each."""

    def __init__(self, world: int) -> None:
        self.queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=4) for _ in range(world)]
        self.failed = threading.Event()

    def fail(self) -> None:
        """A rank failed: every rank waiting on the feed stops."""
        self.failed.set()

    def _check(self) -> None:
        if self.failed.is_set():
            raise _PeerStoppedError("another rank of the DDP run failed; this rank stops too")

    def _put(self, q: queue.Queue[Any], item: Any) -> None:
        while True:
            self._check()
            try:
                q.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def source(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Rank 0: yield ``batches``, giving each to the other ranks first."""
        for batch in batches:
            for q in self.queues[1:]:
                self._put(q, batch)
            yield batch
        for q in self.queues[1:]:
            self._put(q, _END)

    def sink(self, rank: int) -> Iterator[Any]:
        """Another rank: the batches rank 0 gave, until the end of the phase."""
        q = self.queues[rank]
        while True:
            self._check()
            try:
                item = q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _END:
                return
            yield item


def _sum_hook(state: ProcessGroup, bucket: GradBucket) -> Work:
    """DistributedConfig(all_reduce_op=Sum): the replicas' gradients summed, not averaged."""
    work: Work = state.all_reduce(bucket.buffer(), ReduceOp.SUM, async_op=True)
    return work


@dataclass
class _Shared:
    """What the controller gives every rank thread."""

    plan: Plan
    replicas: list[nn.Module]
    optimizers: list[optim.Optimizer]
    schedulers: list[Any]
    op: str  # "mean" or "sum"
    bucket_cap_mb: float
    feed: _Feed
    errors: dict[int, BaseException] = field(default_factory=dict)


class DdpWorker(Worker):
    """One rank's share of each global batch on its device, gradients all-reduced by DDP."""

    def __init__(self, rank: int, shared: _Shared) -> None:
        self.rank, self.shared = rank, shared
        self.k = len(shared.replicas)
        self.device: Device = collectives.get_device()
        self.module = shared.replicas[rank]
        self.optimizer = shared.optimizers[rank]
        self.scheduler = shared.schedulers[rank]
        self.is_main = rank == 0
        self.has_buffers = any(True for _ in self.module.buffers())
        self._net: DistributedDataParallel | None = None

    def net(self) -> DistributedDataParallel:
        """The DDP wrapper, made at the first training step (after a resume's load; its
        construction is a collective, reached at the same point on every rank)."""
        if self._net is None:
            hook = _sum_hook if self.shared.op == "sum" else None
            self._net = DistributedDataParallel(
                self.module,
                bucket_cap_mb=self.shared.bucket_cap_mb,
                broadcast_buffers=False,  # done here, for train_step models too
                comm_hook=hook,
            )
        return self._net

    def batches(
        self, loader: Iterable[Any], epoch: int, phase: str, progress: Progress
    ) -> Iterator[Any]:
        if self.rank == 0:
            return self.shared.feed.source(super().batches(loader, epoch, phase, progress))
        return self.shared.feed.sink(self.rank)

    def train_batch(self, batch: Any, epoch: int, index: int, tally: Tally) -> None:
        n = check_train_batch(batch, self.k, epoch, index)
        lo, hi = shard_bounds(n, self.k)[self.rank]
        part = shard(batch, (lo, hi), n, self.device)
        net = self.net()
        if self.has_buffers and self.k > 1:
            broadcast_module_buffers(net.process_group, self.module, net.process_group.ranks[0])
        self.optimizer.zero_grad()
        out = run_step(self.module, net, part, self.shared.plan.loss_fn, True)
        loss = out.loss
        # Mean averages the ranks' gradients; a rank whose shard is not 1/k of the batch is
        # weighted so that the average is the gradient of the global batch's mean loss.
        scale = (hi - lo) * self.k / n
        if self.shared.op == "mean" and scale != 1.0:
            loss = loss * scale
        loss.backward()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        tally.add(float(out.loss.item()), hi - lo, correct_count(out))

    def valid_batch(self, batch: Any, tally: Tally) -> None:
        n = batch_size(batch)
        lo, hi = shard_bounds(n, self.k)[self.rank]
        if hi > lo:
            part = shard(batch, (lo, hi), n, self.device)
            out = run_step(self.module, self.module, part, self.shared.plan.loss_fn, False)
            tally.add(float(out.loss.item()), hi - lo, correct_count(out))

    def combine(self, tallies: list[Tally]) -> list[Tally]:
        mine = [t.as_list() for t in tallies]
        every = collectives.all_gather_object(mine) if self.k > 1 else [mine]
        return [Tally.total([rank[i] for rank in every]) for i in range(len(tallies))]


def _rank_main(rank: int, shared: _Shared) -> tuple[list[EpochMetrics], int] | None:
    try:
        history, resumed = run_epochs(DdpWorker(rank, shared), shared.plan)
    except BaseException as exc:
        shared.errors[rank] = exc
        shared.feed.fail()
        raise
    return (history, resumed) if rank == 0 else None


def run_ddp(
    plan: Plan,
    model: nn.Module,
    optimizer: optim.Optimizer,
    scheduler: Any,
    devices: Sequence[Device],
    op: str,
    timeout: float,
    bucket_cap_mb: float,
) -> tuple[list[EpochMetrics], int]:
    """Train with one rank thread per device; the user's objects end up holding rank 0's.

    Raises:
        Exception: what a rank raised first (the root cause), chained to the SpawnError.
    """
    user_params = list(model.parameters())
    replicas = [replicate(model, d) for d in devices]
    optimizers, schedulers = [], []
    for rep in replicas:
        mapping = {id(p): rp for p, rp in zip(user_params, rep.parameters(), strict=True)}
        opt = optimizer_over(optimizer, mapping)
        optimizers.append(opt)
        schedulers.append(clone_scheduler(scheduler, optimizer, opt))
    shared = _Shared(plan, replicas, optimizers, schedulers, op, bucket_cap_mb, _Feed(len(devices)))
    try:
        got = collectives.spawn(
            _rank_main,
            args=(shared,),
            nprocs=len(devices),
            backend="threads",
            devices=list(devices),
            timeout=timeout,
        )
    except collectives.SpawnError as err:
        # The rank whose failure stopped the others, whichever rank spawn heard from first.
        causes = [e for e in shared.errors.values() if not isinstance(e, _PeerStoppedError)]
        root = (
            causes[0] if causes else shared.errors.get(err.rank) if err.rank is not None else None
        )
        if root is None:
            raise
        raise root from err
    assert got is not None  # spawn with threads returns every rank's value
    back = {id(rp): p for rp, p in zip(replicas[0].parameters(), user_params, strict=True)}
    model.load_state_dict(replicas[0].state_dict())
    gather_optimizer(optimizer, [optimizers[0]], back)
    sync_hyper(optimizers[0], optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(schedulers[0].state_dict())
    result: tuple[list[EpochMetrics], int] = got[0]
    return result
