"""Neural-network primitives with fused, numerically stable backward rules."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._autograd import Function
from ._device_kinds import fused_op
from ._ops_elementwise import xp_of
from ._ops_movement import Getitem

__all__ = [
    "CrossEntropy",
    "Embedding",
    "LayerNormFn",
    "LogSoftmax",
    "Softmax",
    "cross_entropy_forward",
    "cross_entropy_grad",
    "cross_entropy_targets",
]


class LogSoftmax(Function):
    __slots__ = ("axis", "out")
    autocast = "float32"

    def forward(self, a: Any, axis: int = -1) -> Any:
        xp = xp_of(a)
        shifted = a - a.max(axis=axis, keepdims=True)
        out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
        self.out, self.axis = out, axis
        return out

    def backward(self, g: Any) -> Any:
        xp = xp_of(g)
        return g - xp.exp(self.out) * g.sum(axis=self.axis, keepdims=True)


class Softmax(Function):
    __slots__ = ("axis", "out")
    autocast = "float32"

    def forward(self, a: Any, axis: int = -1) -> Any:
        xp = xp_of(a)
        e = xp.exp(a - a.max(axis=axis, keepdims=True))
        e /= e.sum(axis=axis, keepdims=True)
        self.out, self.axis = e, axis
        return e

    def backward(self, g: Any) -> Any:
        out = self.out
        return out * (g - (g * out).sum(axis=self.axis, keepdims=True))


def cross_entropy_targets(xp: Any, target: Any, ignore_index: int) -> tuple[Any, Any]:
    """``(valid, safe_t)``: which rows count, and the targets with ignored ones set to 0."""
    valid = target != ignore_index
    return valid, xp.where(valid, target, 0)


def cross_entropy_forward(
    logits: Any, target: Any, reduction: str, ignore_index: int, label_smoothing: float
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The cross-entropy of (N, C) ``logits`` against (N,) class indices, on arrays.

    Returns ``(loss, e, sum_e, safe_t, valid, count)``: what :class:`CrossEntropy` computes
    and keeps for :func:`cross_entropy_grad` (``count`` is None unless reduction is "mean").
    A device kind that fuses cross-entropy runs this very function (same bits).
    """
    xp = xp_of(logits)
    n, c = logits.shape
    valid, safe_t = cross_entropy_targets(xp, target, ignore_index)
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = xp.exp(shifted)
    sum_e = e.sum(axis=1, keepdims=True)
    picked = shifted[xp.arange(n), safe_t]
    if label_smoothing:
        # The shift cancels: the target weights sum to 1.
        s = label_smoothing
        picked = (1 - s) * picked + (s / c) * shifted.sum(axis=1)
    loss = xp.where(valid, xp.log(sum_e[:, 0]) - picked, 0)
    if reduction == "none":
        return loss, e, sum_e, safe_t, valid, None
    if reduction == "sum":
        return loss.sum(), e, sum_e, safe_t, valid, None
    count = valid.sum()
    # All-ignored batches give 0/0 = nan, as in PyTorch.
    return loss.sum() / count.astype(logits.dtype), e, sum_e, safe_t, valid, count


def cross_entropy_grad(
    probs: Any, safe_t: Any, valid: Any, count: Any, g: Any, label_smoothing: float
) -> Any:
    """The logits' gradient from ``probs`` = ``e / sum_e`` (a fresh array: it is written in
    place and returned), given the loss's gradient ``g``."""
    xp = xp_of(g)
    grad = probs
    n, c = grad.shape
    s = label_smoothing
    grad[xp.arange(n), safe_t] -= 1 - s
    if s:
        grad -= s / c
    scale = xp.where(valid, g, 0)[:, None]
    if count is not None:  # reduction="mean"
        scale = scale / count.astype(grad.dtype)
    grad *= scale.astype(grad.dtype, copy=False)
    return grad


class CrossEntropy(Function):
    """Mean/sum/none of the cross-entropy of (N, C) logits against (N,) class indices.

    With ``label_smoothing`` = s the target distribution is ``(1 - s) * onehot + s / C``
    (torch's): the loss of a row is ``lse - (1 - s) * x[t] - (s / C) * sum(x)``, and its
    gradient ``softmax(x) - q``. Ignored rows give neither loss nor gradient, and "mean"
    divides by the number of rows not ignored (0/0 = nan when all are, as in torch).

    A device kind with a fused ``"cross_entropy"`` (a remote device: one record each way)
    runs :func:`cross_entropy_forward` and :func:`cross_entropy_grad` as they are here.
    """

    __slots__ = ("count", "e", "fused", "smoothing", "sum_e", "target", "valid")
    autocast = "float32"
    fused: tuple[Any, int, str] | None  # a kind's backward, ignore_index, reduction

    def forward(
        self,
        logits: Any,
        target: Any,
        reduction: str = "mean",
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> Any:
        self.smoothing = label_smoothing
        if type(logits) is not np.ndarray:  # a kind may run it as one op (None: it does not)
            fused = fused_op(logits, "cross_entropy")
            if fused is not None:
                r = fused(logits, target, reduction, ignore_index, label_smoothing)
                if r is not None:
                    # fused's backward takes the probabilities and the raw targets; every
                    # slot is set (release() would pay an exception for each unset one)
                    loss, self.e, backward = r
                    self.fused = (backward, ignore_index, reduction)
                    self.target, self.sum_e = target, None
                    self.valid = self.count = None
                    return loss
        self.fused = None
        loss, self.e, self.sum_e, self.target, self.valid, self.count = cross_entropy_forward(
            logits, target, reduction, ignore_index, label_smoothing
        )
        return loss

    def backward(self, g: Any) -> Any:
        if self.fused is not None:
            backward, ignore_index, reduction = self.fused
            grad = backward(self.e, self.target, g, ignore_index, self.smoothing, reduction)
            return grad, None
        grad = cross_entropy_grad(
            self.e / self.sum_e, self.target, self.valid, self.count, g, self.smoothing
        )
        return grad, None


class LayerNormFn(Function):
    """Normalize over the last ``ndims`` axes, then scale by weight and shift by bias."""

    __slots__ = ("rstd", "shape", "w", "xhat")
    autocast = "float32"

    def forward(
        self, x: Any, w: Any = None, b: Any = None, ndims: int = 1, eps: float = 1e-5
    ) -> Any:
        xp = xp_of(x)
        norm_shape = x.shape[x.ndim - ndims :]
        d = 1
        for s in norm_shape:
            d *= s
        x2 = x.reshape(-1, d)
        mu = x2.mean(axis=1, keepdims=True)
        xc = x2 - mu
        var = (xc * xc).mean(axis=1, keepdims=True)
        rstd = 1.0 / xp.sqrt(var + eps)
        xhat = xc * rstd
        out = xhat
        if w is not None:
            out = out * w.reshape(-1)
        if b is not None:
            out = out + b.reshape(-1)
        self.rstd, self.xhat, self.w, self.shape = rstd, xhat, w, x.shape
        return out.reshape(x.shape)

    def backward(self, g: Any) -> Any:
        xhat, rstd, w = self.xhat, self.rstd, self.w
        d = xhat.shape[1]
        g2 = g.reshape(-1, d)
        gw = gb = gx = None
        if w is not None and self.inputs[1] is not None:
            gw = (g2 * xhat).sum(axis=0).reshape(w.shape)
        if len(self.inputs) > 2 and self.inputs[2] is not None:
            gb = g2.sum(axis=0).reshape(self.inputs[2].shape)
        if self.inputs[0] is not None:
            gxhat = g2 * w.reshape(-1) if w is not None else g2
            gx = rstd * (
                gxhat
                - gxhat.mean(axis=1, keepdims=True)
                - xhat * (gxhat * xhat).mean(axis=1, keepdims=True)
            )
            gx = gx.reshape(self.shape)
        return gx, gw, gb


class Embedding(Getitem):
    """``weight[indices]``; the row ``padding_idx`` (when given) receives no gradient."""

    __slots__ = ("padding_idx",)

    def forward(self, weight: Any, index: Any = None, padding_idx: int | None = None) -> Any:
        self.padding_idx = padding_idx
        return super().forward(weight, index=index)

    def backward(self, g: Any) -> Any:
        grad = super().backward(g)
        if self.padding_idx is not None:
            grad[self.padding_idx] = 0  # as torch: padding positions do not train the row
        return grad
