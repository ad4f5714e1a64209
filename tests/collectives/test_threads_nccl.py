"""The threads backend's CuPy engine: one NCCL communicator per device thread, in this process.

On the fake CuPy (2 fake GPUs) and the fake libnccl of tests/fakes (which performs the
collectives over host memory, one thread a rank, as the real library does with one thread a
GPU). The same on real GPUs: test_threads_gpu.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import collectives as C
from tests.collectives import expect
from tests.collectives.threads_pool import ThreadsPool
from tests.fakes import fake_nccl
from tests.fakes.install import fake_gpu_and_nccl

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def fake() -> Iterator[fake_nccl.FakeNccl]:
    """The fake CuPy and NCCL in place of the real ones (as test_nccl.py installs them)."""
    with fake_gpu_and_nccl() as nccl:
        yield nccl


def cupy_all_reduce(rank: int) -> dict[str, Any]:
    import cupy as cp

    x = cp.arange(10, dtype=cp.float32) * (rank + 1)  # on the rank's GPU: its device is current
    C.all_reduce(x)
    host = np.zeros(3)
    host[:] = rank + 1
    C.all_reduce(host)  # NumPy arrays go through the GPU and come back
    backend = C.get_default_group().backend
    return {
        "device": str(C.get_device()),
        "x_on": int(x.device.id),
        "x": x.get().tolist(),
        "host": host.tolist(),
        "backend": C.get_backend(),
        "comm_gpu": backend.device,  # type: ignore[attr-defined]
    }


def test_each_device_thread_has_its_own_communicator(fake: fake_nccl.FakeNccl) -> None:
    got = C.spawn(
        cupy_all_reduce, nprocs=2, backend="threads", devices=["cuda:0", "cuda:1"], timeout=20
    )
    assert got is not None
    for rank, res in enumerate(got):
        assert res["device"] == f"cuda:{rank}" and res["x_on"] == rank == res["comm_gpu"]
        assert res["x"] == [3.0 * i for i in range(10)]
        assert res["host"] == [3.0] * 3
        assert res["backend"] == "threads"


@pytest.mark.parametrize("n", [1, 2])
def test_shared_bodies_on_device_threads(fake: fake_nccl.FakeNccl, n: int, seed: int) -> None:
    pool = ThreadsPool(n, timeout=20, devices=[f"cuda:{r}" for r in range(n)], tag="nccl")
    expect.all_reduce(pool, seed, "float32", "SUM", [0, 7, 4097], iters=1)
    expect.broadcast(pool, seed, "float64", [1, 4097])
    expect.all_gather(pool, seed, "int32", [7])
    expect.subgroups(pool, seed, [0] if n == 1 else [1, 0], 0)


def test_a_raising_device_thread_aborts_the_others_communicators(
    fake: fake_nccl.FakeNccl,
) -> None:
    seen: dict[int, Any] = {}
    issued = threading.Barrier(2)

    def body(rank: int) -> None:
        import cupy as cp

        C.barrier()
        if rank == 1:
            issued.wait(10)
            time.sleep(0.2)
            raise ValueError("device thread one broke")
        x = cp.ones(8, dtype=cp.float32)
        work = C.all_reduce(x, async_op=True)
        issued.wait(10)
        t0 = time.monotonic()
        try:
            work.wait(timeout=15)
        except C.CollectiveError as exc:
            seen[rank] = (type(exc).__name__, str(exc), time.monotonic() - t0)
            raise

    with pytest.raises(C.SpawnError) as info:
        C.spawn(body, nprocs=2, backend="threads", devices=["cuda:0", "cuda:1"], timeout=30)
    assert info.value.rank == 1 and "device thread one broke" in str(info.value)
    _kind, msg, waited = seen[0]
    assert "rank 1 failed" in msg and "device thread one broke" in msg, msg
    assert waited < 5.0, waited


def _join_on_device(rank: int) -> dict[str, Any]:
    """DDP under ddp.join on this rank's (fake) GPU: rank r has 5 - r batches, Adam."""
    import ddp
    import tensorlib as tl
    from ddp import DistributedDataParallel
    from tensorlib import nn

    dev = C.get_device()
    net = nn.Sequential(nn.Linear(4, 8, generator=tl.Generator(3)), nn.Tanh(), nn.Linear(8, 2))
    model = DistributedDataParallel(net.to(dev))
    opt = tl.optim.Adam(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(rank)
    with ddp.join(model, optimizers=[opt]):
        for _ in range(5 - rank):
            x = tl.tensor(rng.standard_normal((3, 4)), device=dev)
            loss = (model(x) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    moments = [
        v.get().tolist()
        for state in opt.state_dict()["state"].values()
        for v in state.values()
        if hasattr(v, "get")
    ]
    return {"params": [p.data.get().tolist() for p in model.parameters()], "moments": moments}


def test_join_on_device_threads_copies_state_on_the_device(fake: fake_nccl.FakeNccl) -> None:
    """ddp.join with CuPy buckets and optimizer state: the rank that ran out ends with the
    other's parameters and Adam moments (copied device to device through NCCL)."""
    got = C.spawn(
        _join_on_device, nprocs=2, backend="threads", devices=["cuda:0", "cuda:1"], timeout=30
    )
    assert got is not None
    assert got[0]["moments"] and got[0]["moments"] == got[1]["moments"]
    assert got[0]["params"] == got[1]["params"]
