"""The operations of a :class:`~tensorlib.Tensor`: one line each, onto one ``Function``.

:class:`TensorOps` is the base class of ``Tensor`` that holds every differentiable operation
it offers as a method or an operator (arithmetic, elementwise, reductions, movement, the nn
helpers). Each is a one-liner that hands its arguments to the primitive's ``Function.apply``
(the primitives live in ``_ops_*.py``, one small ``Function`` per primitive), or composes
other methods (``var``, ``flatten``, ``squeeze``...). What a tensor *is* (its data, device,
gradient, conversions, in-place writes, comparisons) stays in ``_tensor.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

# Loaded from _autograd's last line, when Function and binary_operator exist (and Tensor not
# yet): the elementwise primitives need only Function, and the operators are built from them.
from . import _ops_elementwise as _ew
from ._autograd import binary_operator

if TYPE_CHECKING:
    from ._device import Device
    from ._tensor import Tensor

__all__ = ["Scalar", "TensorOps"]

Scalar = int | float | bool


class TensorOps:
    """Differentiable operations of :class:`~tensorlib.Tensor` (its base class; not used alone)."""

    __slots__ = ()

    if TYPE_CHECKING:  # provided by Tensor
        _device: Device

        @property
        def shape(self) -> tuple[int, ...]: ...

        @property
        def ndim(self) -> int: ...

    # ------------------------------------------------------------------ arithmetic operators
    # One shorter path for the common case in each (see `_autograd.binary_operator`).
    __add__ = binary_operator(_ew.Add, "__add__")
    __radd__ = binary_operator(_ew.Add, "__radd__", reflected=True)
    __sub__ = binary_operator(_ew.Sub, "__sub__")
    __rsub__ = binary_operator(_ew.Sub, "__rsub__", reflected=True)
    __mul__ = binary_operator(_ew.Mul, "__mul__")
    __rmul__ = binary_operator(_ew.Mul, "__rmul__", reflected=True)
    __truediv__ = binary_operator(_ew.Div, "__truediv__")
    __rtruediv__ = binary_operator(_ew.Div, "__rtruediv__", reflected=True)
    __pow__ = binary_operator(_ew.Pow, "__pow__")
    __rpow__ = binary_operator(_ew.Pow, "__rpow__", reflected=True)

    def __neg__(self) -> Tensor:
        return _ew.Neg.apply(self)

    def __pos__(self) -> Self:
        return self

    def __abs__(self) -> Tensor:
        return _ew.Abs.apply(self)

    def __matmul__(self, other: Any) -> Tensor:
        return _la.Matmul.apply(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return _la.Matmul.apply(other, self)

    def __getitem__(self, index: Any) -> Tensor:
        return _mv.Getitem.apply(self, index=_mv.normalize_index(index, self._device))

    # ------------------------------------------------------------------ elementwise
    def exp(self) -> Tensor:
        """Elementwise e**x."""
        return _ew.Exp.apply(self)

    def log(self) -> Tensor:
        """Elementwise natural logarithm."""
        return _ew.Log.apply(self)

    def sqrt(self) -> Tensor:
        """Elementwise square root."""
        return _ew.Sqrt.apply(self)

    def tanh(self) -> Tensor:
        """Elementwise hyperbolic tangent."""
        return _ew.Tanh.apply(self)

    def sigmoid(self) -> Tensor:
        """Elementwise logistic sigmoid (numerically stable)."""
        return _ew.Sigmoid.apply(self)

    def relu(self) -> Tensor:
        """Elementwise max(x, 0)."""
        return _ew.Relu.apply(self)

    def gelu(self) -> Tensor:
        """GELU, tanh approximation."""
        return _ew.Gelu.apply(self)

    def abs(self) -> Tensor:
        """Elementwise absolute value."""
        return _ew.Abs.apply(self)

    def clip(self, min: Scalar | None = None, max: Scalar | None = None) -> Tensor:
        """Clamp values to [min, max]; gradient flows where min <= x <= max."""
        return _ew.Clip.apply(self, lo=min, hi=max)

    def maximum(self, other: Any) -> Tensor:
        """Elementwise maximum with broadcasting."""
        return _ew.Maximum.apply(self, other)

    def minimum(self, other: Any) -> Tensor:
        """Elementwise minimum with broadcasting."""
        return _ew.Minimum.apply(self, other)

    # ------------------------------------------------------------------ reductions
    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Sum over ``axis`` (all axes when None)."""
        return _rd.Sum.apply(self, axis=_rd.norm_axis(axis, self.ndim), keepdims=keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Mean over ``axis`` (all axes when None)."""
        return _rd.Mean.apply(self, axis=_rd.norm_axis(axis, self.ndim), keepdims=keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Maximum over ``axis``; ties share the gradient equally."""
        return _rd.Max.apply(self, axis=_rd.norm_axis(axis, self.ndim), keepdims=keepdims)

    def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Minimum over ``axis``; ties share the gradient equally."""
        return _rd.Min.apply(self, axis=_rd.norm_axis(axis, self.ndim), keepdims=keepdims)

    def var(
        self,
        axis: int | Sequence[int] | None = None,
        keepdims: bool = False,
        *,
        correction: int = 0,
    ) -> Tensor:
        """Variance over ``axis``: the sum of squared deviations over ``N - correction``.

        The default ``correction=0`` is NumPy's population variance; torch's default is 1
        (Bessel's correction): pass ``correction=1`` for ``torch.var``'s value. Like torch,
        ``N - correction <= 0`` divides by 0 (inf, or nan for zero deviations).
        """
        mu = self.mean(axis=axis, keepdims=True)
        d = self - mu
        if correction == 0:
            return (d * d).mean(axis=axis, keepdims=keepdims)
        axes = _rd.norm_axis(axis, self.ndim)
        n = 1
        for ax in axes if axes is not None else range(self.ndim):
            n *= self.shape[ax]
        return (d * d).sum(axis=axis, keepdims=keepdims) / float(max(n - correction, 0))

    # ------------------------------------------------------------------ movement
    def reshape(self, *shape: Any) -> Tensor:
        """Reshape (one dimension may be -1)."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        return _mv.Reshape.apply(self, shape=tuple(int(s) for s in shape))

    def view(self, *shape: Any) -> Tensor:
        """Alias of :meth:`reshape`."""
        return self.reshape(*shape)

    def flatten(self, start_axis: int = 0) -> Tensor:
        """Merge dimensions from ``start_axis`` on into one."""
        return self.reshape(*self.shape[:start_axis], -1)

    def transpose(self, *axes: Any) -> Tensor:
        """Permute axes (NumPy semantics: no axes reverses them)."""
        if len(axes) == 1 and isinstance(axes[0], tuple | list):
            axes = tuple(axes[0])
        if not axes:
            axes = tuple(range(self.ndim - 1, -1, -1))
        return _mv.Transpose.apply(self, axes=_mv.norm_perm(axes, self.ndim))

    def permute(self, *axes: Any) -> Tensor:
        """Permute axes to the given order."""
        return self.transpose(*axes)

    def swapaxes(self, a: int, b: int) -> Tensor:
        """Swap two axes."""
        perm = list(range(self.ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return self.transpose(tuple(perm))

    def expand(self, *shape: Any) -> Tensor:
        """Broadcast to ``shape`` (-1 keeps a dimension)."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        lead = len(shape) - self.ndim
        full = tuple(
            self.shape[i - lead] if (s == -1 and i >= lead) else int(s) for i, s in enumerate(shape)
        )
        return _mv.BroadcastTo.apply(self, shape=full)

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        """Broadcast to ``shape`` (NumPy rules)."""
        return _mv.BroadcastTo.apply(self, shape=tuple(int(s) for s in shape))

    def squeeze(self, axis: int | None = None) -> Tensor:
        """Remove size-1 dimensions (or only ``axis``)."""
        if axis is None:
            return self.reshape(*[s for s in self.shape if s != 1])
        ax = axis % self.ndim
        if self.shape[ax] != 1:
            raise ValueError(f"squeeze: axis {axis} has size {self.shape[ax]}, not 1")
        return self.reshape(*(self.shape[:ax] + self.shape[ax + 1 :]))

    def unsqueeze(self, axis: int) -> Tensor:
        """Insert a size-1 dimension at ``axis``."""
        ax = axis % (self.ndim + 1) if axis < 0 else axis
        return self.reshape(*(self.shape[:ax] + (1,) + self.shape[ax:]))

    # ------------------------------------------------------------------ nn helpers
    def softmax(self, axis: int = -1) -> Tensor:
        """Softmax along ``axis`` (numerically stable)."""
        return _nnf.Softmax.apply(self, axis=axis)

    def log_softmax(self, axis: int = -1) -> Tensor:
        """Log-softmax along ``axis`` (numerically stable)."""
        return _nnf.LogSoftmax.apply(self, axis=axis)


from . import _ops_linalg as _la  # noqa: E402
from . import _ops_movement as _mv  # noqa: E402
from . import _ops_nn as _nnf  # noqa: E402
from . import _ops_reduce as _rd  # noqa: E402
