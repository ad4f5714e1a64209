"""Burn's device-list all_reduce on real GPUs: the NCCL group-call engine, one thread.

Marked ``gpu`` (skipped without a usable GPU, tests/conftest.py says why): every visible GPU
in one context, so world size 1 on a machine with one GPU. The bodies are test_distributed.py's
(run on 4 fake GPUs in test_distributed_nccl.py). Float results are compared to the in-order
NumPy reduction within rounding (NCCL sums in its own order; its Mean multiplies each input by
1/n), integers exactly. Under ``TENSORLIB_FAKE_CUPY=1`` the arrays are host memory, so the
fake NCCL stands in for libnccl too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import tensorlib as tl
from collectives.distributed import ReduceOperation
from tests.collectives import test_distributed as bodies

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _nccl() -> Iterator[None]:
    if os.environ.get("TENSORLIB_FAKE_CUPY") == "1":
        from tests.fakes.install import fake_gpu_and_nccl

        with fake_gpu_and_nccl():
            yield
    else:
        yield


def _gpus() -> list[tl.Device]:
    devs = list(tl.Device.enumerate("cuda"))
    if not devs:
        pytest.skip("no GPU visible")
    return devs


@pytest.mark.parametrize("op", bodies.OPS, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32"])
def test_one_thread_all_reduces_every_gpu(op: ReduceOperation, dtype: str) -> None:
    bodies.check_one_thread_submits_every_device_then_resolves(_gpus(), op, dtype, exact=False)


def test_many_calls_in_a_row_and_the_config_op_on_gpus() -> None:
    devs = _gpus()
    if len(devs) >= 3:
        bodies.check_the_config_op_is_the_default_and_many_calls_stay_in_order(
            devs[:3], exact=False
        )
    bodies.check_one_thread_per_device_as_burns_ddp_runs(devs, calls=10, exact=False)
    if len(devs) >= 2:
        bodies.check_leaving_the_context_ends_it(devs[:2])
