"""Gradient clipping without torch: on every device, in place, without host syncs, and errors.

The values themselves are checked against torch in parity/test_clip_grad.py.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import nn
from tests.helpers import DEVICES

SHAPES = [(2, 3), (4,)]


def _params(device: str, scale: float = 1.0) -> tuple[list[nn.Parameter], Any, np.ndarray]:
    """Two parameters whose gradients are views into one flat bucket (as under DDP)."""
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(10) * scale
    bucket = tl.tensor(flat, device=device)
    params = [nn.Parameter(tl.zeros(s, dtype=tl.float64, device=device)) for s in SHAPES]
    params[0].grad = tl.from_array(bucket.data[:6].reshape(2, 3))
    params[1].grad = tl.from_array(bucket.data[6:])
    return params, bucket, flat


def _forbid_host_reads(monkeypatch: pytest.MonkeyPatch, array: Any) -> None:
    """On the fake CuPy, make every device-to-host read fail (a real GPU cannot be patched)."""
    if os.environ.get("TENSORLIB_FAKE_CUPY") != "1":  # tests/conftest.py installed the fake
        return
    cls = type(array)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("clip_grad read a value back from the GPU (a host sync)")

    for name in ("get", "item", "tolist", "__float__", "__bool__", "__int__"):
        monkeypatch.setattr(cls, name, refuse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [2.0, 1, 3.5, "inf"])
def test_clip_grad_norm_scales_in_place_on_the_device(
    device: str, norm_type: float | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    params, bucket, flat = _params(device, scale=10.0)
    want_norm = np.linalg.norm(flat, ord=float(norm_type))
    if device != "cpu":
        _forbid_host_reads(monkeypatch, bucket.data)
    total = nn.utils.clip_grad_norm_(params, 1.0, norm_type=norm_type)
    monkeypatch.undo()
    assert total.device == tl.device(device) and total.shape == () and total.dtype == np.float64
    np.testing.assert_allclose(total.item(), want_norm, rtol=1e-12)
    # the bucket itself was scaled: the gradients are still views of it
    np.testing.assert_allclose(bucket.numpy(), flat * (1.0 / (want_norm + 1e-6)), rtol=1e-12)
    assert params[1].grad is not None
    np.testing.assert_array_equal(params[1].grad.numpy(), bucket.numpy()[6:])


@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_leaves_small_gradients_alone(device: str) -> None:
    params, bucket, flat = _params(device, scale=0.01)
    nn.utils.clip_grad_norm_(iter(params), 5.0)  # any iterable
    np.testing.assert_array_equal(bucket.numpy(), flat)


@pytest.mark.parametrize("device", DEVICES)
def test_error_if_nonfinite(device: str) -> None:
    params, bucket, flat = _params(device)
    bucket.data[3] = np.nan
    with pytest.raises(RuntimeError, match=r"total norm of order 2.0 .* non-finite \(nan\)"):
        nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert np.isnan(bucket.numpy()[3]) and np.array_equal(bucket.numpy()[:3], flat[:3])
    total = nn.utils.clip_grad_norm_(params, 1.0)  # without the check: nan everywhere
    assert np.isnan(total.item()) and np.isnan(bucket.numpy()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_value_clamps_in_place(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    params, bucket, flat = _params(device)
    if device != "cpu":
        _forbid_host_reads(monkeypatch, bucket.data)
    nn.utils.clip_grad_value_(params, 0.5)
    monkeypatch.undo()
    np.testing.assert_array_equal(bucket.numpy(), np.clip(flat, -0.5, 0.5))


def test_float16_gradients_do_not_overflow_the_norm() -> None:
    p = nn.Parameter(tl.zeros(4, dtype=tl.float16))
    p.grad = tl.full((4,), 300.0, dtype=tl.float16)  # 300**2 overflows float16
    total = nn.utils.clip_grad_norm_(p, 1.0)
    assert total.dtype == np.float16 and total.item() == 600.0


def test_bad_arguments() -> None:
    p = nn.Parameter(tl.ones(2))
    p.grad = tl.ones(2)
    with pytest.raises(TypeError, match=r"parameters\[1\] is a ndarray"):
        nn.utils.clip_grad_norm_([p, np.ones(2)], 1.0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="norm_type must be a number or 'inf'"):
        nn.utils.clip_grad_norm_(p, 1.0, norm_type="fro")
    with pytest.raises(RuntimeError, match="infinity norm of an empty gradient"):
        e = nn.Parameter(tl.ones(0))
        e.grad = tl.ones(0)
        nn.utils.clip_grad_norm_(e, 1.0, norm_type="inf")
    with pytest.raises(TypeError, match="total_norm must be a Tensor"):
        nn.utils.clip_grads_with_norm_(p, 1.0, 2.0)  # type: ignore[arg-type]


def test_exported_where_torch_users_look() -> None:
    from tensorlib.nn.utils import clip_grad, clip_grad_norm_

    assert clip_grad_norm_ is nn.utils.clip_grad_norm_ is clip_grad.clip_grad_norm_
