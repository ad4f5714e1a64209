"""axonml's communication functions: ``all_reduce_sum(tensor, pg)`` and the rest.

Each takes the tensor first and the group last, as axonml's do, and works in place where
axonml's take ``&mut Tensor``. The gradient helpers are :func:`ddp.sync_gradients`
(bucketed: one all-reduce per bucket, not one per tensor).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tensorlib import Tensor

from .._sync import sync_gradients as _sync_gradients
from ._backend import ReduceOp
from ._group import ProcessGroup

__all__ = [
    "all_gather",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_min",
    "all_reduce_product",
    "all_reduce_sum",
    "barrier",
    "broadcast",
    "broadcast_from",
    "is_main_process",
    "rank",
    "sync_gradient",
    "sync_gradients",
    "world_size",
]


def _pg(pg: Any, what: str) -> ProcessGroup:
    if not isinstance(pg, ProcessGroup):
        raise TypeError(
            f"{what}: expected a ddp.axon.ProcessGroup as the group (ProcessGroup.mock(), "
            f"world.default_group()...), got {type(pg).__name__}"
        )
    return pg


def all_reduce_sum(tensor: Any, pg: ProcessGroup) -> Any:
    """Sum ``tensor`` over ``pg``'s ranks, in place; returns ``tensor``."""
    return _pg(pg, "all_reduce_sum").all_reduce_tensor(tensor, ReduceOp.SUM)


def all_reduce_mean(tensor: Any, pg: ProcessGroup) -> Any:
    """Average ``tensor`` over ``pg``'s ranks, in place (floating dtypes); returns ``tensor``."""
    return _pg(pg, "all_reduce_mean").all_reduce_tensor(tensor, ReduceOp.AVERAGE)


def all_reduce_min(tensor: Any, pg: ProcessGroup) -> Any:
    """Elementwise minimum over ``pg``'s ranks, in place; returns ``tensor``."""
    return _pg(pg, "all_reduce_min").all_reduce_tensor(tensor, ReduceOp.MIN)


def all_reduce_max(tensor: Any, pg: ProcessGroup) -> Any:
    """Elementwise maximum over ``pg``'s ranks, in place; returns ``tensor``."""
    return _pg(pg, "all_reduce_max").all_reduce_tensor(tensor, ReduceOp.MAX)


def all_reduce_product(tensor: Any, pg: ProcessGroup) -> Any:
    """Elementwise product over ``pg``'s ranks, in place; returns ``tensor``."""
    return _pg(pg, "all_reduce_product").all_reduce_tensor(tensor, ReduceOp.PRODUCT)


def broadcast(tensor: Any, pg: ProcessGroup, src: int | None = None) -> Any:
    """Copy rank ``src``'s ``tensor`` into every rank's, in place (default: the group's first
    rank, rank 0 for the whole world, as axonml's ``broadcast``); returns ``tensor``."""
    return _pg(pg, "broadcast").broadcast_tensor(tensor, src)


def broadcast_from(tensor: Any, src: int, pg: ProcessGroup) -> Any:
    """Copy rank ``src``'s ``tensor`` into every rank's, in place; returns ``tensor``."""
    return _pg(pg, "broadcast_from").broadcast_tensor(tensor, src)


def all_gather(tensor: Any, pg: ProcessGroup) -> Any:
    """Every rank's ``tensor``, stacked in rank order: a new tensor of shape
    ``(pg.size(), *tensor.shape)``."""
    return _pg(pg, "all_gather").all_gather_tensor(tensor)


def barrier(pg: ProcessGroup) -> None:
    """Wait until every rank of ``pg`` reached this barrier."""
    _pg(pg, "barrier").barrier()


def rank(pg: ProcessGroup) -> int:
    """This rank in the world."""
    return _pg(pg, "rank").rank()


def world_size(pg: ProcessGroup) -> int:
    """Ranks in the world."""
    return _pg(pg, "world_size").world_size()


def is_main_process(pg: ProcessGroup) -> bool:
    """Whether this is rank 0."""
    return _pg(pg, "is_main_process").rank() == 0


def sync_gradients(gradients: Iterable[Tensor], pg: ProcessGroup) -> int:
    """Average each gradient tensor over ``pg``'s ranks, in place.

    The tensors are gradients themselves (axonml's usage), or parameters, whose ``.grad`` is
    averaged: :func:`ddp.sync_gradients` tells them apart. They go through the package's
    buckets, one all-reduce per 25 MiB rather than one per tensor. Every rank passes the same
    shapes and dtypes in the same order.

    Returns:
        The number of all-reduces issued (0 in a world of one).
    """
    return _sync_gradients(list(gradients), _pg(pg, "sync_gradients").group, op="avg")


def sync_gradient(gradient: Tensor, pg: ProcessGroup) -> int:
    """Average one gradient tensor over ``pg``'s ranks, in place (see :func:`sync_gradients`)."""
    return _sync_gradients([gradient], _pg(pg, "sync_gradient").group, op="avg")
