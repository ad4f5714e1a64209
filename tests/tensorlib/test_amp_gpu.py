"""Autocast and GradScaler on a CUDA device (CuPy): the twins of test_amp.py's CPU cases.

Run on a GPU, or on the fake CuPy: ``TENSORLIB_FAKE_CUPY=1 pytest tests/tensorlib/test_amp_gpu.py``.
Each case runs the same thing on the CPU and compares.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F

pytestmark = pytest.mark.gpu

F16, F32 = tl.float16, tl.float32
CUDA = "cuda:0"


def _leaves(device: str, dtype: Any = F32) -> list[tl.Tensor]:
    rng = np.random.default_rng(0)
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    return [
        tl.tensor((rng.standard_normal(s) * 0.5).astype(dtype), device=device, requires_grad=True)
        for s in shapes
    ]


def _forward(p: list[tl.Tensor], x: tl.Tensor) -> tl.Tensor:
    return F.linear(F.linear(x, p[0], p[1]).relu(), p[2], p[3])


def test_autocast_on_cuda_matches_cpu() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, 8)).astype(np.float32)
    target = rng.integers(0, 4, 10)
    results = {}
    for device in ("cpu", CUDA):
        params = _leaves(device)
        with tl.autocast(dtype=tl.float16):
            logits = _forward(params, tl.tensor(x, device=device))
            loss = F.cross_entropy(logits, target)
            sm = logits.softmax()
        assert logits.dtype == F16 and loss.dtype == F32 and sm.dtype == F32
        assert logits.device == device and loss.device == device
        loss.backward()
        for p in params:
            assert p.grad is not None and p.grad.dtype == F32 and p.grad.device == device
        results[device] = [logits.numpy(), loss.numpy()]
        results[device] += [p.grad.numpy() for p in params if p.grad is not None]
    for i, (c, g) in enumerate(zip(results["cpu"], results[CUDA], strict=True)):
        np.testing.assert_allclose(g, c, rtol=1e-2, atol=1e-2, err_msg=f"result {i}")


def test_autocast_device_type_selects_cuda_tensors() -> None:
    a = tl.ones((3, 4), device=CUDA)
    c = tl.ones((3, 4))
    with tl.autocast(device_type="cpu"):
        assert (a @ a.T).dtype == F32 and (c @ c.T).dtype == F16
    with tl.autocast(device_type="cuda"):
        assert (a @ a.T).dtype == F16 and (c @ c.T).dtype == F32


def _run(device: str, dtype: Any, bad: dict[int, float], steps: int = 12) -> dict[str, Any]:
    params = _leaves(device, dtype)
    opt = tl.optim.SGD(params, lr=0.05, momentum=0.9)
    scaler = tl.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    rng = np.random.default_rng(2)
    ran: list[int] = []
    scales: list[float] = []
    inner = opt.step

    def counted() -> None:
        ran.append(step)
        inner()

    opt.step = counted  # type: ignore[method-assign]
    for step in range(steps):
        x = tl.tensor(rng.standard_normal((10, 8)).astype(dtype), device=device)
        opt.zero_grad()
        scaler.scale((_forward(params, x) ** 2).mean()).backward()
        if step in bad:
            assert params[2].grad is not None
            params[2].grad[0, 1] = bad[step]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"ran": ran, "scales": scales, "params": [p.numpy() for p in params]}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_grad_scaler_on_cuda_skips_the_same_steps_as_on_cpu(dtype: Any) -> None:
    bad = {3: np.inf, 4: np.nan, 9: -np.inf}
    cpu, gpu = _run("cpu", dtype, bad), _run(CUDA, dtype, bad)
    assert gpu["ran"] == cpu["ran"] == [s for s in range(12) if s not in bad]
    assert gpu["scales"] == cpu["scales"]
    assert cpu["scales"][2:4] == [2.0**11, 2.0**10]  # grew after 3 good steps, backed off
    tol = 1e-10 if dtype == np.float64 else 1e-5
    for g, c in zip(gpu["params"], cpu["params"], strict=True):
        np.testing.assert_allclose(g, c, rtol=tol * 10, atol=tol)


def test_unscale_on_cuda_stays_on_the_device_and_in_place() -> None:
    import cupy as cp

    params = _leaves(CUDA)
    bucket = tl.zeros(16 * 8, device=CUDA)
    params[0].set_grad_buffer(bucket.reshape(16, 8))
    opt = tl.optim.SGD(params, lr=0.1)
    scaler = tl.amp.GradScaler()
    x = tl.ones((2, 8), device=CUDA)
    scaler.scale(_forward(params, x).sum()).backward()
    assert params[0].grad is not None
    scaled = params[0].grad.numpy().copy()
    scaler.unscale_(opt)
    state = scaler._per_optimizer_states[id(opt)]
    flags = state["found_inf_per_device"]
    assert list(flags) == [tl.device(CUDA)] and isinstance(flags[tl.device(CUDA)], cp.ndarray)
    assert state["found_inf"] is None  # no host sync before step()
    np.testing.assert_array_equal(bucket.numpy().reshape(16, 8), scaled / 2.0**16)
    assert scaler.step(opt) is None and state["found_inf"] is False
