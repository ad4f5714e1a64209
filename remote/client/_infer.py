"""Result shapes and dtypes of NumPy operations, found on the client without the data.

The client never runs an op, yet must give every result its shape and dtype at once (autodiff
and tensorlib's checks read them). Shapes follow NumPy's rules (broadcasting, reductions,
matmul, indexing); dtypes come from NumPy itself (``ufunc.resolve_dtypes`` with Python
scalars as weak, NEP 50) or from running the op once on one-element arrays, cached by the
input dtypes, so an op costs a dict lookup, not a computation on its data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "broadcast",
    "dtype_by_example",
    "index_shape",
    "matmul_shape",
    "memo_get",
    "memo_put",
    "reduce_shape",
    "reshape_shape",
    "ufunc_dtype",
]

Shape = tuple[int, ...]


def broadcast(*shapes: Shape) -> Shape:
    """NumPy's broadcast of ``shapes``.

    Raises:
        ValueError: when they do not broadcast (NumPy's message).
    """
    first = shapes[0]
    if all(s == first for s in shapes):
        return first
    n = max(len(s) for s in shapes)
    out = []
    for i in range(-n, 0):
        dim = 1
        for s in shapes:
            if len(s) >= -i:
                d = s[i]
                if d != 1:
                    if dim != 1 and d != dim:
                        raise ValueError(
                            "operands could not be broadcast together with shapes "
                            + " ".join(str(tuple(s)) for s in shapes)
                        )
                    dim = d
        out.append(dim)
    return tuple(out)


# Inferred results by signature (op, input shapes and dtypes, arguments): a training loop
# issues the same few signatures every step, so inference runs once for each.
_memo: dict[Any, Any] = {}
_MEMO_MAX = 1 << 14


def memo_get(key: Any) -> Any:
    """What :func:`memo_put` stored under ``key`` (None: nothing, or an unhashable key)."""
    try:
        return _memo.get(key)
    except TypeError:  # an unhashable argument (a list): not cached
        return None


def memo_put(key: Any, value: Any) -> None:
    """Remember an inferred result under its signature ``key``."""
    if len(_memo) >= _MEMO_MAX:  # shapes that never repeat: start over, never grow
        _memo.clear()
    try:
        _memo[key] = value
    except TypeError:
        pass


# Callers may cache under their own keys here (name and operand kinds).
ufunc_cache: dict[tuple[Any, ...], np.dtype[Any]] = {}


def weak(x: Any) -> Any:
    """What decides ``x``'s part in a result dtype: its dtype, or its Python type (a weak
    scalar, NEP 50)."""
    t = type(x)
    if t is bool or t is int or t is float:
        return t
    return x.dtype


def ufunc_dtype(ufunc: np.ufunc, *operands: Any) -> np.dtype[Any]:
    """The output dtype NumPy gives ``ufunc`` on ``operands`` (arrays, handles, numbers)."""
    key = (ufunc, *(weak(x) for x in operands))
    dt = ufunc_cache.get(key)
    if dt is None:
        dt = _resolve(ufunc, key[1:])
        ufunc_cache[key] = dt
    return dt


def _resolve(ufunc: np.ufunc, kinds: tuple[Any, ...]) -> np.dtype[Any]:
    try:
        return np.dtype(ufunc.resolve_dtypes((*kinds, None))[-1])
    except (TypeError, AttributeError, ValueError):  # no loop for these: as NumPy would raise
        examples = [k(1) if isinstance(k, type) else np.ones(1, dtype=k) for k in kinds]
        with np.errstate(all="ignore"):
            return np.asarray(ufunc(*examples)).dtype


_example_cache: dict[tuple[Any, ...], np.dtype[Any]] = {}


def dtype_by_example(key: tuple[Any, ...], fn: Callable[..., Any], *dtypes: Any) -> np.dtype[Any]:
    """The dtype of ``fn`` on one-element arrays of ``dtypes`` (Python types: a weak scalar),
    cached under ``key``."""
    dt = _example_cache.get(key)
    if dt is None:
        examples = [d(1) if isinstance(d, type) else np.ones(1, dtype=d) for d in dtypes]
        with np.errstate(all="ignore"):
            dt = np.asarray(fn(*examples)).dtype
        _example_cache[key] = dt
    return dt


def norm_axes(axis: Any, ndim: int) -> tuple[int, ...] | None:
    """``axis`` (None, an int or ints) as non-negative axes, NumPy's errors for bad ones."""
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
    out = []
    for a in axes:
        a = int(a)
        if not -ndim <= a < max(ndim, 1) or (ndim == 0 and a not in (0, -1)):
            raise np.exceptions.AxisError(a, ndim)
        out.append(a % ndim if ndim else 0)
    if len(set(out)) != len(out):
        raise ValueError("duplicate value in 'axis'")
    return tuple(out)


def reduce_shape(shape: Shape, axis: Any, keepdims: bool) -> Shape:
    """The shape a reduction over ``axis`` leaves."""
    axes = norm_axes(axis, len(shape))
    if axes is None:
        return (1,) * len(shape) if keepdims else ()
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def matmul_shape(a: Shape, b: Shape) -> Shape:
    """NumPy's ``matmul`` result shape (1-d operands promoted, batch dims broadcast)."""
    if not a or not b:
        raise ValueError("matmul: Input operand does not have enough dimensions")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(
            f"matmul: Input operand 1 has a mismatch in its core dimension 0 "
            f"(size {b2[-2]} is different from {a2[-1]})"
        )
    out = (*broadcast(a2[:-2], b2[:-2]), a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def reshape_shape(size: int, shape: Shape, old: Shape) -> Shape:
    """``shape`` with its one -1 resolved for ``size`` elements."""
    if shape.count(-1) > 1:
        raise ValueError("can only specify one unknown dimension")
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape array of size {size} into shape {shape}")
        shape = tuple(size // known if d == -1 else d for d in shape)
    if any(d < 0 for d in shape) or math.prod(shape) != size:
        raise ValueError(f"cannot reshape array of size {size} into shape {shape}")
    return shape


def _is_int_array(x: Any) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and dt.kind in "iu" and not isinstance(x, np.generic)


def _is_bool_array(x: Any) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and dt.kind == "b" and not isinstance(x, bool)


def index_shape(shape: Shape, index: Any) -> tuple[Shape, bool]:
    """The shape of ``a[index]`` for ``a`` of ``shape``, and whether it is a view (basic).

    ``index`` holds ints, slices, None, Ellipsis, and integer or boolean arrays (a boolean
    array must be a NumPy one here: its shape depends on its values).

    Raises:
        IndexError: NumPy's errors for indices that do not fit ``shape``.
    """
    parts = list(index) if type(index) is tuple else [index]
    # Expand Ellipsis and count the axes each part consumes.
    used = 0
    for p in parts:
        if _is_bool_array(p):
            used += p.ndim
        elif p is not None and p is not Ellipsis:
            used += 1
    if used > len(shape):
        raise IndexError(
            f"too many indices for array: array is {len(shape)}-dimensional, "
            f"but {used} were indexed"
        )
    n_ell = sum(1 for p in parts if p is Ellipsis)
    if n_ell > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if n_ell:
        i = next(k for k, p in enumerate(parts) if p is Ellipsis)
        parts[i : i + 1] = [slice(None)] * (len(shape) - used)
    else:
        parts += [slice(None)] * (len(shape) - used)
    advanced = any(_is_int_array(p) or _is_bool_array(p) for p in parts)
    out: list[int] = []
    adv_shapes: list[Shape] = []
    adv_at: list[int] = []  # positions (in `parts`) of advanced indices
    axis = 0
    for k, p in enumerate(parts):
        if p is None:
            out.append(1)
        elif type(p) is slice:
            out.append(len(range(*p.indices(shape[axis]))))
            axis += 1
        elif _is_bool_array(p):
            dims = shape[axis : axis + p.ndim]
            if tuple(p.shape) != tuple(dims):
                raise IndexError(
                    f"boolean index did not match indexed array along axis {axis}; size of "
                    f"axis is {dims[0] if dims else 0} but size of boolean index is "
                    f"{p.shape[0] if p.ndim else 0}"
                )
            adv_shapes.append((int(np.count_nonzero(p)),))
            adv_at.append(k)
            out.append(-1)  # a placeholder for the advanced block
            axis += p.ndim
        elif _is_int_array(p):
            adv_shapes.append(tuple(p.shape))
            adv_at.append(k)
            out.append(-1)
            axis += 1
        else:
            i = int(p)
            n = shape[axis]
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {n}")
            if advanced:  # an integer among arrays takes part in the advanced block
                adv_shapes.append(())
                adv_at.append(k)
                out.append(-1)
            axis += 1
    if not advanced:
        return tuple(out), True
    block = broadcast(*adv_shapes)
    first = out.index(-1)
    rest = [d for d in out if d != -1]
    adjacent = adv_at == list(range(adv_at[0], adv_at[0] + len(adv_at)))
    if adjacent:
        before = sum(1 for d in out[:first] if d != -1)
        return tuple(rest[:before]) + block + tuple(rest[before:]), False
    return block + tuple(rest), False
