"""The one way the differential suite compares tensorlib with PyTorch.

PyTorch (CPU) is the reference. A case builds the same inputs for both libraries from one
NumPy array per input (:func:`pair`), runs the operation in each, and checks values and
gradients with :func:`assert_close` at the tolerances below. torch is optional: import it
from here (``torch`` is None when it is missing, and the package's conftest skips every test
with :data:`TORCH_REASON`).

Tolerances (relative, with a small absolute floor for values near zero):

======== ================ ==================
dtype     values           gradients
======== ================ ==================
float64   rtol 1e-7        rtol 1e-6
float32   rtol 1e-5        rtol 1e-4
float16   rtol 1e-3        rtol 1e-2
======== ================ ==================
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

import tensorlib as tl

__all__ = [
    "DTYPES",
    "TOLERANCES",
    "TORCH_REASON",
    "assert_close",
    "assert_grads_close",
    "check",
    "pair",
    "to_numpy",
    "torch",
]

try:
    import torch

    TORCH_REASON: str | None = None
except ImportError as exc:  # the differential suite needs the `parity` extra
    # cast, not an ignore: mypy types the failed import differently with torch and without it
    torch = cast(Any, None)
    TORCH_REASON = (
        f"PyTorch is not installed ({exc}); the differential suite compares with it: "
        "`pip install -e '.[parity]'` (a CPU build of torch==2.13.0)"
    )

DTYPES = (np.float64, np.float32)

# dtype -> (value rtol, value atol, gradient rtol, gradient atol)
TOLERANCES: dict[Any, tuple[float, float, float, float]] = {
    np.dtype(np.float64): (1e-7, 1e-10, 1e-6, 1e-9),
    np.dtype(np.float32): (1e-5, 1e-6, 1e-4, 1e-5),
    np.dtype(np.float16): (1e-3, 1e-3, 1e-2, 1e-2),
}


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy copy of a tensorlib tensor, a torch tensor or an array (for comparisons)."""
    if isinstance(x, tl.Tensor):
        return np.asarray(x.numpy())
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def pair(array: Any, dtype: Any = None, requires_grad: bool = True) -> tuple[tl.Tensor, Any]:
    """The same data as a tensorlib tensor and a torch tensor (each its own copy)."""
    a = np.array(array, dtype=dtype if dtype is not None else np.asarray(array).dtype)
    floating = a.dtype.kind == "f"
    ours = tl.tensor(a.copy(), requires_grad=requires_grad and floating)
    theirs = torch.tensor(a.copy(), requires_grad=requires_grad and floating)
    return ours, theirs


def _tols(dtype: Any, grad: bool) -> tuple[float, float]:
    rtol, atol, grtol, gatol = TOLERANCES[np.dtype(dtype)]
    return (grtol, gatol) if grad else (rtol, atol)


def assert_close(ours: Any, theirs: Any, what: str = "value", grad: bool = False) -> None:
    """Check shape, dtype and values of ours against torch's, at the dtype's tolerance."""
    a, b = to_numpy(ours), to_numpy(theirs)
    assert a.shape == b.shape, f"{what}: shape {a.shape}, torch has {b.shape}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype}, torch has {b.dtype}"
    if a.dtype.kind != "f":
        np.testing.assert_array_equal(a, b, err_msg=what)
        return
    rtol, atol = _tols(a.dtype, grad)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=what)


def assert_grads_close(ours: list[tl.Tensor], theirs: list[Any], what: str = "grad") -> None:
    """Check each leaf's ``.grad`` against torch's (both missing, or both close)."""
    assert len(ours) == len(theirs)
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        if t.grad is None:
            assert o.grad is None, f"{what}[{i}]: tensorlib has a gradient, torch has none"
            continue
        assert o.grad is not None, f"{what}[{i}]: torch has a gradient, tensorlib has none"
        assert_close(o.grad, t.grad, f"{what}[{i}]", grad=True)


def check(
    ours_fn: Any,
    theirs_fn: Any,
    arrays: list[Any],
    dtype: Any = None,
    seed: int = 0,
    what: str = "op",
) -> tuple[Any, Any]:
    """Run one operation in both libraries on the same inputs; compare value and gradients.

    ``ours_fn(*tensorlib leaves)`` and ``theirs_fn(*torch leaves)`` get a pair (:func:`pair`)
    per array (floating ones require grad). Their outputs are compared; then both backprop
    the same seeded random upstream gradient (non-uniform, so a wrong gradient cannot hide
    in a plain sum) and every leaf's ``.grad`` is compared. Returns the two outputs.
    """
    pairs = [pair(a, dtype if np.asarray(a).dtype.kind == "f" else None) for a in arrays]
    ours = ours_fn(*[p[0] for p in pairs])
    theirs = theirs_fn(*[p[1] for p in pairs])
    assert_close(ours, theirs, what)
    if theirs.requires_grad:
        r = np.random.default_rng(seed + 12345).standard_normal(tuple(theirs.shape))
        r = r.astype(to_numpy(theirs).dtype)
        ours.backward(tl.tensor(r))
        theirs.backward(torch.tensor(r))
        assert_grads_close([p[0] for p in pairs], [p[1] for p in pairs], f"{what} grad")
    return ours, theirs
