"""Every op family on a remote device gives NumPy's values, shapes and dtypes, and tensorlib
(autodiff, layers, losses, optimizers, moves, hooks, files) works on it as on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import remote
import tensorlib as tl
import tensorlib.functional as F
from remote.client import _infer
from tensorlib import nn, optim

RNG = np.random.default_rng(0)
A = RNG.standard_normal((3, 4))
B = RNG.standard_normal((4,))
I32 = np.arange(12, dtype=np.int32).reshape(3, 4)


def both(dev: tl.Device, fn: Any, *arrays: np.ndarray) -> None:
    """``fn`` on NumPy arrays and on their remote copies: same values, shape, dtype (the
    client's inferred shape and dtype included)."""
    xp = dev.xp
    want = np.asarray(fn(np, *arrays))
    got = fn(xp, *(xp.asarray(a) for a in arrays))
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    assert np.array_equal(got.get(), want, equal_nan=True)


ELEMENTWISE = [
    lambda xp, a, b: a + b,
    lambda xp, a, b: a - 2,
    lambda xp, a, b: 1.5 * a / b,
    lambda xp, a, b: a**2,
    lambda xp, a, b: 2.0**a,
    lambda xp, a, b: -a,
    lambda xp, a, b: abs(a),
    lambda xp, a, b: xp.exp(a) + xp.log(xp.abs(a)) + xp.sqrt(xp.abs(b)) + xp.tanh(a),
    lambda xp, a, b: xp.maximum(a, 0) + xp.minimum(a, b),
    lambda xp, a, b: xp.sign(a) * xp.isfinite(a),
    lambda xp, a, b: (a > b) & (a < 1) | ~(a == 0),
    lambda xp, a, b: xp.where(a > 0, a, 0.5),
    lambda xp, a, b: xp.clip(a, -0.5, 0.5),
    lambda xp, a, b: a.astype(np.float32) + np.float32(1),
    lambda xp, a, b: a.astype(np.int32) * 3 // 2,
]


@pytest.mark.parametrize("fn", ELEMENTWISE)
def test_elementwise_ops_broadcast_and_promote_as_numpy(rdev: tl.Device, fn: Any) -> None:
    both(rdev, fn, A, B)


REDUCTIONS = [
    lambda xp, a: a.sum(),
    lambda xp, a: a.sum(axis=0),
    lambda xp, a: a.mean(axis=(0, 1), keepdims=True),
    lambda xp, a: a.max(axis=1),
    lambda xp, a: a.min(axis=-1, keepdims=True),
    lambda xp, a: a.argmax(axis=1),
    lambda xp, a: (a > 0).sum(axis=0),
    lambda xp, a: (a > 0).any(),
    lambda xp, a: a.astype(np.int32).sum(),
    lambda xp, a: a.astype(np.int32).mean(axis=0),
]


@pytest.mark.parametrize("fn", REDUCTIONS)
def test_reductions_give_numpys_shapes_and_dtypes(rdev: tl.Device, fn: Any) -> None:
    both(rdev, fn, A)


MOVEMENT = [
    lambda xp, a: a.reshape(2, -1),
    lambda xp, a: a.T @ a,
    lambda xp, a: a @ a[0],
    lambda xp, a: xp.matmul(a[None], a.T),
    lambda xp, a: a.transpose(1, 0).copy(),
    lambda xp, a: xp.broadcast_to(a[:, None, :], (3, 2, 4)),
    lambda xp, a: xp.expand_dims(a, 0).squeeze(0),
    lambda xp, a: a.swapaxes(0, 1),
    lambda xp, a: xp.concatenate([a, a * 2], axis=1),
    lambda xp, a: xp.stack([a, a], axis=-1),
    lambda xp, a: a[1:, ::2],
    lambda xp, a: a[..., None, 1],
    lambda xp, a: a[np.array([2, 0, 2])],
    lambda xp, a: a[xp.arange(3), np.array([0, 3, 1])],
    lambda xp, a: a[a > 0],
    lambda xp, a: a[:, np.array([[0, 1], [2, 3]])],
    lambda xp, a: xp.zeros_like(a) + xp.ones((4,)) + xp.full((3, 1), 2.0),
    lambda xp, a: xp.arange(0, 1, 0.25) + xp.arange(4),
]


@pytest.mark.parametrize("fn", MOVEMENT)
def test_movement_indexing_and_matmul_as_numpy(rdev: tl.Device, fn: Any) -> None:
    both(rdev, fn, A)


INDICES = [
    (slice(None), 1), (1, slice(None)), (Ellipsis, 0), (None, 0, None), (slice(5, 1, -1),),
    (np.array([0, 0]), slice(None), np.array([1, 2])), (np.array([[0], [1]]), np.array([0, 1])),
    (0, np.array([1, 2])), (slice(None), np.array([0, 1]), 0), (np.array([True, False, True]),),
    (Ellipsis, np.array([1])), (slice(1, None), None, np.array([0, 2, 2])),
]  # fmt: skip


@pytest.mark.parametrize("index", INDICES)
def test_index_shapes_follow_numpy_without_the_data(index: Any) -> None:
    a = np.zeros((3, 4, 5))
    shape, _ = _infer.index_shape(a.shape, index)
    assert shape == a[index].shape


def test_setitem_views_and_in_place_ops_write_through_as_numpy(rdev: tl.Device) -> None:
    xp = rdev.xp
    n, r = A.copy(), xp.asarray(A)
    for arr, mod in ((n, np), (r, xp)):
        v = arr[1]
        v *= 2  # through a view into the base
        arr[:, 0] = 7.0
        arr[mod.asarray(np.array([0, 2])), 1] -= 1
        mod.add.at(arr, (np.array([0, 0]), 2), 1.0) if mod is np else xp.add_at(
            arr, (np.array([0, 0]), 2), 1.0
        )
    assert np.array_equal(r.get(), n)
    assert r[1].base is r and r.copy().base is None
    with pytest.raises(ValueError, match="broadcast"):
        r[0] = xp.ones((3,))


def _model_step(dev: Any) -> tuple[list[np.ndarray], float]:
    tl.manual_seed(3)
    model = nn.Sequential(
        nn.Embedding(10, 6), nn.LayerNorm(6), nn.Linear(6, 8), nn.GELU(), nn.Dropout(0.2),
        nn.Linear(8, 3),
    ).to(tl.float64)  # fmt: skip
    model.to(dev)
    opt = optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    idx = tl.tensor(np.array([[1, 2], [3, 1]]), device=dev)
    target = tl.tensor(np.array([[0.5, -1.0, 2.0], [0.0, 1.0, 0.0]]), device=dev)
    loss = 0.0
    for _ in range(3):
        out = model(idx).mean(axis=1).sigmoid() * 2 + F.softmax(model(idx)[:, 0], axis=-1)
        l2 = F.mse_loss(out, target) + out.var(correction=1) + out.abs().max() * 0.1
        opt.zero_grad()
        l2.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = l2.item()
    return [p.numpy() for p in model.parameters()], loss


def test_layers_losses_autodiff_and_optimizers_match_the_cpu(rdev: tl.Device) -> None:
    want, want_loss = _model_step("cpu")
    got, got_loss = _model_step(rdev)
    assert got_loss == want_loss
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(a, b)


def test_tensors_and_modules_move_both_ways_and_mixing_devices_is_refused(
    rdev: tl.Device,
) -> None:
    t = tl.tensor(A, requires_grad=True)
    r = t.to(rdev)
    assert r.device == rdev and str(r.device).startswith("remote://")
    (r * r).sum().backward()  # the gradient comes back through the move
    assert t.grad is not None and np.array_equal(t.grad.numpy(), 2 * A)
    back = r.detach().to("cpu")
    assert back.device == tl.device("cpu") and np.array_equal(back.numpy(), A)
    assert tl.device(str(rdev)) is rdev
    m = nn.Linear(4, 2).to(str(rdev))
    assert m.weight.device == rdev
    m.to("cpu")
    assert m.weight.device == tl.device("cpu")
    with pytest.raises(RuntimeError, match="same device"):
        _ = r + t
    other = remote.devices(str(rdev)[len("remote://") :].rsplit("/", 1)[0], token="s3cret-token")[1]
    with pytest.raises(RuntimeError, match="same device"):
        _ = r + r.detach().to(other)
    assert "remote://" in repr(r) and "tensor(" in repr(r)


def test_grad_hooks_grad_buffers_and_synchronize_work_remotely(rdev: tl.Device) -> None:
    w = tl.tensor(A, device=rdev, requires_grad=True)
    fired: list[tuple[int, ...]] = []
    w.register_post_accumulate_grad_hook(lambda leaf: fired.append(tuple(leaf.shape)))
    buf = tl.zeros(3, 4, dtype=tl.float64, device=rdev)
    w.set_grad_buffer(buf)
    x = tl.tensor(np.ones((2, 4)), device=rdev)
    F.linear(x, w).sum().backward()
    assert fired == [(3, 4)] and w.grad is buf
    rdev.synchronize()
    assert np.array_equal(buf.numpy(), np.full((3, 4), 2.0))


def test_save_and_load_remote_tensors_and_optimizer_state(rdev: tl.Device, tmp_path: Path) -> None:
    p = tl.tensor(A, device=rdev, requires_grad=True)
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    (p * p).sum().backward()
    opt.step()
    tl.save({"p": p.detach(), "opt": opt.state_dict()}, tmp_path / "ck.npz")
    loaded = tl.load(tmp_path / "ck.npz")
    assert np.array_equal(loaded["p"].numpy(), p.numpy())
    assert np.array_equal(np.asarray(loaded["opt"]["state"][0]["momentum_buffer"]), 2 * A)
