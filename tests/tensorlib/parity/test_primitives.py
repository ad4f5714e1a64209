"""Every differentiable primitive against PyTorch: values and gradients, float64 and float32.

Elementwise math and activations (with the edge values where rules differ: 0 for abs, relu and
pow, the bounds for clip, ties for maximum/minimum, large magnitudes for sigmoid, gelu and
softmax), the power rule, reductions, matmul, movement, indexing, joining and casts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorlib as tl

from .compare import DTYPES, assert_close, check, pair, torch

Fn = Callable[..., Any]


def _randn(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _with_edges(seed: int, *shape: int, edges: tuple[float, ...] = (0.0,)) -> np.ndarray:
    """Random values with each of ``edges`` written into a few fixed places."""
    a = _randn(seed, *shape).ravel()
    for i, e in enumerate(edges):
        a[i::7][:2] = e
    return a.reshape(shape)


# ============================================================================ unary
UNARY: list[tuple[str, Fn, Any, np.ndarray]] = [
    ("neg", lambda x: -x, lambda x: -x, _randn(1, 3, 4)),
    ("abs_at_0", lambda x: x.abs(), torch.abs if torch else None, _with_edges(2, 3, 5)),
    ("abs_op", abs, abs, _with_edges(3, 4)),
    ("exp", tl.exp, torch.exp if torch else None, _randn(4, 3, 4) * 3),
    ("log", tl.log, torch.log if torch else None, np.abs(_randn(5, 3, 4)) + 1e-3),
    ("sqrt", tl.sqrt, torch.sqrt if torch else None, np.abs(_randn(6, 3, 4)) + 1e-2),
    ("tanh", tl.tanh, torch.tanh if torch else None, _with_edges(7, 3, 4, edges=(0.0, 30.0))),
    (
        "sigmoid",
        lambda x: x.sigmoid(),
        torch.sigmoid if torch else None,
        _with_edges(8, 3, 5, edges=(0.0, 60.0, -60.0, 700.0, -700.0)),
    ),
    ("relu_at_0", lambda x: x.relu(), torch.relu if torch else None, _with_edges(9, 3, 5)),
    (
        "gelu",
        lambda x: x.gelu(),
        (lambda x: torch.nn.functional.gelu(x, approximate="tanh")) if torch else None,
        _with_edges(10, 4, 6, edges=(0.0, 12.0, -12.0, 300.0, -300.0)),
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "ours", "theirs", "x"), UNARY, ids=[u[0] for u in UNARY])
def test_unary(name: str, ours: Fn, theirs: Fn, x: np.ndarray, dtype: Any) -> None:
    check(ours, theirs, [x], dtype, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lo", "hi"), [(-0.5, 0.5), (None, 0.25), (-0.25, None), (0.3, 0.3)], ids=str
)
def test_clip_matches_clamp_including_the_bounds(lo: Any, hi: Any, dtype: Any) -> None:
    # Values exactly at a bound: torch's clamp passes the gradient there (lo <= x <= hi).
    x = _with_edges(11, 4, 5, edges=tuple(v for v in (lo, hi) if v is not None))
    check(lambda t: t.clip(lo, hi), lambda t: torch.clamp(t, lo, hi), [x], dtype, what="clip")
    check(lambda t: tl.clip(t, lo, hi), lambda t: t.clamp(lo, hi), [x], dtype, what="tl.clip")


# ============================================================================ binary
SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((4, 1), (1,))]
BINARY: list[tuple[str, Fn, Any]] = [
    ("add", lambda a, b: a + b, lambda a, b: a + b),
    ("sub", lambda a, b: a - b, lambda a, b: a - b),
    ("mul", lambda a, b: a * b, lambda a, b: a * b),
    ("div", lambda a, b: a / b, lambda a, b: a / b),
    ("maximum", tl.maximum, torch.maximum if torch else None),
    ("minimum", lambda a, b: a.minimum(b), torch.minimum if torch else None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sa", "sb"), SHAPES, ids=str)
@pytest.mark.parametrize(("name", "ours", "theirs"), BINARY, ids=[b[0] for b in BINARY])
def test_binary_broadcasting(
    name: str, ours: Fn, theirs: Fn, sa: tuple[int, ...], sb: tuple[int, ...], dtype: Any
) -> None:
    a = _randn(20, *sa)
    b = _randn(21, *sb)
    if name == "div":
        b = np.sign(b) * (np.abs(b) + 0.5)  # away from 0
    check(ours, theirs, [a, b], dtype, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_maximum_minimum_ties_split_the_gradient(name: str, dtype: Any) -> None:
    a = np.round(_randn(22, 4, 5))
    b = np.round(_randn(23, 4, 5))
    b[::2] = a[::2]  # many exact ties
    ours, theirs = getattr(tl, name), getattr(torch, name)
    check(ours, theirs, [a, b], dtype, what=name)
    # A tie with a broadcast scalar-shaped operand, too.
    check(ours, theirs, [a, np.array([0.0])], dtype, what=f"{name} vs 0")


REFLECTED: list[tuple[str, Fn]] = [
    ("radd", lambda x: 1.5 + x),
    ("rsub", lambda x: 2 - x),
    ("rmul", lambda x: 3 * x),
    ("rdiv", lambda x: 2.0 / x),
    ("rpow", lambda x: 2.0**x),
    ("add_int", lambda x: x + 1),
    ("sub_float", lambda x: x - 0.25),
    ("div_int", lambda x: x / 4),
    ("mul_bool", lambda x: x * True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "fn"), REFLECTED, ids=[r[0] for r in REFLECTED])
def test_ops_with_python_scalars(name: str, fn: Fn, dtype: Any) -> None:
    x = np.sign(_randn(24, 3, 4)) * (np.abs(_randn(25, 3, 4)) + 0.5)
    check(fn, fn, [x], dtype, what=name)


# ============================================================================ pow
# NumPy warns where the true value is an infinity or nan (0**-1, (-2)**0.5); torch agrees on them.
_NAN_INF = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@_NAN_INF
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("exponent", [0, 1, 2, 0.5, -1, 3, 0.0, 2.0, -0.5])
def test_pow_scalar_exponent_at_zero_and_negatives(exponent: float, dtype: Any) -> None:
    # x ** 0 has gradient 0 everywhere (0 * 0**-1 would be nan at 0); fractional powers of
    # negatives are nan in both; negative powers at 0 give infinities in both.
    x = np.array([[0.0, -2.0, 1.5, -0.5], [3.0, 0.0, -1.0, 0.25]])
    check(lambda t: t**exponent, lambda t: t**exponent, [x], dtype, what=f"x**{exponent}")


@_NAN_INF
@pytest.mark.parametrize("dtype", DTYPES)
def test_pow_tensor_exponent_with_zeros(dtype: Any) -> None:
    # Every (base, exponent) kind: base 0, negative, positive; exponent 0, >0, <0, fractional.
    base = np.array([0.0, 0.0, 0.0, 0.0, 0.0, -2.0, -2.0, -2.0, 2.0, 1.5, 0.5, -1.0])
    expo = np.array([0.0, 1.0, 2.0, -1.0, 0.5, 0.0, 2.0, 0.5, -1.0, 0.0, 3.0, 3.0])
    check(lambda a, b: a**b, lambda a, b: a**b, [base, expo], dtype, what="a**b")
    # Broadcast: a row of exponents against a column of bases.
    check(
        lambda a, b: a**b,
        lambda a, b: a**b,
        [base[:6, None], np.array([0.0, 1.0, 2.0, 3.0])],
        dtype,
        what="a**b broadcast",
    )


@_NAN_INF
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", [0.0, 2.0, -2.0, 0.5])
def test_pow_scalar_base(base: float, dtype: Any) -> None:
    x = np.array([0.0, -2.0, 1.5, 1.0, -0.5])
    check(lambda t: base**t, lambda t: base**t, [x], dtype, what=f"{base}**x")


# ============================================================================ reductions
AXES = [None, 0, 1, -1, (0, 2), (1, 2)]


def _torch_axis(axis: Any) -> Any:
    return () if axis is None else axis


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", ["sum", "mean"])
def test_sum_mean(name: str, axis: Any, keepdims: bool, dtype: Any) -> None:
    x = _randn(30, 2, 3, 4)
    dim = _torch_axis(axis)
    if axis is None and not keepdims:
        theirs = lambda t: getattr(t, name)()  # noqa: E731
    else:
        theirs = lambda t: getattr(t, name)(dim=dim if dim != () else (0, 1, 2), keepdim=keepdims)  # noqa: E731
    check(lambda t: getattr(t, name)(axis, keepdims), theirs, [x], dtype, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", ["max", "min"])
def test_max_min_match_amax_amin_with_ties(
    name: str, axis: Any, keepdims: bool, dtype: Any
) -> None:
    # Ties share the gradient equally: torch.amax/amin's rule (and torch.max()'s over all
    # elements); torch.max(dim) instead gives it all to one index (documented difference).
    x = np.round(_randn(31, 2, 3, 4))  # integers: many ties
    theirs = getattr(torch, "amax" if name == "max" else "amin")
    check(
        lambda t: getattr(t, name)(axis, keepdims),
        lambda t: theirs(t, dim=_torch_axis(axis), keepdim=keepdims),
        [x],
        dtype,
        what=name,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_max_splits_ties_like_torch_max(dtype: Any) -> None:
    x = np.array([[1.0, 3.0, 3.0], [0.0, 3.0, -1.0]])
    check(lambda t: t.max(), lambda t: t.max(), [x], dtype, what="max()")
    check(lambda t: tl.min(t), lambda t: t.min(), [x], dtype, what="min()")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize(("axis", "keepdims"), [(None, False), (0, False), (-1, True)], ids=str)
def test_var(axis: Any, keepdims: bool, correction: int, dtype: Any) -> None:
    # tensorlib's default is NumPy's population variance (correction=0); torch's is 1.
    x = _randn(32, 3, 5) * 2 + 1
    check(
        lambda t: t.var(axis, keepdims, correction=correction),
        lambda t: torch.var(t, dim=axis, keepdim=keepdims, correction=correction),
        [x],
        dtype,
        what="var",
    )


def test_var_default_is_the_population_variance() -> None:
    x, xt = pair(_randn(33, 4, 6), np.float64)
    assert_close(x.var(), torch.var(xt, correction=0))
    assert_close(x.var(1), torch.var(xt, dim=1, correction=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("axis", "keepdims"), [(None, False), (0, False), (1, True), (-1, False)])
def test_argmax_argmin_first_of_ties(axis: Any, keepdims: bool, dtype: Any) -> None:
    x = np.round(_randn(34, 4, 5))
    x[1, :] = 2.0  # a row of ties: the first index wins in both
    ours, theirs = pair(x, dtype, requires_grad=False)
    assert_close(ours.argmax(axis, keepdims), torch.argmax(theirs, dim=axis, keepdim=keepdims))
    assert_close(ours.argmin(axis, keepdims), torch.argmin(theirs, dim=axis, keepdim=keepdims))


# ============================================================================ matmul
MATMUL = [
    ((4,), (4,)),
    ((4,), (4, 3)),
    ((2, 4), (4,)),
    ((2, 4), (4, 3)),
    ((5, 2, 4), (5, 4, 3)),
    ((2, 1, 3, 4), (5, 4, 2)),
    ((3, 2, 4), (4,)),
    ((4,), (2, 4, 3)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sa", "sb"), MATMUL, ids=str)
def test_matmul(sa: tuple[int, ...], sb: tuple[int, ...], dtype: Any) -> None:
    a, b = _randn(40, *sa), _randn(41, *sb)
    check(lambda x, y: x @ y, lambda x, y: x @ y, [a, b], dtype, what="@")
    check(tl.matmul, torch.matmul, [a, b], dtype, seed=1, what="matmul")


# ============================================================================ movement
MOVEMENT: list[tuple[str, Fn, Fn]] = [
    ("reshape", lambda t: t.reshape(4, -1), lambda t: t.reshape(4, -1)),
    ("reshape_tuple", lambda t: tl.reshape(t, (3, 8)), lambda t: t.reshape(3, 8)),
    ("view", lambda t: t.view(-1), lambda t: t.reshape(-1)),
    ("transpose_all", lambda t: t.transpose(), lambda t: t.permute(2, 1, 0)),
    ("T", lambda t: t.T, lambda t: t.permute(2, 1, 0)),
    ("permute", lambda t: t.permute(1, 2, 0), lambda t: t.permute(1, 2, 0)),
    ("permute_neg", lambda t: tl.permute(t, (-1, 0, 1)), lambda t: t.permute(-1, 0, 1)),
    ("swapaxes", lambda t: t.swapaxes(0, 2), lambda t: t.swapaxes(0, 2)),
    ("expand", lambda t: t[:, :1].expand(5, 2, 3, 4), lambda t: t[:, :1].expand(5, 2, 3, 4)),
    ("expand_keep", lambda t: t[:, :1].expand(-1, 3, -1), lambda t: t[:, :1].expand(-1, 3, -1)),
    ("broadcast_to", lambda t: tl.broadcast_to(t, (2, 2, 3, 4)), lambda t: t.expand(2, 2, 3, 4)),
    ("squeeze", lambda t: t[:, :1].squeeze(), lambda t: t[:, :1].squeeze()),
    ("squeeze_axis", lambda t: t[:, :1].squeeze(1), lambda t: t[:, :1].squeeze(1)),
    ("unsqueeze", lambda t: t.unsqueeze(1), lambda t: t.unsqueeze(1)),
    ("unsqueeze_neg", lambda t: t.unsqueeze(-1), lambda t: t.unsqueeze(-1)),
    ("flatten", lambda t: t.flatten(), lambda t: t.flatten()),
    ("flatten_1", lambda t: t.flatten(1), lambda t: t.flatten(1)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "ours", "theirs"), MOVEMENT, ids=[m[0] for m in MOVEMENT])
def test_movement(name: str, ours: Fn, theirs: Fn, dtype: Any) -> None:
    check(ours, theirs, [_randn(50, 2, 3, 4)], dtype, what=name)


INDEX: list[tuple[str, Fn, Fn]] = [
    ("int", lambda t: t[1], lambda t: t[1]),
    ("slices", lambda t: t[1:, ::2], lambda t: t[1:, ::2]),
    ("ellipsis", lambda t: t[..., 1], lambda t: t[..., 1]),
    ("none", lambda t: t[None, 0], lambda t: t[None, 0]),
    ("negative_int", lambda t: t[-1, :, -2], lambda t: t[-1, :, -2]),
    # torch has no negative steps: flip is its way to say t[::-1]
    ("neg_step", lambda t: t[::-1], lambda t: t.flip(0)),
    ("neg_step_2", lambda t: t[:, ::-2], lambda t: t.flip(1)[:, ::2]),
    ("int_list_repeats", lambda t: t[[0, 2, 0, 0]], lambda t: t[[0, 2, 0, 0]]),
    (
        "int_array_repeats",
        lambda t: t[np.array([[1, 1], [0, 2]])],
        lambda t: t[torch.tensor([[1, 1], [0, 2]])],
    ),
    (
        "two_int_arrays",
        lambda t: t[np.array([0, 2, 0]), np.array([1, 1, 1])],
        lambda t: t[torch.tensor([0, 2, 0]), torch.tensor([1, 1, 1])],
    ),
    (
        "int_array_and_slice",
        lambda t: t[:, np.array([3, 0, 3])],
        lambda t: t[:, torch.tensor([3, 0, 3])],
    ),
    ("tensor_index", lambda t: t[tl.tensor([2, 2])], lambda t: t[torch.tensor([2, 2])]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "ours", "theirs"), INDEX, ids=[i[0] for i in INDEX])
def test_indexing(name: str, ours: Fn, theirs: Fn, dtype: Any) -> None:
    check(ours, theirs, [_randn(51, 3, 4, 5)], dtype, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_boolean_mask_indexing(dtype: Any) -> None:
    x = _randn(52, 4, 5)
    mask = _randn(53, 4, 5) > 0
    row_mask = np.array([True, False, True, True])
    check(lambda t: t[mask], lambda t: t[torch.tensor(mask)], [x], dtype, what="mask")
    check(lambda t: t[row_mask], lambda t: t[torch.tensor(row_mask)], [x], dtype, what="rows")
    # A mask computed from the tensor itself (a bool tensor as the index).
    check(lambda t: t[t > 0.5], lambda t: t[t > 0.5], [x], dtype, what="t[t > 0.5]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate_stack(axis: int, dtype: Any) -> None:
    sizes = [(2, 3, 4), (2, 3, 4), (2, 3, 4)]
    if axis == 0:
        sizes = [(1, 3, 4), (3, 3, 4), (2, 3, 4)]
    arrays = [_randn(60 + i, *s) for i, s in enumerate(sizes)]
    check(
        lambda *ts: tl.concatenate(ts, axis=axis),
        lambda *ts: torch.cat(ts, dim=axis),
        arrays,
        dtype,
        what="concatenate",
    )
    same = [_randn(70 + i, 2, 3) for i in range(3)]
    check(
        lambda *ts: tl.stack(ts, axis=axis),
        lambda *ts: torch.stack(ts, dim=axis),
        same,
        dtype,
        what="stack",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_where(dtype: Any) -> None:
    cond = _randn(80, 3, 4) > 0
    a, b = _randn(81, 3, 4), _randn(82, 4)
    check(
        lambda x, y: tl.where(cond, x, y),
        lambda x, y: torch.where(torch.tensor(cond), x, y),
        [a, b],
        dtype,
        what="where",
    )
    check(
        lambda x: tl.where(x > 0, x, 0.0),
        lambda x: torch.where(x > 0, x, 0.0),
        [a],
        dtype,
        what="where scalar",
    )


# ============================================================================ nn primitives
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("scale", [1.0, 1e3])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_log_softmax(name: str, scale: float, axis: int, dtype: Any) -> None:
    x = _randn(90, 3, 4, 5) * scale
    check(
        lambda t: getattr(t, name)(axis),
        lambda t: getattr(torch, name)(t, dim=axis),
        [x],
        dtype,
        what=name,
    )
    check(
        lambda t: getattr(tl.functional, name)(t, axis=axis),
        lambda t: getattr(torch.nn.functional, name)(t, dim=axis),
        [x],
        dtype,
        seed=1,
        what=f"F.{name}",
    )


# ============================================================================ casts
CASTS: list[tuple[str, Fn, Fn]] = [
    ("to_f32", lambda t: t.to(tl.float32), lambda t: t.to(torch.float32)),
    ("to_f64", lambda t: t.to("float64"), lambda t: t.to(torch.float64)),
    ("astype_f32", lambda t: t.astype(np.float32), lambda t: t.to(torch.float32)),
    ("float", lambda t: t.float(), lambda t: t.float()),
    ("double", lambda t: t.double(), lambda t: t.double()),
    ("to_cpu_dtype", lambda t: t.to("cpu", dtype=tl.float64), lambda t: t.to("cpu", torch.float64)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "ours", "theirs"), CASTS, ids=[c[0] for c in CASTS])
def test_casts_carry_the_gradient_back_in_the_input_dtype(
    name: str, ours: Fn, theirs: Fn, dtype: Any
) -> None:
    # The value is compared in the target dtype; the gradient in the input's (assert_close
    # checks dtypes too).
    check(lambda t: ours(t) * 3.0, lambda t: theirs(t) * 3.0, [_randn(95, 3, 4)], dtype, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_casts_to_integers_match(dtype: Any) -> None:
    x = _randn(96, 3, 4) * 5
    ours, theirs = pair(x, dtype, requires_grad=False)
    assert_close(ours.long(), theirs.long(), "long")
    assert_close(ours.to(tl.int32), theirs.to(torch.int32), "int32")
    assert_close(ours.to(tl.bool_), theirs.to(torch.bool), "bool")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_with_masked_entries(name: str, dtype: Any) -> None:
    # Attention masks write -inf: those entries get probability 0 and gradient 0.
    x = _randn(91, 4, 6)
    x[np.triu_indices(4, 1)] = -np.inf
    check(
        lambda t: getattr(t, name)(-1),
        lambda t: getattr(torch, name)(t, dim=-1),
        [x],
        dtype,
        what=f"masked {name}",
    )
