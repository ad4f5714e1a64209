"""Tensors on a GPU that is not the calling thread's current one (PyTorch's semantics).

One thread holding tensors on several GPUs (Burn's single-controller style, the Learner's
``multi_device`` strategy) must get every op, gradient, optimizer step and clip on the
tensors' own GPU, whatever GPU is current, and find its current GPU unchanged afterwards.
CuPy runs kernels on the current device and refuses (or, with peer access, silently computes
on the current GPU) arrays that live on another one, so each case here checks both the
numbers (against the CPU) and where the results live.

Run on a machine with two GPUs or more, or on the fake CuPy (two fake GPUs):
``TENSORLIB_FAKE_CUPY=1 pytest tests/tensorlib/test_multi_gpu.py``. Skipped with fewer GPUs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F
from tensorlib import _device_guard, nn, optim

pytestmark = pytest.mark.gpu

OTHER = "cuda:1"  # the tensors' GPU; GPU 0 stays current


def _runtime() -> Any:
    return tl.device("cuda:0").xp.cuda.runtime


@pytest.fixture(autouse=True)
def gpu0_current() -> Iterator[None]:
    """Two GPUs or a skip; GPU 0 current during the test (the caller's device), restored."""
    if tl.cuda_device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {tl.cuda_device_count()} visible")
    rt = _runtime()
    before = rt.getDevice()
    rt.setDevice(0)
    try:
        yield
    finally:
        rt.setDevice(before)


def _current() -> int:
    return int(_runtime().getDevice())


def _on(t: tl.Tensor, device: str = OTHER) -> None:
    """``t`` is on ``device`` by its Device and by where its array really lives."""
    assert str(t.device) == device
    assert int(t.data.device.id) == tl.device(device).index


# ============================================================================ single ops
OPS: dict[str, Callable[[tl.Tensor, tl.Tensor], tl.Tensor]] = {
    "add": lambda a, b: a + b,  # the operators' shorter path
    "rsub_number": lambda a, b: 2.0 - a,
    "mul_int": lambda a, b: a * a.long(),  # promotion: through Function.apply
    "exp": lambda a, b: a.exp(),
    "where": lambda a, b: tl.where(a > b, a, b),
    "where_numbers": lambda a, b: tl.where(a > b, 1.0, 0.0),  # no tensor operand
    "sum": lambda a, b: a.sum(axis=0),
    "mean_all": lambda a, b: a.mean(),
    "max": lambda a, b: a.max(axis=1, keepdims=True),
    "var": lambda a, b: a.var(axis=1),
    "matmul": lambda a, b: a @ b.T,
    "softmax": lambda a, b: a.softmax(),
    "getitem_basic": lambda a, b: a[1:, ::2],
    "getitem_tensor_index": lambda a, b: a[tl.tensor(np.array([2, 0]), device=a.device)],
    "getitem_host_index": lambda a, b: a[np.array([1, 1])],
    "concatenate": lambda a, b: tl.concatenate([a, b], axis=0),
    "compare": lambda a, b: a >= b,
    "argmax": lambda a, b: a.argmax(axis=1),
    "argmin": lambda a, b: a.argmin(),
    "any": lambda a, b: (a > 0.5).any(),
    "all_invert": lambda a, b: (~(a > b)).all(),
    "embedding": lambda a, b: F.embedding(tl.tensor(np.array([3, 0]), device=a.device), a.T),
    "cast": lambda a, b: a.to(dtype=tl.float64),
}


@pytest.mark.parametrize("name", list(OPS))
def test_an_op_runs_on_its_inputs_gpu(name: str) -> None:
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((3, 4)).astype(np.float32)
    b_np = rng.standard_normal((3, 4)).astype(np.float32)
    want = OPS[name](tl.tensor(a_np), tl.tensor(b_np)).numpy()
    got = OPS[name](tl.tensor(a_np, device=OTHER), tl.tensor(b_np, device=OTHER))
    _on(got)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    assert _current() == 0


def test_in_place_writes_land_on_the_tensors_gpu() -> None:
    t = tl.zeros((2, 3), device=OTHER)
    t[0] = 1.0
    t[1, tl.tensor(np.array([0, 2]), device=OTHER)] = 5.0
    t[:, 1] = np.array([7.0, 8.0], dtype=np.float32)
    assert t.tolist() == [[1.0, 7.0, 1.0], [5.0, 8.0, 5.0]]
    u = tl.ones((2, 3), device=OTHER)
    u.copy_(t * 2.0)
    assert u.tolist() == [[2.0, 14.0, 2.0], [10.0, 16.0, 10.0]]
    u.fill_(3.0)
    u[...] = tl.full((2, 3), 4.0, device="cuda:0")  # from another GPU: moved first
    assert u.tolist() == [[4.0] * 3] * 2
    _on(t)
    _on(u)
    assert _current() == 0


def test_creation_with_device_lands_there() -> None:
    made = [
        tl.zeros(2, 3, device=OTHER),
        tl.ones(2, device=OTHER),
        tl.full((2, 3), 1.0, device=OTHER),
        tl.arange(5, device=OTHER),
        tl.tensor([[1.0, 2.0]], device=OTHER),
        tl.rand(3, device=OTHER),
        tl.randn(3, device=OTHER),
        tl.zeros_like(tl.ones(2, device=OTHER)),
        tl.full_like(tl.ones(2, device=OTHER), 3.0),
        nn.Linear(3, 2, device=OTHER).weight,
    ]
    for t in made:
        _on(t)
    assert _current() == 0


def test_burn_single_controller_loop() -> None:
    """Burn's page: one thread, a tensor per device, an op on each."""
    out = []
    for d in tl.Device.enumerate("cuda"):
        x = tl.full((2, 3), 1.0, device=d)
        y = x * 2.0
        _on(y, str(d))
        out.append(y)
    assert [y.tolist() for y in out] == [[[2.0] * 3] * 2] * len(out)
    assert _current() == 0


def test_moves_between_gpus_and_gradients_back() -> None:
    a = tl.tensor(np.arange(6.0).reshape(2, 3), device=OTHER, requires_grad=True)
    b = a[:, ::2].to("cuda:0")  # a strided view from the other GPU
    _on(b, "cuda:0")
    np.testing.assert_array_equal(b.numpy(), [[0.0, 2.0], [3.0, 5.0]])
    # A graph over both GPUs, and the CPU, with no `with device` anywhere.
    loss = ((b * b).sum().to(OTHER) + (a * 3.0).sum()).to("cpu")
    loss.backward()
    assert a.grad is not None
    _on(a.grad)
    np.testing.assert_array_equal(a.grad.numpy(), [[3.0, 3.0, 7.0], [9.0, 3.0, 13.0]])
    assert _current() == 0


def test_module_state_and_initializers_write_on_the_modules_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Linear(4, 3, device=OTHER)
    nn.init.xavier_uniform_(model.weight)
    nn.init.zeros_(model.bias)
    nn.init.ones_(model.bias)
    model.load_state_dict({k: v.cpu() * 2.0 for k, v in model.state_dict().items()})
    assert model.bias.tolist() == [2.0, 2.0, 2.0]
    _on(model.weight)
    _on(model.bias)
    # The index check (TENSORLIB_CHECK_INDICES=1) counts bad targets on the logits' GPU.
    monkeypatch.setenv("TENSORLIB_CHECK_INDICES", "1")
    F.cross_entropy(model(tl.ones((2, 4), device=OTHER)), tl.tensor([0, 2], device=OTHER))
    F.check_indices()
    assert _current() == 0


# ============================================================================ a training step
def _model(device: str) -> nn.Module:
    tl.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)


def _train(device: str, make_opt: Callable[[list[tl.Tensor]], Any], amp: bool) -> list[Any]:
    """Two steps (forward, backward, clip, step) on ``device``: the parameters and gradients
    after them, and the total norms the clips saw."""
    model = _model(device)
    opt = make_opt(list(model.parameters()))
    scaler = tl.amp.GradScaler(init_scale=2.0**8, enabled=amp)
    rng = np.random.default_rng(1)
    out: list[Any] = []
    for _ in range(2):
        x = tl.tensor(rng.standard_normal((6, 5)).astype(np.float32), device=device)
        y = tl.tensor(rng.integers(0, 3, 6), device=device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        scaler.step(opt)
        scaler.update()
        out.append(norm.numpy())
        if device != "cpu":
            _on(loss, device)
            _on(norm, device)
    for p in model.parameters():
        assert p.grad is not None
        if device != "cpu":
            _on(p, device)
            _on(p.grad, device)
        out += [p.numpy(), p.grad.numpy()]
    return out


OPTIMIZERS: dict[str, Callable[[list[tl.Tensor]], Any]] = {
    "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adamw": lambda ps: optim.AdamW(ps, lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("per_node", [False, True], ids=["one_switch", "per_node"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "grad_scaler"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_steps_on_another_gpu_match_the_cpu(
    name: str, amp: bool, per_node: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both ways backward keeps devices: once per graph (no node ever moved data between
    # devices) or per node (one did, somewhere: then any graph may span devices).
    monkeypatch.setattr(_device_guard, "cross_device_recorded", per_node)
    want = _train("cpu", OPTIMIZERS[name], amp)
    got = _train(OTHER, OPTIMIZERS[name], amp)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"result {i}")
    assert _current() == 0


def test_optimizer_state_round_trip_stays_on_the_parameters_gpu() -> None:
    model = _model(OTHER)
    opt = optim.Adam(model.parameters(), lr=1e-2)
    F.mse_loss(model(tl.ones((2, 5), device=OTHER)), tl.zeros((2, 3), device=OTHER)).backward()
    opt.step()
    again = optim.Adam(model.parameters(), lr=1e-2)
    again.load_state_dict(opt.state_dict())
    for state in again.state.values():
        assert state["exp_avg"].device.id == 1 and state["exp_avg_sq"].device.id == 1
    model.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.numpy().any() for p in model.parameters())
    assert _current() == 0


# ============================================================================ threads
def test_each_thread_keeps_its_own_current_gpu() -> None:
    """Two threads, each current on one GPU, computing on the other GPU's tensors."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(current: int, tensors_on: str) -> None:
        try:
            _runtime().setDevice(current)
            barrier.wait(timeout=10)
            for _ in range(20):
                w = tl.ones((3, 3), device=tensors_on, requires_grad=True)
                (w @ w).sum().backward()
                assert w.grad is not None
                _on(w.grad, tensors_on)
                assert _current() == current
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(0, "cuda:1")),
        threading.Thread(target=work, args=(1, "cuda:0")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert _current() == 0
