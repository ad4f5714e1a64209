"""Autocast's state and dispatch, float16 matmul on NumPy, and GradScaler's contract.

The comparisons with PyTorch are in ``parity/test_amp.py``; these tests need no torch.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F
from tensorlib import _autocast, nn

F16, F32, F64 = tl.float16, tl.float32, tl.float64


def _leaf(shape: tuple[int, ...], dtype: Any = F32, seed: int = 0) -> tl.Tensor:
    rng = np.random.default_rng(seed)
    return tl.tensor(rng.standard_normal(shape).astype(dtype), requires_grad=True)


# ============================================================================ autocast state
def test_autocast_is_a_context_manager_that_restores_state() -> None:
    a, b = _leaf((3, 4)), _leaf((4, 2))
    assert not _autocast.is_enabled() and _autocast.active == 0
    with tl.autocast(dtype=tl.float16):
        assert _autocast.is_enabled("cpu") and _autocast.is_enabled("cuda")
        assert (a @ b).dtype == F16
        with tl.autocast(enabled=False):  # nested off: fp32 again
            assert (a @ b).dtype == F32
        assert (a @ b).dtype == F16
    assert (a @ b).dtype == F32
    assert not _autocast.is_enabled() and _autocast.active == 0


def test_autocast_restores_state_when_the_block_raises() -> None:
    with pytest.raises(KeyError), tl.autocast():
        raise KeyError("boom")
    assert not _autocast.is_enabled() and _autocast.active == 0


def test_autocast_as_a_decorator_and_reused_instance() -> None:
    a, b = _leaf((3, 4)), _leaf((4, 2))

    @tl.autocast()
    def forward(x: tl.Tensor, y: tl.Tensor) -> tl.Tensor:
        """Docstring kept."""
        return x @ y

    assert forward(a, b).dtype == F16 and forward.__doc__ == "Docstring kept."
    assert (a @ b).dtype == F32
    ctx = tl.amp.autocast()  # the same class, from tl.amp too
    with ctx, ctx:  # one instance entered twice restores both levels
        assert (a @ b).dtype == F16
    assert not _autocast.is_enabled()


def test_autocast_is_per_thread() -> None:
    a, b = _leaf((3, 4)), _leaf((4, 2))
    seen: list[Any] = []
    started, release = threading.Event(), threading.Event()

    def other() -> None:
        started.set()
        release.wait(10)
        seen.append((a @ b).dtype)

    t = threading.Thread(target=other)
    t.start()
    started.wait(10)
    with tl.autocast():
        release.set()
        t.join(10)
        assert (a @ b).dtype == F16
    assert seen == [F32]


def test_device_type_limits_what_is_cast() -> None:
    a, b = _leaf((3, 4)), _leaf((4, 2))
    with tl.autocast(device_type="cuda"):
        assert (a @ b).dtype == F32  # CPU tensors: autocast is on for CUDA only
    with tl.autocast(device_type="cpu"):
        assert (a @ b).dtype == F16
        with tl.autocast(device_type="cuda", enabled=False):
            assert (a @ b).dtype == F16  # turning CUDA off leaves the CPU on


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": tl.float32}, ValueError, "must be tensorlib.float16"),
        ({"dtype": "bfloat16"}, ValueError, "no bfloat16"),
        ({"dtype": tl.int64}, ValueError, "float16"),
        ({"device_type": "cuda:0"}, ValueError, "device_type must be"),
        ({"device_type": "tpu"}, ValueError, "device_type must be"),
        ({"enabled": 1}, TypeError, "enabled must be a bool"),
    ],
)
def test_autocast_rejects_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        tl.autocast(**kwargs)


def test_autocast_accepts_float16_spellings() -> None:
    for dt in (tl.float16, "float16", "half", np.float16):
        assert tl.autocast(dtype=dt).fast_dtype == F16


# ============================================================================ casting rules
def test_policies_on_each_op_family() -> None:
    x16 = _leaf((4, 5), F16)
    x32 = _leaf((4, 5), F32)
    w = _leaf((3, 5), F32)
    with tl.autocast():
        assert F.linear(x32, w).dtype == F16
        assert nn.Linear(5, 3)(x32).dtype == F16
        assert tl.matmul(x32, w.T).dtype == F16
        for out in (
            x16.exp(),
            tl.log(x16.abs()),
            x16**2,
            x16.sum(),
            x16.sum(axis=1),
            x16.softmax(),
            F.log_softmax(x16),
            F.layer_norm(x16, (5,)),
            F.cross_entropy(x16, np.array([0, 1, 2, 3])),
        ):
            assert out.dtype == F32
        assert (x16 + x32).dtype == F32  # promotion, as outside autocast
        assert x16.relu().dtype == F16 and x16.mean().dtype == F16 and x16.tanh().dtype == F16
        assert x32.exp().dtype == F32 and x32.sum().dtype == F32


def test_float64_integer_and_bool_tensors_are_never_cast() -> None:
    x64 = _leaf((3, 3), F64)
    ints = tl.tensor(np.arange(6).reshape(2, 3))
    mask = tl.tensor(np.array([True, False]))
    with tl.autocast():
        assert (x64 @ x64).dtype == F64 and x64.exp().dtype == F64
        assert ints.sum().dtype == tl.int64 and (ints @ ints.T).dtype == tl.int64
        assert mask.sum().dtype == np.sum(np.array([True])).dtype


def test_gradients_reach_float32_leaves_in_float32() -> None:
    """Casts are differentiable Cast nodes: float32 parameters get float32 gradients; backward
    runs each op in its forward's dtype, not under autocast."""
    x = _leaf((6, 5), F32, seed=1)
    lin = nn.Linear(5, 4)
    with tl.autocast():
        h = lin(x)
        loss = F.cross_entropy(h, np.array([0, 1, 2, 3, 0, 1]))
    assert h.dtype == F16 and loss.dtype == F32
    loss.backward()
    for p in (x, lin.weight, lin.bias):
        assert p.grad is not None and p.grad.dtype == F32
    ref_x, ref_w, ref_b = (t.detach().requires_grad_() for t in (x, lin.weight, lin.bias))
    F.cross_entropy(F.linear(ref_x, ref_w, ref_b), np.array([0, 1, 2, 3, 0, 1])).backward()
    for ours, ref in ((x, ref_x), (lin.weight, ref_w), (lin.bias, ref_b)):
        assert ours.grad is not None and ref.grad is not None
        np.testing.assert_allclose(ours.grad.numpy(), ref.grad.numpy(), rtol=2e-2, atol=2e-3)


def test_autocast_inside_no_grad_records_nothing() -> None:
    a, b = _leaf((3, 4)), _leaf((4, 2))
    with tl.no_grad(), tl.autocast():
        out = a @ b
    assert out.dtype == F16 and not out.requires_grad and out.grad_fn is None


def test_backward_outside_autocast_matches_inside() -> None:
    """Calling backward inside the autocast block changes nothing (backward is never cast)."""
    grads = []
    for inside in (False, True):
        a, b = _leaf((3, 4), seed=2), _leaf((4, 2), seed=3)
        with tl.autocast():
            loss = (a @ b).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        assert a.grad is not None
        grads.append(a.grad.numpy())
    np.testing.assert_array_equal(grads[0], grads[1])


# ======================================================================== float16 matmul on NumPy
def _round16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float16)


@pytest.mark.parametrize(
    ("sa", "sb"),
    [((5, 7), (7, 3)), ((7,), (7, 3)), ((5, 7), (7,)), ((7,), (7,)), ((2, 5, 7), (7, 3))],
)
def test_float16_matmul_accumulates_in_float32(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    """float16 @ float16 equals the float32 product rounded once (as cuBLAS computes it)."""
    rng = np.random.default_rng(4)
    a16 = rng.standard_normal(sa).astype(np.float16)
    b16 = rng.standard_normal(sb).astype(np.float16)
    a, b = tl.tensor(a16, requires_grad=True), tl.tensor(b16, requires_grad=True)
    out = a @ b
    assert out.dtype == F16
    np.testing.assert_array_equal(out.numpy(), _round16(a16.astype(np.float32) @ b16))
    g = rng.standard_normal(out.shape).astype(np.float16)
    out.backward(tl.tensor(g))
    ref_a, ref_b = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    (ref_a @ ref_b).backward(tl.tensor(g.astype(np.float32)))
    assert a.grad is not None and b.grad is not None and ref_a.grad is not None
    assert a.grad.dtype == F16 and b.grad is not None and ref_b.grad is not None
    np.testing.assert_array_equal(a.grad.numpy(), _round16(ref_a.grad.numpy()))
    np.testing.assert_array_equal(b.grad.numpy(), _round16(ref_b.grad.numpy()))


def test_float16_linear_rounds_once_including_the_bias() -> None:
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(s).astype(np.float16) for s in ((4, 6), (3, 6), (3,)))
    out = F.linear(tl.tensor(x), tl.tensor(w), tl.tensor(b))
    ref = x.astype(np.float32) @ w.T.astype(np.float32) + b.astype(np.float32)
    np.testing.assert_array_equal(out.numpy(), ref.astype(np.float16))


def test_float16_linear_writes_weight_grads_into_grad_buffers() -> None:
    rng = np.random.default_rng(6)
    x = tl.tensor(rng.standard_normal((4, 6)).astype(np.float16))
    w = tl.tensor(rng.standard_normal((3, 6)).astype(np.float16), requires_grad=True)
    b = tl.tensor(rng.standard_normal(3).astype(np.float16), requires_grad=True)
    wbuf, bbuf = tl.zeros((3, 6), dtype=F16), tl.zeros(3, dtype=F16)
    w.set_grad_buffer(wbuf)
    b.set_grad_buffer(bbuf)
    g = rng.standard_normal((4, 3)).astype(np.float16)
    F.linear(x, w, b).backward(tl.tensor(g))
    assert w.grad is wbuf and b.grad is bbuf
    g32 = g.astype(np.float32)
    np.testing.assert_array_equal(wbuf.numpy(), _round16(g32.T @ x.numpy().astype(np.float32)))
    np.testing.assert_array_equal(bbuf.numpy(), _round16(g32.sum(axis=0)))


def test_float16_overflow_gives_inf_without_a_warning() -> None:
    big = tl.tensor(np.full((2, 2), 300.0, np.float16))
    with np.errstate(over="raise"):
        out = big @ big
    assert np.isinf(out.numpy()).all()


# ============================================================================ GradScaler
def _model_and_opt(dtype: Any = F32) -> tuple[list[tl.Tensor], tl.optim.SGD]:
    params = [_leaf((3, 4), dtype, seed=7), _leaf((3,), dtype, seed=8)]
    return params, tl.optim.SGD(params, lr=0.1)


def _backward(scaler: tl.amp.GradScaler, params: list[tl.Tensor]) -> None:
    x = tl.tensor(np.ones((2, 4), np.float32)).astype(params[0].dtype)
    scaler.scale(F.linear(x, params[0], params[1]).sum()).backward()


def test_scale_handles_nested_structures() -> None:
    s = tl.amp.GradScaler(init_scale=4.0)
    a, b = tl.tensor([1.0]), tl.tensor([2.0])
    out = s.scale([a, (b, [a])])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert out[0].tolist() == [4.0] and out[1][0].tolist() == [8.0]
    lazy = s.scale(iter([a, b]))
    assert [t.tolist() for t in lazy] == [[4.0], [8.0]]
    with pytest.raises(ValueError, match="Tensor or an iterable"):
        s.scale(3.0)


def test_step_skips_on_inf_and_nan_and_backs_off() -> None:
    params, opt = _model_and_opt()
    s = tl.amp.GradScaler(init_scale=8.0, growth_interval=2)
    for bad in (np.inf, np.nan):
        before = [p.numpy().copy() for p in params]
        opt.zero_grad()
        _backward(s, params)
        assert params[1].grad is not None
        params[1].grad.data[0] = bad
        scale = s.get_scale()
        assert s.step(opt) is None
        s.update()
        assert s.get_scale() == scale * 0.5 and s._get_growth_tracker() == 0
        for p, old in zip(params, before, strict=True):
            np.testing.assert_array_equal(p.numpy(), old)  # skipped: untouched


def test_unscale_divides_in_place_and_growth_happens() -> None:
    params, opt = _model_and_opt()
    s = tl.amp.GradScaler(init_scale=8.0, growth_interval=2)
    for i in range(4):
        opt.zero_grad()
        _backward(s, params)
        grad = params[0].grad
        assert grad is not None
        data = grad.data
        scaled = data.copy()
        s.unscale_(opt)
        assert params[0].grad is grad and grad.data is data  # in place: views stay views
        np.testing.assert_array_equal(data, scaled / s.get_scale())
        s.step(opt)
        s.update()
        assert s._get_growth_tracker() == (i + 1) % 2
    assert s.get_scale() == 32.0


def test_unscale_keeps_ddp_style_bucket_views() -> None:
    params, opt = _model_and_opt()
    bucket = tl.zeros(15)
    params[0].set_grad_buffer(bucket[:12].reshape(3, 4))
    params[1].set_grad_buffer(bucket[12:])
    s = tl.amp.GradScaler(init_scale=4.0)
    _backward(s, params)
    s.unscale_(opt)
    assert params[1].grad is not None
    np.testing.assert_array_equal(bucket.numpy()[12:], params[1].grad.numpy())
    np.testing.assert_array_equal(bucket.numpy()[12:], [2.0, 2.0, 2.0])


def test_growth_never_overflows_the_float32_scale() -> None:
    params, opt = _model_and_opt()
    s = tl.amp.GradScaler(init_scale=2.0**120, growth_factor=2.0**10, growth_interval=1)
    _backward(s, params)
    s.step(opt)
    s.update()  # 2**130 is no float32: the scale stays, the tracker restarts
    assert s.get_scale() == 2.0**120 and s._get_growth_tracker() == 0


def test_update_with_new_scale() -> None:
    params, opt = _model_and_opt()
    s = tl.amp.GradScaler()
    _backward(s, params)
    s.step(opt)
    s.update(1.0 / 3.0)
    assert s.get_scale() == float(np.float32(1.0 / 3.0))
    s.update(tl.tensor([64.0]))
    assert s.get_scale() == 64.0
    with pytest.raises(TypeError, match="one-element tensor"):
        s.update(tl.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="number"):
        s.update("2")  # type: ignore[arg-type]


def test_scaler_errors() -> None:
    params, opt = _model_and_opt()
    s = tl.amp.GradScaler()
    for call in (lambda: s.unscale_(opt), lambda: s.step(opt), lambda: s.update()):
        with pytest.raises(RuntimeError, match="scale\\(loss or outputs\\)"):
            call()
    s.scale(tl.tensor(1.0))
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer"):
        s.step(opt)  # no parameter has a gradient
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        _fresh_update()
    _backward(s, params)
    with pytest.raises(RuntimeError, match="Closure"):
        s.step(opt, closure=lambda: None)
    with pytest.raises(ValueError, match="growth factor"):
        tl.amp.GradScaler(growth_factor=0.5)
    with pytest.raises(ValueError, match="device must be"):
        tl.amp.GradScaler("tpu")
    p16, opt16 = _model_and_opt(F16)
    s16 = tl.amp.GradScaler(init_scale=2.0)  # 2**16 is no float16 (a float16 loss: inf)
    _backward(s16, p16)
    with pytest.raises(ValueError, match="FP16 gradients"):
        s16.unscale_(opt16)


def _fresh_update() -> None:
    s = tl.amp.GradScaler()
    s.scale(tl.tensor(1.0))
    s.update()


def test_disabled_scaler_passes_through() -> None:
    params, opt = _model_and_opt()
    s = tl.amp.GradScaler(enabled=False, growth_factor=0.5)  # factors unchecked when disabled
    loss = tl.tensor(3.0)
    assert s.scale(loss) is loss and not s.is_enabled() and s.get_scale() == 1.0
    _backward(s, params)
    before = params[0].numpy().copy()
    s.unscale_(opt)
    assert s.step(opt) is None
    assert not np.array_equal(params[0].numpy(), before)
    s.update()
    assert s.state_dict() == {}
    s.load_state_dict({})  # a no-op


def test_state_dict_round_trip_and_accessors() -> None:
    s = tl.amp.GradScaler(init_scale=128.0, growth_factor=3.0, backoff_factor=0.25)
    assert s.state_dict() == {
        "scale": 128.0,
        "growth_factor": 3.0,
        "backoff_factor": 0.25,
        "growth_interval": 2000,
        "_growth_tracker": 0,
    }
    s.set_growth_factor(4.0)
    s.set_backoff_factor(0.125)
    s.set_growth_interval(7)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        4.0,
        0.125,
        7,
    )
    t = tl.amp.GradScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    assert t.scale(tl.tensor(1.0)).item() == 128.0  # the loaded scale is the first one used
    with pytest.raises(RuntimeError, match="state dict is empty"):
        t.load_state_dict({})
    saved = tl.amp.GradScaler(init_scale=2.0).state_dict()
    t.load_state_dict(saved)
    assert t.get_scale() == 2.0  # replaces a scale already in use
