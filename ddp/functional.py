"""Collectives with gradients, for model-parallel code (as ``torch.distributed.nn.functional``).

Each function is a differentiable tensorlib op: its forward runs a collective on the tensor's
array and its backward runs the collective that is its derivative. The convention is torch's:
the objective is the **sum of every rank's loss**, and each rank's input is its own variable
(but ``scatter``'s replicated input: one variable that every rank holds), so the gradient a
rank receives is the derivative of that sum with respect to its input:

=====================  ========================================  ==============================
op                     forward (rank r of W)                      backward (gradient of x_r)
=====================  ========================================  ==============================
``all_reduce(x)``      ``y = x_0 + ... + x_{W-1}``                all-reduce of the ranks' grads
``all_gather(x, a)``   ``y = concat(x_0, ..., x_{W-1}; axis a)``  slice r of the summed grads
``gather(x, a)``       the same as ``all_gather``                 the same
``reduce_scatter``     slice r of ``x_0 + ... + x_{W-1}``         the ranks' grads, gathered
``scatter(x, a)``      slice r of ``x`` (``x`` alike on all)      the ranks' slice grads,
                                                                   gathered, on every rank
``scatter(x, a, src)`` slice r of ``x_src``                       the ranks' slice grads,
                                                                   gathered to ``src``; 0
                                                                   elsewhere
=====================  ========================================  ==============================

``scatter`` has two forms, for the two kinds of input:

- ``scatter(x, axis)``, for a **replicated** ``x``: the same value on every rank, made by the
  same computation from the same parameters and data (replicated layers before a
  column-parallel split). It moves no data forward, and ``x`` is one variable held by every
  rank, so its gradient is the concatenation of every rank's slice gradient, on every rank
  (Megatron's split / all-gather rule): replicated layers before it get the same gradient
  everywhere and stay identical, as in the one-process model.
- ``scatter(x, axis, src=k)``, for an ``x`` **owned by rank k** (torch.distributed.nn's
  scatter): rank k's ``x`` is sent (the other ranks' ``x`` gives only the shape and dtype), and
  the gradient goes back to ``k`` alone (zeros on the other ranks). Use this form too for an
  ``x`` computed from an ``all_reduce`` or ``all_gather`` output: their backward sums the
  ranks' gradients, so the replicated form's full gradient on every rank would be counted
  ``W`` times there. ``scatter(all_reduce(z), src=k)`` has the same values and gradients as
  ``reduce_scatter(z)``.

Every rank of the group must run the same ops in the same order, forward and backward: a rank
whose loss does not depend on an op's output never runs that op's backward, and the others'
then fail with the group's timeout. Outside any process group every op is the identity
(world size 1). Only ``sum`` and ``avg`` reductions are differentiable here.
"""

from __future__ import annotations

from typing import Any

import collectives
from tensorlib import Function, Tensor

from ._sync import resolve_group

__all__ = ["all_gather", "all_reduce", "gather", "reduce_scatter", "scatter"]


def _axis(x: Tensor, axis: int, where: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{where}: axis must be an int, got {axis!r}")
    nd = len(x.shape)
    if not -nd <= axis < nd:
        raise ValueError(f"{where}: axis {axis} is out of range for a tensor of shape {x.shape}")
    return axis % nd


def _check_divisible(shape: tuple[int, ...], axis: int, size: int, where: str) -> None:
    if shape[axis] % size:
        raise ValueError(
            f"{where}: axis {axis} of shape {tuple(shape)} has {shape[axis]} entries, which the "
            f"group size {size} does not divide; pad it to a multiple of {size}"
        )


def _gather_along(pg: Any, arr: Any, axis: int) -> Any:
    """Every rank's ``arr`` concatenated along ``axis`` (one all-gather)."""
    xp = _xp(arr)
    out = pg.all_gather(xp.ascontiguousarray(arr))  # (size, *arr.shape)
    return xp.concatenate(list(out), axis=axis)


def _reduce_scatter_along(pg: Any, arr: Any, axis: int, op: str) -> Any:
    """Block ``rank`` along ``axis`` of the reduction of every rank's ``arr``."""
    xp = _xp(arr)
    moved = xp.ascontiguousarray(xp.moveaxis(arr, axis, 0))
    out = pg.reduce_scatter(moved, op)
    return xp.ascontiguousarray(xp.moveaxis(out, 0, axis))


def _xp(arr: Any) -> Any:
    if type(arr).__module__.startswith("cupy"):
        import cupy

        return cupy
    import numpy

    return numpy


def _slice(arr: Any, axis: int, index: int, size: int) -> Any:
    n = arr.shape[axis] // size
    lead = (slice(None),) * axis
    return arr[(*lead, slice(index * n, (index + 1) * n))]


def _reduce_op(op: str, where: str) -> str:
    if not isinstance(op, str) or op.lower() not in ("sum", "avg"):
        raise ValueError(
            f"{where}: op must be 'sum' or 'avg' (the differentiable reductions), got {op!r}"
        )
    return op.lower()


# ---------------------------------------------------------------------- the primitives
class _AllReduce(Function):
    __slots__ = ("group", "op")

    def forward(self, a: Any, group: Any = None, op: str = "sum") -> Any:
        self.group, self.op = group, op
        out = _xp(a).array(a, copy=True, order="C")
        group.all_reduce(out, op)
        return out

    def backward(self, g: Any) -> Any:
        out = _xp(g).array(g, copy=True, order="C")  # never reduce the engine's array in place
        self.group.all_reduce(out, self.op)
        return out


class _AllGather(Function):
    __slots__ = ("axis", "group")

    def forward(self, a: Any, group: Any = None, axis: int = 0) -> Any:
        self.group, self.axis = group, axis
        return _gather_along(group, a, axis)

    def backward(self, g: Any) -> Any:
        return _reduce_scatter_along(self.group, g, self.axis, "sum")


class _ReduceScatter(Function):
    __slots__ = ("axis", "group", "op")

    def forward(self, a: Any, group: Any = None, axis: int = 0, op: str = "sum") -> Any:
        self.group, self.axis, self.op = group, axis, op
        return _reduce_scatter_along(group, a, axis, op)

    def backward(self, g: Any) -> Any:
        full = _gather_along(self.group, g, self.axis)
        if self.op == "avg":
            full = full / self.group.size
        return full


class _Scatter(Function):
    """Split a replicated ``x``: no data moves forward; the gradient is every rank's slice
    gradient gathered, on every rank (``x`` is one variable that every rank holds)."""

    __slots__ = ("axis", "group")

    def forward(self, a: Any, group: Any = None, axis: int = 0) -> Any:
        self.group, self.axis = group, axis
        return _xp(a).ascontiguousarray(_slice(a, axis, group.rank, group.size))

    def backward(self, g: Any) -> Any:
        return _gather_along(self.group, g, self.axis)


class _ScatterFrom(Function):
    """Split the ``x`` of rank ``src`` (torch.distributed.nn's scatter): ``src``'s ``x`` is
    broadcast, and the slices' gradients go back to ``src`` only."""

    __slots__ = ("axis", "group", "is_src")

    def forward(self, a: Any, group: Any = None, axis: int = 0, src: int = 0) -> Any:
        self.group, self.axis = group, axis
        self.is_src = group.info.global_rank == src
        full = _xp(a).array(a, copy=True, order="C")  # never overwrite the caller's x
        group.broadcast(full, src)
        return _xp(a).ascontiguousarray(_slice(full, axis, group.rank, group.size))

    def backward(self, g: Any) -> Any:
        full = _gather_along(self.group, g, self.axis)
        # The other ranks' x did not feed any output: their gradient is zero (and still an
        # array, so that ops before this one run their backward on every rank).
        return full if self.is_src else _xp(g).zeros_like(full)


# ---------------------------------------------------------------------- the functions
def all_reduce(x: Tensor, op: str = "sum", group: collectives.ProcessGroup | None = None) -> Tensor:
    """The sum (or mean, ``op="avg"``) of every rank's ``x``; the gradient is all-reduced too.

    Raises:
        ValueError: for an op other than ``sum``/``avg``.
        RuntimeError: when this rank is not a member of ``group``.
    """
    rop = _reduce_op(op, "ddp.functional.all_reduce")
    pg = resolve_group(group, "ddp.functional.all_reduce")
    if pg is None:
        return x
    return _AllReduce.apply(x, group=pg, op=rop)


def all_gather(x: Tensor, axis: int = 0, group: collectives.ProcessGroup | None = None) -> Tensor:
    """Every rank's ``x`` concatenated along ``axis`` (in rank order), on every rank.

    The gradient of ``x`` is this rank's slice of the sum of every rank's upstream gradient
    (a reduce-scatter). ``x`` must have the same shape on every rank.

    Raises:
        ValueError: for an axis out of range.
        RuntimeError: when this rank is not a member of ``group``.
    """
    ax = _axis(x, axis, "ddp.functional.all_gather")
    pg = resolve_group(group, "ddp.functional.all_gather")
    if pg is None:
        return x
    return _AllGather.apply(x, group=pg, axis=ax)


def gather(x: Tensor, axis: int = 0, group: collectives.ProcessGroup | None = None) -> Tensor:
    """The same op as :func:`all_gather`: every rank's ``x`` concatenated along ``axis``, on
    every rank.

    Megatron's "gather from the model-parallel region" has the same forward, but its backward
    takes this rank's slice of a gradient that is the same on every rank (one loss, computed
    on every rank); this one sums the ranks' gradients (every rank's loss counts, the
    module's convention). A loss computed alike on every rank after it therefore counts
    ``W`` times: scale it by ``1 / W`` for the one-process gradient.
    """
    ax = _axis(x, axis, "ddp.functional.gather")
    pg = resolve_group(group, "ddp.functional.gather")
    if pg is None:
        return x
    return _AllGather.apply(x, group=pg, axis=ax)


def reduce_scatter(
    x: Tensor, axis: int = 0, op: str = "sum", group: collectives.ProcessGroup | None = None
) -> Tensor:
    """Rank r's block along ``axis`` of the sum (or mean) of every rank's ``x``.

    The gradient of ``x`` is every rank's upstream gradient gathered along ``axis``.

    Raises:
        ValueError: when the group size does not divide ``x.shape[axis]``, for an axis out of
            range, or an op other than ``sum``/``avg``.
        RuntimeError: when this rank is not a member of ``group``.
    """
    where = "ddp.functional.reduce_scatter"
    ax, rop = _axis(x, axis, where), _reduce_op(op, where)
    pg = resolve_group(group, where)
    if pg is None:
        return x
    _check_divisible(tuple(x.shape), ax, pg.size, where)
    return _ReduceScatter.apply(x, group=pg, axis=ax, op=rop)


def scatter(
    x: Tensor,
    axis: int = 0,
    group: collectives.ProcessGroup | None = None,
    src: int | None = None,
) -> Tensor:
    """Rank r's block along ``axis`` of ``x``: of a replicated ``x``, or of rank ``src``'s.

    Without ``src``, ``x`` must hold the same value on every rank (replicated layers' output);
    no data moves, and the gradient of ``x`` is every rank's slice gradient gathered into
    ``x``'s shape, on every rank (Megatron's rule), so the layers before it stay replicated.
    With ``src``, rank ``src``'s ``x`` is scattered (broadcast, then sliced) and the gradient
    goes back to ``src`` only, zeros elsewhere (torch.distributed.nn's rule); use it for an
    ``x`` that one rank owns, or one computed from an :func:`all_reduce` or
    :func:`all_gather` output, whose backward sums the ranks' gradients (see the module doc).

    Args:
        x: the tensor: alike on every rank (no ``src``), or rank ``src``'s (the others' give
            the shape and dtype).
        axis: the axis to split; the group size must divide its length.
        group: the group (None: the default group).
        src: the global rank that owns ``x`` (None: ``x`` is replicated).

    Raises:
        ValueError: when the group size does not divide ``x.shape[axis]``, for an axis out of
            range, or when ``src`` is not a member.
        TypeError: when ``src`` is not an int.
        RuntimeError: when this rank is not a member of ``group``.
    """
    where = "ddp.functional.scatter"
    ax = _axis(x, axis, where)
    if src is not None and (isinstance(src, bool) or not isinstance(src, int)):
        raise TypeError(f"{where}: src must be an int rank or None, got {src!r}")
    pg = resolve_group(group, where)
    if pg is None:
        return x
    _check_divisible(tuple(x.shape), ax, pg.size, where)
    if src is None:
        return _Scatter.apply(x, group=pg, axis=ax)
    if src not in pg.ranks:
        raise ValueError(f"{where}: src={src} is not a member (members: {list(pg.ranks)})")
    return _ScatterFrom.apply(x, group=pg, axis=ax, src=src)
