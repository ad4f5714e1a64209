"""Ignite's ``auto_*`` helpers and rank filters, over ``ddp.auto_*`` and ``ddp.one_rank_only``.

One implementation: these are Ignite's signatures over ``ddp``'s helpers, which do the work.
What differs is what Ignite's reference fixes: ``auto_model``'s ``sync_bn``,
``auto_dataloader(dataset, **kwargs)`` with torch's DataLoader options (``shuffle`` False by
default, so an evaluation loader sees every sample once; loader-process options accepted and
ignored, a sampler of one's own) and, as the seed writes it, ``auto_dataloader(loader)`` of an
existing ``ddp.DataLoader``; ``auto_optim``'s Horovod keywords refused. ``one_rank_only``
waits at a barrier by default (``with_barrier=True``), as the seed and ``ddp`` do, so that a
rank-0 write is on disk before the others go on; Ignite's own default is False.
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


def auto_dataloader(dataset: Sequence[Any] | DataLoader, **kwargs: Any) -> DataLoader:
    """A data loader that gives each rank its share, as Ignite's; or, given an existing
    :class:`ddp.DataLoader` (as the seed passes one), that loader made distributed.

    ``batch_size`` is the global batch: each of N ranks gets ``batch_size // N`` per step from
    a :class:`~ddp.DistributedSampler`, so one process and N ranks see the same global batches.

    An evaluation loader (``shuffle=False``, the default, and no ``drop_last``) gives uneven
    shards: the ranks see every sample exactly once (some have one sample more), so a metric
    summed over the ranks equals one process's. A training loader (``shuffle=True`` or
    ``drop_last=True``) gives even shards, padded like PyTorch's sampler, so every rank runs
    the same number of steps. ``even_shards=True`` or ``False`` asks for either explicitly
    (see :func:`ddp.auto_dataloader`). Ignite pads in both cases.

    Given a ``DataLoader``, its arrays, ``batch_size`` (the global batch), ``shuffle``,
    ``drop_last``, ``seed``, ``device`` and epoch are kept, and ``**kwargs`` overrides them;
    the result reads this rank's share through a ``DistributedSampler`` (at world size 1, and
    without overrides, it is the loader itself). ``ddp.DataLoader`` has no collate function
    (a batch is one index per array), so there is none to keep.

    Args:
        dataset: same-length arrays, e.g. ``(x, y)`` (what :class:`ddp.DataLoader` takes),
            or a ``ddp.DataLoader`` over them.
        **kwargs: ``batch_size`` (default 1, or the loader's), ``shuffle`` (default False, as
            torch's DataLoader, or the loader's), ``drop_last``, ``seed``, ``device``,
            ``even_shards`` (default None: chosen from ``shuffle`` and ``drop_last``), or
            ``sampler`` (a ``DistributedSampler`` of your own, used as given with
            ``batch_size`` per rank; its own ``even_shards`` decides the sharding; not with
            a loader); ``num_workers``, ``pin_memory``, ``persistent_workers``,
            ``prefetch_factor`` and ``timeout`` are accepted and ignored (there are no loader
            processes).

    Raises:
        ValueError: when ``batch_size`` is not divisible by the world size (the error names
            the sizes that are), for ``even_shards=False`` with ``drop_last=True``,
            ``even_shards`` together with ``sampler``, or a loader whose own sampler already
            decides the order.
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
    if isinstance(dataset, DataLoader):
        return _from_loader(dataset, opts)
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


def _from_loader(loader: DataLoader, opts: dict[str, Any]) -> DataLoader:
    """:func:`auto_dataloader` of an existing loader: the same settings, this rank's share."""
    where = "idist.auto_dataloader(loader)"
    if "sampler" in opts:
        raise TypeError(
            f"{where}: sampler= is for a dataset; a loader keeps its settings and gets a "
            "DistributedSampler"
        )
    world = get_world_size()
    own = loader.sampler
    if own is not None:
        if isinstance(own, DistributedSampler) and not opts:
            if (own.num_replicas, own.rank) == (world, get_rank()):
                return loader  # already this rank's share
        elif world == 1 and not opts:
            return loader
        raise ValueError(
            f"{where}: the loader's sampler ({type(own).__name__}) already decides which "
            f"samples it reads, so it cannot be split between {world} ranks; give "
            "auto_dataloader a DataLoader without a sampler (shuffle=True/False), or its "
            "arrays: auto_dataloader(loader.arrays, batch_size=..., ...)"
        )
    if world == 1 and not opts:
        return loader  # one rank: its share is every sample, in the loader's own order
    settings: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "shuffle": loader.shuffle,
        "drop_last": loader.drop_last,
        "seed": loader.seed,
        "device": loader.device,
        **opts,
    }
    made = _auto.auto_dataloader(loader.arrays, **settings)
    if loader.epoch:
        made.set_epoch(loader.epoch)
    return made


def one_rank_only(
    rank: int = 0, with_barrier: bool = True
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorator: run the function on ``rank`` only (its value there, None elsewhere), then,
    with ``with_barrier``, wait for every rank.

    The default waits (``with_barrier=True``), as the seed writes it: every rank calls the
    decorated function, and none goes on before ``rank`` has finished it (a checkpoint it
    writes is complete). Ignite's own default is ``with_barrier=False``: pass it for a
    function that only some ranks call, or to skip the wait.

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
