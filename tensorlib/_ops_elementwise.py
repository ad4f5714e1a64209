"""Elementwise primitives: arithmetic, unary math, activations, comparisons-with-grad, casts."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from . import _device_kinds
from ._autograd import Function
from ._device import Device, _load_cupy

__all__ = [
    "Abs",
    "Add",
    "Cast",
    "Clip",
    "Div",
    "Exp",
    "Gelu",
    "Log",
    "Maximum",
    "Minimum",
    "Mul",
    "Neg",
    "Pow",
    "Relu",
    "Sigmoid",
    "Sqrt",
    "Sub",
    "Tanh",
    "ToDevice",
    "Where",
    "xp_of",
]


def xp_of(a: Any) -> Any:
    """Array module (numpy, cupy, or a registered device kind's) of an array."""
    if isinstance(a, np.ndarray | np.generic):
        return np
    kind = _device_kinds.kind_of_array(a)
    if kind is not None:
        return kind.xp(kind.device_of(a))
    return _load_cupy()


# ============================================================================ binary arithmetic
class Add(Function):
    __slots__ = ()
    promote_from = 0

    compute = staticmethod(operator.add)  # forward without a node (see binary_operator)

    def forward(self, a: Any, b: Any) -> Any:
        return a + b

    def backward(self, g: Any) -> Any:
        return g, g


class Sub(Function):
    __slots__ = ()
    promote_from = 0

    compute = staticmethod(operator.sub)  # forward without a node (see binary_operator)

    def forward(self, a: Any, b: Any) -> Any:
        return a - b

    def backward(self, g: Any) -> Any:
        return g, (-g if self.inputs[1] is not None else None)


class Mul(Function):
    __slots__ = ("a", "b")
    promote_from = 0

    compute = staticmethod(operator.mul)  # forward without a node (see binary_operator)

    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        return a * b

    def backward(self, g: Any) -> Any:
        ga = g * self.b if self.inputs[0] is not None else None
        gb = g * self.a if self.inputs[1] is not None else None
        return ga, gb


class Div(Function):
    __slots__ = ("b", "out")
    promote_from = 0
    float_result = True  # torch: int tensors give float32

    compute = staticmethod(operator.truediv)  # forward without a node (see binary_operator)

    def forward(self, a: Any, b: Any) -> Any:
        self.b = b
        self.out = out = a / b
        return out

    def backward(self, g: Any) -> Any:
        ga = g / self.b if self.inputs[0] is not None else None
        gb = -g * self.out / self.b if self.inputs[1] is not None else None
        return ga, gb


class Pow(Function):
    __slots__ = ("a", "b", "out")
    promote_from = 0
    autocast = "float32"

    compute = staticmethod(operator.pow)  # forward without a node (see binary_operator)

    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        self.out = out = a**b
        return out

    def backward(self, g: Any) -> Any:
        a, b = self.a, self.b
        xp = xp_of(self.out)
        ga = gb = None
        if self.inputs[0] is not None:
            # torch's rule: the base gradient is 0 wherever the exponent is 0, even at a == 0,
            # where b * a**(b - 1) would be 0 * inf = nan.
            if isinstance(b, int | float):
                if b == 0:
                    ga = xp.zeros_like(g)
                elif b == 2:
                    ga = g * (2 * a)
                else:
                    ga = g * (b * a ** (b - 1))
            else:
                # a**0 = 1 where b == 0, so b * ... is exactly 0 there, without 0 * inf.
                ga = g * (b * a ** (xp.where(b == 0, 1, b) - 1))
        if self.inputs[1] is not None:
            gb = g * _pow_exponent_grad(xp, a, b, self.out)
        return ga, gb


def _pow_exponent_grad(xp: Any, a: Any, b: Any, out: Any) -> Any:
    """d(a**b)/db = a**b * log(a), with torch's values at a == 0: 0 where b >= 0 (the limit),
    and a**b * log(0) = -(a**b) (an infinity) where b < 0. Computed without 0 * inf."""
    if isinstance(a, int | float):  # a scalar base (2 ** t)
        if a == 0:
            return xp.where(b < 0, -out, 0)
        return out * (math.log(a) if a > 0 else math.nan)
    zero = a == 0
    rest = xp.where(zero, 0, out) * xp.log(xp.where(zero, 1, a))
    return xp.where(zero, xp.where(b < 0, -out, 0), rest)


class Neg(Function):
    __slots__ = ()

    def forward(self, a: Any) -> Any:
        return -a

    def backward(self, g: Any) -> Any:
        return -g


# ============================================================================ unary math
class Exp(Function):
    __slots__ = ("out",)
    promote_from = 0
    float_result = True  # torch: int tensors give float32
    autocast = "float32"

    def forward(self, a: Any) -> Any:
        self.out = out = xp_of(a).exp(a)
        return out

    def backward(self, g: Any) -> Any:
        return g * self.out


class Log(Function):
    __slots__ = ("a",)
    promote_from = 0
    float_result = True  # torch: int tensors give float32
    autocast = "float32"

    def forward(self, a: Any) -> Any:
        self.a = a
        return xp_of(a).log(a)

    def backward(self, g: Any) -> Any:
        return g / self.a


class Sqrt(Function):
    __slots__ = ("out",)
    promote_from = 0
    float_result = True  # torch: int tensors give float32

    def forward(self, a: Any) -> Any:
        self.out = out = xp_of(a).sqrt(a)
        return out

    def backward(self, g: Any) -> Any:
        return g / (2 * self.out)


class Abs(Function):
    __slots__ = ("a",)

    def forward(self, a: Any) -> Any:
        self.a = a
        return xp_of(a).abs(a)

    def backward(self, g: Any) -> Any:
        return g * xp_of(g).sign(self.a)


class Clip(Function):
    __slots__ = ("a", "hi", "lo")

    def forward(self, a: Any, lo: float | None = None, hi: float | None = None) -> Any:
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"clip: min ({lo}) is greater than max ({hi})")
        self.a, self.lo, self.hi = a, lo, hi
        if lo is None and hi is None:
            return a.copy()
        return xp_of(a).clip(a, lo, hi)

    def backward(self, g: Any) -> Any:
        a, lo, hi = self.a, self.lo, self.hi
        xp = xp_of(g)
        if lo is None and hi is None:
            return g
        if lo is None:
            mask = a <= hi
        elif hi is None:
            mask = a >= lo
        else:
            mask = (a >= lo) & (a <= hi)
        return xp.where(mask, g, 0)


# ============================================================================ activations
class Tanh(Function):
    __slots__ = ("out",)
    promote_from = 0
    float_result = True  # torch: int tensors give float32

    def forward(self, a: Any) -> Any:
        self.out = out = xp_of(a).tanh(a)
        return out

    def backward(self, g: Any) -> Any:
        out = self.out
        return g * (1 - out * out)


class Sigmoid(Function):
    __slots__ = ("out",)
    promote_from = 0
    float_result = True  # torch: int tensors give float32

    def forward(self, a: Any) -> Any:
        xp = xp_of(a)
        # exp(-|x|) never overflows; pick the stable branch per sign.
        e = xp.exp(-xp.abs(a))
        out = xp.where(a >= 0, 1 / (1 + e), e / (1 + e))
        self.out = out
        return out

    def backward(self, g: Any) -> Any:
        out = self.out
        return g * (out * (1 - out))


def relu_backward(g: Any, out: Any) -> Any:
    """ReLU's input gradient from its output (arrays in and out, no autodiff)."""
    return g * (out > 0)


class Relu(Function):
    __slots__ = ("out",)

    def forward(self, a: Any) -> Any:
        self.out = out = xp_of(a).maximum(a, 0)
        return out

    def backward(self, g: Any) -> Any:
        if type(g) is not np.ndarray:  # a kind may run it as one op (None: it does not)
            fused = _device_kinds.fused_op(g, "relu_grad")
            if fused is not None:
                grad = fused(g, self.out)
                if grad is not None:
                    return grad
        return relu_backward(g, self.out)


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


class Gelu(Function):
    """GELU with the tanh approximation (GPT-2's; torch's ``approximate='tanh'``)."""

    __slots__ = ("a", "t")
    promote_from = 0
    float_result = True  # torch: int tensors give float32

    def forward(self, a: Any) -> Any:
        xp = xp_of(a)
        # tanh is exactly +-1 (even in float64) once |a| > 10, so clipping the polynomial's
        # input there changes no result but keeps float16 from overflowing (a**3 > 65504 for
        # |a| > 40, and inf * 0 = nan in backward for |a| > 256).
        u = xp.clip(a, -10, 10)
        t = xp.tanh(_GELU_C * (u + _GELU_K * u * u * u))
        self.a, self.t = a, t
        return 0.5 * a * (1 + t)

    def backward(self, g: Any) -> Any:
        a, t = self.a, self.t
        u = xp_of(a).clip(a, -10, 10)  # see forward
        du = _GELU_C * (1 + 3 * _GELU_K * u * u)
        return g * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * du)


# ============================================================================ select
class Maximum(Function):
    __slots__ = ("a", "b")
    promote_from = 0

    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        xp = xp_of(a) if not isinstance(a, int | float) else xp_of(b)
        return xp.maximum(a, b)

    def backward(self, g: Any) -> Any:
        return _select_grads(self, g, self.a > self.b)


class Minimum(Function):
    __slots__ = ("a", "b")
    promote_from = 0

    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        xp = xp_of(a) if not isinstance(a, int | float) else xp_of(b)
        return xp.minimum(a, b)

    def backward(self, g: Any) -> Any:
        return _select_grads(self, g, self.a < self.b)


def _select_grads(fn: Maximum | Minimum, g: Any, a_wins: Any) -> tuple[Any, Any]:
    # Ties split the gradient equally, as torch.maximum does.
    xp = xp_of(g)
    tie = fn.a == fn.b
    half = g * 0.5
    ga = xp.where(a_wins, g, xp.where(tie, half, 0)) if fn.inputs[0] is not None else None
    gb = xp.where(a_wins, 0, xp.where(tie, half, g)) if fn.inputs[1] is not None else None
    return ga, gb


class Where(Function):
    __slots__ = ("cond",)
    promote_from = 1  # a and b, not the condition

    def forward(self, cond: Any, a: Any, b: Any) -> Any:
        if getattr(cond, "dtype", None) != np.bool_:
            raise TypeError(
                f"where: condition must be a bool array, got {type(cond).__name__} "
                f"of dtype {getattr(cond, 'dtype', None)}"
            )
        self.cond = cond
        return xp_of(cond).where(cond, a, b)

    def backward(self, g: Any) -> Any:
        xp = xp_of(g)
        cond = self.cond
        ga = xp.where(cond, g, 0) if self.inputs[1] is not None else None
        gb = xp.where(cond, 0, g) if self.inputs[2] is not None else None
        return None, ga, gb


# ============================================================================ casts and moves
class Cast(Function):
    __slots__ = ()

    def forward(self, a: Any, dtype: Any = None) -> Any:
        return a.astype(dtype)

    def backward(self, g: Any) -> Any:
        return g  # the engine casts it back to the input's dtype


class ToDevice(Function):
    __slots__ = ("src",)
    moves_device = True

    def forward(self, a: Any, device: Device | None = None, src: Device | None = None) -> Any:
        self.src = src
        assert device is not None and src is not None
        return _move(a, device)

    def backward(self, g: Any) -> Any:
        assert self.src is not None
        return _move(g, self.src)


def _move(a: Any, dev: Device) -> Any:
    if dev.type == "cpu":
        # Between logical CPU devices (cpu -> cpu:1) a copy: distinct devices share no memory.
        return a.get() if not isinstance(a, np.ndarray) else a.copy()
    if dev.type != "cuda":  # a registered kind (remote): through the host
        host = a if isinstance(a, np.ndarray) else a.get()
        return _device_kinds.kind_of_device(dev).from_host(host, dev)
    if not isinstance(a, np.ndarray) and _device_kinds.kind_of_array(a) is not None:
        a = a.get()  # from a registered kind onto a GPU: through the host
    cp = _load_cupy()
    with cp.cuda.Device(dev.index):
        if isinstance(a, np.ndarray):
            return cp.asarray(a)  # host -> device copy
        # Between GPUs: a copy onto dev, the current device here. order="A": with CuPy's
        # default "K" a strided array (a[:, ::2]) raises "CuPy cannot copy non-contiguous
        # array between devices"; "A" first makes it contiguous on its own GPU.
        return cp.array(a, copy=True, order="A")
