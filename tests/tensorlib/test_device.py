"""Devices: parsing and interning, and the error a user gets when CUDA cannot be used."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import CudaUnavailableError, Device, _device

CPU = Device("cpu")


# ============================================================================ the CPU device
def test_cpu_device_is_interned() -> None:
    assert Device("cpu") is CPU
    assert Device(" CPU ") is CPU
    assert Device(CPU) is CPU
    assert tl.device() is CPU and tl.device(None) is CPU and tl.device("cpu") is CPU
    assert pickle.loads(pickle.dumps(CPU)) is CPU
    assert tl.zeros(1).device is CPU


def test_cpu_device_attributes() -> None:
    assert CPU.type == "cpu" and CPU.index is None and not CPU.is_cuda
    assert CPU.xp is np
    assert str(CPU) == "cpu" and repr(CPU) == "device('cpu')"
    assert CPU == "cpu" and CPU != "gpu" and CPU != "cuda:x"
    assert hash(CPU) == hash(Device("cpu"))
    CPU.synchronize()  # a no-op that must not need CuPy
    with CPU as d:
        assert d is CPU
    assert tl.device_of(np.zeros(2)) is CPU and tl.device_of(np.float32(1.0)) is CPU
    with pytest.raises(TypeError, match="list"):
        tl.device_of([1.0])


# ids must not be the bare word "gpu": conftest would take it for the `gpu` marker and skip.
@pytest.mark.parametrize(
    "spec", ["cuda:x", "gpu", "cuda:", "cuda:-1", "cuda:0:1", "", "cuda0"], ids=lambda s: f"{s!r}"
)
def test_bad_device_specs_raise_value_error_naming_the_spec(spec: str) -> None:
    with pytest.raises(ValueError, match=f"{spec!r}"):
        Device(spec)


def test_non_string_device_spec_raises_type_error() -> None:
    with pytest.raises(TypeError, match="'cpu' or 'cuda:0'"):
        Device(0)  # type: ignore[arg-type]


def test_cuda_availability_here_is_consistent() -> None:
    reason = tl.cuda_unavailable_reason()
    assert tl.cuda_is_available() == (reason is None)
    if importlib.util.find_spec("cupy") is None:
        assert not tl.cuda_is_available()
        assert tl.cuda_device_count() == 0
        assert reason is not None and "CuPy" in reason


# ============================================================================ simulated CUDA states
@pytest.fixture
def fresh_cuda_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Forget what tensorlib learned about CuPy (restored afterwards by monkeypatch)."""
    monkeypatch.setattr(_device, "_cupy", None)
    monkeypatch.setattr(_device, "_cupy_reason", None)
    # Drop interned CUDA devices, or Device("cuda:0") would not look at CuPy again.
    cpu_only = {k: v for k, v in Device._cache.items() if v.type == "cpu"}
    monkeypatch.setattr(Device, "_cache", cpu_only)
    yield monkeypatch


def _fake_cupy(count: Any) -> SimpleNamespace:
    def get_device_count() -> int:
        if isinstance(count, Exception):
            raise count
        return int(count)

    runtime = SimpleNamespace(getDeviceCount=get_device_count)
    return SimpleNamespace(__version__="13.6.0", cuda=SimpleNamespace(runtime=runtime))


def _assert_install_hint(message: str) -> None:
    assert "pip install .[cuda12]" in message and "pip install .[cuda13]" in message


def test_missing_cupy_gives_one_clear_error_everywhere(
    fresh_cuda_state: pytest.MonkeyPatch,
) -> None:
    fresh_cuda_state.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(CudaUnavailableError) as info:
        Device("cuda")
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "CuPy is not installed or failed to import" in message
    _assert_install_hint(message)
    assert not tl.cuda_is_available()
    assert tl.cuda_unavailable_reason() == message
    assert tl.cuda_device_count() == 0
    x = tl.ones(2)
    for attempt in (
        lambda: Device("cuda:0"),
        lambda: tl.zeros(2, device="cuda:0"),
        lambda: tl.tensor([1.0], device="cuda"),
        lambda: x.to("cuda"),
        lambda: x.cuda(),
    ):
        with pytest.raises(CudaUnavailableError) as again:
            attempt()
        assert str(again.value) == message
    assert CPU != "cuda"  # comparing with an unusable device is just False


def test_first_failure_reason_is_kept(fresh_cuda_state: pytest.MonkeyPatch) -> None:
    fresh_cuda_state.setitem(sys.modules, "cupy", None)
    first = tl.cuda_unavailable_reason()
    fresh_cuda_state.setitem(sys.modules, "cupy", _fake_cupy(1))  # would work now
    assert tl.cuda_unavailable_reason() == first


class _BrokenCupyFinder:
    """A meta-path finder that makes `import cupy` fail as a CuPy built for another CUDA."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "cupy":
            raise ImportError("libcudart.so.12: cannot open shared object file")


def test_broken_cupy_import_keeps_the_original_error(
    fresh_cuda_state: pytest.MonkeyPatch,
) -> None:
    fresh_cuda_state.delitem(sys.modules, "cupy", raising=False)
    fresh_cuda_state.setattr(sys, "meta_path", [_BrokenCupyFinder(), *sys.meta_path])
    with pytest.raises(CudaUnavailableError, match=r"libcudart\.so\.12") as info:
        Device("cuda:0")
    assert "ImportError" in str(info.value)
    _assert_install_hint(str(info.value))
    assert isinstance(info.value.__cause__, ImportError)


def test_cupy_without_driver(fresh_cuda_state: pytest.MonkeyPatch) -> None:
    fresh_cuda_state.setitem(
        sys.modules, "cupy", _fake_cupy(RuntimeError("cudaErrorInsufficientDriver"))
    )
    with pytest.raises(CudaUnavailableError) as info:
        Device("cuda")
    message = str(info.value)
    assert "CuPy 13.6.0 is installed but found no usable NVIDIA driver" in message
    assert "cudaErrorInsufficientDriver" in message and "nvidia-smi" in message
    _assert_install_hint(message)


def test_cupy_without_visible_gpu(fresh_cuda_state: pytest.MonkeyPatch) -> None:
    fresh_cuda_state.setitem(sys.modules, "cupy", _fake_cupy(0))
    fresh_cuda_state.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(CudaUnavailableError, match=r"no CUDA GPU is visible.*VISIBLE_DEVICES=''"):
        Device("cuda")
    assert tl.cuda_device_count() == 0


def test_cuda_devices_with_a_working_cupy(fresh_cuda_state: pytest.MonkeyPatch) -> None:
    fresh_cuda_state.setitem(sys.modules, "cupy", _fake_cupy(2))
    assert tl.cuda_is_available() and tl.cuda_unavailable_reason() is None
    assert tl.cuda_device_count() == 2
    d0 = Device("cuda")
    assert d0 is Device("cuda:0") and d0 is Device("CUDA:0")
    assert d0.type == "cuda" and d0.index == 0 and d0.is_cuda and str(d0) == "cuda:0"
    assert d0 == "cuda:0" and d0 != CPU
    assert Device("cuda:1").index == 1 and Device("cuda:1") is not d0
    with pytest.raises(CudaUnavailableError, match=r"'cuda:2'.*only 2 GPU"):
        Device("cuda:2")


# ============================================================================ a real GPU
@pytest.mark.gpu
def test_move_to_gpu_and_back_is_differentiable() -> None:
    x = tl.tensor([1.0, -2.0, 3.0], dtype=tl.float64, requires_grad=True)
    y = x.to("cuda:0")
    assert y.device == "cuda:0" and y.device.is_cuda and y.requires_grad
    z = (y * y).to("cpu")
    assert z.device is CPU
    np.testing.assert_allclose(z.numpy(), [1.0, 4.0, 9.0])
    (z * tl.tensor([1.0, 10.0, 100.0], dtype=tl.float64)).sum().backward()
    assert x.grad is not None and x.grad.device is CPU
    np.testing.assert_allclose(x.grad.numpy(), [2.0, -40.0, 600.0])
    w = tl.randn(3, device="cuda:0", requires_grad=True)
    w.cpu().sum().backward()
    assert w.grad is not None and w.grad.device == "cuda:0"
    np.testing.assert_allclose(w.grad.numpy(), np.ones(3))


@pytest.mark.gpu
def test_mixing_devices_names_both_devices() -> None:
    g, c = tl.ones(2, device="cuda:0"), tl.ones(2)
    # Comparisons and where() bypass Function.apply's check, so they check on their own.
    for op in (lambda: g < c, lambda: c == g, lambda: g & (c > 0), lambda: g + c):
        with pytest.raises(RuntimeError, match=r"cuda:0.*cpu|cpu.*cuda:0"):
            op()
    with pytest.raises(RuntimeError, match=r"condition is on cpu.*cuda:0"):
        tl.where(c > 0, g, 0.0)


@pytest.mark.gpu
def test_gpu_dlpack_and_creation() -> None:
    import cupy as cp

    assert tl.cuda_is_available() and tl.cuda_device_count() >= 1
    a = cp.arange(4, dtype=cp.float32)
    t = tl.from_dlpack(a)
    assert t.device == "cuda:0"
    back = cp.from_dlpack(t)
    back[0] = 7.0
    assert float(a[0]) == 7.0  # zero-copy both ways
    g = tl.tensor(np.arange(3.0), device="cuda:0")
    assert g.device == "cuda:0" and g.tolist() == [0.0, 1.0, 2.0]
    assert tl.tensor(g, device="cpu").device is CPU
