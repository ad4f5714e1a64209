"""Linear-algebra primitives: matmul (NumPy semantics) and the fused affine map ``linear``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._autograd import Function
from ._backward import take_grad_buffer
from ._device_kinds import fused_op
from ._ops_elementwise import xp_of

__all__ = ["Linear", "Matmul", "linear_backward", "linear_forward"]

_F16 = np.dtype(np.float16)


def _mm(a: Any, b: Any, out: Any = None, bias: Any = None) -> Any:
    """``a @ b (+ bias)``, into ``out`` when given; float16 on NumPy is computed in float32.

    NumPy has no BLAS for float16 (a 256x256 product took ~90 ms instead of ~1 ms) and
    accumulates in float16. Computing in float32 and rounding once to float16 is what GPUs do
    (cuBLAS accumulates float16 GEMMs in float32, and adds the bias before rounding), so CPU
    results match CUDA's and torch's. CuPy arrays take the plain path: cuBLAS already does it.
    """
    if a.dtype == _F16 and b.dtype == _F16 and isinstance(a, np.ndarray):
        r = np.matmul(a.astype(np.float32), b.astype(np.float32))
        if bias is not None:
            r += bias
        # Overflow to inf is float16's normal behaviour (GradScaler relies on it): no warning.
        with np.errstate(over="ignore"):
            if out is None:
                return r.astype(_F16)  # float16 operands give float16, whatever the bias
            np.copyto(out, r, casting="same_kind")
        return out
    r = a @ b if out is None else xp_of(a).matmul(a, b, out=out)
    if bias is not None:
        r += bias  # r is fresh, so adding in place saves a temporary
    return r


def _sum0(g: Any, out: Any = None) -> Any:
    """``g.sum(axis=0)`` (into ``out``), accumulated in float32 for float16 NumPy arrays."""
    if g.dtype == _F16 and isinstance(g, np.ndarray):
        r = g.sum(axis=0, dtype=np.float32)
        with np.errstate(over="ignore"):
            if out is None:
                return r.astype(_F16)
            np.copyto(out, r, casting="same_kind")
        return out
    return g.sum(axis=0) if out is None else g.sum(axis=0, out=out)


def linear_forward(x: Any, w: Any, b: Any = None) -> Any:
    """``x @ w.T + b`` on arrays, as :class:`Linear` computes it (and a device kind that
    fuses ``"linear"`` runs it: the same bits)."""
    return _mm(x, w.T, bias=b)


def linear_backward(
    g: Any, x: Any, w: Any, need_x: bool, need_w: bool, need_b: bool,
    gw_out: Any = None, gb_out: Any = None,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """``(gx, gw, gb)`` of ``x @ w.T + b`` for the output's gradient ``g`` (None where not
    needed), ``gw`` and ``gb`` written into ``gw_out`` and ``gb_out`` when given (and then
    those arrays); what :class:`Linear` computes, and a kind that fuses it runs."""
    g2 = g.reshape(-1, g.shape[-1]) if g.ndim != 2 else g
    gx = _mm(g, w) if need_x else None
    gw = gb = None
    if need_w:
        x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
        gw = _mm(g2.T, x2, gw_out)
    if need_b:
        gb = _sum0(g2, gb_out)
    return gx, gw, gb


class Matmul(Function):
    __slots__ = ("a", "b")
    autocast = "lower"

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
        return _mm(a, b)

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
            ga = _mm(g2, b2.swapaxes(-1, -2))
            if a.ndim == 1:
                ga = ga.reshape(ga.shape[:-2] + (ga.shape[-1],))
        if self.inputs[1] is not None:
            if a.ndim > 2 and b.ndim == 2:
                # A matrix shared by a batch: fold the batch into rows, one GEMM whose sum over
                # the batch is part of the accumulation (as torch does; in float16 it rounds
                # once instead of once per batch element and again when summed).
                gb = _mm(a.reshape(-1, a.shape[-1]).T, g.reshape(-1, g.shape[-1]))
            else:
                gb = _mm(a2.swapaxes(-1, -2), g2)
            if b.ndim == 1:
                gb = gb.reshape(gb.shape[:-1])
        return ga, gb


class Linear(Function):
    """``x @ weight.T + bias`` in one node, with weight of shape (out_features, in_features)."""

    __slots__ = ("w", "x")
    autocast = "lower"

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
        if type(x) is not np.ndarray:  # a kind may run it as one op (None: it does not)
            fused = fused_op(x, "linear")
            if fused is not None:
                out = fused(x, w, b)
                if out is not None:
                    return out
        return _mm(x, w.T, bias=b)

    def backward(self, g: Any) -> Any:
        x, w, inputs = self.x, self.w, self.inputs
        need_x, need_w = inputs[0] is not None, inputs[1] is not None
        bias = inputs[2] if len(inputs) > 2 else None
        # Straight into the parameters' grad buffers when they have them (DDP's buckets).
        gw_out = take_grad_buffer(inputs[1]) if need_w and g.dtype == x.dtype == w.dtype else None
        gb_out = (
            take_grad_buffer(bias) if bias is not None and g.dtype == bias._data.dtype else None
        )
        if type(g) is not np.ndarray and gw_out is None and gb_out is None:
            fused = fused_op(g, "linear_grad")  # a kind may run it as one op (None: it does not)
            if fused is not None:
                grads = fused(g, x, w, need_x, need_w, bias is not None)
                if grads is not None:
                    return grads[: len(inputs)]
        grads = linear_backward(g, x, w, need_x, need_w, bias is not None, gw_out, gb_out)
        return grads[: len(inputs)]
