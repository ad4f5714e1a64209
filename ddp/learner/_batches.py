"""Splitting a global batch into one shard per device, and moving each shard to its device.

A batch is what a loader yields: a Tensor or array, or a tuple, list or dict of them (nested),
every array with the same first (sample) dimension; other values (numbers, strings, None) are
given to every shard as they are. Shards are contiguous: the first ``n % k`` devices get one
sample more, as ``numpy.array_split`` does, so every strategy sees the same global batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import tensorlib as tl
from tensorlib import Device, Tensor

__all__ = ["batch_size", "shard", "shard_bounds"]


def _is_array(value: Any) -> bool:
    return isinstance(value, Tensor | np.ndarray) or (
        type(value).__module__.startswith("cupy") and hasattr(value, "shape")
    )


def _sizes(value: Any, path: str, out: list[tuple[str, int]]) -> None:
    if _is_array(value):
        if not value.shape:
            raise ValueError(
                f"the batch's {path or 'value'} is a 0-d array; every array of a batch needs a "
                "first (sample) axis to be split across devices"
            )
        out.append((path or "batch", int(value.shape[0])))
    elif isinstance(value, tuple | list):
        for i, v in enumerate(value):
            _sizes(v, f"{path}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _sizes(v, f"{path}[{k!r}]", out)


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch`` (the first dimension its arrays share).

    Raises:
        ValueError: when the batch holds no array, or arrays of different lengths.
    """
    found: list[tuple[str, int]] = []
    _sizes(batch, "", found)
    if not found:
        raise ValueError(
            f"a batch must hold at least one array or Tensor (e.g. (x, y)), got "
            f"{type(batch).__name__}"
        )
    if len({n for _, n in found}) != 1:
        shown = ", ".join(f"{p}: {n}" for p, n in found)
        raise ValueError(
            f"the arrays of a batch must have the same first dimension to be split across "
            f"devices, got {shown}"
        )
    return found[0][1]


def shard_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ``(start, stop)`` ranges covering ``range(n)``, the first ``n % k``
    one longer (``numpy.array_split``'s rule)."""
    base, extra = divmod(n, k)
    out, start = [], 0
    for j in range(k):
        stop = start + base + (1 if j < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _leaf(value: Any, lo: int, hi: int, whole: bool, device: Device) -> Any:
    if isinstance(value, Tensor):
        part = value if whole else value[lo:hi]
        return part.detach().to(device)
    # NumPy (or CuPy) data: one copy onto the device, as the loader's tl.tensor would make.
    return tl.tensor(value if whole else value[lo:hi], device=device)


def shard(batch: Any, bounds: tuple[int, int], n: int, device: Device) -> Any:
    """The samples ``bounds`` of ``batch`` (of ``n`` samples) as Tensors on ``device``, in the
    batch's own structure."""
    lo, hi = bounds
    whole = lo == 0 and hi == n

    def walk(value: Any) -> Any:
        if _is_array(value):
            return _leaf(value, lo, hi, whole, device)
        if isinstance(value, tuple | list):
            items = [walk(v) for v in value]
            if hasattr(value, "_fields"):  # a namedtuple keeps its type
                return type(value)(*items)
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return walk(batch)
