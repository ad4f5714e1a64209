"""``memory_stats``: the bytes this rank holds in parameters, gradients and optimizer state.

What is counted is what the arrays hold, generically, so it works for a plain model, for
:class:`ddp.DistributedDataParallel`, for :class:`ddp.ZeroRedundancyOptimizer` and for
sharded modules whose ``parameters()`` are this rank's shards:

* an array that is a view is counted as the array it views (its ``base``, followed to the
  array that owns the memory), once: DDP's gradients are views into flat buckets, so the
  buckets are what is counted, padding included (on the cpu backend a bucket is a
  shared-memory segment rounded up to whole pages: the whole mapping is counted); a shard
  that views a padded flat buffer counts the whole buffer;
* an array counted once is never counted again, in its own category or a later one (the
  order is parameters, gradients, optimizer);
* the optimizer's part is every array in its ``state`` (for ZeRO-1: the inner optimizer's,
  which holds only this rank's pieces); numbers (``step``) are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tensorlib import Tensor

__all__ = ["memory_stats"]


def memory_stats(model: Any, optimizer: Any = None) -> dict[str, int]:
    """Bytes this rank holds in ``model``'s parameters and gradients and ``optimizer``'s state.

    Args:
        model: a tensorlib module (plain, DDP-wrapped or sharded).
        optimizer: its optimizer (any tensorlib optimizer or ZeroRedundancyOptimizer), or None.

    Returns:
        ``{"parameters": ..., "gradients": ..., "optimizer": ...}`` in bytes: each array
        counted once, as the whole memory block it views (shards and padding included).
    """
    seen: set[int] = set()
    params = list(model.parameters())
    grads: list[Any] = [p.grad.data for p in params if p.grad is not None]
    # DDP keeps every gradient in flat buckets, allocated before the first backward.
    reducer = getattr(model, "reducer", None)
    grads += [b.buffer for b in getattr(reducer, "buckets", ()) if b.buffer is not None]
    return {
        "parameters": _count((p.data for p in params), seen),
        "gradients": _count(grads, seen),
        "optimizer": _count(_state_arrays(optimizer), seen) if optimizer is not None else 0,
    }


def _state_arrays(optimizer: Any) -> Iterator[Any]:
    inner = getattr(optimizer, "optim", None)
    state = inner.state if inner is not None else getattr(optimizer, "state", {})
    for entry in state.values():
        values: Iterable[Any] = entry.values() if isinstance(entry, dict) else (entry,)
        for v in values:
            a = v.data if isinstance(v, Tensor) else v
            if _is_array(a) and getattr(a, "ndim", 0) > 0:
                yield a


def _is_array(a: Any) -> bool:
    return hasattr(a, "nbytes") and hasattr(a, "shape") and hasattr(a, "dtype")


def _owner(a: Any) -> Any:
    """The array whose memory ``a`` views (``a`` itself when it owns it)."""
    while True:
        base = getattr(a, "base", None)
        if base is None or not _is_array(base):
            return a
        a = base


def _count(arrays: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for a in arrays:
        owner = _owner(a)
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        total += int(owner.nbytes)
    return total
