"""The server's op table: what each code of ``_wire.OPS`` runs, as ``table[op](args, out)``.

Names come from the fixed table in ``_wire``, never from the wire; ``args`` arrive with their
REFs already replaced by the session's arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tensorlib.functional import (
    cross_entropy_forward,
    cross_entropy_grad,
    cross_entropy_targets,
    linear_backward,
    linear_forward,
    relu_backward,
)
from tensorlib.optim import adam_update

from .._wire import (
    ADAM_FLAGS,
    ADAM_HYPER,
    ADAM_NUMBERS,
    BINARY_UFUNCS,
    LOSS_REDUCTIONS,
    OP_CODES,
    OPS,
    REDUCTIONS,
    UNARY_UFUNCS,
    Ref,
)

__all__ = ["ADAM_WRITTEN", "Handler", "adam_writes", "handlers"]

Handler = Callable[[Sequence[Any], Any], Any]


def handlers(xp: Any, guard: Callable[[int], None] | None = None) -> list[Handler | None]:
    """The op table for array module ``xp``: ``OPS[i]`` runs as ``table[i](args, out)``.

    With ``guard``, an op that makes a new array first calls ``guard(nbytes)`` with what its
    result will take (``_SIZES``: from its operands' shapes and dtypes, before it allocates
    anything), so that a session's memory limit refuses it before it exists. Names come from
    the fixed table in ``_wire``, never from the wire.
    """
    table: list[Handler | None] = [None] * len(OPS)

    def set_(name: str, fn: Handler) -> None:
        table[OP_CODES[name]] = fn

    for name in BINARY_UFUNCS:
        f = getattr(xp, name, None)
        if f is not None:
            set_(name, _binary(f))
    for name in UNARY_UFUNCS:
        f = getattr(xp, name, None)
        if f is not None:
            set_(name, _unary(f))
    for name in REDUCTIONS:
        set_(name, _reduction(name, with_dtype=name in ("sum", "mean", "prod")))
    # UPLOAD: its ARRAY, or (shape, dtype) of an array of zeros whose pieces follow
    set_("upload", lambda a, out: xp.asarray(a[0]) if len(a) == 1 else xp.zeros(a[0], a[1]))
    set_("full", lambda a, out: xp.full(a[0], a[1], dtype=a[2]))
    set_("arange", lambda a, out: xp.arange(a[0], a[1], a[2], dtype=a[3]))
    set_("matmul", lambda a, out: xp.matmul(a[0], a[1], out=out))
    set_("reshape", lambda a, out: a[0].reshape(a[1]))
    set_("transpose", lambda a, out: a[0].transpose(a[1]))
    set_("broadcast_to", lambda a, out: xp.broadcast_to(a[0], a[1]))
    set_("expand_dims", lambda a, out: xp.expand_dims(a[0], a[1]))
    set_("squeeze", lambda a, out: a[0].squeeze(axis=a[1]))
    set_("swapaxes", lambda a, out: a[0].swapaxes(a[1], a[2]))
    set_("getitem", lambda a, out: a[0][a[1]])
    set_("setitem", lambda a, out: out.__setitem__(a[0], a[1]))
    set_("concatenate", lambda a, out: xp.concatenate(a[0], axis=a[1]))
    set_("stack", lambda a, out: xp.stack(a[0], axis=a[1]))
    set_("copy", lambda a, out: a[0].copy())
    set_("astype", lambda a, out: a[0].astype(a[1]))
    set_("fill", lambda a, out: out.fill(a[0]))
    set_("where", lambda a, out: xp.where(a[0], a[1], a[2]))
    set_("clip", lambda a, out: xp.clip(a[0], a[1], a[2], out=out))
    set_("add_at", lambda a, out: _add_at(xp, out, a[0], a[1]))
    set_("adam", _adam(xp.ndarray))
    _fused_nn(set_, xp)
    if guard is not None:
        for code, size in _sizes().items():
            fn = table[code]
            if fn is not None:
                table[code] = _guarded(fn, size, guard)
    return table


def _fused_nn(set_: Callable[[str, Handler], None], xp: Any) -> None:
    """LINEAR, LINEAR_GRAD, CROSS_ENTROPY, CROSS_ENTROPY_GRAD and RELU_GRAD: the functions
    tensorlib's Linear, CrossEntropy and Relu run, on the same arrays (the same bits). Wrong
    kinds of values raise here, so the record's results are poisoned, as any op's that fails."""
    array_type = xp.ndarray

    def arrays(name: str, *xs: Any) -> None:
        if not all(isinstance(x, array_type) for x in xs):
            raise TypeError(f"{name}: the operands must be arrays")

    def numbers(name: str, ignore: Any, smoothing: Any, reduction: Any) -> str:
        if type(ignore) is not int or type(smoothing) not in (int, float):
            raise TypeError(f"{name}: ignore_index must be an int and smoothing a number")
        if type(reduction) is not int or not 0 <= reduction < len(LOSS_REDUCTIONS):
            raise ValueError(f"{name}: reduction code {reduction!r} is not 0, 1 or 2")
        return LOSS_REDUCTIONS[reduction]

    def linear(a: Sequence[Any], out: Any) -> Any:
        x, w, b = a
        arrays("linear", x, w, *(() if b is None else (b,)))
        return linear_forward(x, w, b)

    def linear_grad(a: Sequence[Any], out: Any) -> Any:
        g, x, w, need_x, need_w, need_b = a
        arrays("linear_grad", g, x, w)
        if not all(type(v) is bool for v in (need_x, need_w, need_b)):
            raise TypeError("linear_grad: which gradients to make must be booleans")
        return linear_backward(g, x, w, need_x, need_w, need_b)

    def cross_entropy(a: Sequence[Any], out: Any) -> Any:
        logits, target, reduction, ignore, smoothing = a
        arrays("cross_entropy", logits, target)
        red = numbers("cross_entropy", ignore, smoothing, reduction)
        loss, e, sum_e, *_ = cross_entropy_forward(logits, target, red, ignore, smoothing)
        return loss, e / sum_e  # the local backward's first step, made here once

    def cross_entropy_grad_(a: Sequence[Any], out: Any) -> Any:
        probs, target, g, ignore, smoothing, reduction = a
        arrays("cross_entropy_grad", probs, target, g)
        red = numbers("cross_entropy_grad", ignore, smoothing, reduction)
        valid, safe_t = cross_entropy_targets(xp, target, ignore)
        count = valid.sum() if red == "mean" else None
        return cross_entropy_grad(probs.copy(), safe_t, valid, count, g, smoothing)

    def relu_grad(a: Sequence[Any], out: Any) -> Any:
        g, y = a
        arrays("relu_grad", g, y)
        return relu_backward(g, y)

    set_("linear", linear)
    set_("linear_grad", linear_grad)
    set_("cross_entropy", cross_entropy)
    set_("cross_entropy_grad", cross_entropy_grad_)
    set_("relu_grad", relu_grad)


def _binary(f: Any) -> Handler:
    def run(a: Sequence[Any], out: Any) -> Any:
        return f(a[0], a[1]) if out is None else f(a[0], a[1], out=out)

    return run


def _unary(f: Any) -> Handler:
    def run(a: Sequence[Any], out: Any) -> Any:
        return f(a[0]) if out is None else f(a[0], out=out)

    return run


def _reduction(name: str, with_dtype: bool) -> Handler:
    def run(a: Sequence[Any], out: Any) -> Any:
        method = getattr(a[0], name)  # a fixed name from OPS, on an array from the table
        if with_dtype:
            return method(axis=a[1], keepdims=a[2], dtype=a[3], out=out)
        return method(axis=a[1], keepdims=a[2], out=out)

    return run


def _add_at(xp: Any, a: Any, index: Any, values: Any) -> None:
    if xp is np:
        np.add.at(a, index, values)
    else:  # CuPy
        import cupyx

        cupyx.scatter_add(a, index, values)


# An ADAM record's values: the hyper-parameters, then IDS of the data, grads, two moments and
# amsgrad maxima, then the steps (``_records``).
_H = len(ADAM_HYPER)
_ADAM_VALUES = _H + 6
# Which of them it writes in place: the data, the two moments, and the amsgrad maxima
# (tuples, one array a parameter); the grads (value _H + 1) it only reads.
ADAM_WRITTEN = (_H, _H + 2, _H + 3, _H + 4)


def _adam(array_type: type) -> Handler:
    """ADAM: ``tensorlib.optim.adam_update`` on each parameter, as a local step runs it (the
    same function on the same NumPy, so the same bits). Every value is checked first (types,
    counts, each parameter's shapes and float dtypes): a malformed record changes nothing.
    The handler returns the update, not yet run: the worker runs it at once, or just after
    answering the READ that follows it (``Worker``)."""

    def run(a: Sequence[Any], out: Any) -> Callable[[], None]:
        if len(a) != _ADAM_VALUES:
            raise TypeError(f"adam: {_ADAM_VALUES} arguments expected, got {len(a)}")
        hyper = dict(zip(ADAM_HYPER, a[:_H], strict=True))
        arrays, steps = a[_H : _H + 5], a[_H + 5]
        for name in ADAM_NUMBERS:
            if type(hyper[name]) not in (int, float):
                raise TypeError(f"adam: {name} must be a number, got {type(hyper[name]).__name__}")
        if any(type(hyper[name]) is not bool for name in ADAM_FLAGS):
            raise TypeError("adam: decoupled and maximize must be booleans")
        if type(steps) is not tuple or not all(type(t) is int and t >= 1 for t in steps):
            raise TypeError("adam: the steps must be a tuple of integers >= 1")
        n = len(steps)
        for k, xs in enumerate(arrays):
            if type(xs) is not tuple or len(xs) != (n if k < 4 or xs else 0):
                raise TypeError(f"adam: {n} arrays expected for each of data, grad, m, v")
            if not all(issubclass(t, array_type) for t in set(map(type, xs))):
                raise TypeError("adam: a parameter's data, grad and moments must be arrays")
        data, grad, m, v, vmax = arrays
        for i in range(n):
            group = (data[i], grad[i], m[i], v[i], *((vmax[i],) if vmax else ()))
            if any(x.shape != data[i].shape or x.dtype.kind != "f" for x in group):
                raise TypeError(
                    f"adam: parameter {i}'s data, grad and moments must be float arrays of "
                    f"one shape, got {[(x.shape, str(x.dtype)) for x in group]}"
                )

        def update() -> None:
            for i in range(n):
                adam_update(
                    data[i], grad[i], m[i], v[i], vmax[i] if vmax else None, steps[i], **hyper
                )

        return update

    return run


def adam_writes(args: Sequence[Any]) -> list[int]:
    """The ids an ADAM record (its values as decoded, REFs unresolved) writes: what a failure
    poisons (the data and the moments)."""
    out: list[int] = []
    for k in ADAM_WRITTEN:
        xs = args[k] if len(args) > k else ()
        out += [x for x in xs if type(x) is Ref] if type(xs) is tuple else []
    return out


# ---------------------------------------------------------------------------- result sizes
# What each op that makes a new array will allocate for it, computed from its operands'
# shapes and dtypes by NumPy's rules (broadcasting, type resolution, indexing) without
# touching their data, so that a session's limit refuses the op before it allocates. Ops not
# here make views (reshape of a contiguous array, transpose, broadcast_to...) or write in
# place (setitem, fill, add_at, adam, collective, any op given ``out``).
Size = Callable[[Sequence[Any]], int]


def _guarded(fn: Handler, size: Size, guard: Callable[[int], None]) -> Handler:
    def run(a: Sequence[Any], out: Any) -> Any:
        if out is None:
            try:
                nbytes = size(a)
            except Exception:  # malformed operands: the op itself raises NumPy's error
                nbytes = 0
            guard(nbytes)
        return fn(a, out)

    return run


def _sizes() -> dict[int, Size]:
    """The size of each guarded op's result (results, for ops that make several), by code."""
    sizes: dict[str, Size] = {
        "upload": lambda a: (
            int(a[0].nbytes) if len(a) == 1 else math.prod(a[0]) * np.dtype(a[1]).itemsize
        ),
        "full": lambda a: math.prod(a[0]) * np.dtype(a[2]).itemsize,
        "arange": lambda a: max(0, math.ceil((a[1] - a[0]) / a[2])) * np.dtype(a[3]).itemsize,
        "matmul": lambda a: (
            _matmul_count(_shape(a[0]), _shape(a[1])) * _ufunc_itemsize(np.matmul, a[0], a[1])
        ),
        "reshape": _reshape_size,
        "getitem": lambda a: _index_count(a[0].shape, a[1]) * a[0].dtype.itemsize,
        "concatenate": _joined_size,
        "stack": _joined_size,
        "copy": lambda a: int(a[0].nbytes),
        "astype": lambda a: int(a[0].size) * np.dtype(a[1]).itemsize,
        "where": lambda a: _broadcast_count(a) * _result_itemsize(a[1:]),
        "clip": lambda a: _broadcast_count(a) * _result_itemsize(a),
        "linear": lambda a: math.prod(a[0].shape[:-1]) * a[1].shape[0] * _result_itemsize(a[:2]),
        "linear_grad": _linear_grad_size,
        # the probabilities, and the loss (at most one a row)
        "cross_entropy": lambda a: int(a[0].nbytes) + int(a[0].nbytes) // max(1, a[0].shape[-1]),
        "cross_entropy_grad": lambda a: int(a[0].nbytes),
        "relu_grad": lambda a: int(a[0].nbytes),
    }
    for name in BINARY_UFUNCS + UNARY_UFUNCS:
        sizes[name] = _elementwise_size(getattr(np, name))
    for name in REDUCTIONS:
        sizes[name] = _reduce_size(name)
    return {OP_CODES[name]: size for name, size in sizes.items()}


def _elementwise_size(ufunc: np.ufunc) -> Size:
    n = ufunc.nin

    def size(a: Sequence[Any]) -> int:
        return _broadcast_count(a[:n]) * _ufunc_itemsize(ufunc, *a[:n])

    return size


def _shape(x: Any) -> tuple[int, ...]:
    if type(x) in _NUMBERS:
        return ()
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


_NUMBERS = (bool, int, float)


def _kind(x: Any) -> Any:
    """What decides ``x``'s part in a result dtype: a Python number's type (weak, NEP 50),
    else its dtype."""
    t = type(x)
    return t if t is bool or t is int or t is float else x.dtype


_itemsizes: dict[tuple[Any, ...], int] = {}  # by ufunc and operand kinds: a few dozen


def _ufunc_itemsize(ufunc: np.ufunc, *operands: Any) -> int:
    key = (ufunc, *map(_kind, operands))
    n = _itemsizes.get(key)
    if n is None:
        try:
            n = np.dtype(ufunc.resolve_dtypes((*key[1:], None))[-1]).itemsize
        except (TypeError, ValueError):  # no loop: the op raises NumPy's error itself
            n = 0
        _itemsizes[key] = n
    return n


def _result_itemsize(operands: Sequence[Any]) -> int:
    kinds = [x if type(x) in (bool, int, float) else x.dtype for x in operands if x is not None]
    return int(np.result_type(*kinds).itemsize)


def _broadcast_count(operands: Sequence[Any]) -> int:
    """The elements of ``operands`` broadcast together (by dimension: a few steps an op)."""
    shapes = [_shape(x) for x in operands if x is not None]
    first = shapes[0]
    if all(s == first for s in shapes):
        return math.prod(first)
    count = 1
    for i in range(1, max(map(len, shapes)) + 1):
        dim = 1
        for s in shapes:
            d = s[-i] if len(s) >= i else 1
            if d != 1:
                if dim != 1 and d != dim:
                    raise ValueError(f"shapes {shapes} do not broadcast")
                dim = d
        count *= dim
    return count


def _matmul_count(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    rows = a[-2] if len(a) > 1 else 1
    cols = b[-1] if len(b) > 1 else 1
    return math.prod(np.broadcast_shapes(a[:-2], b[:-2])) * rows * cols


def _reshape_size(a: Sequence[Any]) -> int:
    """A reshape copies only an array it cannot view in the new shape."""
    x = a[0]
    if x.flags.c_contiguous:
        return 0
    if type(x) is np.ndarray:
        try:
            np.reshape(x, a[1], copy=False)  # NumPy 2.1+: raises if it would copy
            return 0
        except ValueError:
            pass
        except TypeError:  # an older NumPy: count the copy it may make
            pass
    return int(x.nbytes)


def _joined_size(a: Sequence[Any]) -> int:
    xs = a[0]
    return sum(int(x.size) for x in xs) * _result_itemsize(xs)


def _index_count(shape: tuple[int, ...], index: Any) -> int:
    """The elements of ``x[index]`` for ``x`` of ``shape`` (0 for a basic index: a view)."""
    parts = list(index) if type(index) is tuple else [index]
    if not any(hasattr(p, "dtype") and not isinstance(p, np.generic) for p in parts):
        return 0
    used = sum(p.ndim if getattr(p, "dtype", None) == np.bool_ else 1 for p in parts)
    used -= sum(1 for p in parts if p is None or p is Ellipsis)
    count, axis = 1, 0
    block: list[tuple[int, ...]] = []
    for p in parts:
        if p is None:
            continue
        if p is Ellipsis:
            k = len(shape) - used
            count *= math.prod(shape[axis : axis + k])
            axis += k
        elif type(p) is slice:
            count *= len(range(*p.indices(shape[axis])))
            axis += 1
        elif hasattr(p, "dtype") and p.dtype == np.bool_:
            block.append((int(p.sum()),))  # the mask's True entries
            axis += p.ndim
        else:  # an integer array, or an integer (one element of the advanced block)
            block.append(_shape(p))
            axis += 1
    return count * math.prod(shape[axis:]) * math.prod(np.broadcast_shapes(*block))


_reduce_itemsizes: dict[tuple[Any, ...], int] = {}


def _reduce_size(name: str) -> Size:
    def size(a: Sequence[Any]) -> int:
        x, axis = a[0], a[1]
        if axis is None:
            count = 1
        else:
            axes = {int(i) % x.ndim for i in ((axis,) if type(axis) is int else axis)}
            count = math.prod(d for i, d in enumerate(x.shape) if i not in axes)
        dtype = a[3] if len(a) > 3 else None
        key = (name, x.dtype, dtype)
        n = _reduce_itemsizes.get(key)
        if n is None:  # NumPy's own choice, on one element (mean of ints: float64...)
            one = np.ones(1, dtype=x.dtype)
            kwargs = {} if dtype is None else {"dtype": dtype}
            with np.errstate(all="ignore"):
                n = int(getattr(one, name)(**kwargs).dtype.itemsize)
            _reduce_itemsizes[key] = n
        return count * n

    return size


def _linear_grad_size(a: Sequence[Any]) -> int:
    g, x, w, need_x, need_w, need_b = a
    return (
        (int(x.nbytes) if need_x is True else 0)
        + (int(w.nbytes) if need_w is True else 0)
        + (int(g.nbytes) // max(1, math.prod(g.shape[:-1])) if need_b is True else 0)
    )
