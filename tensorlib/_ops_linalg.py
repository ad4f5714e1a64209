"""Linear-algebra primitives: matmul (NumPy semantics) and the fused affine map ``linear``."""

from __future__ import annotations

from typing import Any

from ._autograd import Function, take_grad_buffer
from ._ops_elementwise import xp_of

__all__ = ["Linear", "Matmul"]


class Matmul(Function):
    __slots__ = ("a", "b")

    def forward(self, a: Any, b: Any) -> Any:
        if getattr(a, "ndim", 0) == 0 or getattr(b, "ndim", 0) == 0:
            raise ValueError("matmul does not accept 0-d operands (use * for scalars)")
        ka = a.shape[-1]
        kb = b.shape[-2] if b.ndim > 1 else b.shape[0]
        if ka != kb:
            raise ValueError(
                f"inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)} ({ka} != {kb})"
            )
        self.a, self.b = a, b
        return a @ b

    def backward(self, g: Any) -> Any:
        a, b = self.a, self.b
        # Promote 1-d operands to matrices, use the 2-d rules, then drop the added axis.
        a2 = a.reshape(1, -1) if a.ndim == 1 else a
        b2 = b.reshape(-1, 1) if b.ndim == 1 else b
        g2 = g
        if a.ndim == 1 and b.ndim == 1:
            # Vector @ vector gives a 0-d g: it has no axis for the indexing below to extend.
            g2 = g2.reshape(1, 1)
        elif a.ndim == 1:
            g2 = g2[..., None, :]
        elif b.ndim == 1:
            g2 = g2[..., None]
        ga = gb = None
        if self.inputs[0] is not None:
            ga = g2 @ b2.swapaxes(-1, -2)
            if a.ndim == 1:
                ga = ga.reshape(ga.shape[:-2] + (ga.shape[-1],))
        if self.inputs[1] is not None:
            gb = a2.swapaxes(-1, -2) @ g2
            if b.ndim == 1:
                gb = gb.reshape(gb.shape[:-1])
        return ga, gb


class Linear(Function):
    """``x @ weight.T + bias`` in one node, with weight of shape (out_features, in_features)."""

    __slots__ = ("w", "x")

    def forward(self, x: Any, w: Any, b: Any = None) -> Any:
        if w.ndim != 2:
            raise ValueError(f"linear: weight must be 2-d (out, in), got shape {tuple(w.shape)}")
        if x.ndim == 0 or x.shape[-1] != w.shape[1]:
            raise ValueError(
                f"linear: input's last dimension must be in_features={w.shape[1]}, got input "
                f"of shape {tuple(x.shape)}"
            )
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"linear: bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")
        self.x, self.w = x, w
        out = x @ w.T
        if b is not None:
            out += b  # out is fresh, so adding in place saves a temporary
        return out

    def backward(self, g: Any) -> Any:
        x, w = self.x, self.w
        g2 = g.reshape(-1, g.shape[-1]) if g.ndim != 2 else g
        gx = gw = gb = None
        if self.inputs[0] is not None:
            gx = g @ w
        if self.inputs[1] is not None:
            x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
            # Straight into the weight's grad buffer when it has one (DDP's bucket).
            out = take_grad_buffer(self.inputs[1]) if g2.dtype == x2.dtype == w.dtype else None
            gw = g2.T @ x2 if out is None else xp_of(g2).matmul(g2.T, x2, out=out)
        if len(self.inputs) > 2 and self.inputs[2] is not None:
            bias = self.inputs[2]
            out = take_grad_buffer(bias) if g2.dtype == bias._data.dtype else None
            gb = g2.sum(axis=0) if out is None else g2.sum(axis=0, out=out)
        return (gx, gw, gb)[: len(self.inputs)]
