"""The dtypes a Tensor may hold, and how user-given dtypes are normalized."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "bool_",
    "float16",
    "float32",
    "float64",
    "int32",
    "int64",
    "is_floating",
    "normalize_dtype",
]

float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
bool_ = np.dtype(np.bool_)

SUPPORTED: frozenset[np.dtype[Any]] = frozenset({float16, float32, float64, int32, int64, bool_})
FLOATING: frozenset[np.dtype[Any]] = frozenset({float16, float32, float64})
_NAMES = "float16, float32, float64, int32, int64, bool"

_ALIASES: dict[str, np.dtype[Any]] = {
    "float16": float16,
    "half": float16,
    "float32": float32,
    "float": float32,
    "float64": float64,
    "double": float64,
    "int32": int32,
    "int": int64,
    "int64": int64,
    "long": int64,
    "bool": bool_,
}


def normalize_dtype(dtype: Any) -> np.dtype[Any]:
    """Turn a dtype spec (NumPy dtype, type or name) into one of the supported dtypes.

    Raises:
        TypeError: if the dtype is not one tensorlib supports.
    """
    if isinstance(dtype, str) and dtype in _ALIASES:
        return _ALIASES[dtype]
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"unknown dtype {dtype!r}; supported: {_NAMES}") from exc
    if dt not in SUPPORTED:
        raise TypeError(f"unsupported dtype {dt}; tensorlib supports {_NAMES}")
    return dt


def is_floating(dtype: np.dtype[Any]) -> bool:
    """True for float16/float32/float64."""
    return dtype in FLOATING


def default_dtype_for(data: Any) -> np.dtype[Any]:
    """Dtype for Python data with no explicit dtype: floats -> float32, ints -> int64."""
    arr_dtype = np.asarray(data).dtype
    if arr_dtype.kind == "f":
        return float32
    if arr_dtype.kind in "iu":
        return int64
    if arr_dtype.kind == "b":
        return bool_
    raise TypeError(f"cannot make a tensor from data of dtype {arr_dtype}; supported: {_NAMES}")
