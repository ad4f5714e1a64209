"""Gradient clipping (``torch.nn.utils.clip_grad``): by total norm, or by value.

Everything stays on the gradients' devices: the clip coefficient is a 0-d array there and
multiplies every gradient whatever its value (as torch does), so clipping a GPU model never
waits for the GPU. Gradients are scaled in place, so a gradient that is a view into a
communication bucket (DDP) stays one.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..._autograd import no_grad
from ..._device import Device
from ..._ops_elementwise import xp_of
from ..._tensor import Tensor

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm"]

TensorOrTensors = Tensor | Iterable[Tensor]


def _as_list(tensors: TensorOrTensors, what: str) -> list[Tensor]:
    items = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}[{i}] is a {type(t).__name__}, expected a tensorlib Tensor")
    return items


def _norm_type(norm_type: float | str) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type must be a number or 'inf', got {norm_type!r}") from None
    if math.isnan(p):
        raise ValueError("norm_type must not be nan")
    return p


def _vector_norm(a: Any, p: float) -> Any:
    """The ``p``-norm of all of ``a``'s elements, a 0-d array on ``a``'s device."""
    xp = xp_of(a)
    out_dtype = a.dtype
    if a.dtype == np.float16:  # sum in float32: squares of half values overflow early
        a = a.astype(np.float32)
    mag = xp.abs(a)
    if p == math.inf or p == -math.inf:
        if mag.size == 0:
            raise RuntimeError(
                "clip_grad: cannot compute the infinity norm of an empty gradient "
                "(the max has no identity), as in torch"
            )
        r = mag.max() if p > 0 else mag.min()
    elif p == 0:
        r = (mag != 0).sum().astype(mag.dtype)
    elif p == 1:
        r = mag.sum()
    elif p == 2:
        r = xp.sqrt((mag * mag).sum())
    else:
        r = (mag**p).sum() ** (1.0 / p)
    return xp.asarray(r, dtype=out_dtype)


@no_grad()
def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """The ``norm_type``-norm of all of ``tensors`` together, as if concatenated into one vector.

    Args:
        tensors: a tensor or an iterable of tensors (for clipping: the gradients).
        norm_type: the order ``p``: any number, ``inf`` (or ``"inf"``) for the max magnitude.
        error_if_nonfinite: raise when the norm is nan or infinite (reads it on the host).
        foreach: accepted for torch's signature; there is only one implementation.

    Returns:
        A 0-d tensor on the first tensor's device, in the tensors' (promoted) dtype; a float32
        zero when there are no tensors.

    Raises:
        RuntimeError: if ``error_if_nonfinite`` and the norm is nan or infinite.
    """
    del foreach
    items = _as_list(tensors, "tensors")
    p = _norm_type(norm_type)
    if not items:
        return Tensor(0.0, dtype=np.float32)
    first = items[0]._device
    norms = []
    for t in items:
        # a norm may overflow to inf (torch's does, silently): that is for the caller to see
        with t._device, np.errstate(over="ignore", invalid="ignore"):
            n = _vector_norm(t._data, p)
        norms.append(n if t._device is first else Tensor._wrap(n, t._device).to(first)._data)
    with first, np.errstate(over="ignore", invalid="ignore"):
        total = _vector_norm(xp_of(norms[0]).stack(norms), p)
    if error_if_nonfinite and not bool(xp_of(total).isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {p} of the gradients is non-finite ({float(total)}), so "
            "it cannot be clipped; pass error_if_nonfinite=False to scale the gradients by the "
            "non-finite norm anyway"
        )
    return Tensor._wrap(total, first)


@no_grad()
def clip_grads_with_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    total_norm: Tensor,
    foreach: bool | None = None,
) -> None:
    """Scale the gradients in place by ``min(max_norm / (total_norm + 1e-6), 1)``.

    Args:
        parameters: a tensor or an iterable of tensors; those without ``.grad`` are skipped.
        max_norm: the largest total norm to allow.
        total_norm: the gradients' total norm (from :func:`get_total_norm`), a 0-d tensor.
        foreach: accepted for torch's signature; there is only one implementation.
    """
    del foreach
    grads = [p._grad for p in _as_list(parameters, "parameters") if p._grad is not None]
    if not grads:
        return
    if not isinstance(total_norm, Tensor):
        raise TypeError(f"total_norm must be a Tensor, got {type(total_norm).__name__}")
    max_norm = float(max_norm)
    total = total_norm._data
    with total_norm._device:
        # Multiplying by a coefficient clamped to 1 avoids an `if coef < 1`, which would
        # read the norm back from the GPU.
        coef = xp_of(total).minimum(max_norm / (total + 1e-6), 1.0)
    on: dict[Device, Any] = {total_norm._device: coef}
    for g in grads:
        c = on.get(g._device)
        if c is None:
            c = on[g._device] = Tensor._wrap(coef, total_norm._device).to(g._device)._data
        # inf * 0 is nan here as in torch, which does not warn about it either
        with g._device, np.errstate(invalid="ignore"):
            g._data *= c


@no_grad()
def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Scale all gradients in place so that their total norm is at most ``max_norm``.

    The norm is taken over every gradient together, as if concatenated into one vector, and
    each gradient is multiplied by ``min(max_norm / (total_norm + 1e-6), 1)``, on its device
    (no host synchronization unless ``error_if_nonfinite``). Under DDP, call it after
    ``backward()`` returns: the gradients are then averaged over ranks, so every rank
    computes the same norm and clips alike.

    Args:
        parameters: a tensor or an iterable of tensors; those without ``.grad`` are skipped.
        max_norm: the largest total norm to allow.
        norm_type: the order ``p`` of the norm: any number, ``inf`` (or ``"inf"``).
        error_if_nonfinite: raise instead of clipping when the total norm is nan or infinite.
        foreach: accepted for torch's signature; there is only one implementation.

    Returns:
        The total norm of the gradients before clipping, a 0-d tensor.

    Raises:
        RuntimeError: if ``error_if_nonfinite`` and the total norm is nan or infinite
            (the gradients are then left as they were).
    """
    is_generator = isinstance(parameters, types.GeneratorType)
    params = _as_list(parameters, "parameters")
    if is_generator and not params:
        warnings.warn(
            "`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3
        )
    grads = [p._grad for p in params if p._grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    clip_grads_with_norm_(params, max_norm, total)
    return total


@no_grad()
def clip_grad_value_(
    parameters: TensorOrTensors, clip_value: float, foreach: bool | None = None
) -> None:
    """Clamp every gradient in place to ``[-clip_value, clip_value]``.

    Args:
        parameters: a tensor or an iterable of tensors; those without ``.grad`` are skipped.
        clip_value: the largest magnitude to allow (nan gradients stay nan).
        foreach: accepted for torch's signature; there is only one implementation.
    """
    del foreach
    value = float(clip_value)
    for p in _as_list(parameters, "parameters"):
        g = p._grad
        if g is not None:
            with g._device:
                xp_of(g._data).clip(g._data, -value, value, out=g._data)
