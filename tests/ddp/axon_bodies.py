"""Rank bodies for ``ddp.axon`` (axonml-distributed's API) and ``ddp.sync_gradients``.

Each body runs on every rank of a world and returns what the test compares across ranks
(JSON-able). ``world`` None means this process's default group (``World.init()``: a rank of a
pool, serial x1, cpu xN or threads xN); the mock-world tests pass the ``World`` of one
``MockBackend.create_world(n)`` end instead, in a thread of the test process.

Rank r contributes values that depend on r, so a reduction that skips a rank, or does
nothing, shows in the result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import collectives
import ddp
import tensorlib as tl
from ddp.axon import (
    DistributedDataParallel,
    GradientBucket,
    GradientSynchronizer,
    GradSyncStrategy,
    ReduceOp,
    World,
    all_gather,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_min,
    all_reduce_product,
    all_reduce_sum,
    barrier,
    broadcast,
    broadcast_from,
    is_main_process,
    rank,
    sync_gradient,
    sync_gradients,
    world_size,
)
from tensorlib import nn


def _world(world: World | None) -> World:
    return World.init() if world is None else world


def _vals(t: Any) -> list[Any]:
    out: list[Any] = (t.numpy() if isinstance(t, tl.Tensor) else np.asarray(t)).tolist()
    return out


# ---------------------------------------------------------------------- communication
def comm_case(world: World | None = None) -> dict[str, Any]:
    """Every communication function of the README (and axonml's other all-reduces)."""
    w = _world(world)
    pg = w.default_group()
    r, n = w.rank(), w.world_size()
    base = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    out: dict[str, Any] = {"rank": rank(pg), "world_size": world_size(pg)}
    out["is_main"] = is_main_process(pg)
    for name, fn in [
        ("sum", all_reduce_sum),
        ("mean", all_reduce_mean),
        ("min", all_reduce_min),
        ("max", all_reduce_max),
        ("product", all_reduce_product),
    ]:
        t = tl.tensor(base * (r + 1))
        assert fn(t, pg) is t, f"{name}: the tensor itself comes back"
        out[name] = _vals(t)
    t = tl.tensor(base * (r + 1))
    broadcast(t, pg)
    out["broadcast"] = _vals(t)
    t = tl.tensor(base * (r + 1))
    broadcast_from(t, n - 1, pg)
    out["broadcast_from_last"] = _vals(t)
    # A transposed (non-contiguous) tensor is reduced too, through a copy.
    t = tl.tensor(np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1)).transpose(1, 0)
    all_reduce_sum(t, pg)
    out["transposed_sum"] = _vals(t)
    gathered = all_gather(tl.tensor(base * (r + 1)), pg)
    out["gathered"] = _vals(gathered)
    barrier(pg)
    w.barrier()
    return out


# ---------------------------------------------------------------------- gradients
def plain_gradients_case(world: World | None = None) -> dict[str, Any]:
    """``ddp.sync_gradients([g1, g2], group)`` with gradient tensors themselves (axonml's
    usage), a parameter and a frozen parameter in one list; axon's ``sync_gradients``."""
    w = _world(world)
    group = w.default_group().group
    r = w.rank()
    g1 = tl.tensor([0.1, 0.2]) * float(r + 1)
    g2 = tl.tensor([[0.3, 0.4, 0.5]]) * float(r + 1)
    issued = ddp.sync_gradients([g1, g2], group)
    param = nn.Parameter(tl.zeros(3))
    param.grad = tl.tensor([1.0, 2.0, 3.0]) * float(r + 1)
    frozen = nn.Parameter(tl.ones(2), requires_grad=False)
    grad = tl.tensor([4.0]) * float(r + 1)
    mixed = ddp.sync_gradients([param, frozen, grad], group, op="sum")
    a, b = tl.tensor([1.0, 2.0]) * float(r + 1), tl.tensor([3.0]) * float(r + 1)
    axon_issued = sync_gradients([a, b], w.default_group())
    c = tl.tensor([5.0, 6.0]) * float(r + 1)
    sync_gradient(c, w.default_group())
    return {
        "issued": issued,
        "g1": _vals(g1),
        "g2": _vals(g2),
        "mixed_issued": mixed,
        "param_grad": _vals(param.grad),
        "param": _vals(param),
        "frozen_grad": None if frozen.grad is None else _vals(frozen.grad),
        "frozen": _vals(frozen),
        "grad": _vals(grad),
        "axon_issued": axon_issued,
        "axon": [_vals(a), _vals(b), _vals(c)],
    }


def bucket_case(world: World | None = None) -> dict[str, Any]:
    """The README's bucketing: add, all-reduce ``data_mut()`` through the backend, extract."""
    w = _world(world)
    pg = w.default_group()
    r = w.rank()
    bucket = GradientBucket(5)
    assert bucket.is_empty()
    assert bucket.add(tl.tensor([0.1, 0.2]) * float(r + 1))
    assert bucket.add(tl.tensor([[0.3], [0.4], [0.5]]) * float(r + 1))
    full = bucket.is_full()
    refused = bucket.add(tl.tensor([9.0]))  # a sixth element does not fit
    pg.backend().all_reduce(bucket.data_mut(), ReduceOp.Average)
    synced = bucket.extract()
    return {
        "full": full,
        "refused": refused,
        "size": bucket.size(),
        "synced": [_vals(t) for t in synced],
        "shapes": [list(t.shape) for t in synced],
    }


def synchronizer_case(bucket_size: int, world: World | None = None) -> dict[str, Any]:
    """``GradientSynchronizer``: sizes 2, 3 and 4 in buckets of ``bucket_size`` elements;
    the group's sequence number says how many all-reduces ran; ``NoSync`` runs none."""
    w = _world(world)
    pg = w.default_group()
    r = w.rank()
    sync = GradientSynchronizer(GradSyncStrategy.Synchronous, bucket_size)
    sync.prepare(4)
    grads = [tl.tensor(np.full(k, float(r + 1), np.float32)) for k in (2, 3, 4)]
    for i, g in zip((0, 1, 3), grads, strict=True):
        sync.add_gradient(i, g)
    before = pg.group.seq
    issued = sync.sync_all(pg)
    ran = pg.group.seq - before
    kept = [sync.gradients()[0] is grads[0], sync.gradients()[2] is None]
    sync.clear()
    off = GradientSynchronizer(GradSyncStrategy.NoSync, bucket_size)
    off.prepare(1)
    mine = tl.tensor([float(r + 1)])
    off.add_gradient(0, mine)
    return {
        "issued": issued,
        "ran": ran,
        "grads": [_vals(g) for g in grads],
        "kept": kept,
        "cleared": sync.gradients(),
        "no_sync": [off.sync_all(pg), _vals(mine)],
    }


# ---------------------------------------------------------------------- DDP
def ddp_case(world: World | None = None) -> dict[str, Any]:
    """The README's loop: DDP over ``world.default_group()``, ``sync_parameters()``, a step
    whose backward averages, then ``sync_gradients()`` (which must issue no collective), and
    its refusals: before any backward, and after a ``no_sync`` backward."""
    w = _world(world)
    r = w.rank()
    model = nn.Linear(3, 2)
    rng = np.random.default_rng(10 + r)  # every rank its own start: DDP copies rank 0's
    for p in model.parameters():
        p.data[...] = rng.standard_normal(p.shape)
    net = DistributedDataParallel(model, w.default_group())
    seq = net.process_group.seq
    errors: dict[str, str] = {}
    try:
        net.sync_gradients()
    except RuntimeError as e:
        errors["before_backward"] = str(e)
    copied = net.sync_parameters()
    net.train()
    x = tl.tensor(np.full((2, 3), float(r + 1), np.float32))
    net.forward(x).sum().backward()
    before = net.process_group.seq
    stats = net.sync_gradients()
    extra = net.process_group.seq - before
    grad = _vals(model.weight.grad)
    with net.no_sync():
        net.forward(x).sum().backward()
    try:
        net.sync_gradients()
    except RuntimeError as e:
        errors["after_no_sync"] = str(e)
    net.forward(x).sum().backward()  # averages the accumulated sum
    after_sync = _vals(model.weight.grad)
    net.sync_gradients()
    return {
        "param0": _vals(model.weight),
        "copied": copied,
        "grad": grad,
        "after_sync": after_sync,
        "extra_collectives": extra,
        "launched": len(stats.launch_order),
        "errors": errors,
        "issued_at_setup": seq,
    }


# ---------------------------------------------------------------------- groups
def subgroup_case(world: World | None = None) -> dict[str, Any]:
    """``world.new_group`` on every rank: the members all-reduce their ranks, the others are
    refused; a group naming a rank the world lacks answers ``size`` but refuses collectives."""
    w = _world(world)
    n = w.world_size()
    members = [0, n - 1] if n > 1 else [0]
    sub = w.new_group(members)
    out: dict[str, Any] = {
        "size": sub.size(),
        "ranks": sub.ranks(),
        "contains": [sub.contains(r) for r in range(n)],
        "clone_size": sub.clone().size(),
    }
    if sub.contains(w.rank()):
        t = tl.tensor([float(w.rank())])
        all_reduce_sum(t, sub)
        out["sum"] = _vals(t)
    else:
        try:
            sub.barrier()
        except RuntimeError as e:
            out["refused"] = str(e)
    beyond = w.new_group([0, n])  # rank n does not exist
    try:
        beyond.barrier()
    except ValueError as e:
        out["beyond"] = [beyond.size(), str(e)]
    seq = w.default_group().group.seq
    w.barrier()  # the world's own group still works after all that
    out["world_seq_step"] = w.default_group().group.seq - seq
    return out


def default_world_case() -> dict[str, Any]:
    """``World.init()`` names the process's default group."""
    w = World.init()
    return {
        "rank": w.rank(),
        "world_size": w.world_size(),
        "is_main": w.is_main(),
        "same_group": w.default_group().group is collectives.get_default_group(),
        "backend": w.default_group().backend().name(),
    }
