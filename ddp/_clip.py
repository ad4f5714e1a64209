"""``clip_grad_norm_`` that knows ``fully_shard`` shards: the global norm, as FSDP2 users get it.

Under ``fully_shard`` each rank's shard ``.grad`` holds its rows of the averaged gradient, so the
norm of the whole gradient is ``(sum over ranks of each rank's local sum of |g|^p) ** (1/p)``
(the max over ranks for the infinity norm, the min for ``-inf``): one all-reduce per group.
Padding rows are left out (they are zero, which only the ``-inf`` norm would notice). Parameters
that are not shards (under DDP or ZeRO-1: every rank holds the full averaged gradient) count
once, from this rank's copy. With no shard among the parameters this is tensorlib's
``clip_grad_norm_`` itself: the same numbers, no collective.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

from collectives import ProcessGroup, ReduceOp
from tensorlib import Tensor, no_grad
from tensorlib.nn.utils import clip_grad_norm_ as _plain_clip_grad_norm_
from tensorlib.nn.utils import clip_grads_with_norm_

from .fsdp._param import layout_of_shard
from .fsdp._unit import shard_of

__all__ = ["clip_grad_norm_"]


def _norm_type(norm_type: float | str) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type must be a number or 'inf', got {norm_type!r}") from None
    if math.isnan(p):
        raise ValueError("norm_type must not be nan")
    return p


def _partial(grads: list[Any], p: float) -> float:
    """This rank's part of the norm of ``grads`` (host arrays): the sum of ``|g|^p`` (the max
    or min of ``|g|`` for ``p = +-inf``, the count of nonzeros for ``p = 0``), in float64."""
    if p == math.inf or p == -math.inf:
        parts = [np.abs(g).max() if p > 0 else np.abs(g).min() for g in grads if g.size]
        if not parts:
            return -math.inf if p > 0 else math.inf  # the identity of MAX / MIN
        return float(max(parts) if p > 0 else min(parts))
    total = 0.0
    for g in grads:
        a = np.abs(np.asarray(g, dtype=np.float64))
        if p == 0:
            total += float(np.count_nonzero(a))
        elif p == 1:
            total += float(a.sum())
        elif p == 2:
            total += float(np.vdot(a, a))
        else:
            total += float((a**p).sum())
    return total


def _combine(parts: list[float], p: float) -> float:
    if p == math.inf:
        return max(0.0, *parts)  # 0 when no rank had a gradient
    if p == -math.inf:
        return min(parts)
    s = sum(parts)
    return s if p == 0 else s ** (1.0 / p)


@no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Scale all gradients in place so that their global norm is at most ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` as FSDP2 users call it: pass ``model.parameters()`` of a
    ``fully_shard`` model and the norm is that of the whole averaged gradient, taken over every
    rank's shards (a collective: every rank of each shard group must call it, with the same
    parameters), so every rank gets the same norm and clips by the same factor, as DDP with
    the plain clip does. Parameters that are not shards count once, from this rank's copy
    (their gradients are the same on every rank under DDP and ZeRO-1); with no shard among
    them this is exactly ``tensorlib.nn.utils.clip_grad_norm_``, with no communication.

    Args:
        parameters: a tensor or an iterable of tensors; those without ``.grad`` are skipped.
        max_norm: the largest total norm to allow.
        norm_type: the order ``p`` of the norm: any number, ``inf`` (or ``"inf"``).
        error_if_nonfinite: raise instead of clipping when the total norm is nan or infinite.
        foreach: accepted for torch's signature; there is only one implementation.

    Returns:
        The global norm of the gradients before clipping, a 0-d tensor in the gradients'
        dtype (float32 for float16 gradients), the same on every rank.

    Raises:
        TypeError: when an element of ``parameters`` is not a Tensor.
        ValueError: for a ``norm_type`` that is not a number.
        RuntimeError: if ``error_if_nonfinite`` and the global norm is nan or infinite (the
            gradients are then left as they were, on every rank).
    """
    del foreach
    is_generator = isinstance(parameters, types.GeneratorType)
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    for i, t in enumerate(params):
        if not isinstance(t, Tensor):
            raise TypeError(f"parameters[{i}] is a {type(t).__name__}, expected a tensorlib Tensor")
    # Shards by group, in the order their first parameter comes (the same on every rank).
    groups: dict[int, tuple[ProcessGroup, list[Any]]] = {}
    replicated: list[Tensor] = []
    for t in params:
        sp = layout_of_shard(t)
        entry = None if sp is None else shard_of(*sp.places[0])
        if entry is None or sp is None:
            replicated.append(t)
            continue
        group = entry[0].group
        _, grads = groups.setdefault(id(group), (group, []))
        if t._grad is not None:
            valid = max(0, min(sp.rows, sp.shape[0] - group.rank * sp.rows))
            grads.append(np.asarray(t._grad._data)[:valid])  # padding rows left out
    if not groups:
        if is_generator and not params:
            warnings.warn(
                "`parameters` is an empty generator, no gradient clipping will occur.",
                stacklevel=3,
            )
        return _plain_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    p = _norm_type(norm_type)
    op = ReduceOp.MAX if p == math.inf else ReduceOp.MIN if p == -math.inf else ReduceOp.SUM
    parts: list[float] = []
    for group, grads in groups.values():
        buf = np.array([_partial(grads, p)], dtype=np.float64)
        if group.size > 1:
            group.all_reduce(buf, op=op)
        parts.append(float(buf[0]))
    rep = [np.asarray(t._grad.to("cpu")._data) for t in replicated if t._grad is not None]
    parts.append(_partial(rep, p))
    grads_of = [t._grad for t in params if t._grad is not None]
    dtype = np.result_type(*[g.dtype for g in grads_of]) if grads_of else np.dtype(np.float32)
    if dtype == np.float16:
        dtype = np.dtype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        total = Tensor(np.asarray(_combine(parts, p), dtype=dtype))
    if error_if_nonfinite and not math.isfinite(float(total.item())):
        raise RuntimeError(
            f"the total norm of order {p} of the gradients is non-finite ({float(total.item())}), "
            "so it cannot be clipped; pass error_if_nonfinite=False to scale the gradients by "
            "the non-finite norm anyway"
        )
    clip_grads_with_norm_(params, max_norm, total)
    return total
