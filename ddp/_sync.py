"""Manual gradient and parameter sync for code that does not wrap its model (axonml's helpers).

``DistributedDataParallel`` averages gradients during ``backward()``. Code that keeps its own
model (model-parallel layers, a replicated bias next to sharded weights, a custom training
step) calls :func:`sync_gradients` after ``backward()`` instead: the gradients (of parameters,
or gradient tensors themselves, as axonml passes them) are packed into flat buckets of at most
``bucket_cap_mb`` (one per dtype and device: the package's one bucketing, ``ddp/_buckets.py``),
each bucket is reduced by one all-reduce, and the results are written back.
:func:`sync_parameters` makes every rank's parameters and buffers equal to one rank's (what
DDP does at construction).

DDP's own copies of a module's state, :func:`broadcast_module_state` (at construction and at
the end of a :func:`ddp.join`) and :func:`broadcast_module_buffers` (before a forward that
follows a synchronizing one, as PyTorch does), live here too.

Outside any process group, or in a group of one, both communicate nothing: every rank's
values already are the result (world size 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import collectives
import tensorlib as tl
from tensorlib import Tensor, nn

from ._buckets import FlatBucket, plan_buckets

__all__ = [
    "broadcast_module_buffers",
    "broadcast_module_state",
    "reduce_tensors",
    "resolve_group",
    "sync_gradients",
    "sync_parameters",
]

_OPS = ("avg", "sum", "min", "max", "prod")


def resolve_group(group: Any, where: str) -> Any:
    """The group a helper works on, or None for world size 1 (nothing to communicate).

    ``group`` None means the default group; outside any process group that is a world of
    one, and nothing is initialized by asking (the serial model).

    Raises:
        TypeError: when ``group`` is not a process group.
        RuntimeError: when this rank is not a member of ``group``.
    """
    if group is None:
        if not collectives.is_initialized():
            return None
        group = collectives.get_default_group()
    if isinstance(group, collectives.NonMemberGroup):
        raise RuntimeError(
            f"{where}: rank {group.global_rank} is not a member of the group with ranks "
            f"{list(group.ranks)}; call it on the group's members only"
        )
    if not isinstance(group, collectives.ProcessGroup):
        kind = type(group)
        raise TypeError(
            f"{where}: group must be a collectives.ProcessGroup (from collectives.new_group; a "
            f"ddp.axon group's is its .group) or None, got {kind.__module__}.{kind.__qualname__}"
        )
    return group if group.size > 1 else None


def _params(params: Iterable[Tensor] | nn.Module, where: str) -> list[Tensor]:
    items = list(params.parameters() if isinstance(params, nn.Module) else params)
    for i, p in enumerate(items):
        if not isinstance(p, Tensor):
            raise TypeError(f"{where}: item {i} is a {type(p).__name__}, not a tensorlib Tensor")
    return items


def sync_gradients(
    params: Iterable[Tensor] | nn.Module,
    group: collectives.ProcessGroup | None = None,
    op: str = "avg",
    bucket_cap_mb: float = 25.0,
) -> int:
    """Reduce the gradients of ``params`` across ``group``, one all-reduce per bucket.

    Each item is one of three things, told apart by what it is:

    * a tensor that requires grad (a parameter): its ``.grad`` is reduced; one whose ``.grad``
      is None takes part as zeros and receives the reduced gradient (as under DDP with
      ``find_unused_parameters``, the other ranks' contributions still reach it);
    * an ``nn.Parameter`` with ``requires_grad=False`` (frozen): skipped;
    * any other tensor (``requires_grad=False``, not a Parameter): it *is* a gradient, e.g.
      ``[p.grad for p in params]`` or axonml's list of gradient tensors, and its own values
      are reduced in place.

    Every rank must pass the same items (shapes and dtypes) in the same order: the buckets
    depend on them alone, never on which gradients exist, so every rank issues the same
    all-reduces.

    Args:
        params: the tensors (or a module, for all of its parameters).
        group: the group (None: the default group; outside any group nothing happens).
        op: ``"avg"`` (data parallelism), ``"sum"`` (a replicated parameter of a
            model-parallel layer, whose ranks each hold part of the gradient), ``"min"``,
            ``"max"`` or ``"prod"``.
        bucket_cap_mb: the largest bucket in MiB; a larger tensor gets a bucket of its own.

    Returns:
        The number of all-reduces issued (0 at world size 1, where every result is the
        rank's own value).

    Raises:
        ValueError: for an unknown ``op`` or a non-positive ``bucket_cap_mb``.
        TypeError: when an item of ``params`` is not a Tensor.
    """
    where = "sync_gradients"
    if not isinstance(op, str) or op.lower() not in _OPS:
        raise ValueError(f"{where}: op must be one of {list(_OPS)}, got {op!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, int | float):
        raise TypeError(f"{where}: bucket_cap_mb must be a number, got {bucket_cap_mb!r}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"{where}: bucket_cap_mb must be positive, got {bucket_cap_mb}")
    items = _params(params, where)
    pg = resolve_group(group, where)
    if pg is None:
        return 0
    targets: list[Tensor] = []
    assign: list[tuple[Tensor, Tensor]] = []  # (parameter, gradient made here) to set after
    for p in items:
        if p.requires_grad:
            g = p.grad
            if g is None or not g.data.flags.writeable:
                # No gradient: zeros take part; a read-only one: a copy is reduced.
                arr = p.device.xp.zeros(p.shape, p.data.dtype) if g is None else g.data.copy()
                g = tl.from_array(arr, p.device)
                assign.append((p, g))
            targets.append(g)
        elif not isinstance(p, nn.Parameter):
            targets.append(p)  # a gradient itself: its values are reduced
    count = reduce_tensors(pg, targets, op.lower(), max(1, int(bucket_cap_mb * (1 << 20))))
    for p, g in assign:
        p.grad = g
    return count


def reduce_tensors(
    pg: collectives.ProcessGroup,
    tensors: list[Tensor],
    op: str | collectives.ReduceOp,
    cap: int,
    unit: str = "bytes",
) -> int:
    """Reduce the values of ``tensors`` across ``pg`` in place, one all-reduce per bucket
    (:func:`ddp._buckets.plan_buckets`, in the order given).

    Args:
        pg: the group (every member passes the same shapes and dtypes in the same order).
        tensors: what to reduce; each one's ``.data`` receives the result (written in place
            when writable: views into it, such as DDP's buckets, stay valid).
        op: the reduction.
        cap: the largest bucket, in ``unit``.
        unit: ``"bytes"`` or ``"elements"``.

    Returns:
        The number of all-reduces issued.
    """
    if unit not in ("bytes", "elements"):
        raise ValueError(f"reduce_tensors: unit must be 'bytes' or 'elements', got {unit!r}")
    sizes = [int(t.data.nbytes) if unit == "bytes" else int(t.data.size) for t in tensors]
    plan = plan_buckets([(t.dtype, t.device) for t in tensors], sizes, cap)
    for members in plan:
        bucket = [tensors[i] for i in members]
        layout = FlatBucket(bucket[0].dtype, bucket[0].device)
        for t in bucket:
            layout.add(t.shape)
        flat = layout.pack([t.data for t in bucket])
        pg.all_reduce(flat, op)
        for t, chunk in zip(bucket, layout.chunks(flat), strict=True):
            if t.data.flags.writeable:
                t.data[...] = chunk
            else:
                t.data = chunk.copy()
    return len(plan)


def sync_parameters(
    module: nn.Module, src: int = 0, group: collectives.ProcessGroup | None = None
) -> int:
    """Copy global rank ``src``'s parameters and buffers into every rank's ``module``, in place.

    Every rank must call it with a module of the same structure (the broadcasts compare shapes
    and dtypes across ranks; a mismatch fails on every rank and names both sides).

    Args:
        module: the model.
        src: the global rank whose values win.
        group: the group (None: the default group; outside any group nothing happens).

    Returns:
        The number of tensors broadcast (0 at world size 1).

    Raises:
        TypeError: when ``module`` is not an ``nn.Module``.
        ValueError: when ``src`` is not a member of the group.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"sync_parameters: expected an nn.Module, got {type(module).__name__}")
    pg = resolve_group(group, "sync_parameters")
    if pg is None:
        if src != 0:
            raise ValueError(f"sync_parameters: src={src} does not exist at world size 1")
        return 0
    tensors = [*module.parameters(), *module.buffers()]
    for t in tensors:
        arr = t.data
        if arr.flags.c_contiguous and arr.flags.writeable:
            pg.broadcast(arr, src)
        else:
            tmp = t.device.xp.ascontiguousarray(arr)
            pg.broadcast(tmp, src)
            t.data[...] = tmp
    return len(tensors)


def broadcast_module_state(
    group: collectives.ProcessGroup, module: nn.Module, src: int | None = None
) -> None:
    """Copy global rank ``src``'s (default: the group's first rank's) parameters and buffers
    of ``module`` to every rank, one broadcast per dtype and device.

    DDP's copy, not :func:`sync_parameters`: DDP has already checked that every rank holds
    the same names, shapes and dtypes, so it concatenates, where :func:`sync_parameters`
    broadcasts tensor by tensor so that the broadcasts themselves compare the shapes.
    """
    if group.size == 1:
        return
    src = group.ranks[0] if src is None else src
    tensors = [p for _, p in module.named_parameters()] + [b for _, b in module.named_buffers()]
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


def broadcast_module_buffers(group: collectives.ProcessGroup, module: nn.Module, src: int) -> None:
    """Copy global rank ``src``'s buffers of ``module`` to every rank, one broadcast each
    (what DDP does with ``broadcast_buffers`` before a forward that follows a synchronizing
    one)."""
    for _, b in module.named_buffers():
        data = b.data
        if data.flags.c_contiguous:
            group.broadcast(data, src=src)
        else:
            # Collectives take contiguous arrays only; a transposed buffer goes through
            # a contiguous copy.
            tmp = b.device.xp.ascontiguousarray(data)
            group.broadcast(tmp, src=src)
            data[...] = tmp
