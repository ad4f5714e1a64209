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


def handlers(xp: Any, guard: Callable[[int], None] = lambda n: None) -> list[Handler | None]:
    """The op table for array module ``xp``: ``OPS[i]`` runs as ``table[i](args, out)``;
    ``guard(nbytes)`` vets what a creation op would allocate before it does.

    Names come from the fixed table in ``_wire``, never from the wire.
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
    set_("upload", lambda a, out: xp.asarray(a[0]))

    def full(a: Sequence[Any], out: Any) -> Any:
        guard(math.prod(a[0]) * np.dtype(a[2]).itemsize)
        return xp.full(a[0], a[1], dtype=a[2])

    def arange(a: Sequence[Any], out: Any) -> Any:
        guard(max(0, math.ceil((a[1] - a[0]) / a[2])) * np.dtype(a[3]).itemsize)
        return xp.arange(a[0], a[1], a[2], dtype=a[3])

    set_("full", full)
    set_("arange", arange)
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
