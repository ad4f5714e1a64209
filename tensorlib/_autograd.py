"""Reverse-mode autodiff, forward side: the :class:`Function` base and the operators' shorter
path. The engine that runs ``backward()`` is :mod:`._backward`.

Grad mode (``no_grad``...) lives in ``_grad_mode`` and is re-exported here.

Contract for ``Function.backward``: return, for each argument of ``forward``, a gradient array
(or None). Each must be a new array, the incoming ``grad`` itself, or a view of ``grad`` --
never an array saved from forward -- so the engine knows which gradients it may reuse or
accumulate into in place. Gradients may have a broadcast shape; the engine sums them back to
the input's shape (the one place un-broadcasting happens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _autocast, _device_guard
from ._device import CPU, device_of
from ._device_guard import call_on
from ._dtype import FLOATING, promote_operands
from ._grad_mode import _state, enable_grad, is_grad_enabled, no_grad, set_grad_enabled

__all__ = [
    "Function",
    "enable_grad",
    "is_grad_enabled",
    "no_grad",
    "set_grad_enabled",
]

_NUMBERS = (int, float)


def _describe(args: tuple[Any, ...]) -> str:
    parts = []
    for a in args:
        shape = getattr(a, "shape", None)
        dtype = getattr(a, "dtype", None)
        if shape is not None and dtype is not None:
            parts.append(f"{tuple(shape)} {dtype}")
        else:
            parts.append(type(a).__name__)
    return ", ".join(parts)


class Function:
    """One differentiable primitive: ``forward`` on raw arrays, ``backward`` returning grads.

    Subclasses implement ``forward(*arrays, **options)`` (saving what backward needs on
    ``self``) and ``backward(grad)``. Users call ``Subclass.apply(*tensors_or_constants)``;
    non-Tensor arguments are constants and receive no gradient.
    """

    __slots__ = ("freed", "inputs")

    inputs: tuple[Tensor | None, ...]
    freed: bool
    # True for primitives whose output lives on another device than their inputs.
    moves_device = False
    # Type promotion (torch's rules, `_dtype.promote_operands`): positional arguments from
    # this index on are cast to one result dtype (None: no promotion); `float_result` makes
    # an integer result float32 (true division, exp...).
    promote_from: int | None = None
    float_result = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, grad: Any) -> Any:
        raise NotImplementedError

    _saved_names: tuple[str, ...] = ()
    _has_dict = False
    _plain_release = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names: list[str] = []
        for klass in cls.__mro__:
            for name in klass.__dict__.get("__slots__", ()):
                if name not in ("inputs", "freed"):
                    names.append(name)
        cls._saved_names = tuple(names)
        # Known once per class: asking a slotted instance for its __dict__ raises inside
        # getattr, which is slow on the backward path.
        cls._has_dict = cls.__dictoffset__ != 0
        # Nothing saved and release() not overridden: the engine drops the edges itself.
        cls._plain_release = not names and not cls._has_dict and cls.release is Function.release

    def release(self) -> None:
        """Drop saved intermediates (called by the engine once backward passed this node)."""
        names = self._saved_names
        if names:
            for name in names:
                try:
                    delattr(self, name)
                except AttributeError:
                    pass
        # Subclasses without __slots__ (e.g. users' custom Functions) save on the instance dict.
        if self._has_dict:
            self.__dict__.clear()
        # Drop the edges too: they hold the input Tensors, whose arrays would otherwise stay
        # alive as long as the output does (every activation of a model while `loss` lives).
        self.inputs = ()
        self.freed = True

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Tensor:
        """Run the primitive on Tensors and constants; record it when a gradient is needed."""
        if _autocast.active:  # one global read when no thread has autocast on
            policy = getattr(cls, "autocast", None)
            if policy is not None:
                args = _autocast.cast_args(policy, args)
        raw = []
        ins: list[Tensor | None] = []
        requires_grad = False
        dev = None
        dt: Any = None  # the Tensor arguments' one dtype; False: mixed, or other operands
        for a in args:
            if isinstance(a, Tensor):
                data = a._data
                raw.append(data)
                if dt is None:
                    dt = data.dtype
                elif dt is not data.dtype and dt != data.dtype:
                    dt = False
                if a.requires_grad:
                    requires_grad = True
                    ins.append(a)
                else:
                    ins.append(None)
                if dev is None:
                    dev = a._device
                elif a._device is not dev:
                    raise RuntimeError(
                        f"{cls.__name__}: expected all tensors on the same device, got "
                        f"{dev} and {a._device}"
                    )
            else:
                kind = type(a)
                if kind is not float and kind is not int:  # (the common case, checked cheaply)
                    if isinstance(a, np.generic):  # NumPy scalars act as Python numbers (torch's
                        a = a.item()  # rule); np.float64 is a float subclass: test it first
                    elif not isinstance(a, _NUMBERS):
                        dt = False  # an array operand: promotion decides
                raw.append(a)
                ins.append(None)
        # CuPy computes on the current GPU: the inputs' GPU must be current for the casts and
        # the forward, whichever is (see _device_guard). The CPU pays one identity test.
        gpu = dev if dev is not CPU and dev is not None and dev.type == "cuda" else None
        # One floating dtype and Python numbers: that dtype wins, nothing to promote.
        if cls.promote_from is not None and dt not in FLOATING:
            if gpu is not None:
                call_on(gpu, promote_operands, (raw, cls.promote_from, cls.float_result), {})
            else:
                promote_operands(raw, cls.promote_from, cls.float_result)
        ctx = object.__new__(cls)
        try:
            if gpu is not None:
                out = call_on(gpu, ctx.forward, tuple(raw), kwargs)
            else:
                out = ctx.forward(*raw, **kwargs)
        except (ValueError, TypeError, IndexError) as exc:
            raise _forward_error(cls, exc, raw) from exc
        if isinstance(out, np.generic):  # NumPy returns scalars from 0-d ufuncs and reductions
            out = np.asarray(out)
        if cls.moves_device:
            dev = kwargs["device"]
            if requires_grad and _state.enabled:  # recorded: backward checks each node's device
                _device_guard.cross_device_recorded = True
        elif dev is None:
            dev = device_of(out)
        # The output is built inline, here and in binary_operator's shorter path, not by a
        # shared helper: one more call is ~5% of an op on tiny tensors (benchmarks.mlp_step).
        t = object.__new__(Tensor)
        t._data = out
        t._device = dev
        t._grad = None
        t._hooks = None
        if requires_grad and _state.enabled:
            ctx.inputs = tuple(ins)
            ctx.freed = False
            t._ctx = ctx
            t.requires_grad = True
        else:
            t._ctx = None
            t.requires_grad = False
        return t


def _forward_error(cls: type[Function], exc: Exception, raw: list[Any]) -> Exception:
    """``exc`` from ``cls.forward``, again, with the op's name and its inputs' shapes."""
    return type(exc)(f"{cls.__name__}: {exc} (inputs: {_describe(tuple(raw))})")


_new = object.__new__
_NO_KWARGS: dict[str, Any] = {}


def binary_operator(
    cls: type[Function], name: str, reflected: bool = False
) -> Callable[[Any, Any], Tensor]:
    """The operator method ``name`` running ``cls.apply(self, other)`` (``(other, self)`` when
    ``reflected``), by a shorter path in the common case: no autocast anywhere, and two tensors
    of one floating dtype (the same dtype object) on one device, or one and a Python
    ``float``/``int``. There ``apply`` would promote, cast and check nothing, so this builds the
    same output and node in fewer steps; any other case goes through ``apply``. For primitives
    whose ``forward(a, b)`` takes the operands as they are, whose output stays on their device,
    and whose ``compute(a, b)`` is ``forward``'s result without a node (used when no graph is
    recorded): the arithmetic operators.
    """
    compute = cls.compute  # type: ignore[attr-defined]

    # The method itself holds the path (no second call: on tiny tensors a call is ~5% of an op).
    def method(self: Any, other: Any) -> Tensor:
        if reflected:
            a, b = other, self
        else:
            a, b = self, other
        if not _autocast.active:
            if isinstance(a, Tensor):
                da = a._data
                dt = da.dtype
                dev = a._device
                ia = a if a.requires_grad else None
                if isinstance(b, Tensor):
                    db = b._data
                    ok = b._device is dev and db.dtype is dt
                    ib = b if b.requires_grad else None
                else:
                    db = b
                    ok = type(b) is float or type(b) is int  # not bool, not NumPy scalars
                    ib = None
            else:  # a number on the left (the reflected operators): b is the tensor
                db = b._data
                dt = db.dtype
                dev = b._device
                da = a
                ok = type(a) is float or type(a) is int
                ia = None
                ib = b if b.requires_grad else None
            if ok and dt in FLOATING:
                record = (ia is not None or ib is not None) and _state.enabled
                try:
                    if dev is not CPU and dev.type == "cuda":  # on its GPU (see _device_guard)
                        ctx = _new(cls)
                        fn = ctx.forward if record else compute
                        out = call_on(dev, fn, (da, db), _NO_KWARGS)
                    elif record:
                        ctx = _new(cls)
                        out = ctx.forward(da, db)
                    else:
                        out = compute(da, db)
                except (ValueError, TypeError, IndexError) as exc:
                    raise _forward_error(cls, exc, [da, db]) from exc
                if isinstance(out, np.generic):
                    out = np.asarray(out)
                t = _new(Tensor)  # as apply builds it (inline on purpose: see there)
                t._data = out
                t._device = dev
                t._grad = None
                t._hooks = None
                if record:
                    ctx.inputs = (ia, ib)
                    ctx.freed = False
                    t._ctx = ctx
                    t.requires_grad = True
                else:
                    t._ctx = None
                    t.requires_grad = False
                return t
        return cls.apply(a, b)

    method.__name__ = name
    method.__qualname__ = f"TensorOps.{name}"
    method.__module__ = "tensorlib._tensor_ops"
    method.__doc__ = f"``{cls.__name__}.apply`` of the operands (see ``binary_operator``)."
    return method


from ._tensor import Tensor  # noqa: E402  (Tensor needs Function first; import at the end)
