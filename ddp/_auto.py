"""World-size-aware helpers in the manner of PyTorch Ignite's ``idist.auto_*`` and Horovod.

The same training script runs in one process or on N ranks without branching:
:func:`auto_model` wraps the model in ``DistributedDataParallel`` only when there is more than
one rank, :func:`auto_dataloader` splits the data and the global batch between the ranks, and
:func:`one_rank_only` runs side effects (logging, writing files) on one rank.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import numpy as np

import collectives
import tensorlib as tl
from tensorlib import nn, optim

from ._data import DataLoader
from ._ddp import DistributedDataParallel
from ._sampler import DistributedSampler, check_int

__all__ = ["auto_dataloader", "auto_model", "auto_optim", "one_rank_only"]

P = ParamSpec("P")
R = TypeVar("R")


def _ddp_class() -> type[DistributedDataParallel]:
    """The class :func:`auto_model` wraps with (tests put a stand-in here)."""
    return DistributedDataParallel


def default_device() -> str | None:
    """The device :func:`auto_model` moves a model to when none is given.

    ``"cuda:{local_rank % device_count}"`` when the default group's backend is nccl (each rank
    on its own GPU; under ``collectives.run``/``spawn`` every rank sees just its own GPU, so
    this is ``"cuda:0"`` there). Otherwise None: the model stays where it is, which is the CPU
    for a freshly built one (a model the user already put on a GPU is not moved back to the
    CPU just because the backend is cpu or serial). Nothing is initialized by asking.

    Raises:
        RuntimeError: when the backend is nccl but no GPU is visible.
    """
    if not collectives.is_initialized() or collectives.get_backend() != "nccl":
        return None
    count = tl.cuda_device_count()
    if count < 1:
        raise RuntimeError(
            "auto_model: the default group's backend is nccl but no CUDA GPU is visible "
            f"({tl.cuda_unavailable_reason()}); pass device= explicitly"
        )
    return f"cuda:{collectives.get_local_rank() % count}"


def auto_model(module: nn.Module, device: str | tl.Device | None = None, **ddp_kwargs: Any) -> Any:
    """Move ``module`` to this rank's device and wrap it for data parallelism when needed.

    At world size 1 the module itself is returned (moved), so the training loop is the same
    in one process and on N ranks. At world size > 1 (of ``ddp_kwargs["process_group"]`` when
    given, else of the default group) it returns ``DistributedDataParallel(module,
    **ddp_kwargs)``, which broadcasts rank 0's parameters; this is a collective call, so every
    rank must make it.

    Args:
        module: the model.
        device: where to put it; None chooses with :func:`default_device`: this rank's GPU
            under the nccl backend, else the module stays where it is (the CPU, unless you
            moved it).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb``,
            ``find_unused_parameters``, ...). They are checked against its signature at every
            world size, so a misspelled option fails in a one-process run too.

    Returns:
        The module (world size 1) or its ``DistributedDataParallel`` wrapper.

    Raises:
        TypeError: when ``module`` is not an ``nn.Module`` or an option is unknown.
        ValueError: when ``module`` is already wrapped.
        RuntimeError: when ``device`` is None, the backend is nccl and no GPU is visible
            (see :func:`default_device`).
    """
    ddp_cls = _ddp_class()
    if isinstance(module, ddp_cls):
        raise ValueError("auto_model: the module is already wrapped in DistributedDataParallel")
    if not isinstance(module, nn.Module):
        raise TypeError(f"auto_model: module must be a tensorlib nn.Module, got {type(module)!r}")
    try:
        inspect.signature(ddp_cls).bind(module, **ddp_kwargs)
    except TypeError as exc:
        raise TypeError(f"auto_model: bad DistributedDataParallel options: {exc}") from None
    group = ddp_kwargs.get("process_group")
    world = group.size if group is not None else collectives.get_world_size()
    target = device if device is not None else default_device()
    if target is not None:
        module.to(target)
    if world <= 1:
        return module
    return ddp_cls(module, **ddp_kwargs)


def auto_optim(optimizer: optim.Optimizer) -> optim.Optimizer:
    """Return ``optimizer`` unchanged, after checking that it is a tensorlib Optimizer.

    Nothing needs wrapping (unlike Horovod's ``DistributedOptimizer``, which averages
    gradients inside ``step()``): ``DistributedDataParallel`` averages every gradient across
    ranks during ``backward()``, so each rank's optimizer sees the same averaged gradients,
    starts from the same (broadcast) parameters and makes the same update. The function exists
    so that scripts written for Ignite's ``idist.auto_optim`` read the same.

    Raises:
        TypeError: when ``optimizer`` is not a ``tensorlib.optim.Optimizer``.
    """
    if not isinstance(optimizer, optim.Optimizer):
        raise TypeError(
            f"auto_optim: expected a tensorlib.optim.Optimizer, got {type(optimizer)!r}"
        )
    return optimizer


def auto_dataloader(
    arrays: Sequence[Any],
    batch_size: int,
    shuffle: bool = True,
    drop_last: bool = False,
    seed: int = 0,
    device: str | tl.Device | None = None,
    even_shards: bool | None = None,
) -> DataLoader:
    """A :class:`DataLoader` that splits the data and the global batch between the ranks.

    ``batch_size`` is the GLOBAL batch. At world size N > 1 each rank gets a
    :class:`DistributedSampler` and a per-rank batch of ``batch_size // N``. How the data is
    split between the ranks (``even_shards``):

    - even shards (for training): every rank gets the same number of samples, padded by
      repeating the start of the epoch's order or, with ``drop_last``, truncated, so every
      rank runs the same number of steps (what DDP training needs: each step is a collective
      backward). A padded sample is seen twice in the epoch.
    - uneven shards (for evaluation): no padding; rank ``r`` gets positions
      ``r, r + N, r + 2N, ...`` of the epoch's order, so the ranks see every sample exactly
      once and some ranks have one sample (hence possibly one batch) more than others. A
      metric summed over the ranks then equals one process's.

    The default (``even_shards=None``) chooses even shards for a training loader
    (``shuffle=True`` or ``drop_last=True``) and uneven shards otherwise (``shuffle=False``:
    an evaluation loader, as Ignite's examples build theirs). Either way global batch ``k``
    (the union of every rank's batch ``k``) is the same set of samples as batch ``k`` of the
    one-process loader with the same seed, which is what makes N ranks train like one
    process; with padded even shards only a last, partial global batch differs.
    At world size 1 it is a plain DataLoader (shuffled with ``shuffle``).

    ``batch_size`` must be divisible by N: rounding would silently change the global batch
    (and with it the learning dynamics), so it is an error, not a warning.

    Call ``loader.set_epoch(epoch)`` at the start of every epoch (it reaches the sampler).

    Args:
        arrays: same-length arrays, e.g. ``(x, y)``.
        batch_size: the global batch size.
        shuffle: shuffle every epoch (seeded by ``seed + epoch``, identically on every rank).
        drop_last: drop the tail that does not fill a whole global batch (the batches kept
            are then the same with even and uneven shards, so it implies even shards).
        seed: base seed, the same on every rank.
        device: device of the yielded Tensors.
        even_shards: True: every rank the same number of samples (padded); False: every
            sample exactly once (ranks may differ by one sample); None: True when
            ``shuffle`` or ``drop_last``, else False.

    Returns:
        The loader.

    Raises:
        TypeError: when ``even_shards`` is not a bool or None.
        ValueError: when ``batch_size`` is not divisible by the world size, for
            ``even_shards=False`` with ``drop_last=True``, and for the DataLoader's own
            argument errors.
    """
    batch_size = check_int("auto_dataloader", "batch_size", batch_size, 1)
    even = _resolve_even_shards("auto_dataloader", even_shards, shuffle, drop_last)
    world = collectives.get_world_size()
    if world <= 1:
        return DataLoader(
            arrays, batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, device=device
        )
    if batch_size % world:
        lower = batch_size - batch_size % world
        near = f"{lower} or {lower + world}" if lower else f"{world}"
        raise ValueError(
            f"auto_dataloader: batch_size={batch_size} is the global batch and must be "
            f"divisible by the world size {world}; use {near} "
            f"(any multiple of {world}): each of the {world} ranks reads batch_size / {world} "
            "samples a step, and rounding that share would silently change the global batch, "
            "and with it what one step learns"
        )
    probe = DataLoader(arrays, 1)  # checks the arrays and gives their common length
    sampler = DistributedSampler(
        probe.num_samples,
        num_replicas=world,
        rank=collectives.get_rank(),
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        even_shards=even,
    )
    return DataLoader(
        arrays, batch_size // world, sampler=sampler, drop_last=drop_last, device=device
    )


def _resolve_even_shards(where: str, even_shards: Any, shuffle: Any, drop_last: Any) -> bool:
    """Whether :func:`auto_dataloader` gives every rank the same number of samples.

    None chooses even shards for a training loader (``shuffle`` or ``drop_last``) and
    uneven ones (every sample exactly once) for an evaluation loader.

    Raises:
        TypeError: when ``even_shards`` is not a bool or None.
        ValueError: for ``even_shards=False`` with ``drop_last=True``, which contradict.
    """
    if even_shards is None:
        return bool(shuffle) or bool(drop_last)
    if not isinstance(even_shards, bool | np.bool_):
        raise TypeError(
            f"{where}: even_shards must be True (every rank the same number of samples, "
            "for training), False (every sample exactly once, for evaluation) or None "
            f"(chosen from shuffle and drop_last), got {even_shards!r}"
        )
    if drop_last and not even_shards:
        raise ValueError(
            f"{where}: even_shards=False asks for every sample exactly once, but "
            "drop_last=True drops the tail that does not fill a global batch; for an "
            "evaluation loader pass drop_last=False, for a training loader even_shards=True "
            "(or None)"
        )
    return bool(even_shards)


def one_rank_only(
    rank: int = 0, with_barrier: bool = True
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorator: run the function on ``rank`` only, then (optionally) wait for every rank.

    The function's value is returned on ``rank`` and None elsewhere. With ``with_barrier``
    and more than one rank, every rank then meets at a barrier of the default group, so the
    others do not run ahead of, say, a file the function writes; every rank must then call
    the decorated function. If the function raises, the exception propagates on ``rank``
    before the barrier; the other ranks' barrier then fails with the peer's failure (or the
    group's timeout) rather than continuing as if it had run.

    Example:
        >>> @one_rank_only()
        ... def log(msg: str) -> None:
        ...     print(msg)

    Args:
        rank: the global rank that runs the function.
        with_barrier: meet at a barrier afterwards (when the world size is > 1).

    Returns:
        The decorator.

    Raises:
        TypeError: when ``rank`` is not an int.
        ValueError: when ``rank`` is negative; when called, when ``rank`` is not below the
            world size (the function would never run).
    """
    rank = check_int("one_rank_only", "rank", rank, 0)

    def decorator(fn: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            world = collectives.get_world_size()
            if rank >= world:
                raise ValueError(
                    f"one_rank_only: rank {rank} does not exist at world size {world}, so "
                    f"{getattr(fn, '__qualname__', fn)!r} would run nowhere"
                )
            result = fn(*args, **kwargs) if collectives.get_rank() == rank else None
            if with_barrier and world > 1:
                collectives.barrier()
            return result

        return wrapper

    return decorator
