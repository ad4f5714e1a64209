"""Type promotion against PyTorch: the result dtype (and value) of mixed-dtype operations.

tensorlib follows torch's rules (docs/tensorlib.md, "Dtype promotion"): tensors with
dimensions outrank 0-d tensors, which outrank Python numbers; a lower rank decides only with a
higher category (bool < integer < floating). NumPy scalars count as Python numbers, NumPy
arrays as tensors. Gradients come back in each input's own dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F

from .compare import assert_close, assert_grads_close, check, pair, torch

DT = ["float16", "float32", "float64", "int32", "int64", "bool"]
VALUES = [1, 2, 3]  # exact in every dtype (bool: True)


def _both(dtype: str, ndim: int = 1) -> tuple[tl.Tensor, Any]:
    a = np.array(VALUES if ndim else VALUES[1], dtype=dtype)
    return tl.tensor(a), torch.tensor(a)


OPS: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
}


def _close(ours: tl.Tensor, theirs: Any, what: str) -> None:
    assert str(ours.dtype) == str(theirs.dtype).removeprefix("torch."), (
        f"{what}: tensorlib gives {ours.dtype}, torch gives {theirs.dtype}"
    )
    if ours.dtype.kind == "f":
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-3, err_msg=what)
    else:
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=what)


# ============================================================================ tensor-tensor
@pytest.mark.parametrize(("nda", "ndb"), [(1, 1), (1, 0), (0, 1), (0, 0)])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("db", DT)
@pytest.mark.parametrize("da", DT)
def test_tensor_tensor(da: str, db: str, op: str, nda: int, ndb: int) -> None:
    # int32 + float16 -> float16 (NumPy: float64); float32 + 0-d float64 -> float32.
    a, at = _both(da, nda)
    b, bt = _both(db, ndb)
    _close(OPS[op](a, b), OPS[op](at, bt), f"{da}[{nda}d] {op} {db}[{ndb}d]")


@pytest.mark.parametrize("db", DT)
@pytest.mark.parametrize("da", DT)
def test_maximum_where_concatenate_promote(da: str, db: str) -> None:
    a, at = _both(da)
    b, bt = _both(db)
    _close(tl.maximum(a, b), torch.maximum(at, bt), f"maximum {da} {db}")
    cond = np.array([True, False, True])
    _close(tl.where(cond, a, b), torch.where(torch.tensor(cond), at, bt), f"where {da} {db}")
    _close(tl.concatenate([a, b]), torch.cat([at, bt]), f"concatenate {da} {db}")
    _close(tl.stack([a, b]), torch.stack([at, bt]), f"stack {da} {db}")


# ============================================================================ Python scalars
@pytest.mark.parametrize("ndim", [1, 0])
@pytest.mark.parametrize("scalar", [True, 2, 1.5, -3], ids=repr)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("da", DT)
def test_tensor_python_scalar(da: str, op: str, scalar: Any, ndim: int) -> None:
    # int tensor * 1.5 -> float32 (the default float dtype), not NumPy's float64.
    a, at = _both(da, ndim)
    _close(OPS[op](a, scalar), OPS[op](at, scalar), f"{da} {op} {scalar!r}")
    _close(OPS[op](scalar, a), OPS[op](scalar, at), f"{scalar!r} {op} {da}")


# ============================================================================ NumPy scalars
NP_SCALARS = [
    np.float64(1.5),
    np.float32(1.5),
    np.float16(0.5),
    np.int64(2),
    np.int32(3),
    np.float64(1) / np.sqrt(np.float64(8)),
]


@pytest.mark.parametrize("scalar", NP_SCALARS, ids=repr)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("da", DT)
def test_numpy_scalars_act_as_python_numbers(da: str, op: str, scalar: Any) -> None:
    # NumPy 2 (NEP 50) would make float32 * np.float64(1.5) float64; torch keeps float32.
    a, at = _both(da)
    _close(OPS[op](a, scalar), OPS[op](at, scalar), f"{da} {op} {scalar!r}")
    _close(OPS[op](scalar, a), OPS[op](scalar, at), f"{scalar!r} {op} {da}")
    _close(a**scalar, at**scalar, f"{da} ** {scalar!r}") if da[0] == "f" else None


@pytest.mark.parametrize("da", DT)
def test_numpy_bool_scalar_acts_as_python_bool(da: str) -> None:
    # A documented difference: torch turns np.bool_ into a float (int32 * np.True_ is
    # float32 there); tensorlib treats it as the Python bool it stands for.
    a, _ = _both(da)
    for op in ("add", "mul"):
        ours = OPS[op](a, np.True_)
        ref = OPS[op](a, True)
        assert ours.dtype == ref.dtype
        np.testing.assert_array_equal(ours.numpy(), ref.numpy())


# ============================================================================ NumPy arrays
@pytest.mark.parametrize("array_ndim", [1, 0])
@pytest.mark.parametrize("db", DT)
@pytest.mark.parametrize("da", DT)
def test_numpy_arrays_act_as_tensors(da: str, db: str, array_ndim: int) -> None:
    # An ndarray operand counts as a tensor of its dtype: ndim >= 1 as a dimensioned tensor,
    # 0-d as a 0-d tensor (so a 0-d float64 array does not widen a float32 tensor).
    a, at = _both(da)
    arr = np.array(VALUES if array_ndim else VALUES[2], dtype=db)
    _close(a * arr, at * torch.tensor(arr), f"{da} * ndarray[{db}, {array_ndim}d]")
    reflected: Any = arr + a  # ndarray + Tensor: NumPy defers to Tensor.__radd__
    assert isinstance(reflected, tl.Tensor)
    _close(reflected, torch.tensor(arr) + at, f"ndarray[{db}, {array_ndim}d] + {da}")


# ============================================================================ unary, division
@pytest.mark.parametrize("da", ["int32", "int64", "bool"])
def test_integer_inputs_to_float_functions_give_float32(da: str) -> None:
    a, at = _both(da)
    b, bt = _both("int64" if da == "bool" else da)
    _close(a / b, at / bt, "true division")
    for name in ("exp", "log", "sqrt", "tanh"):
        _close(getattr(tl, name)(a), getattr(torch, name)(at), name)
    _close(F.sigmoid(a), torch.sigmoid(at), "sigmoid")


def test_where_with_python_numbers() -> None:
    a, at = _both("int64")
    cond = np.array([True, False, True])
    tc = torch.tensor(cond)
    _close(tl.where(cond, a, 1.5), torch.where(tc, at, 1.5), "where(c, int, float)")
    _close(tl.where(cond, 1.0, 0.0), torch.where(tc, 1.0, 0.0), "where(c, float, float)")
    _close(tl.where(cond, 2, 0), torch.where(tc, 2, 0), "where(c, int, int)")
    f, ft = _both("float32")
    _close(tl.where(np.True_, f, 0.0), torch.where(torch.tensor(True), ft, 0.0), "np.True_")


# ============================================================================ gradients
@pytest.mark.parametrize(("da", "db"), [("float16", "float32"), ("float32", "float64")])
def test_gradients_come_back_in_each_inputs_dtype(da: str, db: str) -> None:
    rng = np.random.default_rng(0)
    a, at = pair(rng.standard_normal((3, 4)), da)
    b, bt = pair(rng.standard_normal(()), db)  # 0-d: does not widen a
    out, outt = a * b + a, at * bt + at
    assert_close(out, outt, "value")
    r = rng.standard_normal((3, 4)).astype(da)
    out.backward(tl.tensor(r))
    outt.backward(torch.tensor(r))
    assert_grads_close([a, b], [at, bt])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_array_operand_has_no_gradient_and_keeps_the_dtype(dtype: Any) -> None:
    arr = np.random.default_rng(1).standard_normal(4).astype(np.float64)
    check(lambda t: t * arr, lambda t: t * torch.tensor(arr), [np.ones((3, 4))], dtype)


def test_attention_block_stays_float32_end_to_end() -> None:
    """``softmax(q @ k.T * (1 / np.sqrt(d))) @ v`` in float32: every value and gradient too."""
    rng = np.random.default_rng(7)
    n, d = 5, 8
    leaves = [rng.standard_normal((n, d)).astype(np.float32) for _ in range(3)]
    pairs = [pair(x, np.float32) for x in leaves]
    (q, qt), (k, kt), (v, vt) = pairs
    scale = 1 / np.sqrt(d)  # a NumPy float64 scalar
    assert isinstance(scale, np.float64)
    scores = q @ k.T * scale
    att = scores.softmax(-1)
    out = att @ v
    ref = torch.softmax(qt @ kt.T * scale, -1) @ vt
    for t in (scores, att, out):
        assert t.dtype == np.float32, t.dtype
    assert_close(out, ref, "attention")
    r = rng.standard_normal((n, d)).astype(np.float32)
    out.backward(tl.tensor(r))
    ref.backward(torch.tensor(r))
    for leaf in (q, k, v):
        assert leaf.grad is not None and leaf.grad.dtype == np.float32
    assert_grads_close([q, k, v], [qt, kt, vt])
    # The reflected form and a float32 NumPy scalar as well.
    assert (np.float64(0.5) * q).dtype == np.float32
    assert (q / np.sqrt(np.float32(d))).dtype == np.float32
