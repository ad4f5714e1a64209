"""The Learner's ``multi_device`` strategy over two GPUs: one thread, a replica per GPU.

Every replica's forward, backward and optimizer step run from the one thread whose current
GPU is GPU 0, so each must run on its replica's GPU (tensorlib's ops follow their tensors'
device). Marked ``gpu``: it skips with fewer than two GPUs, and runs on tests/fakes' CuPy
(two fake GPUs) in every CI run (tests/test_fake_gpu.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tensorlib as tl
from ddp.learner import ExecutionStrategy
from tests.ddp.test_learner import MULTI_TOL, _close, _train

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.mark.parametrize("mode", ["main_device", "sharded"])
def test_multi_device_over_two_gpus_equals_one_cpu(tmp_path: Path, mode: str) -> None:
    if tl.cuda_device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {tl.cuda_device_count()} visible")
    rt = tl.device("cuda:0").xp.cuda.runtime
    rt.setDevice(0)
    reference = _train(tmp_path / "cpu", ExecutionStrategy.single_device("cpu"))
    devices = ["cuda:0", "cuda:1"]
    multi = _train(tmp_path / mode, ExecutionStrategy.multi_device(devices, optim=mode))
    _close(multi, reference, MULTI_TOL)
    assert next(multi.model.parameters()).device is tl.device("cuda:0")
    assert rt.getDevice() == 0
