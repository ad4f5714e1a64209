"""Neural-network primitives with fused, numerically stable backward rules."""

from __future__ import annotations

from typing import Any

from ._autograd import Function
from ._ops_elementwise import xp_of
from ._ops_movement import Getitem

__all__ = ["CrossEntropy", "Embedding", "LayerNormFn", "LogSoftmax", "Softmax"]


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


class CrossEntropy(Function):
    """Mean/sum/none of the cross-entropy of (N, C) logits against (N,) class indices.

    With ``label_smoothing`` = s the target distribution is ``(1 - s) * onehot + s / C``
    (torch's): the loss of a row is ``lse - (1 - s) * x[t] - (s / C) * sum(x)``, and its
    gradient ``softmax(x) - q``. Ignored rows give neither loss nor gradient, and "mean"
    divides by the number of rows not ignored (0/0 = nan when all are, as in torch).
    """

    __slots__ = ("count", "e", "reduction", "smoothing", "sum_e", "target", "valid")
    autocast = "float32"

    def forward(
        self,
        logits: Any,
        target: Any,
        reduction: str = "mean",
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> Any:
        xp = xp_of(logits)
        n, c = logits.shape
        rows = xp.arange(n)
        valid = target != ignore_index
        safe_t = xp.where(valid, target, 0)
        shifted = logits - logits.max(axis=1, keepdims=True)
        e = xp.exp(shifted)
        sum_e = e.sum(axis=1, keepdims=True)
        picked = shifted[rows, safe_t]
        if label_smoothing:
            # The shift cancels: the target weights sum to 1.
            s = label_smoothing
            picked = (1 - s) * picked + (s / c) * shifted.sum(axis=1)
        loss = xp.where(valid, xp.log(sum_e[:, 0]) - picked, 0)
        self.e, self.sum_e, self.target, self.valid = e, sum_e, safe_t, valid
        self.reduction, self.smoothing = reduction, label_smoothing
        if reduction == "none":
            self.count = None
            return loss
        if reduction == "sum":
            self.count = None
            return loss.sum()
        count = valid.sum()
        self.count = count
        # All-ignored batches give 0/0 = nan, as in PyTorch.
        return loss.sum() / count.astype(logits.dtype)

    def backward(self, g: Any) -> Any:
        xp = xp_of(g)
        grad = self.e / self.sum_e
        n, c = grad.shape
        s = self.smoothing
        grad[xp.arange(n), self.target] -= 1 - s
        if s:
            grad -= s / c
        scale = xp.where(self.valid, g, 0)[:, None]
        if self.count is not None:  # reduction="mean"
            scale = scale / self.count.astype(grad.dtype)
        grad *= scale.astype(grad.dtype, copy=False)
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
