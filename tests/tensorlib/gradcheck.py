"""Reference checks for tensorlib primitives: forward against NumPy, backward against float64
central finite differences (chainer's ``FunctionTestCase`` idea, in a few functions).

Every check takes ``fn(*tensors) -> Tensor`` and a list of float64 NumPy inputs. ``fn`` receives
one tensor per input (all of them differentiable); anything that is not differentiated (integer
indices, masks, targets) is closed over by ``fn`` and should be built on ``x.device``.

Non-scalar outputs are reduced to ``sum(fn(*inputs) * R)`` for a fixed random ``R``, so every
output element contributes with its own weight and a wrong gradient cannot hide in a plain sum.
Finite differences always run on the CPU in float64; the analytic gradient runs on ``device``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import tensorlib as tl

__all__ = [
    "FWD_TOL",
    "analytic_grads",
    "check_forward",
    "check_grad",
    "check_grad_low_precision",
    "numerical_grads",
]

TensorFn = Callable[..., tl.Tensor]

# (rtol, atol) for forwards against a float64 reference computed from the same (rounded) inputs.
FWD_TOL: dict[np.dtype[Any], tuple[float, float]] = {
    np.dtype(np.float64): (1e-10, 1e-12),
    np.dtype(np.float32): (2e-5, 2e-6),
    np.dtype(np.float16): (1e-2, 2e-3),
}


def _weights(shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(shape)


def _objective(fn: TensorFn, arrays: Sequence[np.ndarray[Any, Any]], weights: Any) -> float:
    with tl.no_grad():
        out = fn(*[tl.tensor(a, dtype=tl.float64) for a in arrays])
    return float(np.sum(out.numpy().astype(np.float64) * weights))


def numerical_grads(
    fn: TensorFn,
    inputs: Sequence[np.ndarray[Any, Any]],
    weights: np.ndarray[Any, Any],
    eps: float = 1e-6,
) -> list[np.ndarray[Any, Any]]:
    """Central differences of ``sum(fn(*inputs) * weights)`` in float64 on the CPU."""
    arrays = [np.array(a, dtype=np.float64, copy=True) for a in inputs]
    grads = []
    for a in arrays:
        flat = a.reshape(-1)  # a view: perturbing it perturbs the array fn sees
        g = np.zeros(a.size)
        for i in range(a.size):
            orig = flat[i]
            flat[i] = orig + eps
            f_plus = _objective(fn, arrays, weights)
            flat[i] = orig - eps
            f_minus = _objective(fn, arrays, weights)
            flat[i] = orig
            g[i] = (f_plus - f_minus) / (2 * eps)
        grads.append(g.reshape(a.shape))
    return grads


def analytic_grads(
    fn: TensorFn,
    inputs: Sequence[np.ndarray[Any, Any]],
    weights: np.ndarray[Any, Any] | None = None,
    *,
    device: str = "cpu",
    dtype: Any = np.float64,
    seed: int = 0,
) -> tuple[np.ndarray[Any, Any], list[np.ndarray[Any, Any]]]:
    """Run ``fn`` on ``device`` in ``dtype`` and backpropagate ``sum(out * weights)``.

    Returns the output and each input's gradient as NumPy arrays. ``weights`` defaults to a
    standard-normal array of the output's shape drawn from ``seed``.
    """
    tensors = [tl.tensor(a, dtype=dtype, device=device, requires_grad=True) for a in inputs]
    out = fn(*tensors)
    if weights is None:
        weights = _weights(out.shape, seed)
    loss = (out * tl.tensor(weights, dtype=out.dtype, device=device)).sum()
    loss.backward()
    grads = []
    for i, t in enumerate(tensors):
        if t.grad is None:
            raise AssertionError(f"input {i} of shape {t.shape} received no gradient")
        if t.grad.dtype != t.dtype or t.grad.shape != t.shape:
            raise AssertionError(
                f"input {i}: gradient has {t.grad.shape} {t.grad.dtype}, "
                f"input has {t.shape} {t.dtype}"
            )
        grads.append(t.grad.numpy().astype(np.float64))
    return out.numpy(), grads


def check_grad(
    fn: TensorFn,
    inputs: Sequence[np.ndarray[Any, Any]],
    *,
    device: str = "cpu",
    eps: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
) -> list[np.ndarray[Any, Any]]:
    """Assert that the float64 analytic gradient on ``device`` matches finite differences.

    Returns the analytic gradients (float64) for further checks.
    """
    _, grads = analytic_grads(fn, inputs, device=device, seed=seed)
    with tl.no_grad():
        out_shape = fn(*[tl.tensor(a, dtype=tl.float64) for a in inputs]).shape
    weights = _weights(out_shape, seed)
    numeric = numerical_grads(fn, inputs, weights, eps=eps)
    for i, (got, want) in enumerate(zip(grads, numeric, strict=True)):
        np.testing.assert_allclose(
            got, want, rtol=rtol, atol=atol, err_msg=f"gradient of input {i} (shape {got.shape})"
        )
    return grads


def check_grad_low_precision(
    fn: TensorFn,
    inputs: Sequence[np.ndarray[Any, Any]],
    *,
    dtype: Any = np.float32,
    device: str = "cpu",
    rtol: float = 1e-4,
    atol: float = 1e-4,
    seed: int = 0,
) -> None:
    """Assert that gradients computed in ``dtype`` match the float64 analytic gradients.

    The inputs are first rounded to ``dtype`` so both runs differentiate at the same point;
    ``atol`` is scaled by the largest float64 gradient entry.
    """
    rounded = [np.asarray(a).astype(dtype).astype(np.float64) for a in inputs]
    _, ref = analytic_grads(fn, rounded, device=device, dtype=np.float64, seed=seed)
    _, low = analytic_grads(fn, rounded, device=device, dtype=dtype, seed=seed)
    for i, (got, want) in enumerate(zip(low, ref, strict=True)):
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        np.testing.assert_allclose(
            got,
            want,
            rtol=rtol,
            atol=atol * scale,
            err_msg=f"{np.dtype(dtype).name} gradient of input {i} (shape {got.shape})",
        )


def check_forward(
    fn: TensorFn,
    ref: Callable[..., Any],
    inputs: Sequence[np.ndarray[Any, Any]],
    *,
    device: str = "cpu",
    dtype: Any = np.float64,
    tol_scale: float = 1.0,
) -> np.ndarray[Any, Any]:
    """Assert ``fn`` in ``dtype`` on ``device`` matches ``ref`` (NumPy, float64) and keeps dtype.

    The reference sees the inputs already rounded to ``dtype``, so only the op's own error is
    measured. Returns the output as a NumPy array.
    """
    dt = np.dtype(dtype)
    rounded = [np.asarray(a).astype(dt) for a in inputs]
    out = fn(*[tl.tensor(a, dtype=dt, device=device) for a in rounded])
    assert out.dtype == dt, f"output dtype {out.dtype} for {dt} inputs"
    assert out.device == tl.device(device), f"output on {out.device}, inputs on {device}"
    want = np.asarray(ref(*[a.astype(np.float64) for a in rounded]))
    got = out.numpy()
    assert got.shape == want.shape, f"shape {got.shape} != expected {want.shape}"
    rtol, atol = FWD_TOL[dt]
    np.testing.assert_allclose(
        got.astype(np.float64), want, rtol=rtol * tol_scale, atol=atol * tol_scale
    )
    return got
