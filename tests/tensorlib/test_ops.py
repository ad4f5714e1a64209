"""Per-primitive tests: forwards against NumPy, backwards against float64 finite differences.

Three layers:

* a table of cases (``CASES``), each a small fixed example of one primitive, run for every
  dtype (float64/32/16 forwards, float64 gradients against finite differences, float32
  gradients against float64 ones) on every device;
* hypothesis tests over random shapes for the families where shapes matter (broadcasting
  binary ops, reductions over random axes, batched matmul, indexing);
* explicit tests for behaviour that a generic check cannot express (ties in max/min, repeated
  indices, overflow at |x| = 1000, dropout masks, dtype promotion with Python scalars, errors).
"""

from __future__ import annotations

import math
import operator
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tensorlib as tl
from tensorlib import functional as F
from tests.helpers import DEVICES
from tests.tensorlib.gradcheck import (
    check_forward,
    check_grad,
    check_grad_low_precision,
)

Array = np.ndarray[Any, Any]
Sampler = Callable[[np.random.Generator], Array]

FLOAT_DTYPES = [np.float64, np.float32, np.float16]


# ============================================================================ helpers
def _on(x: tl.Tensor, data: Any) -> tl.Tensor:
    """A constant (index, mask, target) on ``x``'s device."""
    return tl.tensor(np.asarray(data), device=x.device)


@contextmanager
def _no_fp_warnings() -> Iterator[None]:
    """Fail on overflow / invalid / divide-by-zero (underflow to 0 is fine)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            yield


def normal(*shape: int, scale: float = 1.0) -> Sampler:
    return lambda rng: rng.standard_normal(shape) * scale


def uniform(lo: float, hi: float, *shape: int) -> Sampler:
    return lambda rng: rng.uniform(lo, hi, shape)


def positive(*shape: int) -> Sampler:
    """Inputs for log, sqrt and fractional powers: well inside the domain."""
    return uniform(0.5, 2.0, *shape)


def away(*shape: int, lo: float = 0.2) -> Sampler:
    """Values with |x| >= lo: away from the kinks of relu/abs and the pole of 1/x."""
    return lambda rng: rng.choice([-1.0, 1.0], shape) * rng.uniform(lo, 2.0, shape)


def grid(*shape: int, offset: float = 0.0) -> Sampler:
    """Values near k*0.3 + offset: two grids 0.15 apart never come within 0.09 of each other,
    so maximum/minimum of them stay away from ties under finite differences."""
    return lambda rng: rng.integers(-6, 7, shape) * 0.3 + offset + rng.uniform(-0.03, 0.03, shape)


def distinct(*shape: int) -> Sampler:
    """Pairwise distinct values (>= 0.24 apart), so max/min reductions have no ties."""

    def draw(rng: np.random.Generator) -> Array:
        n = math.prod(shape)
        vals = (rng.permutation(n) - n / 2) * 0.3 + rng.uniform(-0.03, 0.03, n)
        return vals.reshape(shape)

    return draw


def avoiding(*shape: int, points: tuple[float, ...]) -> Sampler:
    """Uniform in [-2, 2] but at least 0.1 away from each of ``points`` (clip bounds)."""

    def draw(rng: np.random.Generator) -> Array:
        x = rng.uniform(-2.0, 2.0, shape)
        for p in points:
            near = np.abs(x - p) < 0.1
            x = np.where(near, p + np.sign(x - p + 1e-12) * 0.2, x)
        return x

    return draw


def np_gelu(x: Array) -> Array:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_sigmoid(x: Array) -> Array:
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-x))


def np_softmax(x: Array, axis: int = -1) -> Array:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_log_softmax(x: Array, axis: int = -1) -> Array:
    s = x - x.max(axis=axis, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=axis, keepdims=True))


def np_cross_entropy(
    x: Array, t: Array, reduction: str = "mean", ignore_index: int = -100
) -> Array:
    lsm = np_log_softmax(x, axis=1)
    valid = t != ignore_index
    picked = lsm[np.arange(len(t)), np.where(valid, t, 0)]
    loss = np.where(valid, -picked, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.asarray(loss.sum())
    return np.asarray(loss.sum() / valid.sum())


def np_layer_norm(
    x: Array, ndims: int, w: Array | None = None, b: Array | None = None, eps: float = 1e-5
) -> Array:
    axes = tuple(range(x.ndim - ndims, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


# ============================================================================ the case table
@dataclass(frozen=True)
class Case:
    """One primitive on fixed inputs: ``fn`` on tensors, ``ref`` on float64 NumPy arrays."""

    name: str
    fn: Callable[..., tl.Tensor]
    ref: Callable[..., Any]
    samplers: tuple[Sampler, ...]
    tol16: float = 1.0  # extra slack for float16 forwards (long reductions, normalizations)

    def inputs(self) -> list[Array]:
        rng = np.random.default_rng(zlib.crc32(self.name.encode()))
        return [s(rng) for s in self.samplers]


IDX_REPEATED = np.array([0, 2, 0, 0, -1])
MASK_34 = np.array([[1, 0, 1, 1], [0, 0, 0, 1], [1, 1, 0, 0]], dtype=bool)
COND = np.array([[[True, False, True, True]], [[False, False, True, False]]])  # (2, 1, 4)
TARGETS = np.array([0, 3, -100, 1, 3])
EMB_IDX = np.array([[0, 2, 0], [3, 0, 2]])


def _ce(reduction: str, targets: Array = TARGETS, ignore_index: int = -100) -> Case:
    return Case(
        f"cross_entropy_{reduction}_ignore{ignore_index}",
        lambda x: F.cross_entropy(
            x, _on(x, targets), reduction=reduction, ignore_index=ignore_index
        ),
        lambda x: np_cross_entropy(x, targets, reduction, ignore_index),
        (normal(len(targets), 4, scale=2.0),),
    )


CASES: list[Case] = [
    # ---- arithmetic, with broadcasting and Python scalars on either side
    Case("add_broadcast", operator.add, np.add, (normal(3, 1, 4), normal(2, 4))),
    Case("add_0d", operator.add, np.add, (normal(), normal(2, 3))),
    Case("sub_broadcast", operator.sub, np.subtract, (normal(4), normal(3, 1))),
    Case("mul_broadcast", operator.mul, np.multiply, (normal(2, 3), normal(3))),
    Case("mul_0d", operator.mul, np.multiply, (normal(2, 1), normal())),
    Case("div_broadcast", operator.truediv, np.divide, (normal(2, 3), away(1, 3, lo=0.5))),
    Case("radd_scalar", lambda x: 1.5 + x, lambda x: 1.5 + x, (normal(2, 3),)),
    Case("sub_scalar", lambda x: x - 0.25, lambda x: x - 0.25, (normal(2, 3),)),
    Case("rsub_scalar", lambda x: 2.0 - x, lambda x: 2.0 - x, (normal(2, 3),)),
    Case("rmul_scalar", lambda x: 3 * x, lambda x: 3 * x, (normal(2, 3),)),
    Case("div_scalar", lambda x: x / 4.0, lambda x: x / 4.0, (normal(2, 3),)),
    Case("rdiv_scalar", lambda x: 2.0 / x, lambda x: 2.0 / x, (away(2, 3, lo=0.5),)),
    Case("neg", operator.neg, np.negative, (normal(2, 3),)),
    # ---- powers: tensor**scalar, tensor**tensor, scalar**tensor
    Case("pow_square", lambda x: x**2, lambda x: x**2, (normal(2, 3),)),
    Case("pow_cube", lambda x: x**3, lambda x: x**3, (normal(2, 3),)),
    Case("pow_half", lambda x: x**0.5, np.sqrt, (positive(2, 3),)),
    Case("pow_negative", lambda x: x**-1.5, lambda x: x**-1.5, (positive(2, 3),)),
    Case("pow_tensor_tensor", operator.pow, np.power, (positive(2, 3), normal(3))),
    Case("pow_scalar_base", lambda x: 2.0**x, lambda x: 2.0**x, (normal(2, 3),)),
    Case("pow_int_base", lambda x: 3**x, lambda x: 3.0**x, (normal(4),)),
    # ---- unary math and activations
    Case("exp", tl.exp, np.exp, (normal(2, 3),)),
    Case("log", tl.log, np.log, (positive(2, 3),)),
    Case("sqrt", tl.sqrt, np.sqrt, (positive(2, 3),)),
    Case("tanh", tl.tanh, np.tanh, (normal(2, 3, scale=2.0),)),
    Case("sigmoid", F.sigmoid, np_sigmoid, (normal(2, 3, scale=3.0),)),
    Case("relu", F.relu, lambda x: np.maximum(x, 0), (away(3, 4),)),
    Case("gelu", F.gelu, np_gelu, (normal(3, 4, scale=2.0),)),
    Case("abs", tl.abs, np.abs, (away(3, 4),)),
    Case(
        "clip_min",
        lambda x: x.clip(min=-0.5),
        lambda x: np.maximum(x, -0.5),
        (avoiding(3, 4, points=(-0.5,)),),
    ),
    Case(
        "clip_max",
        lambda x: x.clip(max=0.7),
        lambda x: np.minimum(x, 0.7),
        (avoiding(3, 4, points=(0.7,)),),
    ),
    Case(
        "clip_both",
        lambda x: tl.clip(x, -0.5, 0.7),
        lambda x: np.clip(x, -0.5, 0.7),
        (avoiding(3, 4, points=(-0.5, 0.7)),),
    ),
    # ---- select
    Case("maximum", tl.maximum, np.maximum, (grid(3, 1), grid(1, 4, offset=0.15))),
    Case("minimum", tl.minimum, np.minimum, (grid(2, 3), grid(3, offset=0.15))),
    Case(
        "maximum_scalar",
        lambda x: tl.maximum(x, 0.15),
        lambda x: np.maximum(x, 0.15),
        (grid(3, 4),),
    ),
    Case(
        "minimum_scalar_left",
        lambda x: tl.minimum(0.15, x),
        lambda x: np.minimum(0.15, x),
        (grid(3, 4),),
    ),
    Case(
        "where_broadcast",
        lambda a, b: tl.where(_on(a, COND), a, b),
        lambda a, b: np.where(COND, a, b),
        (normal(3, 4), normal(1, 3, 1)),
    ),
    Case(
        "where_scalar",
        lambda a: tl.where(_on(a, MASK_34), a, 0.0),
        lambda a: np.where(MASK_34, a, 0.0),
        (normal(3, 4),),
    ),
    # ---- reductions
    Case("sum_all", lambda x: x.sum(), np.sum, (normal(3, 4),)),
    Case("sum_axis", lambda x: x.sum(axis=1), lambda x: x.sum(axis=1), (normal(3, 4),)),
    Case(
        "sum_negative_axis_keepdims",
        lambda x: x.sum(axis=-1, keepdims=True),
        lambda x: x.sum(axis=-1, keepdims=True),
        (normal(2, 3, 4),),
    ),
    Case(
        "sum_tuple", lambda x: tl.sum(x, (0, 2)), lambda x: x.sum(axis=(0, 2)), (normal(2, 3, 4),)
    ),
    Case(
        "mean_all_keepdims",
        lambda x: x.mean(keepdims=True),
        lambda x: x.mean(keepdims=True),
        (normal(3, 4),),
    ),
    Case("mean_axis", lambda x: tl.mean(x, 0), lambda x: x.mean(axis=0), (normal(3, 4),)),
    Case(
        "mean_negative_tuple",
        lambda x: x.mean(axis=(-1, -3)),
        lambda x: x.mean(axis=(-1, -3)),
        (normal(2, 3, 4),),
    ),
    Case("max_all", lambda x: x.max(), np.max, (distinct(3, 4),)),
    Case("max_axis", lambda x: x.max(axis=0), lambda x: x.max(axis=0), (distinct(3, 4),)),
    Case(
        "max_tuple_keepdims",
        lambda x: tl.max(x, (0, 1), keepdims=True),
        lambda x: x.max(axis=(0, 1), keepdims=True),
        (distinct(2, 3, 4),),
    ),
    Case("max_negative_axis", lambda x: x.max(-1), lambda x: x.max(-1), (distinct(2, 3, 4),)),
    Case("min_all", lambda x: tl.min(x), np.min, (distinct(3, 4),)),
    Case(
        "min_axis_keepdims",
        lambda x: x.min(axis=1, keepdims=True),
        lambda x: x.min(axis=1, keepdims=True),
        (distinct(3, 4),),
    ),
    Case(
        "min_tuple",
        lambda x: x.min(axis=(1, 2)),
        lambda x: x.min(axis=(1, 2)),
        (distinct(2, 3, 4),),
    ),
    # ---- matmul: 1-d operands, 2-d, batched with broadcast batch dimensions
    Case("matmul_vec_vec", operator.matmul, np.matmul, (normal(4), normal(4))),
    Case("matmul_vec_mat", operator.matmul, np.matmul, (normal(3), normal(3, 2))),
    Case("matmul_mat_vec", operator.matmul, np.matmul, (normal(2, 3), normal(3))),
    Case("matmul_mat_mat", tl.matmul, np.matmul, (normal(2, 3), normal(3, 4))),
    Case("matmul_batched", operator.matmul, np.matmul, (normal(2, 1, 2, 3), normal(3, 3, 2))),
    Case("matmul_batch_vec", operator.matmul, np.matmul, (normal(2, 3, 4), normal(4))),
    Case("matmul_vec_batch", operator.matmul, np.matmul, (normal(3), normal(2, 3, 2))),
    # ---- movement
    Case(
        "reshape_minus1",
        lambda x: x.reshape(4, -1),
        lambda x: x.reshape(4, -1),
        (normal(2, 3, 4),),
    ),
    Case("reshape_to_0d", lambda x: tl.reshape(x, ()), lambda x: x.reshape(()), (normal(1, 1),)),
    Case("transpose_reverse", lambda x: x.transpose(), np.transpose, (normal(2, 3, 4),)),
    Case(
        "transpose_axes",
        lambda x: tl.transpose(x, (1, 0, 2)),
        lambda x: x.transpose(1, 0, 2),
        (normal(2, 3, 4),),
    ),
    Case(
        "permute_negative",
        lambda x: x.permute(-1, 0, 1),
        lambda x: x.transpose(2, 0, 1),
        (normal(2, 3, 4),),
    ),
    Case("T", lambda x: x.T, lambda x: x.T, (normal(3, 4),)),
    Case(
        "expand",
        lambda x: x.expand(2, -1, 4),
        lambda x: np.broadcast_to(x, (2, 3, 4)),
        (normal(3, 1),),
    ),
    Case(
        "broadcast_to",
        lambda x: tl.broadcast_to(x, (3, 4)),
        lambda x: np.broadcast_to(x, (3, 4)),
        (normal(4),),
    ),
    Case("getitem_int", lambda x: x[1], lambda x: x[1], (normal(3, 4),)),
    Case(
        "getitem_negative_step",
        lambda x: x[-1, ::-2],
        lambda x: x[-1, ::-2],
        (normal(3, 5),),
    ),
    Case("getitem_reverse", lambda x: x[::-1], lambda x: x[::-1], (normal(4, 2),)),
    Case(
        "getitem_newaxis_ellipsis",
        lambda x: x[1:, None, ..., 0],
        lambda x: x[1:, None, ..., 0],
        (normal(3, 2, 4),),
    ),
    Case(
        "getitem_repeated_ints",
        lambda x: x[_on(x, IDX_REPEATED)],
        lambda x: x[IDX_REPEATED],
        (normal(3, 4),),
    ),
    Case(
        "getitem_list_columns",
        lambda x: x[:, [1, 1, 3]],
        lambda x: x[:, [1, 1, 3]],
        (normal(3, 4),),
    ),
    Case(
        "getitem_int_pairs",
        lambda x: x[[0, 1, 0], [2, 2, 2]],
        lambda x: x[[0, 1, 0], [2, 2, 2]],
        (normal(3, 4),),
    ),
    Case("getitem_mask", lambda x: x[_on(x, MASK_34)], lambda x: x[MASK_34], (normal(3, 4),)),
    Case(
        "getitem_row_mask",
        lambda x: x[_on(x, np.array([True, False, True]))],
        lambda x: x[np.array([True, False, True])],
        (normal(3, 4),),
    ),
    Case(
        "concatenate_axis0",
        lambda a, b: tl.concatenate([a, b]),
        lambda a, b: np.concatenate([a, b]),
        (normal(2, 3), normal(4, 3)),
    ),
    Case(
        "concatenate_last_axis",
        lambda a, b, c: tl.concatenate([a, b, c], axis=-1),
        lambda a, b, c: np.concatenate([a, b, c], axis=-1),
        (normal(2, 1), normal(2, 3), normal(2, 2)),
    ),
    Case(
        "stack_axis0",
        lambda a, b: tl.stack([a, b]),
        lambda a, b: np.stack([a, b]),
        (normal(2, 3), normal(2, 3)),
    ),
    Case(
        "stack_last_axis",
        lambda a, b, c: tl.stack([a, b, c], axis=-1),
        lambda a, b, c: np.stack([a, b, c], axis=-1),
        (normal(2, 3), normal(2, 3), normal(2, 3)),
    ),
    # ---- neural-network functions
    Case("softmax_last", F.softmax, np_softmax, (normal(3, 4, scale=2.0),)),
    Case(
        "softmax_axis0",
        lambda x: x.softmax(axis=0),
        lambda x: np_softmax(x, 0),
        (normal(3, 4, scale=2.0),),
    ),
    Case("log_softmax_last", F.log_softmax, np_log_softmax, (normal(3, 4, scale=2.0),)),
    Case(
        "log_softmax_middle",
        lambda x: x.log_softmax(axis=1),
        lambda x: np_log_softmax(x, 1),
        (normal(2, 3, 4, scale=2.0),),
    ),
    _ce("mean"),
    _ce("sum"),
    _ce("none"),
    _ce("mean", np.array([1, 0, 2, 1]), ignore_index=1),
    Case(
        "mse_mean",
        lambda x, y: F.mse_loss(x, y),
        lambda x, y: np.mean((x - y) ** 2),
        (normal(3, 4), normal(3, 4)),
    ),
    Case(
        "mse_sum",
        lambda x, y: F.mse_loss(x, y, reduction="sum"),
        lambda x, y: np.sum((x - y) ** 2),
        (normal(3, 4), normal(3, 4)),
    ),
    Case(
        "mse_none",
        lambda x, y: F.mse_loss(x, y, reduction="none"),
        lambda x, y: (x - y) ** 2,
        (normal(3, 4), normal(3, 4)),
    ),
    Case(
        "linear_1d_bias",
        F.linear,
        lambda x, w, b: x @ w.T + b,
        (normal(3), normal(2, 3), normal(2)),
    ),
    Case(
        "linear_2d_no_bias",
        F.linear,
        lambda x, w: x @ w.T,
        (normal(4, 3), normal(2, 3)),
    ),
    Case(
        "linear_3d_bias",
        F.linear,
        lambda x, w, b: x @ w.T + b,
        (normal(2, 2, 3), normal(4, 3), normal(4)),
    ),
    Case(
        "layer_norm_plain",
        lambda x: F.layer_norm(x, 4),
        lambda x: np_layer_norm(x, 1),
        (normal(3, 4, scale=2.0),),
        tol16=2.0,
    ),
    Case(
        "layer_norm_affine",
        lambda x, w, b: F.layer_norm(x, (4,), w, b),
        lambda x, w, b: np_layer_norm(x, 1, w, b),
        (normal(3, 4, scale=2.0), normal(4), normal(4)),
        tol16=2.0,
    ),
    Case(
        "layer_norm_2d_affine",
        lambda x, w, b: F.layer_norm(x, (3, 4), w, b),
        lambda x, w, b: np_layer_norm(x, 2, w, b),
        (normal(2, 3, 4), normal(3, 4), normal(3, 4)),
        tol16=2.0,
    ),
    Case(
        "layer_norm_2d_weight_only",
        lambda x, w: F.layer_norm(x, (3, 4), weight=w),
        lambda x, w: np_layer_norm(x, 2, w),
        (normal(2, 3, 4), normal(3, 4)),
        tol16=2.0,
    ),
    Case(
        "layer_norm_bias_only",
        lambda x, b: F.layer_norm(x, 4, bias=b),
        lambda x, b: np_layer_norm(x, 1, None, b),
        (normal(3, 4), normal(4)),
        tol16=2.0,
    ),
    Case(
        "embedding_repeated",
        lambda w: F.embedding(_on(w, EMB_IDX), w),
        lambda w: w[EMB_IDX],
        (normal(4, 3),),
    ),
]
CASE_IDS = [c.name for c in CASES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_matches_numpy(case: Case, dtype: Any, device: str) -> None:
    check_forward(
        case.fn,
        case.ref,
        case.inputs(),
        device=device,
        dtype=dtype,
        tol_scale=case.tol16 if dtype == np.float16 else 1.0,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward_matches_finite_differences(case: Case, device: str) -> None:
    check_grad(case.fn, case.inputs(), device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float32_backward_matches_float64(case: Case, device: str) -> None:
    check_grad_low_precision(case.fn, case.inputs(), dtype=np.float32, device=device)


def test_check_grad_catches_a_wrong_backward() -> None:
    """The finite-difference check itself must fail on a wrong gradient."""

    class BadSquare(tl.Function):
        __slots__ = ("a",)

        def forward(self, a: Any) -> Any:
            self.a = a
            return a * a

        def backward(self, g: Any) -> Any:
            return g * self.a  # should be 2 * a

    x = np.random.default_rng(0).uniform(0.5, 2.0, (2, 3))
    with pytest.raises(AssertionError):
        check_grad(BadSquare.apply, [x])
    check_grad(lambda t: t * t, [x])


# ============================================================================ random shapes
SEEDS = st.integers(0, 2**32 - 1)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4)
PAIRS = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=4)


def _normal(rng: np.random.Generator, shape: tuple[int, ...]) -> Array:
    return rng.standard_normal(shape)


def _away(rng: np.random.Generator, shape: tuple[int, ...]) -> Array:
    return away(*shape, lo=0.5)(rng)


def _positive(rng: np.random.Generator, shape: tuple[int, ...]) -> Array:
    return rng.uniform(0.5, 2.0, shape)


def _grid_a(rng: np.random.Generator, shape: tuple[int, ...]) -> Array:
    return grid(*shape)(rng)


def _grid_b(rng: np.random.Generator, shape: tuple[int, ...]) -> Array:
    return grid(*shape, offset=0.15)(rng)


Draw = Callable[[np.random.Generator, tuple[int, ...]], Array]
BINARY: dict[str, tuple[Callable[..., tl.Tensor], Callable[..., Array], Draw, Draw]] = {
    "add": (operator.add, np.add, _normal, _normal),
    "sub": (operator.sub, np.subtract, _normal, _normal),
    "mul": (operator.mul, np.multiply, _normal, _normal),
    "div": (operator.truediv, np.divide, _normal, _away),
    "pow": (operator.pow, np.power, _positive, _normal),
    "maximum": (tl.maximum, np.maximum, _grid_a, _grid_b),
    "minimum": (tl.minimum, np.minimum, _grid_b, _grid_a),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(BINARY))
@given(shapes=PAIRS, seed=SEEDS)
def test_binary_ops_broadcast_random_shapes(
    op: str, device: str, shapes: hnp.BroadcastableShapes, seed: int
) -> None:
    fn, ref, draw_a, draw_b = BINARY[op]
    rng = np.random.default_rng(seed)
    inputs = [draw_a(rng, shapes.input_shapes[0]), draw_b(rng, shapes.input_shapes[1])]
    out = check_forward(fn, ref, inputs, device=device)
    assert out.shape == shapes.result_shape
    check_forward(fn, ref, inputs, device=device, dtype=np.float32)
    check_grad(fn, inputs, device=device, seed=seed)


UNARY: dict[str, tuple[Callable[..., tl.Tensor], Callable[..., Array], Draw]] = {
    "exp": (tl.exp, np.exp, _normal),
    "log": (tl.log, np.log, _positive),
    "sqrt": (tl.sqrt, np.sqrt, _positive),
    "tanh": (tl.tanh, np.tanh, _normal),
    "sigmoid": (F.sigmoid, np_sigmoid, _normal),
    "relu": (F.relu, lambda x: np.maximum(x, 0), _away),
    "gelu": (F.gelu, np_gelu, _normal),
    "abs": (tl.abs, np.abs, _away),
    "neg": (operator.neg, np.negative, _normal),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(UNARY))
@given(shape=SHAPES, seed=SEEDS)
def test_unary_ops_random_shapes(op: str, device: str, shape: tuple[int, ...], seed: int) -> None:
    fn, ref, draw = UNARY[op]
    x = draw(np.random.default_rng(seed), shape)
    out = check_forward(fn, ref, [x], device=device)
    assert out.shape == shape
    check_grad(fn, [x], device=device, seed=seed)


REDUCTIONS = ["sum", "mean", "max", "min"]


@st.composite
def shape_and_axis(draw: st.DrawFn) -> tuple[tuple[int, ...], Any]:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    nd = len(shape)
    single = st.integers(-nd, nd - 1)
    several = st.lists(single, max_size=nd, unique_by=lambda a: a % nd).map(tuple)
    return shape, draw(st.none() | single | several)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", REDUCTIONS)
@given(shape_axis=shape_and_axis(), keepdims=st.booleans(), seed=SEEDS)
def test_reductions_random_axes(
    op: str, device: str, shape_axis: tuple[tuple[int, ...], Any], keepdims: bool, seed: int
) -> None:
    shape, axis = shape_axis
    x = distinct(*shape)(np.random.default_rng(seed))

    def fn(t: tl.Tensor) -> tl.Tensor:
        return getattr(t, op)(axis=axis, keepdims=keepdims)

    def ref(a: Array) -> Array:
        return np.asarray(getattr(np, op)(a, axis=axis, keepdims=keepdims))

    check_forward(fn, ref, [x], device=device)
    check_forward(fn, ref, [x], device=device, dtype=np.float32)
    check_grad(fn, [x], device=device, seed=seed)


@pytest.mark.parametrize("device", DEVICES)
@given(
    shapes=hnp.mutually_broadcastable_shapes(signature=np.matmul.signature, max_dims=2, max_side=3),
    seed=SEEDS,
)
def test_matmul_random_shapes(device: str, shapes: hnp.BroadcastableShapes, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(s) for s in shapes.input_shapes)
    out = check_forward(operator.matmul, np.matmul, [a, b], device=device)
    assert out.shape == shapes.result_shape
    check_forward(operator.matmul, np.matmul, [a, b], device=device, dtype=np.float32)
    check_grad(operator.matmul, [a, b], device=device, seed=seed)


@pytest.mark.parametrize("device", DEVICES)
@given(
    shapes=hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=3, max_side=3),
    seed=SEEDS,
)
def test_where_random_broadcasting(device: str, shapes: hnp.BroadcastableShapes, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cond_shape, a_shape, b_shape = shapes.input_shapes
    cond = rng.random(cond_shape) < 0.5

    def fn(a: tl.Tensor, b: tl.Tensor) -> tl.Tensor:
        return tl.where(_on(a, cond), a, b)

    inputs = [rng.standard_normal(a_shape), rng.standard_normal(b_shape)]
    check_forward(fn, lambda a, b: np.where(cond, a, b), inputs, device=device)
    check_grad(fn, inputs, device=device, seed=seed)


@st.composite
def array_and_basic_index(draw: st.DrawFn) -> tuple[tuple[int, ...], Any]:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    return shape, draw(hnp.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True))


@pytest.mark.parametrize("device", DEVICES)
@given(shape_index=array_and_basic_index(), seed=SEEDS)
def test_getitem_random_basic_indices(
    device: str, shape_index: tuple[tuple[int, ...], Any], seed: int
) -> None:
    shape, index = shape_index
    x = np.random.default_rng(seed).standard_normal(shape)
    check_forward(lambda t: t[index], lambda a: a[index], [x], device=device)
    check_grad(lambda t: t[index], [x], device=device, seed=seed)


@st.composite
def array_and_int_index(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[Array, ...]]:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    index = draw(hnp.integer_array_indices(shape, result_shape=hnp.array_shapes(max_dims=2)))
    return shape, index


@pytest.mark.parametrize("device", DEVICES)
@given(shape_index=array_and_int_index(), seed=SEEDS)
def test_getitem_random_integer_arrays_accumulate(
    device: str, shape_index: tuple[tuple[int, ...], tuple[Array, ...]], seed: int
) -> None:
    """Integer-array indexing (repeats and negative indices are likely) adds gradients up."""
    shape, index = shape_index

    def fn(t: tl.Tensor) -> tl.Tensor:
        return t[tuple(_on(t, i) for i in index)]

    x = np.random.default_rng(seed).standard_normal(shape)
    check_forward(fn, lambda a: a[index], [x], device=device)
    check_grad(fn, [x], device=device, seed=seed)
    # With unit weights the gradient counts how often each element was picked.
    t = tl.tensor(x, device=device, requires_grad=True)
    fn(t).sum().backward()
    counts = np.zeros(shape)
    np.add.at(counts, index, 1.0)
    assert t.grad is not None
    np.testing.assert_array_equal(t.grad.numpy(), counts)


# ============================================================================ explicit behaviour
@pytest.mark.parametrize("device", DEVICES)
def test_host_masks_and_targets_follow_a_gpu_tensor(device: str) -> None:
    """NumPy masks (where) and targets (mse_loss) work on every device, like index arrays."""
    x = tl.tensor([1.0, -2.0, 3.0], device=device, requires_grad=True)
    mask = np.array([True, False, True])
    y = tl.where(mask, x, 0.0)
    assert y.device == device and y.tolist() == [1.0, 0.0, 3.0]
    y.sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 0.0, 1.0]
    loss = F.mse_loss(x, np.array([1.0, -1.0, 1.0], dtype=np.float32))
    assert loss.device == device
    np.testing.assert_allclose(loss.item(), 5.0 / 3.0, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_maximum_minimum_ties_split_gradient(device: str) -> None:
    a_np = np.array([1.0, 2.0, 3.0, -1.0])
    b_np = np.array([1.0, 0.0, 3.0, 5.0])
    for op, a_wins in ((tl.maximum, a_np > b_np), (tl.minimum, a_np < b_np)):
        a = tl.tensor(a_np, device=device, requires_grad=True)
        b = tl.tensor(b_np, device=device, requires_grad=True)
        op(a, b).sum().backward()
        tie = a_np == b_np
        assert a.grad is not None and b.grad is not None
        np.testing.assert_array_equal(a.grad.numpy(), np.where(tie, 0.5, a_wins * 1.0))
        np.testing.assert_array_equal(b.grad.numpy(), np.where(tie, 0.5, ~a_wins * 1.0))
        # The two halves of a tie add up to the full gradient.
        np.testing.assert_array_equal(a.grad.numpy() + b.grad.numpy(), np.ones(4))

    # With broadcasting, the shared halves are summed back to each input's shape.
    a = tl.tensor([[1.0], [2.0]], device=device, requires_grad=True)  # (2, 1)
    b = tl.tensor([1.0, 2.0, 0.0], device=device, requires_grad=True)  # (3,)
    tl.maximum(a, b).sum().backward()
    assert a.grad is not None and b.grad is not None
    np.testing.assert_array_equal(a.grad.numpy(), [[1.5], [2.5]])
    np.testing.assert_array_equal(b.grad.numpy(), [0.5, 1.5, 0.0])

    # A Python scalar tie: the tensor keeps half of the gradient.
    x = tl.tensor([0.0, 1.0, -1.0], device=device, requires_grad=True)
    tl.maximum(x, 0.0).sum().backward()
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [0.5, 1.0, 0.0])


@pytest.mark.parametrize("device", DEVICES)
def test_max_min_reduction_ties_share_gradient(device: str) -> None:
    data = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    cases: list[tuple[str, Any, bool, Any]] = [
        ("max", 1, False, [[0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]]),
        ("max", None, False, [[0, 0.5, 0.5], [0, 0, 0]]),
        ("max", 0, True, [[0, 1, 1], [1, 0, 0]]),
        ("min", 1, True, [[1, 0, 0], [1 / 3, 1 / 3, 1 / 3]]),
        ("min", (0, 1), False, [[1, 0, 0], [0, 0, 0]]),
        ("min", -2, False, [[1, 0, 0], [0, 1, 1]]),
    ]
    for op, axis, keepdims, expected in cases:
        x = tl.tensor(data, device=device, requires_grad=True)
        getattr(x, op)(axis=axis, keepdims=keepdims).sum().backward()
        assert x.grad is not None
        np.testing.assert_allclose(
            x.grad.numpy(), expected, rtol=1e-12, err_msg=f"{op}(axis={axis})"
        )
    # Ties between equal maxima in float32 too, and the shares sum to the incoming gradient.
    x = tl.tensor(np.full((2, 4), 7.0), dtype=tl.float32, device=device, requires_grad=True)
    x.max(axis=1).backward(tl.tensor([2.0, 4.0], device=device))
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), [[0.5] * 4, [1.0] * 4])


@pytest.mark.parametrize("device", DEVICES)
def test_getitem_repeated_indices_add_up(device: str) -> None:
    x = tl.tensor(np.arange(12.0).reshape(3, 4), device=device, requires_grad=True)
    idx = tl.tensor([2, 0, 2, 2, -1], device=device)  # -1 is row 2 again
    y = x[idx]
    np.testing.assert_array_equal(y.numpy(), np.arange(12.0).reshape(3, 4)[[2, 0, 2, 2, -1]])
    y.sum().backward()
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [[1.0] * 4, [0.0] * 4, [4.0] * 4])

    # Pairs of index arrays that repeat the same element.
    x = tl.tensor(np.zeros((2, 3)), device=device, requires_grad=True)
    x[[0, 0, 1, 0], [1, 1, 2, 1]].backward(tl.tensor([1.0, 2.0, 3.0, 4.0], device=device))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [[0.0, 7.0, 0.0], [0.0, 0.0, 3.0]])


@pytest.mark.parametrize("device", DEVICES)
def test_getitem_boolean_mask(device: str) -> None:
    data = np.arange(12.0).reshape(3, 4)
    x = tl.tensor(data, device=device, requires_grad=True)
    mask = x > 4.5  # a bool Tensor used as an index
    y = x[mask]
    np.testing.assert_array_equal(y.numpy(), data[data > 4.5])
    y.backward(tl.tensor(np.arange(1.0, y.shape[0] + 1), device=device))
    expected = np.zeros((3, 4))
    expected[data > 4.5] = np.arange(1.0, 8.0)
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_repeated_indices(device: str) -> None:
    w_np = np.random.default_rng(0).standard_normal((5, 3))
    w = tl.tensor(w_np, device=device, requires_grad=True)
    idx = np.array([[1, 4, 1], [1, 0, 4]])
    out = F.embedding(tl.tensor(idx, device=device), w)
    np.testing.assert_array_equal(out.numpy(), w_np[idx])
    out.sum().backward()
    assert w.grad is not None
    counts = np.bincount(idx.ravel(), minlength=5).astype(np.float64)
    np.testing.assert_array_equal(w.grad.numpy(), np.repeat(counts[:, None], 3, axis=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_sigmoid_extreme_inputs(dtype: Any, device: str) -> None:
    values = np.array([-1000.0, -100.0, -30.0, -1.0, 0.0, 1.0, 30.0, 100.0, 1000.0])
    x = tl.tensor(values, dtype=dtype, device=device, requires_grad=True)
    with _no_fp_warnings():
        y = F.sigmoid(x)
        y.sum().backward()
    out = y.numpy().astype(np.float64)
    assert y.dtype == np.dtype(dtype)
    assert out[0] == 0.0 and out[-1] == 1.0 and out[4] == 0.5
    assert np.all(np.isfinite(out)) and np.all(np.diff(out) >= 0)
    rtol = {np.float64: 1e-12, np.float32: 1e-6, np.float16: 1e-3}[dtype]
    # The reference rounded to dtype: sigmoid(-30) = 9e-14 is 0 in float16.
    ref = np_sigmoid(values.astype(dtype).astype(np.float64)).astype(dtype).astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=float(np.finfo(dtype).smallest_normal))
    assert x.grad is not None
    grad = x.grad.numpy().astype(np.float64)
    assert np.all(np.isfinite(grad))
    assert grad[0] == 0.0 and grad[-1] == 0.0 and grad[4] == 0.25


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_matches_tanh_formula(device: str) -> None:
    xs = np.linspace(-6.0, 6.0, 49)
    y = F.gelu(tl.tensor(xs, dtype=tl.float64, device=device)).numpy()
    c = math.sqrt(2.0 / math.pi)
    formula = [0.5 * v * (1.0 + math.tanh(c * (v + 0.044715 * v**3))) for v in xs]
    np.testing.assert_allclose(y, formula, rtol=1e-13, atol=1e-15)
    # Known values of the tanh approximation (not the erf form: gelu(1) would be 0.8413447).
    g = F.gelu(tl.tensor([1.0, -1.0], dtype=tl.float64, device=device)).numpy()
    np.testing.assert_allclose(g, [0.8411919906082768, -0.15880800939172324], rtol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_gelu_large_inputs_no_overflow(dtype: Any, device: str) -> None:
    """GELU is relu-like far from 0; float16 must not overflow into inf or nan gradients."""
    values = np.array([-1000.0, -300.0, -50.0, -10.5, 10.5, 50.0, 300.0, 1000.0])
    x = tl.tensor(values, dtype=dtype, device=device, requires_grad=True)
    with _no_fp_warnings():
        y = F.gelu(x)
        y.sum().backward()
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_allclose(y.numpy().astype(np.float64), np.maximum(values, 0), atol=1e-6)
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy().astype(np.float64), values > 0, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_pow_exponent_gradient_at_zero_base(device: str) -> None:
    """d(a**b)/db = a**b log(a) tends to 0 at a = 0 (b > 0): no nan from 0 * log(0)."""
    x = tl.tensor([0.0, 1.0, 2.0], dtype=tl.float64, device=device, requires_grad=True)
    p = tl.tensor(2.0, dtype=tl.float64, device=device, requires_grad=True)
    with _no_fp_warnings():
        (x**p).sum().backward()
    assert p.grad is not None and x.grad is not None
    np.testing.assert_allclose(p.grad.item(), 4 * math.log(2), rtol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), [0.0, 2.0, 4.0], rtol=1e-12)
    y = tl.tensor([0.5, 1.0], device=device, requires_grad=True)
    with _no_fp_warnings():
        (0.0**y).sum().backward()
    assert y.grad is not None
    np.testing.assert_array_equal(y.grad.numpy(), [0.0, 0.0])


@pytest.mark.parametrize("device", DEVICES)
def test_pow_zero_exponent_has_zero_gradient_at_zero_base(device: str) -> None:
    """x ** 0 is 1 everywhere, so its gradient is 0, also at x = 0 (not 0 * 0**-1 = nan)."""
    x = tl.tensor([0.0, -2.0, 3.0], dtype=tl.float64, device=device, requires_grad=True)
    (x**0).sum().backward()
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 0.0, 0.0])
    a = tl.tensor([0.0, 0.0, 2.0], dtype=tl.float64, device=device, requires_grad=True)
    b = tl.tensor([0.0, 2.0, 0.0], dtype=tl.float64, device=device)
    with _no_fp_warnings():
        (a**b).sum().backward()
    assert a.grad is not None
    np.testing.assert_array_equal(a.grad.numpy(), [0.0, 0.0, 0.0])


@pytest.mark.parametrize("device", DEVICES)
def test_integer_tensors_with_floats_give_float32(device: str) -> None:
    i = tl.tensor([1, 2, 3], device=device)
    assert (i * 1.5).dtype == np.float32
    assert (i / 2).dtype == np.float32
    assert (i + tl.ones(3, device=device)).dtype == np.float32
    assert (i + tl.ones(3, dtype=tl.float16, device=device)).dtype == np.float16
    assert (i + 2).dtype == np.int64


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_label_smoothing_targets_mix_with_uniform(device: str) -> None:
    # Equal logits: the loss is log C for any smoothing; the gradient is (1/C - q) / N with
    # q = (1 - s) onehot + s / C, and an ignored row gets none.
    logits = tl.zeros(3, 4, dtype=tl.float64, device=device, requires_grad=True)
    s = 0.2
    loss = F.cross_entropy(logits, tl.tensor([0, 2, -100], device=device), label_smoothing=s)
    np.testing.assert_allclose(loss.item(), math.log(4), rtol=1e-12)
    loss.backward()
    q = np.full((2, 4), s / 4)
    q[0, 0] += 1 - s
    q[1, 2] += 1 - s
    assert logits.grad is not None
    np.testing.assert_allclose(logits.grad.numpy()[:2], (0.25 - q) / 2, rtol=1e-12)
    np.testing.assert_array_equal(logits.grad.numpy()[2], 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_padding_row_gets_no_gradient(device: str) -> None:
    emb = tl.nn.Embedding(4, 2, padding_idx=1, device=device)
    np.testing.assert_array_equal(emb.weight.numpy()[1], 0.0)
    emb(tl.tensor([[1, 2], [1, 1]], device=device)).sum().backward()
    assert emb.weight.grad is not None
    np.testing.assert_array_equal(emb.weight.grad.numpy(), [[0, 0], [0, 0], [1, 1], [0, 0]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=lambda d: np.dtype(d).name)
def test_softmax_log_softmax_stable_for_large_logits(dtype: Any, device: str) -> None:
    logits = np.array([[1000.0, 0.0, -1000.0], [1000.0, 1000.0, 1000.0], [-1000.0, -999.0, 0.0]])
    x = tl.tensor(logits, dtype=dtype, device=device, requires_grad=True)
    with _no_fp_warnings():
        lsm = F.log_softmax(x)
        sm = F.softmax(x)
        (lsm * tl.tensor(np.ones((3, 3)), dtype=dtype, device=device)).sum().backward()
    expected_lsm = [
        [0.0, -1000.0, -2000.0],
        [-math.log(3)] * 3,
        [-1000.0, -999.0, 0.0],
    ]
    np.testing.assert_allclose(lsm.numpy(), expected_lsm, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        sm.numpy(), [[1.0, 0.0, 0.0], [1 / 3] * 3, [0.0, 0.0, 1.0]], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(sm.numpy().sum(axis=1), 1.0, rtol=1e-6)
    assert x.grad is not None
    # d/dx sum(log_softmax) = 1 - C * softmax.
    np.testing.assert_allclose(x.grad.numpy(), 1 - 3 * sm.numpy(), atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_large_logits_and_ignore_index(device: str) -> None:
    logits = tl.tensor(
        [[1000.0, 0.0], [0.0, 1000.0], [5.0, 5.0]], device=device, requires_grad=True
    )
    target = tl.tensor([1, 1, -100], device=device)
    with _no_fp_warnings():
        per_row = F.cross_entropy(logits, target, reduction="none")
        loss = F.cross_entropy(logits, target)
        loss.backward()
    np.testing.assert_allclose(per_row.numpy(), [1000.0, 0.0, 0.0], rtol=1e-6)
    # The mean is over the two rows that are not ignored.
    np.testing.assert_allclose(loss.item(), 500.0, rtol=1e-6)
    assert logits.grad is not None
    np.testing.assert_allclose(
        logits.grad.numpy(), [[0.5, -0.5], [0.0, 0.0], [0.0, 0.0]], atol=1e-6
    )


@pytest.mark.parametrize("device", DEVICES)
def test_add_gradient_not_corrupted_by_shared_subexpression(device: str) -> None:
    # Add hands the same gradient array to both inputs; accumulating into one of them in
    # place must not change the other's pending gradient.
    x = tl.tensor([1.0], dtype=tl.float64, device=device, requires_grad=True)
    y = tl.tensor([1.0], dtype=tl.float64, device=device, requires_grad=True)
    p = x * 2.0
    q = y * 3.0
    s = p + q
    ((p + s) * 1.0).sum().backward()  # = 4x + 3y
    assert x.grad is not None and y.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [4.0])
    np.testing.assert_array_equal(y.grad.numpy(), [3.0])


# ---------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_identity_when_p0_or_eval(device: str) -> None:
    data = np.random.default_rng(1).standard_normal((4, 5))
    for kwargs in ({"p": 0.0}, {"p": 0.5, "training": False}, {"p": 1.0, "training": False}):
        x = tl.tensor(data, device=device, requires_grad=True)
        y = F.dropout(x, **kwargs)  # type: ignore[arg-type]
        np.testing.assert_array_equal(y.numpy(), data, err_msg=str(kwargs))
        y.sum().backward()
        assert x.grad is not None
        np.testing.assert_array_equal(x.grad.numpy(), np.ones((4, 5)), err_msg=str(kwargs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_dropout_training_mask_scale_and_gradient(dtype: Any, device: str) -> None:
    p = 0.25
    rng = np.random.default_rng(2)
    data = rng.uniform(0.5, 2.0, (100, 100)).astype(dtype)
    x = tl.tensor(data, device=device, requires_grad=True)
    y = F.dropout(x, p, generator=tl.Generator(7))
    assert y.dtype == np.dtype(dtype)
    out = y.numpy().astype(np.float64)
    kept = out != 0
    scale = 1.0 / (1.0 - p)
    rtol = 1e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(out[kept], data[kept].astype(np.float64) * scale, rtol=rtol)
    # About 1 - p of the elements survive (10 000 draws: the std of the share is 0.0043).
    assert abs(kept.mean() - (1 - p)) < 0.03
    weights = rng.standard_normal((100, 100))
    y.backward(tl.tensor(weights, dtype=dtype, device=device))
    assert x.grad is not None
    expected = weights.astype(dtype).astype(np.float64) * kept * scale
    np.testing.assert_allclose(x.grad.numpy().astype(np.float64), expected, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_reproducible_with_generator(device: str) -> None:
    x = tl.ones(50, 40, device=device)
    a = F.dropout(x, 0.5, generator=tl.Generator(123)).numpy()
    b = F.dropout(x, 0.5, generator=tl.Generator(123)).numpy()
    c = F.dropout(x, 0.5, generator=tl.Generator(124)).numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    gen = tl.Generator(123)
    first = F.dropout(x, 0.5, generator=gen).numpy()
    second = F.dropout(x, 0.5, generator=gen).numpy()
    np.testing.assert_array_equal(first, a)
    assert not np.array_equal(first, second)  # the generator advances between calls
    assert set(np.unique(a)) == {0.0, 2.0}
    zeros = F.dropout(x, 1.0).numpy()
    np.testing.assert_array_equal(zeros, np.zeros((50, 40)))


# ---------------------------------------------------------------------------- dtypes
SCALAR_EXPRS: dict[str, Callable[[tl.Tensor], tl.Tensor]] = {
    "x+1": lambda x: x + 1,
    "1+x": lambda x: 1 + x,
    "x-0.5": lambda x: x - 0.5,
    "0.5-x": lambda x: 0.5 - x,
    "x*2.0": lambda x: x * 2.0,
    "2*x": lambda x: 2 * x,
    "x/3.0": lambda x: x / 3.0,
    "3.0/x": lambda x: 3.0 / x,
    "x**2": lambda x: x**2,
    "x**0.5": lambda x: x**0.5,
    "2.0**x": lambda x: 2.0**x,
    "maximum(x,0.0)": lambda x: tl.maximum(x, 0.0),
    "minimum(0.5,x)": lambda x: tl.minimum(0.5, x),
    "clip": lambda x: x.clip(0.75, 1.5),
    "where(m,x,0.0)": lambda x: tl.where(x > 1.0, x, 0.0),
    "sum*2.0": lambda x: x.sum() * 2.0,
    "mean+1.0": lambda x: x.mean() + 1.0,
    "max/2": lambda x: x.max(axis=0) / 2,
    "mse(x,0.5)": lambda x: F.mse_loss(x, 0.5),
    "dropout": lambda x: F.dropout(x, 0.5, generator=tl.Generator(0)),
    "layer_norm": lambda x: F.layer_norm(x, 3),
    "softmax": lambda x: F.softmax(x),
    "gelu": lambda x: F.gelu(x),
    "sigmoid": lambda x: F.sigmoid(x),
    # NumPy scalars act as Python numbers (NumPy 2 alone would give float64).
    "x*np.float64(0.5)": lambda x: x * np.float64(0.5),
    "np.float64(2)*x": lambda x: np.float64(2) * x,
    "x/np.sqrt(4.0)": lambda x: x / np.sqrt(np.float64(4.0)),
    "x+np.int64(1)": lambda x: x + np.int64(1),
    "x**np.float64(2)": lambda x: x ** np.float64(2),
    "maximum(x,np.float64(1))": lambda x: tl.maximum(x, np.float64(1)),
    "x*0-d float64": lambda x: x * tl.tensor(2.0, dtype=tl.float64, device=x.device),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("expr", list(SCALAR_EXPRS))
def test_python_scalars_keep_dtype(expr: str, dtype: Any, device: str) -> None:
    x = tl.tensor([[0.5, 1.25, 2.0], [1.5, 0.75, 1.0]], dtype=dtype, device=device)
    x.requires_grad_(True)
    y = SCALAR_EXPRS[expr](x)
    assert y.dtype == np.dtype(dtype), f"{expr}: {y.dtype}"
    y.sum().backward()
    assert x.grad is not None
    assert x.grad.dtype == np.dtype(dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_inputs_keep_float32_through_nn_functions(device: str) -> None:
    x = tl.randn(4, 3, device=device, requires_grad=True)
    w = tl.randn(2, 3, device=device, requires_grad=True)
    b = tl.randn(2, device=device, requires_grad=True)
    logits = F.linear(x, w, b)
    loss = F.cross_entropy(logits, tl.tensor([0, 1, 1, 0], device=device))
    assert logits.dtype == np.float32 and loss.dtype == np.float32
    loss.backward()
    for t in (x, w, b):
        assert t.grad is not None and t.grad.dtype == np.float32


# ============================================================================ bad input
def _ones(*shape: int, device: str = "cpu") -> tl.Tensor:
    return tl.ones(*shape, device=device)


ERRORS: list[tuple[str, Callable[[str], Any], type[Exception], tuple[str, ...]]] = [
    (
        "add_shapes",
        lambda d: _ones(2, 3, device=d) + _ones(4, device=d),
        ValueError,
        ("Add", "(2, 3)", "(4,)"),
    ),
    (
        "mul_shapes",
        lambda d: _ones(2, 3, device=d) * _ones(2, device=d),
        ValueError,
        ("Mul", "(2, 3)", "(2,)"),
    ),
    (
        "matmul_inner",
        lambda d: _ones(2, 3, device=d) @ _ones(4, 5, device=d),
        ValueError,
        ("Matmul", "(2, 3)", "(4, 5)"),
    ),
    (
        "matmul_batch",
        lambda d: _ones(2, 2, 3, device=d) @ _ones(3, 3, 4, device=d),
        ValueError,
        ("Matmul", "(2, 2, 3)", "(3, 3, 4)"),
    ),
    ("matmul_0d", lambda d: _ones(device=d) @ _ones(3, device=d), ValueError, ("Matmul", "0-d")),
    ("reshape", lambda d: _ones(2, 3, device=d).reshape(4, -1), ValueError, ("Reshape",)),
    (
        "transpose",
        lambda d: _ones(2, 3, device=d).transpose(0, 0),
        ValueError,
        ("not a permutation",),
    ),
    ("sum_axis", lambda d: _ones(2, 3, device=d).sum(axis=2), ValueError, ("axis 2",)),
    (
        "concatenate",
        lambda d: tl.concatenate([_ones(2, 3, device=d), _ones(2, 4, device=d)]),
        ValueError,
        ("Concatenate",),
    ),
    ("clip", lambda d: _ones(3, device=d).clip(1.0, 0.0), ValueError, ("min",)),
    (
        "where_cond",
        lambda d: tl.where(_ones(3, device=d), _ones(3, device=d), 0.0),
        TypeError,
        ("bool",),
    ),
    (
        "ce_float_target",
        lambda d: F.cross_entropy(_ones(2, 3, device=d), _ones(2, device=d)),
        TypeError,
        ("float32",),
    ),
    (
        "ce_target_shape",
        lambda d: F.cross_entropy(_ones(2, 3, device=d), tl.tensor([0, 1, 1], device=d)),
        ValueError,
        ("(2,)", "(3,)"),
    ),
    (
        "ce_reduction",
        lambda d: F.cross_entropy(_ones(2, 3, device=d), tl.tensor([0, 1], device=d), "avg"),
        ValueError,
        ("avg",),
    ),
    (
        "ce_logits_1d",
        lambda d: F.cross_entropy(_ones(3, device=d), tl.tensor([0], device=d)),
        ValueError,
        ("(N, C)",),
    ),
    (
        "mse_shapes",
        lambda d: F.mse_loss(_ones(2, 3, device=d), _ones(3, 2, device=d)),
        ValueError,
        ("(2, 3)", "(3, 2)"),
    ),
    (
        "linear_in_features",
        lambda d: F.linear(_ones(4, 3, device=d), _ones(2, 5, device=d)),
        ValueError,
        ("in_features=5",),
    ),
    (
        "linear_bias",
        lambda d: F.linear(_ones(4, 3, device=d), _ones(2, 3, device=d), _ones(3, device=d)),
        ValueError,
        ("bias",),
    ),
    (
        "layer_norm_shape",
        lambda d: F.layer_norm(_ones(2, 3, device=d), 4),
        ValueError,
        ("normalized_shape",),
    ),
    (
        "embedding_float",
        lambda d: F.embedding(_ones(2, device=d), _ones(4, 3, device=d)),
        TypeError,
        ("float32",),
    ),
    ("dropout_p", lambda d: F.dropout(_ones(3, device=d), 1.5), ValueError, ("1.5",)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("call", "exc", "fragments"),
    [e[1:] for e in ERRORS],
    ids=[e[0] for e in ERRORS],
)
def test_bad_input_errors_name_op_and_shapes(
    call: Callable[[str], Any], exc: type[Exception], fragments: tuple[str, ...], device: str
) -> None:
    with pytest.raises(exc) as info:
        call(device)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_cross_entropy_out_of_range_targets() -> None:
    # Range checks run on the CPU only (on a GPU they would force a sync every step).
    logits = tl.ones(3, 4)
    with pytest.raises(ValueError, match="target 4 is out of range for 4 classes"):
        F.cross_entropy(logits, tl.tensor([0, 4, 1]))
    with pytest.raises(ValueError, match="target -2 is out of range"):
        F.cross_entropy(logits, tl.tensor([0, -2, 1]))
    # The ignore_index value itself is allowed even though it is outside [0, C).
    F.cross_entropy(logits, tl.tensor([0, -100, 1]))
    with pytest.raises(IndexError, match="index 5 is out of range for 4"):
        F.embedding(tl.tensor([0, 5]), tl.ones(4, 3))


def test_ops_refuse_tensors_on_different_devices_message() -> None:
    """Without a GPU, a stand-in CUDA device exercises the same check and message."""
    fake = object.__new__(tl.Device)
    fake.type, fake.index, fake._name = "cuda", 7, "cuda:7"
    other = tl.Tensor._wrap(np.ones(3, dtype=np.float32), fake)
    with pytest.raises(RuntimeError, match=r"Add: expected all tensors on the same device") as e:
        _ = tl.ones(3) + other
    assert "cpu" in str(e.value) and "cuda:7" in str(e.value)
    with pytest.raises(RuntimeError, match=r"Matmul: .*cpu.*cuda:7"):
        _ = tl.ones(3) @ other


@pytest.mark.gpu
def test_ops_refuse_tensors_on_different_devices_gpu() -> None:
    a = tl.ones(3)
    b = tl.ones(3, device="cuda:0")
    for fn, name in (
        (operator.add, "Add"),
        (operator.mul, "Mul"),
        (operator.matmul, "Matmul"),
        (tl.maximum, "Maximum"),
    ):
        with pytest.raises(RuntimeError, match=rf"{name}: expected all tensors on the same"):
            fn(a, b)
    with pytest.raises(RuntimeError, match="same device"):
        tl.concatenate([a, b])


@pytest.mark.parametrize("device", DEVICES)
def test_host_index_arrays_follow_the_tensor_to_its_device(device: str) -> None:
    # Targets, embedding indices and index tensors built on the host must work with tensors
    # on any device (they are copied over), with the same values and gradients as on the CPU.
    logits = tl.tensor([[1.0, 2.0, 0.5], [0.1, 0.2, 3.0]], device=device, requires_grad=True)
    loss = F.cross_entropy(logits, np.array([1, 2]))
    loss.backward()
    ref = np.array([[1.0, 2.0, 0.5], [0.1, 0.2, 3.0]])
    p = np.exp(ref - ref.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(loss.item(), -np.log(p[[0, 1], [1, 2]]).mean(), rtol=1e-5)
    weight = tl.tensor(np.arange(12.0).reshape(4, 3), device=device, requires_grad=True)
    rows = F.embedding(np.array([3, 0, 3]), weight)
    np.testing.assert_array_equal(rows.numpy(), np.arange(12.0).reshape(4, 3)[[3, 0, 3]])
    picked = weight[tl.tensor([1, 1])]
    (rows.sum() + picked.sum()).backward()
    assert weight.grad is not None
    np.testing.assert_array_equal(weight.grad.numpy()[:, 0], [1.0, 2.0, 0.0, 2.0])
