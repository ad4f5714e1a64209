"""tensorlib's CuPy code paths on a fake CuPy (tests/fakes/fake_cupy/), without a GPU.

* The `gpu`-marked tests are run again in a subprocess with ``TENSORLIB_FAKE_CUPY=1``, which
  makes tests/conftest.py install the fake: arrays of the wrong module mixed together, a
  missing ``.get()`` or an index array left on the host fail there as on a real GPU.
* The fake itself is checked to stay as strict as CuPy, since that is what makes it useful.
* Two fake GPUs check what one real GPU cannot: device bookkeeping and moves between GPUs.

This complements the runs on a real GPU (docs/gpu-results.md); it does not replace them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import Device, _device
from tensorlib import _ops_movement as _mv
from tests.fakes import fake_cupy

ROOT = Path(__file__).resolve().parents[1]
FAKE_ENV = "TENSORLIB_FAKE_CUPY"
TIMEOUT_S = 240
# Well below the number of gpu-marked tests (about 630): lower it only if that many go away.
MIN_PASSED = 600


# ============================================================================ the gpu tests
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get(FAKE_ENV) == "1", reason="already running on the fake CuPy (no recursion)"
)
def test_gpu_tests_pass_on_the_fake_cupy() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env[FAKE_ENV] = "1"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    cmd += ["tests/tensorlib", "tests/ddp/test_ddp_gpu.py", "tests/ddp/test_learner_gpu.py"]
    cmd += ["tests/ddp/test_zero_gpu.py"]
    cmd += ["tests/ddp/test_metrics.py"]  # metrics of CUDA inputs
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        out = b"".join(
            s if isinstance(s, bytes) else s.encode() for s in (exc.stdout, exc.stderr) if s
        )
        pytest.fail(
            f"`{' '.join(cmd)}` with {FAKE_ENV}=1 ran past {TIMEOUT_S} s; output tail:\n"
            + out.decode(errors="replace")[-4000:]
        )
    output = proc.stdout + proc.stderr
    tail = f"`{' '.join(cmd)}` with {FAKE_ENV}=1, output tail:\n{output[-4000:]}"
    assert proc.returncode == 0, f"exit status {proc.returncode}; {tail}"
    assert not re.search(r"\d+ (failed|errors?)\b", output), tail
    assert "ran on the FAKE CuPy" in output, tail
    assert "gpu-marked tests skipped" not in output, tail
    found = re.search(r"(\d+) passed", output)
    passed = int(found.group(1)) if found else 0
    assert passed >= MIN_PASSED, (
        f"only {passed} gpu tests passed (expected >= {MIN_PASSED}); {tail}"
    )


# ============================================================================ the fake itself
@pytest.fixture
def cp() -> Iterator[Any]:
    """A fresh fake ``cupy`` module (not installed), with two GPUs and GPU 0 current."""
    fake_cupy.reset()
    yield fake_cupy.make_modules()["cupy"]
    fake_cupy.reset()


def test_fake_arrays_are_not_numpy_arrays(cp: Any) -> None:
    a = cp.arange(3.0)
    assert not isinstance(a, np.ndarray) and type(a).__module__ == "cupy"
    assert isinstance(a, cp.ndarray) and a.device.id == 0 and a.__dlpack_device__() == (2, 0)
    host = np.zeros(3)
    for convert in (np.asarray, np.array, np.asanyarray, lambda x: host.__setitem__(..., x)):
        with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
            convert(a)
    host = a.get()
    assert type(host) is np.ndarray and host.tolist() == [0.0, 1.0, 2.0]
    host[0] = 5.0
    assert a.get()[0] == 0.0  # get() copies
    assert cp.asnumpy(a).tolist() == [0.0, 1.0, 2.0] and float(a[1]) == 1.0


def test_kernels_refuse_numpy_arrays_but_take_scalars(cp: Any) -> None:
    a = cp.arange(3.0)
    host = np.ones(3)
    refused = [
        lambda: a + host,
        lambda: host + a,
        lambda: a * np.array(2.0),  # 0-d NumPy arrays too
        lambda: a < host,
        lambda: a.__iadd__(host),
        lambda: cp.where(a > 0, a, host),
        lambda: cp.maximum(a, host),
        lambda: cp.exp(host),
        lambda: np.add(a, host),
        lambda: a @ host,
    ]
    for op in refused:
        with pytest.raises(TypeError, match=r"Unsupported type <class 'numpy\.ndarray'>"):
            op()
    with pytest.raises(TypeError, match="Only cupy arrays"):
        cp.concatenate([a, host])
    for ok in (a + 1, 2.0 - a, a * np.float32(2), np.float64(1) + a, a**2, -a, abs(a)):
        assert isinstance(ok, cp.ndarray)


def test_results_stay_fake_arrays_and_0d_is_never_a_numpy_scalar(cp: Any) -> None:
    a = cp.arange(6.0).reshape(2, 3)
    results = [
        np.exp(a),
        np.sum(a),
        a.sum(),
        a.max(axis=1),
        a.mean(),
        a[0, 1],
        a[cp.arange(2)],
        cp.where(a > 2, a, 0),
        (a > 2).any(),
        cp.concatenate([a, a]),
        cp.stack([a, a]),
        cp.broadcast_to(a[0], (4, 3)),
        cp.expand_dims(a, 0),
    ]
    for r in results:
        assert isinstance(r, cp.ndarray), type(r)
    assert a.sum().ndim == 0 and a.sum().item() == 15.0
    view = a[0]
    view[1] = 10.0
    assert a.get()[0, 1] == 10.0 and view.base is a.base  # basic indexing gives views
    assert a[cp.arange(2)].base is None  # advanced indexing copies


def test_current_device_and_peer_access(cp: Any) -> None:
    with cp.cuda.Device(1):
        b = cp.zeros(4)
        assert b.device.id == 1 and (b + 1).device.id == 1
        assert cp.cuda.runtime.getDevice() == 1 and cp.asarray(b) is b
    assert cp.cuda.runtime.getDevice() == 0 and b[1:].device.id == 1  # views stay
    for moved in (cp.array(b), cp.asarray(b)):  # both copy to the current device
        assert moved.device.id == 0 and moved.get().tolist() == [0.0] * 4
    with pytest.raises(ValueError, match=r"resides \(1\).*current device \(0\)"):
        b + 1
    strided = b[::2]
    assert cp.array(strided, order="A").device.id == 0
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        cp.array(strided)
    fake_cupy.config.peer_access = True
    assert (b + 1).device.id == 0  # CuPy with peer access: on the current device
    with pytest.raises(fake_cupy.CUDARuntimeError, match="invalid device ordinal"):
        cp.cuda.Device(2).use()
    assert cp.cuda.runtime.getDeviceCount() == 2


def test_cupy_specific_refusals(cp: Any) -> None:
    a = cp.zeros(3)
    with pytest.raises(ValueError, match=r"non-scalar numpy\.ndarray cannot be used for fill"):
        a[...] = np.ones(3)
    with pytest.raises(TypeError, match="Unsupported type <class 'list'>"):
        a[:] = [1.0, 2.0, 3.0]
    a[...] = np.float64(2.0)  # scalars (and 0-d arrays) are fine
    a[cp.arange(2)] = np.array([5.0, 6.0])  # a scatter copies host values over
    assert a.get().tolist() == [5.0, 6.0, 2.0]
    with pytest.raises(TypeError, match="index array on the host"):
        a[np.array([0, 1])]
    ints = cp.zeros(3, dtype=np.int64)
    with pytest.raises(TypeError, match="scatter_add only supports"):
        fake_cupy.scatter_add(ints, cp.arange(2), 1)
    rng = cp.random.default_rng(0)
    with pytest.raises(TypeError, match="float32 and float64"):
        rng.random((2,), dtype=np.float16)
    assert rng.random((2,), dtype=np.float32).dtype == np.float32
    assert np.isnan(cp.empty(3).get()).all()  # uninitialized memory is not zeros
    for missing in ("linalg", "fft", "take_along_axis"):
        assert not hasattr(cp, missing)
    assert not hasattr(cp.add, "at")


def test_conftest_switch_installs_the_fake_for_tensorlib() -> None:
    if os.environ.get(FAKE_ENV) != "1":
        pytest.skip(f"only with {FAKE_ENV}=1")
    assert type(tl.zeros(1, device="cuda:0").data).__module__ == "cupy"
    assert tl.cuda_device_count() == 2


# ============================================================================ two fake GPUs
@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """tensorlib on two fake GPUs in this process, undone afterwards."""
    modules = fake_cupy.make_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(_device, "_cupy", None)
    monkeypatch.setattr(_device, "_cupy_reason", None)
    monkeypatch.setattr(
        Device, "_cache", {k: v for k, v in Device._cache.items() if v.type == "cpu"}
    )
    fake_cupy.reset(device_count=2)
    yield modules["cupy"]
    fake_cupy.reset()


def _on(t: tl.Tensor) -> tuple[str, int]:
    """(the tensor's device, the GPU its array really lives on)."""
    return str(t.device), int(t.data.device.id)


def test_creation_lands_on_the_requested_gpu(two_gpus: types.ModuleType) -> None:
    assert tl.cuda_device_count() == 2
    made = [
        tl.zeros(2, device="cuda:1"),
        tl.full((2,), 3.0, device="cuda:1"),
        tl.tensor([1.0, 2.0], device="cuda:1"),
        tl.tensor(np.arange(3), device="cuda:1"),
        tl.arange(4, device="cuda:1"),
        tl.rand(2, device="cuda:1"),
        tl.randn(2, dtype=tl.float16, device="cuda:1"),
        tl.nn.Linear(2, 2, device="cuda:1").weight,
        tl.from_dlpack(tl.ones(2, device="cuda:1")),
    ]
    for t in made:
        assert _on(t) == ("cuda:1", 1)
        assert tl.device_of(t.data) is t.device
    assert tl.Generator(0).random((2,), np.float32, tl.device("cuda:1")).device.id == 1
    assert _on(tl.zeros(2, device="cuda:0")) == ("cuda:0", 0)
    with pytest.raises(tl.CudaUnavailableError, match="only 2 GPU"):
        tl.device("cuda:2")


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_moves_between_gpus(two_gpus: types.ModuleType, layout: str) -> None:
    base = tl.tensor(np.arange(12.0).reshape(3, 4), device="cuda:0")
    src = {"contiguous": base, "transposed": base.T, "strided": base[:, ::2]}[layout]
    want = src.numpy()
    for moved in (src.to("cuda:1"), tl.tensor(src, device="cuda:1")):
        assert _on(moved) == ("cuda:1", 1)
        np.testing.assert_array_equal(moved.numpy(), want)
        back = moved.to("cuda:0")
        assert _on(back) == ("cuda:0", 0)
        np.testing.assert_array_equal(back.numpy(), want)
        assert moved.cpu().device is tl.device("cpu")


def test_gradients_flow_back_across_gpus(two_gpus: types.ModuleType) -> None:
    a = tl.tensor([1.0, 2.0, 3.0], device="cuda:0", requires_grad=True)
    with tl.device("cuda:1"):  # compute on a GPU that is not the current one runs under it
        y = a.to("cuda:1") * tl.tensor([1.0, 10.0, 100.0], device="cuda:1")
        assert _on(y) == ("cuda:1", 1)
        y.sum().backward()
    assert a.grad is not None and _on(a.grad) == ("cuda:0", 0)
    np.testing.assert_array_equal(a.grad.numpy(), [1.0, 10.0, 100.0])


def test_host_index_arrays_go_to_the_tensors_gpu(two_gpus: types.ModuleType) -> None:
    # GPU 0 is current: the index must still land on the tensor's GPU.
    idx = _mv.normalize_index((np.array([2, 0]), [1]), tl.device("cuda:1"))
    assert [i.device.id for i in idx] == [1, 1]
    w = tl.tensor(np.arange(6.0).reshape(3, 2), device="cuda:1", requires_grad=True)
    with tl.device("cuda:1"):
        t = tl.zeros(3, device="cuda:1")
        t[np.array([0, 2])] = np.array([1.0, 2.0])
        rows = tl.functional.embedding(np.array([2, 2, 0]), w)
        rows.sum().backward()
    assert t.tolist() == [1.0, 0.0, 2.0]
    assert _on(rows) == ("cuda:1", 1) and w.grad is not None and _on(w.grad) == ("cuda:1", 1)
    np.testing.assert_array_equal(w.grad.numpy(), [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])


# ============================================================================ gpu_check's steps
def test_the_gpu_checks_example_and_timing_steps_run_on_a_fake_gpu(
    two_gpus: types.ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """What benchmarks/gpu_check.py runs after the tests (the example on cuda, mlp_step on
    cuda), small, on the fake: a lent GPU's few minutes must not go to a script error."""
    pytest.importorskip("sklearn", reason="the example's dataset ships with scikit-learn")
    from benchmarks import mlp_step
    from tests.helpers import load_example

    example = load_example("train_mlp")
    acc = example.train(epochs=3, device="cuda", progress=False, log=False)
    assert acc >= 0.8, f"3 epochs on the fake GPU reached only {acc:.2%}"

    argv = ["--device", "cuda", "--sizes", "64,32,10", "--batch", "16", "--rounds", "2"]
    argv += ["--iters", "2", "--warmup", "1", "--chain", "20", "--no-torch"]
    assert mlp_step.main(argv) == 0
    out = capsys.readouterr().out
    assert "tensorlib" in out and "cuda" in out, out


def test_integer_index_arrays_wrap_around_as_in_cupy(cp: Any) -> None:
    """CuPy does not bounds-check integer index arrays (it wraps them), nor does its scatter:
    the fake must not raise where a GPU silently picks another element."""
    a = cp.arange(5.0)
    assert a[cp.asarray([7, -6, 2])].get().tolist() == [2.0, 4.0, 2.0]
    b = cp.zeros((2, 3))
    b[cp.asarray([3]), cp.asarray([-4])] = 1.0
    assert b.get().tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    c = cp.zeros(3)
    fake_cupy.scatter_add(c, cp.asarray([4, 4, -1]), 1.0)
    assert c.get().tolist() == [0.0, 2.0, 1.0]
    with pytest.raises(IndexError):
        a[7]  # a Python int is basic indexing: CuPy raises too


def test_out_of_range_indices_on_a_gpu_wrap_unless_checked(
    two_gpus: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """embedding / cross_entropy with an index out of range: silently wrapped on a GPU, as
    with CuPy; TENSORLIB_CHECK_INDICES=1 finds it on the device (no host sync per call) and
    raises at a later call or at F.check_indices()."""
    import tensorlib.functional as F

    weight = tl.tensor(np.arange(8.0, dtype=np.float32).reshape(4, 2), device="cuda:0")
    idx = tl.tensor(np.array([1, 5]), device="cuda:0")
    assert F.embedding(idx, weight).to("cpu").data.tolist() == [[2.0, 3.0], [2.0, 3.0]]
    logits = tl.tensor(np.zeros((2, 3), dtype=np.float32), device="cuda:0")
    F.cross_entropy(logits, tl.tensor(np.array([0, 3]), device="cuda:0"))  # no error
    F.check_indices()  # nothing checked without the variable
    monkeypatch.setenv("TENSORLIB_CHECK_INDICES", "1")
    F.embedding(tl.tensor(np.array([1, 3]), device="cuda:0"), weight)
    F.check_indices()  # in range: fine
    fake_cupy.host_syncs(reset=True)
    F.embedding(idx, weight)
    assert "ndarray.get" not in fake_cupy.host_syncs(), "the check waited for the GPU"
    with pytest.raises(IndexError, match="embedding: an index is out of range for 4"):
        F.check_indices()
    F.cross_entropy(logits, tl.tensor(np.array([0, 3]), device="cuda:0"))
    with pytest.raises(IndexError, match="cross_entropy: a target is out of range for 3"):
        F.check_indices()
