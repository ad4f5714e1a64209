"""Manual gradient and parameter sync for code that does not wrap its model (axonml's helpers).

``DistributedDataParallel`` averages gradients during ``backward()``. Code that keeps its own
model (model-parallel layers, a replicated bias next to sharded weights, a custom training
step) calls :func:`sync_gradients` after ``backward()`` instead: the gradients are packed into
flat buckets of at most ``bucket_cap_mb`` (one per dtype and device), each bucket is reduced by
one all-reduce, and the results are written back. :func:`sync_parameters` makes every rank's
parameters and buffers equal to one rank's (what DDP does at construction).

DDP's own copies of a module's state, :func:`broadcast_module_state` (at construction and at
the end of a :func:`ddp.join`) and :func:`broadcast_module_buffers` (before a forward that
follows a synchronizing one, as PyTorch does), live here too.

Outside any process group, or in a group of one, both are no-ops (world size 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import collectives
import tensorlib as tl
from tensorlib import Tensor, nn

__all__ = [
    "broadcast_module_buffers",
    "broadcast_module_state",
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
        raise TypeError(
            f"{where}: group must be a ProcessGroup (from collectives.new_group) or None, got "
            f"{type(group).__name__}"
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

    Every rank must pass the same parameters (shapes and dtypes) in the same order: the
    buckets depend on them alone, never on which gradients exist, so every rank issues the
    same all-reduces. A parameter with ``requires_grad=False`` is skipped; one whose ``.grad``
    is None takes part as zeros and receives the reduced gradient (as under DDP with
    ``find_unused_parameters``, the other ranks' contributions still reach it).

    Args:
        params: the tensors (or a module, for all of its parameters).
        group: the group (None: the default group; outside any group nothing happens).
        op: ``"avg"`` (data parallelism), ``"sum"`` (a replicated parameter of a
            model-parallel layer, whose ranks each hold part of the gradient), ``"min"``,
            ``"max"`` or ``"prod"``.
        bucket_cap_mb: the largest bucket in MiB; a larger parameter gets a bucket of its own.

    Returns:
        The number of all-reduces issued (0 at world size 1).

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
    items = [p for p in _params(params, where) if p.requires_grad]
    pg = resolve_group(group, where)
    if pg is None:
        return 0
    cap = max(1, int(bucket_cap_mb * 1024 * 1024))
    count = 0
    for bucket in _buckets(items, cap):
        _reduce_bucket(pg, bucket, op.lower())
        count += 1
    return count


def _buckets(items: list[Tensor], cap: int) -> list[list[Tensor]]:
    """Consecutive parameters of one dtype and device, up to ``cap`` bytes each, in order."""
    by_kind: dict[tuple[str, str], list[list[Tensor]]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for p in items:
        key = (str(p.dtype), str(p.device))
        nbytes = int(p.data.nbytes)
        lists = by_kind.setdefault(key, [[]])
        if lists[-1] and sizes[key] + nbytes > cap:
            lists.append([])
            sizes[key] = 0
        lists[-1].append(p)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [b for lists in by_kind.values() for b in lists]


def _reduce_bucket(pg: collectives.ProcessGroup, bucket: list[Tensor], op: str) -> None:
    xp = bucket[0].device.xp
    parts = [
        p.grad.data.reshape(-1) if p.grad is not None else xp.zeros(p.data.size, p.data.dtype)
        for p in bucket
    ]
    flat = xp.ascontiguousarray(xp.concatenate(parts))
    pg.all_reduce(flat, op)
    start = 0
    for p in bucket:
        chunk = flat[start : start + p.data.size].reshape(p.shape)
        start += p.data.size
        if p.grad is not None and p.grad.data.flags.writeable:
            p.grad.data[...] = chunk  # in place: views into the grad (DDP buckets) stay valid
        else:
            p.grad = tl.from_array(chunk.copy(), p.device)


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
