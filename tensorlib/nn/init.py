"""In-place parameter initializers drawing from a seedable generator."""

from __future__ import annotations

import math

from .._device_guard import on_device
from .._random import Generator, default_generator
from .._tensor import Tensor

__all__ = ["normal_", "ones_", "uniform_", "xavier_uniform_", "zeros_"]


def _fill(t: Tensor, host: object) -> Tensor:
    src = Tensor(host, dtype=t.dtype, device=t.device)
    _write(t, src._data)
    return t


def _write(t: Tensor, value: object) -> None:
    # On t's GPU, whichever is current: CuPy copies and fills on the current one.
    on_device(t._device, t._data.__setitem__, Ellipsis, value)


def uniform_(
    t: Tensor, a: float = 0.0, b: float = 1.0, generator: Generator | None = None
) -> Tensor:
    """Fill ``t`` with U(a, b) samples."""
    g = generator or default_generator
    return _fill(t, g.rng.uniform(a, b, size=t.shape))


def normal_(
    t: Tensor, mean: float = 0.0, std: float = 1.0, generator: Generator | None = None
) -> Tensor:
    """Fill ``t`` with N(mean, std**2) samples."""
    g = generator or default_generator
    return _fill(t, g.rng.normal(mean, std, size=t.shape))


def xavier_uniform_(t: Tensor, gain: float = 1.0, generator: Generator | None = None) -> Tensor:
    """Glorot uniform init for a (fan_out, fan_in, ...) weight."""
    if t.ndim < 2:
        raise ValueError(f"xavier_uniform_ needs at least 2 dims, got shape {t.shape}")
    receptive = 1
    for s in t.shape[2:]:
        receptive *= s
    fan_in, fan_out = t.shape[1] * receptive, t.shape[0] * receptive
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(t, -bound, bound, generator)


def zeros_(t: Tensor) -> Tensor:
    """Fill ``t`` with zeros."""
    _write(t, 0)
    return t


def ones_(t: Tensor) -> Tensor:
    """Fill ``t`` with ones."""
    _write(t, 1)
    return t
