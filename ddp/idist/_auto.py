"""Ignite's ``auto_*`` helpers and rank filters, over ``ddp.auto_*`` and ``ddp.one_rank_only``.

One implementation: these are Ignite's signatures over ``ddp``'s helpers, which do the work.
What differs is what Ignite's reference fixes: ``auto_model``'s ``sync_bn``,
``auto_dataloader(dataset, **kwargs)`` with torch's DataLoader options (``shuffle`` False by
default, so an evaluation loader sees every sample once; loader-process options accepted and
ignored, a sampler of one's own), ``auto_optim``'s Horovod keywords refused, and
``one_rank_only(with_barrier=False)`` by default (``ddp``'s waits by default, so that a
rank-0 write is on disk before the others go on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar

from tensorlib import nn, optim

from .. import _auto
from .._data import DataLoader
from .._sampler import DistributedSampler
from ._config import get_local_rank, get_nproc_per_node, get_rank, get_world_size
from ._ops import barrier

__all__ = ["auto_dataloader", "auto_model", "auto_optim", "one_rank_first", "one_rank_only"]

P = ParamSpec("P")
R = TypeVar("R")

# torch DataLoader options that have no meaning for an in-process loader over arrays.
_IGNORED = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "timeout")
_LOADER = ("batch_size", "shuffle", "drop_last", "seed", "device", "even_shards", "sampler")


def auto_model(model: nn.Module, sync_bn: bool = False, **kwargs: Any) -> Any:
    """Move ``model`` to this rank's device and wrap it in DDP when there are several ranks.

    Args:
        model: the model.
        sync_bn: must be False (tensorlib has no batch norm to synchronize).
        **kwargs: ``DistributedDataParallel`` options (``find_unused_parameters``,
            ``bucket_cap_mb``...), checked at every world size.

    Raises:
        ValueError: for ``sync_bn=True``.
        TypeError: for an unknown option or a model that is not an ``nn.Module``.
    """
    if sync_bn:
        raise ValueError("idist.auto_model: sync_bn=True: tensorlib has no BatchNorm layers")
    return _auto.auto_model(model, **kwargs)


def auto_optim(optimizer: optim.Optimizer, **kwargs: Any) -> optim.Optimizer:
    """Return ``optimizer``: DDP already averages the gradients in ``backward()``.

    Raises:
        TypeError: for keyword arguments (Ignite passes them to Horovod only) or an object
            that is not a tensorlib Optimizer.
    """
    if kwargs:
        raise TypeError(
            f"idist.auto_optim: unexpected arguments {sorted(kwargs)} (no Horovod here)"
        )
    return _auto.auto_optim(optimizer)


def auto_dataloader(dataset: Sequence[Any], **kwargs: Any) -> DataLoader:
    """A data loader over ``dataset`` that gives each rank its share, as Ignite's.

    ``batch_size`` is the global batch: each of N ranks gets ``batch_size // N`` per step from
    a :class:`~ddp.DistributedSampler`, so one process and N ranks see the same global batches.

    An evaluation loader (``shuffle=False``, the default, and no ``drop_last``) gives uneven
    shards: the ranks see every sample exactly once (some have one sample more), so a metric
    summed over the ranks equals one process's. A training loader (``shuffle=True`` or
    ``drop_last=True``) gives even shards, padded like PyTorch's sampler, so every rank runs
    the same number of steps. ``even_shards=True`` or ``False`` asks for either explicitly
    (see :func:`ddp.auto_dataloader`). Ignite pads in both cases.

    Args:
        dataset: same-length arrays, e.g. ``(x, y)`` (what :class:`ddp.DataLoader` takes).
        **kwargs: ``batch_size`` (default 1), ``shuffle`` (default False, as torch's
            DataLoader), ``drop_last``, ``seed``, ``device``, ``even_shards`` (default None:
            chosen from ``shuffle`` and ``drop_last``), or ``sampler`` (a
            ``DistributedSampler`` of your own, used as given with ``batch_size`` per rank;
            its own ``even_shards`` decides the sharding); ``num_workers``, ``pin_memory``,
            ``persistent_workers``, ``prefetch_factor`` and ``timeout`` are accepted and
            ignored (there are no loader processes).

    Raises:
        ValueError: when ``batch_size`` is not divisible by the world size, for
            ``even_shards=False`` with ``drop_last=True``, or ``even_shards`` together with
            ``sampler``.
        TypeError: for another keyword argument, or an ``even_shards`` that is not a bool
            or None.
    """
    unknown = sorted(set(kwargs) - set(_LOADER) - set(_IGNORED))
    if unknown:
        raise TypeError(
            f"idist.auto_dataloader: unexpected arguments {unknown}; accepted: {_LOADER} "
            f"(and, ignored, {_IGNORED})"
        )
    opts = {k: kwargs[k] for k in _LOADER if k in kwargs}
    sampler = opts.pop("sampler", None)
    if sampler is not None:
        if opts.pop("even_shards", None) is not None:
            raise ValueError(
                "idist.auto_dataloader: pass even_shards or sampler, not both: a sampler of "
                "your own decides the sharding (DistributedSampler(..., even_shards=...))"
            )
        if not isinstance(sampler, DistributedSampler) and get_world_size() > 1:
            raise TypeError(
                "idist.auto_dataloader: at world size > 1 a sampler must be a "
                f"ddp.DistributedSampler, got {type(sampler).__name__}"
            )
        return DataLoader(dataset, sampler=sampler, **opts)
    opts.setdefault("batch_size", 1)
    opts.setdefault("shuffle", False)
    return _auto.auto_dataloader(dataset, **opts)


def one_rank_only(
    rank: int = 0, with_barrier: bool = False
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorator: run the function on ``rank`` only (its value there, None elsewhere), then,
    with ``with_barrier``, wait for every rank.

    Raises:
        ValueError: when called with a ``rank`` the world does not have.
    """
    return _auto.one_rank_only(rank=rank, with_barrier=with_barrier)


@contextlib.contextmanager
def one_rank_first(rank: int = 0, local: bool = False) -> Iterator[None]:
    """Run the block on ``rank`` first, then on the others (e.g. one rank downloads a file).

    Args:
        rank: the rank that goes first (a local rank with ``local``).
        local: count ``rank`` among this host's ranks.

    Raises:
        ValueError: when ``rank`` is out of range.
    """
    current = get_local_rank() if local else get_rank()
    size = get_nproc_per_node() if local else get_world_size()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"idist.one_rank_first: rank must be in [0, {size}), got {rank!r}")
    if current != rank:
        barrier()
    yield
    if current == rank:
        barrier()
