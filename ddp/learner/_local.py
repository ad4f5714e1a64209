"""One thread driving one device, or several (Burn's single-device and multi-device paths).

On one device a step is the hand-written loop: forward, backward, ``optimizer.step()``,
``lr_scheduler.step()``. On several (``ExecutionStrategy.multi_device``) the global batch is
split, each device runs a forward and backward on its replica and shard, one after the other,
and the gradients are combined with tensorlib copies, which every device kind supports (the
point of this path: devices with no collectives among them, such as remote devices of two
servers). Then either

* ``"main_device"``: the gradients are summed on the main device, weighted by each shard's
  share of the batch, the user's optimizer steps there, and the parameters are copied to the
  other devices; or
* ``"sharded"``: each parameter belongs to one device (contiguous shards of about equal size);
  its gradients are summed there, that device's optimizer (over its shard) updates it, and it
  is copied to the other devices. The optimizer state is spread across the devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorlib as tl
from tensorlib import Device, Tensor, nn, optim

from ._batches import batch_size, shard, shard_bounds
from ._loop import Plan, Worker, check_train_batch
from ._outputs import Tally
from ._replicas import (
    copy_state,
    gather_optimizer,
    optimizer_over,
    replicate,
    sync_hyper,
    tensors_of,
)
from ._step import correct_count, run_step

__all__ = ["LocalWorker", "shard_owners"]


def shard_owners(sizes: Sequence[int], k: int) -> list[int]:
    """The device owning each parameter: contiguous runs of about ``sum(sizes) / k`` elements
    each (a parameter goes to the device its middle element falls on)."""
    total = max(1, sum(sizes))
    owners, start = [], 0
    for size in sizes:
        owners.append(min(k - 1, (k * (2 * start + size)) // (2 * total)))
        start += size
    return owners


def _weighted_sum(grads: Sequence[Tensor | None], weights: Sequence[float], dev: Device) -> Any:
    """``sum(w * g)`` over the gradients that exist, on ``dev``, in device order."""
    acc = None
    for g, w in zip(grads, weights, strict=True):
        if g is None:
            continue
        term = g.detach().to(dev) * w
        acc = term if acc is None else acc + term
    return acc


class LocalWorker(Worker):
    """Runs the whole global batch on ``devices`` from the calling thread.

    Args:
        plan: the run.
        model: the user's model, on ``devices[0]``.
        optimizer: the user's optimizer over ``model``'s parameters.
        scheduler: the user's scheduler, or None.
        devices: the devices (one for ``single_device``).
        mode: ``"main_device"`` or ``"sharded"`` (ignored on one device).
    """

    def __init__(
        self,
        plan: Plan,
        model: nn.Module,
        optimizer: optim.Optimizer,
        scheduler: Any,
        devices: Sequence[Device],
        mode: str,
    ) -> None:
        self.plan = plan
        self.module, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.devices = list(devices)
        self.k = len(self.devices)
        self.sharded = mode == "sharded" and self.k > 1
        self.replicas = [model] + [replicate(model, d) for d in self.devices[1:]]
        self.params = [list(r.parameters()) for r in self.replicas]
        self.tensors = [tensors_of(r) for r in self.replicas]
        self.owners = shard_owners([p.size for p in self.params[0]], self.k)
        # id(replica parameter) -> the user's: where a shard's optimizer state goes back to.
        self.back = {
            id(rp): p for ps in self.params for rp, p in zip(ps, self.params[0], strict=True)
        }
        self.shard_opts: list[optim.Optimizer] = []
        self._build_shards()

    def _build_shards(self) -> None:
        if not self.sharded:
            return
        self.shard_opts = []
        for j in range(self.k):
            mapping = {id(p): rp for p, rp in zip(self.params[0], self.params[j], strict=True)}
            mine = [id(p) for p, o in zip(self.params[0], self.owners, strict=True) if o == j]
            self.shard_opts.append(optimizer_over(self.optimizer, mapping, mine))
        self.optimizer.state = {}  # the shards hold it until before_save gathers it

    # ------------------------------------------------------------------ Worker
    def set_mode(self, train: bool) -> None:
        for r in self.replicas:
            r.train(train)

    def train_batch(self, batch: Any, epoch: int, index: int, tally: Tally) -> None:
        n = check_train_batch(batch, self.k, epoch, index)
        bounds = shard_bounds(n, self.k)
        for r in self.replicas:
            r.zero_grad()
        for rep, dev, (lo, hi) in zip(self.replicas, self.devices, bounds, strict=True):
            out = run_step(rep, rep, shard(batch, (lo, hi), n, dev), self.plan.loss_fn, True)
            out.loss.backward()
            tally.add(float(out.loss.item()), hi - lo, correct_count(out))
        if self.k == 1:
            self.optimizer.step()
        else:
            self._multi_step([(hi - lo) / n for lo, hi in bounds])
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1

    def _multi_step(self, weights: list[float]) -> None:
        """Combine the devices' gradients, update, and copy the parameters everywhere."""
        with tl.no_grad():
            for i in range(len(self.params[0])):
                home = self.owners[i] if self.sharded else 0
                target = self.params[home][i]
                grads = [ps[i].grad for ps in self.params]
                target.grad = _weighted_sum(grads, weights, self.devices[home])
        if not self.sharded:
            self.optimizer.step()
            for j in range(1, self.k):
                copy_state(self.tensors[0], self.tensors[j])
            return
        for part in self.shard_opts:
            sync_hyper(self.optimizer, part)  # the scheduler sets the user's optimizer's lr
            part.step()
        with tl.no_grad():
            for i, home in enumerate(self.owners):
                src = self.params[home][i]
                for j in range(self.k):
                    if j != home:
                        self.params[j][i].copy_(src)
        buffers = len(self.params[0])
        for j in range(1, self.k):  # buffers (forward-time state) follow the main device's
            copy_state(self.tensors[0][buffers:], self.tensors[j][buffers:])

    def valid_batch(self, batch: Any, tally: Tally) -> None:
        n = batch_size(batch)
        for rep, dev, (lo, hi) in zip(
            self.replicas, self.devices, shard_bounds(n, self.k), strict=True
        ):
            if hi > lo:  # a last batch smaller than the device count leaves some idle
                out = run_step(rep, rep, shard(batch, (lo, hi), n, dev), self.plan.loss_fn, False)
                tally.add(float(out.loss.item()), hi - lo, correct_count(out))

    def before_save(self) -> None:
        if self.sharded:
            gather_optimizer(self.optimizer, self.shard_opts, self.back)

    def after_load(self) -> None:
        for j in range(1, self.k):
            copy_state(self.tensors[0], self.tensors[j])
        self._build_shards()

    def finish(self) -> None:
        """Leave the user's optimizer holding the whole state (sharded: gathered)."""
        self.before_save()
