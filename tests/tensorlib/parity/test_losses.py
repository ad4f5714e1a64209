"""Losses against PyTorch: mse_loss and cross_entropy (reductions, ignore_index,
label_smoothing, (C,) and (N, C, d1, ...) inputs, extreme logits) and their modules."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F
from tensorlib import nn

from .compare import DTYPES, assert_close, check, pair, to_numpy, torch

TF: Any = torch.nn.functional if torch else None
REDUCTIONS = ["mean", "sum", "none"]
SMOOTHING = [0.0, 0.1, 0.5, 1.0]


def _logits(seed: int, *shape: int, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) * scale


def _targets(
    seed: int, shape: tuple[int, ...], c: int, ignored: int = 0, ignore: int = -100
) -> Any:
    t = np.random.default_rng(seed).integers(0, c, size=shape)
    if ignored:
        t.reshape(-1)[: ignored * 3 : 3] = ignore
    return t


# ============================================================================ mse
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_mse_loss(reduction: str, dtype: Any) -> None:
    x, y = _logits(1, 4, 5), _logits(2, 4, 5)
    # Both input and target are leaves: both get gradients, as in torch.
    check(
        lambda a, b: F.mse_loss(a, b, reduction=reduction),
        lambda a, b: TF.mse_loss(a, b, reduction=reduction),
        [x, y],
        dtype,
        what="mse_loss",
    )
    arr = y.astype(dtype)  # a NumPy target, as a data loader gives
    check(
        lambda a: nn.MSELoss(reduction)(a, arr),
        lambda a: torch.nn.MSELoss(reduction=reduction)(a, torch.tensor(arr)),
        [x],
        dtype,
        what="MSELoss",
    )


# ============================================================================ cross entropy
def _check_ce(
    x: Any, t: Any, reduction: str, smoothing: float, dtype: Any, what: str, **kw: Any
) -> None:
    """F.cross_entropy against torch's on the same logits and targets (``t``: a NumPy array
    or a tensor, as users pass either; ``kw``: ignore_index)."""
    check(
        lambda a: F.cross_entropy(a, t, reduction=reduction, label_smoothing=smoothing, **kw),
        lambda a: TF.cross_entropy(
            a, torch.tensor(to_numpy(t)), reduction=reduction, label_smoothing=smoothing, **kw
        ),
        [x],
        dtype,
        what=what,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", SMOOTHING)
@pytest.mark.parametrize("ignored", [0, 2])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_2d(reduction: str, ignored: int, smoothing: float, dtype: Any) -> None:
    x = _logits(3, 7, 5)
    t = _targets(4, (7,), 5, ignored)
    _check_ce(x, t, reduction, smoothing, dtype, "cross_entropy")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_ignoring_a_real_class(reduction: str, smoothing: float, dtype: Any) -> None:
    # ignore_index may be a valid class (2): those rows count for neither loss nor the mean.
    x = _logits(5, 9, 4)
    t = np.array([0, 2, 1, 2, 3, 3, 2, 0, 1])
    what = "cross_entropy ignore_index=2"
    _check_ce(x, tl.tensor(t), reduction, smoothing, dtype, what, ignore_index=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_k_dimensional(reduction: str, smoothing: float, dtype: Any) -> None:
    # (N, C, d1, d2) logits with (N, d1, d2) targets, some ignored.
    x = _logits(6, 2, 4, 3, 5)
    t = _targets(7, (2, 3, 5), 4, ignored=3)
    _check_ce(x, t, reduction, smoothing, dtype, "cross_entropy (N, C, d1, d2)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_unbatched(reduction: str, dtype: Any) -> None:
    x = _logits(8, 6)
    check(
        lambda a: F.cross_entropy(a, np.array(4), reduction=reduction, label_smoothing=0.1),
        lambda a: TF.cross_entropy(a, torch.tensor(4), reduction=reduction, label_smoothing=0.1),
        [x],
        dtype,
        what="cross_entropy (C,)",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("scale", [1e2, 1e4])
def test_cross_entropy_extreme_logits_are_stable(
    scale: float, smoothing: float, dtype: Any
) -> None:
    x = _logits(9, 6, 5, scale=scale)
    x[0] = [scale, -scale, 0.0, scale, -scale]  # ties at the top, a huge spread
    t = _targets(10, (6,), 5, ignored=1)
    ours, _ = check(
        lambda a: F.cross_entropy(a, t, label_smoothing=smoothing),
        lambda a: TF.cross_entropy(a, torch.tensor(t), label_smoothing=smoothing),
        [x],
        dtype,
        what="cross_entropy extreme",
    )
    assert np.isfinite(ours.item())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # 0/0, on purpose
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_all_ignored(reduction: str) -> None:
    # mean over zero targets is 0/0 = nan in both; sum and none are zeros.
    x = _logits(11, 3, 4)
    t = np.full(3, -100)
    for smoothing in (0.0, 0.25):
        ours, theirs = pair(x, np.float64)
        assert_close(
            F.cross_entropy(ours, t, reduction=reduction, label_smoothing=smoothing),
            TF.cross_entropy(
                theirs, torch.tensor(t), reduction=reduction, label_smoothing=smoothing
            ),
            f"all ignored, {reduction}, smoothing {smoothing}",
        )


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_label_smoothing_out_of_range_is_a_value_error(bad: float) -> None:
    x = tl.zeros(2, 3)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        F.cross_entropy(x, np.array([0, 1]), label_smoothing=bad)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        nn.CrossEntropyLoss(label_smoothing=bad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"reduction": "sum"}, {"ignore_index": 1}, {"label_smoothing": 0.2, "reduction": "none"}],
    ids=str,
)
def test_cross_entropy_loss_module(kwargs: dict[str, Any], dtype: Any) -> None:
    x = _logits(12, 8, 3)
    t = _targets(13, (8,), 3)
    check(
        lambda a: nn.CrossEntropyLoss(**kwargs)(a, tl.tensor(t)),
        lambda a: torch.nn.CrossEntropyLoss(**kwargs)(a, torch.tensor(t)),
        [x],
        dtype,
        what=f"CrossEntropyLoss({kwargs})",
    )
