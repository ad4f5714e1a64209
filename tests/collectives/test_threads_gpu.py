"""The threads backend on real GPUs: one rank thread and one NCCL communicator per GPU.

Marked ``gpu`` (skipped without a usable GPU, tests/conftest.py says why): world size 1 on a
machine with one GPU, every visible GPU where there are several. The same paths run on the
fake CuPy and fake libnccl in test_threads_nccl.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collectives as C
import tensorlib as tl
from tests.collectives.test_threads_nccl import cupy_all_reduce

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_device_threads_all_reduce_on_real_gpus() -> None:
    n = tl.cuda_device_count()
    devices = [f"cuda:{r}" for r in range(n)]
    got = C.spawn(cupy_all_reduce, nprocs=n, backend="threads", devices=devices, timeout=60)
    assert got is not None
    total = n * (n + 1) / 2
    for rank, res in enumerate(got):
        assert res["device"] == f"cuda:{rank}" and res["x_on"] == rank == res["comm_gpu"]
        assert res["x"] == [total * i for i in range(10)]
        assert res["host"] == [total] * 3


def _ddp_step(rank: int, xs: Any, ys: Any) -> list[Any]:
    from ddp import DistributedDataParallel
    from tensorlib import nn

    dev = C.get_device()
    gen = tl.Generator(7)
    net = nn.Sequential(
        nn.Linear(4, 8, generator=gen, dtype="float64"),
        nn.Tanh(),
        nn.Linear(8, 2, generator=gen, dtype="float64"),
    ).to(dev)
    model = DistributedDataParallel(net)
    opt = tl.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        x = tl.tensor(xs[step][rank], device=dev)
        y = tl.tensor(ys[step][rank], device=dev)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.numpy() for p in net.parameters()]


def test_ddp_on_device_threads_matches_one_process_on_the_cpu() -> None:
    from tensorlib import nn

    n = tl.cuda_device_count()
    rng = np.random.default_rng(0)
    xs, ys = rng.standard_normal((3, n, 5, 4)), rng.standard_normal((3, n, 5, 2))
    got = C.spawn(
        _ddp_step,
        args=(xs, ys),
        nprocs=n,
        backend="threads",
        devices=[f"cuda:{r}" for r in range(n)],
        timeout=120,
    )
    gen = tl.Generator(7)
    ref = nn.Sequential(
        nn.Linear(4, 8, generator=gen, dtype="float64"),
        nn.Tanh(),
        nn.Linear(8, 2, generator=gen, dtype="float64"),
    )
    opt = tl.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        x, y = tl.tensor(xs[step].reshape(-1, 4)), tl.tensor(ys[step].reshape(-1, 2))
        ((ref(x) - y) ** 2).mean().backward()
        opt.step()
    assert got is not None
    for params in got:
        for p, q in zip(params, ref.parameters(), strict=True):
            np.testing.assert_allclose(p, q.numpy(), rtol=1e-10, atol=1e-12)
