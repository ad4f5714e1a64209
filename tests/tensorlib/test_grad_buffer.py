"""Tensor.set_grad_buffer: backward writes a leaf's gradient straight into a given buffer
(and Tensor.use_grad_buffer makes it ``.grad`` when the caller filled it).

DDP relies on it to have linear layers' gradients computed into its communication buckets;
the gradients must be exactly those computed without a buffer, in every situation where the
engine has to fall back (a second use, accumulation, other ops, a failed backward).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F
from tensorlib import nn
from tests.helpers import DEVICES


def _host(t: Any) -> np.ndarray[Any, Any]:
    return np.asarray(t.to("cpu").data)


def _layer(device: str, dtype: str = "float32") -> Any:
    return nn.Linear(5, 4, dtype=dtype, generator=tl.Generator(3)).to(device)


def _x(device: str, dtype: str = "float32", seed: int = 0) -> tl.Tensor:
    rng = np.random.default_rng(seed)
    return tl.tensor(rng.standard_normal((6, 5)), dtype=dtype, device=device)


def _buffers(layer: Any) -> list[tl.Tensor]:
    """Views into one flat array, like a DDP bucket."""
    params = [layer.weight, layer.bias]
    flat = layer.weight.device.xp.full(sum(p.size for p in params), 7.0, dtype=layer.weight.dtype)
    out, off = [], 0
    for p in params:
        view = tl.from_array(flat[off : off + p.size].reshape(p.shape))
        p.set_grad_buffer(view)
        out.append(view)
        off += p.size
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_linear_writes_into_the_buffer_which_becomes_grad(device: str, dtype: str) -> None:
    ref, lay = _layer(device, dtype), _layer(device, dtype)
    bufs = _buffers(lay)
    for m in (ref, lay):
        (F.linear(_x(device, dtype), m.weight, m.bias) ** 2).sum().backward()
    assert lay.weight.grad is bufs[0] and lay.bias.grad is bufs[1]
    np.testing.assert_array_equal(_host(lay.weight.grad), _host(ref.weight.grad))
    np.testing.assert_array_equal(_host(lay.bias.grad), _host(ref.bias.grad))


@pytest.mark.parametrize("device", DEVICES)
def test_weight_used_twice_gets_both_gradients(device: str) -> None:
    """A tied weight: one use writes into the buffer, the engine adds the other one."""
    ref, lay = (
        nn.Linear(5, 5, generator=tl.Generator(1)),
        nn.Linear(5, 5, generator=tl.Generator(1)),
    )
    ref, lay = ref.to(device), lay.to(device)  # type: ignore[assignment]
    bufs = _buffers(lay)
    for m in (ref, lay):
        h = F.linear(_x(device), m.weight, m.bias).tanh()
        F.linear(h, m.weight, m.bias).sum().backward()
    assert lay.weight.grad is bufs[0]
    np.testing.assert_allclose(_host(lay.weight.grad), _host(ref.weight.grad), rtol=1e-6)
    np.testing.assert_allclose(_host(lay.bias.grad), _host(ref.bias.grad), rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_second_backward_accumulates_into_the_buffer(device: str) -> None:
    ref, lay = _layer(device), _layer(device)
    bufs = _buffers(lay)
    for m in (ref, lay):
        for seed in (0, 1):
            F.linear(_x(device, seed=seed), m.weight, m.bias).sum().backward()
    assert lay.weight.grad is bufs[0]
    np.testing.assert_allclose(_host(lay.weight.grad), _host(ref.weight.grad), rtol=1e-6)
    np.testing.assert_allclose(_host(lay.bias.grad), _host(ref.bias.grad), rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_other_ops_fall_back_to_a_fresh_gradient(device: str) -> None:
    """An op without buffer support: the gradient is right and the buffer is untouched."""
    lay = _layer(device)
    bufs = _buffers(lay)
    (lay.weight * 3.0).sum().backward()
    assert lay.weight.grad is not bufs[0]
    np.testing.assert_array_equal(_host(lay.weight.grad), np.full((4, 5), 3.0, np.float32))
    np.testing.assert_array_equal(_host(bufs[0]), np.full((4, 5), 7.0, np.float32))


def test_a_failed_backward_does_not_keep_the_buffer_taken() -> None:
    class Boom(tl.Function):
        def forward(self, a: Any) -> Any:
            return a * 1.0

        def backward(self, g: Any) -> Any:
            raise RuntimeError("boom")

    lay = _layer("cpu")
    bufs = _buffers(lay)
    x = _x("cpu").requires_grad_()
    # Linear's backward runs (taking the buffers) before Boom's, which raises.
    out = F.linear(Boom.apply(x), lay.weight, lay.bias)
    with pytest.raises(RuntimeError, match="boom"):
        out.sum().backward()
    lay.weight.zero_grad_()
    lay.bias.zero_grad_()
    F.linear(_x("cpu"), lay.weight, lay.bias).sum().backward()
    assert lay.weight.grad is bufs[0] and lay.bias.grad is bufs[1]


def test_set_grad_buffer_checks_its_argument() -> None:
    lay = _layer("cpu")
    w = lay.weight
    with pytest.raises(ValueError, match="shape"):
        w.set_grad_buffer(tl.zeros(5, 4))
    with pytest.raises(ValueError, match="dtype"):
        w.set_grad_buffer(tl.zeros(4, 5, dtype="float64"))
    with pytest.raises(ValueError, match="C-contiguous"):
        w.set_grad_buffer(tl.zeros(5, 4).transpose())
    with pytest.raises(TypeError, match="Tensor"):
        w.set_grad_buffer(np.zeros((4, 5), np.float32))
    with pytest.raises(RuntimeError, match="leaf"):
        (w * 2).set_grad_buffer(tl.zeros(4, 5))
    with pytest.raises(RuntimeError, match="leaf"):
        tl.zeros(4, 5).set_grad_buffer(tl.zeros(4, 5))
    buf = tl.zeros(4, 5)
    w.set_grad_buffer(buf)
    w.set_grad_buffer(None)  # removed: backward makes a fresh gradient again
    F.linear(_x("cpu"), w, lay.bias).sum().backward()
    assert w.grad is not buf


@pytest.mark.parametrize("device", DEVICES)
def test_use_grad_buffer_makes_the_buffer_grad_as_it_is(device: str) -> None:
    """DDP's way to put a bucket view in as ``.grad``: no check again, no copy."""
    lay = _layer(device)
    w = lay.weight
    with pytest.raises(RuntimeError, match="no grad buffer"):
        w.use_grad_buffer()
    bufs = _buffers(lay)
    (w * 3.0).sum().backward()  # an op without buffer support: a fresh gradient
    fresh = w.grad
    assert fresh is not None and fresh is not bufs[0]
    bufs[0].data[...] = fresh.data
    assert w.use_grad_buffer() is bufs[0] and w.grad is bufs[0]
    np.testing.assert_array_equal(_host(w.grad), np.full((4, 5), 3.0, np.float32))
    (w * 2.0).sum().backward()  # it is .grad now: the next gradient is added into it
    assert w.grad is bufs[0]
    np.testing.assert_array_equal(_host(bufs[0]), np.full((4, 5), 5.0, np.float32))
    w.set_grad_buffer(None)
    with pytest.raises(RuntimeError, match="no grad buffer"):
        w.use_grad_buffer()
