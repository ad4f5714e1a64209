"""Gradient clipping against torch.nn.utils: the total norm returned and the gradients after.

Each case gives the same gradients to parameters in both libraries (several shapes, one
parameter without a gradient, seeded values with zeros, negatives and large magnitudes),
clips in each, and compares the returned norm (value, dtype, 0-d) and every gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import nn

from .compare import DTYPES, assert_close, pair, torch

SHAPES = [(3, 4), (5,), (2, 1, 3), (1,)]
NORM_TYPES: list[float | str] = [1, 2.0, 3.5, float("inf"), "inf", -float("inf"), 0.5]


def _grads(dtype: Any, seed: int = 0, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(s) * scale for s in SHAPES]
    grads[0][0, :2] = 0.0  # exact zeros
    grads[0][1, 0] = -40.0 * scale  # one large magnitude dominates the inf-norm
    return [g.astype(dtype) for g in grads]


def _params(grads: Sequence[np.ndarray | None]) -> tuple[list[Any], list[Any]]:
    """Parameters in both libraries with these gradients (None: a parameter without one)."""
    ours, theirs = [], []
    for g in grads:
        o, t = pair(np.ones((2, 2)) if g is None else np.ones(g.shape, dtype=g.dtype))
        if g is not None:
            o.grad = tl.tensor(g.copy())
            t.grad = torch.tensor(g.copy())
        ours.append(o)
        theirs.append(t)
    return ours, theirs


def _assert_grads(ours: list[Any], theirs: list[Any]) -> None:
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        if t.grad is None:
            assert o.grad is None, f"param {i}: tensorlib grew a gradient"
            continue
        assert_close(o.grad, t.grad, f"param {i}: clipped grad")  # values, not derivatives


def _norm(grads: list[np.ndarray], p: float | str) -> float:
    flat = np.concatenate([g.ravel().astype(np.float64) for g in grads])
    return float(np.linalg.norm(flat, ord=float(p)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["below", "above"], ids=["norm<max", "norm>max"])
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=repr)
def test_clip_grad_norm_matches_torch(norm_type: float | str, where: str, dtype: Any) -> None:
    grads = _grads(dtype)
    total = _norm(grads, norm_type)
    max_norm = total * (2.0 if where == "below" else 0.1) if total > 0 else 1.0
    ours, theirs = _params([grads[0], None, *grads[1:]])
    got = nn.utils.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    # torch's stubs say float, but it takes "inf" (float(norm_type)) as its docs say; a cast,
    # not an ignore, since without torch installed mypy sees no stubs to disagree with
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=cast(Any, norm_type))
    assert isinstance(got, tl.Tensor) and got.shape == ()
    assert_close(got, want, "total norm")
    _assert_grads(ours, theirs)
    if where == "below":  # nothing to clip: gradients are exactly as they were
        for o, g in zip([ours[0], *ours[2:]], grads, strict=True):
            np.testing.assert_array_equal(o.grad.numpy(), g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=repr)
def test_single_tensor_large_and_zero_gradients_match_torch(norm_type: float, dtype: Any) -> None:
    for scale in (1e6, 0.0):  # large magnitudes; all zeros (norm 0, coefficient clamped)
        grads = _grads(dtype, seed=3, scale=scale)[:1]
        ours, theirs = _params(grads)
        got = nn.utils.clip_grad_norm_(ours[0], 1.0, norm_type)
        want = torch.nn.utils.clip_grad_norm_(theirs[0], 1.0, norm_type)
        assert_close(got, want, f"total norm (scale {scale})")
        _assert_grads(ours, theirs)


def test_mixed_dtypes_match_torch() -> None:
    """float32 and float64 gradients: the norm is promoted, each gradient keeps its dtype."""
    grads = [_grads(np.float32)[0], _grads(np.float64, seed=1)[1]]
    ours, theirs = _params(grads)
    got = nn.utils.clip_grad_norm_(ours, 0.5)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert_close(got, want, "total norm")
    _assert_grads(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("norm_type", [2.0, 1, float("inf")], ids=repr)
def test_nonfinite_gradients_match_torch(norm_type: float, bad: float, dtype: Any) -> None:
    grads = _grads(dtype)
    grads[1][2] = bad
    # error_if_nonfinite=True: both raise, and neither touches the gradients
    ours, theirs = _params(grads)
    with pytest.raises(RuntimeError, match="non-finite"):
        nn.utils.clip_grad_norm_(ours, 1.0, norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type, error_if_nonfinite=True)
    _assert_grads(ours, theirs)
    # error_if_nonfinite=False: the same nonfinite norm, the same (nan/zero) gradients
    got = nn.utils.clip_grad_norm_(ours, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert_close(got, want, "total norm")
    _assert_grads(ours, theirs)


def test_no_gradients_and_empty_generators_match_torch() -> None:
    ours, theirs = _params([None, None])
    assert_close(nn.utils.clip_grad_norm_(ours, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        empty: list[Any] = []
        nn.utils.clip_grad_norm_((p for p in empty), 1.0)
        torch.nn.utils.clip_grad_norm_((p for p in empty), 1.0)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and messages[0] == messages[1], messages


def test_total_norm_and_scaling_apart_match_torch() -> None:
    """``get_total_norm`` then ``clip_grads_with_norm_`` (torch's two halves of clipping)."""
    grads = _grads(np.float64)
    ours, theirs = _params(grads)
    got = nn.utils.get_total_norm([p.grad for p in ours], 3.5)
    want = torch.nn.utils.get_total_norm([p.grad for p in theirs], 3.5)
    assert_close(got, want, "get_total_norm")
    nn.utils.clip_grads_with_norm_(ours, 1.5, got)
    torch.nn.utils.clip_grads_with_norm_(theirs, 1.5, want)
    _assert_grads(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip_value", [0.5, 2, 0.0, 1e9])
def test_clip_grad_value_matches_torch(clip_value: float, dtype: Any) -> None:
    grads = _grads(dtype, seed=2)
    grads[2][0, 0, 1] = np.nan  # nan stays nan, as torch's clamp leaves it
    ours, theirs = _params([grads[0], None, *grads[1:]])
    assert nn.utils.clip_grad_value_(ours, clip_value) is None
    torch.nn.utils.clip_grad_value_(theirs, clip_value)
    _assert_grads(ours, theirs)
    one, tone = _params(grads[:1])
    nn.utils.clip_grad_value_(one[0], clip_value)  # a single tensor
    torch.nn.utils.clip_grad_value_(tone[0], clip_value)
    _assert_grads(one, tone)
