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
    "promote_operands",
    "result_type",
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


# ---------------------------------------------------------------------------- type promotion
# PyTorch's rules (c10's ResultTypeState), which tensorlib follows: operands fall into three
# priority groups -- tensors/arrays with at least one dimension, 0-d tensors/arrays, Python
# numbers (NumPy scalars count as Python numbers) -- and a lower group decides the dtype only
# when its category (bool < integer < floating) is higher than every higher group's. Within a
# group, and between groups when the lower one wins, dtypes promote as below: same category
# -> the wider one (NumPy's table); across categories -> the higher category's dtype (int32 +
# float16 -> float16, where NumPy gives float64). A Python float counts as float32, the
# default float dtype, a Python int as int64.
_RANK = {"b": 0, "i": 1, "u": 1, "f": 2}


def _rank(dt: np.dtype[Any]) -> int:
    return _RANK.get(dt.kind, 3)


def _promote(x: np.dtype[Any] | None, y: np.dtype[Any] | None) -> np.dtype[Any] | None:
    if x is None or x == y:
        return y
    if y is None:
        return x
    rx, ry = _rank(x), _rank(y)
    if rx == ry:
        return np.promote_types(x, y)
    return x if rx > ry else y


def _combine(higher: np.dtype[Any] | None, lower: np.dtype[Any] | None) -> np.dtype[Any] | None:
    """torch's combine_categories: ``lower`` counts only when its category is higher."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if _rank(higher) == 2:
        return higher
    if higher == bool_ or _rank(lower) == 2:
        return _promote(higher, lower)
    return higher


def _scalar_dtype(x: Any) -> np.dtype[Any] | None:
    if isinstance(x, bool):
        return bool_
    if isinstance(x, int):
        return int64
    if isinstance(x, float):
        return float32
    return None  # not a number tensorlib knows: leave it to NumPy/CuPy


def result_type(*operands: Any) -> np.dtype[Any] | None:
    """The dtype PyTorch gives an elementwise op on ``operands`` (arrays and Python numbers).

    Returns None when no operand is a number or an array.
    """
    dim = zero = wrapped = None
    for x in operands:
        dt = getattr(x, "dtype", None)
        if dt is None:
            wrapped = _promote(wrapped, _scalar_dtype(x))
        elif x.ndim:
            dim = _promote(dim, dt)
        else:
            zero = _promote(zero, dt)
    return _combine(dim, _combine(zero, wrapped))


def promote_operands(raw: list[Any], start: int = 0, to_float: bool = False) -> None:
    """Cast the arrays in ``raw[start:]`` (in place in the list) to their :func:`result_type`.

    Python numbers stay as they are: against an array of the result dtype, NumPy (NEP 50)
    and CuPy keep that dtype. ``to_float`` (true division, exp...) turns an integer or bool
    result into float32, as torch does.
    """
    ops = raw[start:] if start else raw
    # Fast path (nearly every call): all arrays share one floating dtype, which then wins.
    first = None
    for x in ops:
        dt = getattr(x, "dtype", None)
        if dt is not None:
            if first is None:
                first = dt
            elif dt is not first and dt != first:
                first = None
                break
    if first is not None and first.kind == "f":
        return
    rt = result_type(*ops)
    if rt is None:
        return
    if to_float and _rank(rt) < 2:
        rt = float32
    for i in range(start, len(raw)):
        x = raw[i]
        dt = getattr(x, "dtype", None)
        if dt is not None and dt != rt:
            raw[i] = x.astype(rt)
