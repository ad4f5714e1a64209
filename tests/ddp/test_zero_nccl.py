"""ZeRO over NCCL, on the fake CuPy (two fake GPUs) and the fake libnccl of tests/fakes, which
performs the collectives over host memory with one thread a rank, as the real library does with
one thread a GPU: the threads backend's CuPy engine, one NCCL communicator per device thread.

* ``ZeroRedundancyOptimizer`` with CuPy parameters (DDP's buckets, its pieces, AdamW's state
  and the all-gather buckets on each rank's GPU) gives DDP's parameters bit for bit;
* ``fully_shard`` (NumPy parameters; its all-gathers and reduce-scatters go through NCCL) too.

The same on real GPUs: tests/ddp/test_zero_gpu.py (spawned ranks over libnccl).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import collectives as C
import tensorlib as tl
from tests.fakes import fake_nccl
from tests.fakes.install import fake_gpu_and_nccl

pytestmark = pytest.mark.timeout(120)

STEPS, PER_RANK = 6, 4


@pytest.fixture(scope="module")
def fake() -> Iterator[fake_nccl.FakeNccl]:
    with fake_gpu_and_nccl() as nccl:
        yield nccl


def _model(device: str) -> Any:
    gen = tl.Generator(7)
    net = tl.nn.Sequential(
        tl.nn.Linear(6, 10, generator=gen), tl.nn.Tanh(), tl.nn.Linear(10, 3, generator=gen)
    )
    return net.to(device)


def _train(model: Any, opt: Any, device: str) -> None:
    rank, world = C.get_rank(), C.get_world_size()
    for step in range(STEPS):
        rng = np.random.default_rng([step, 3])
        x = rng.standard_normal((world * PER_RANK, 6)).astype(np.float32)
        y = rng.standard_normal((world * PER_RANK, 3)).astype(np.float32)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        xb, yb = tl.tensor(x[rows], device=device), tl.tensor(y[rows], device=device)
        opt.zero_grad()
        ((model(xb) - yb) ** 2).mean().backward()
        opt.step()


def _host(model: Any) -> list[list[float]]:
    inner = getattr(model, "module", model)
    return [np.asarray(v.to("cpu").numpy()).ravel().tolist() for v in inner.state_dict().values()]


def zero1_rank(rank: int) -> dict[str, Any]:
    from ddp import DistributedDataParallel, ZeroRedundancyOptimizer

    dev = str(C.get_device())
    sharded = DistributedDataParallel(_model(dev))
    opt = ZeroRedundancyOptimizer(sharded.parameters(), optimizer_class=tl.optim.AdamW, lr=1e-2)
    _train(sharded, opt, dev)
    ref = DistributedDataParallel(_model(dev))
    _train(ref, tl.optim.AdamW(ref.parameters(), lr=1e-2), dev)
    assert opt.optim is not None
    state_on = {
        type(v.data if isinstance(v, tl.Tensor) else v).__module__.split(".")[0]
        for st in opt.optim.state.values()
        for v in st.values()
        if getattr(v, "ndim", 0) > 0
    }
    return {"params": _host(sharded), "ref": _host(ref), "state_on": sorted(state_on)}


def fsdp_rank(rank: int) -> dict[str, Any]:
    from ddp import DistributedDataParallel, fully_shard

    sharded = _model("cpu")
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer)
    fully_shard(sharded)
    _train(sharded, tl.optim.AdamW(sharded.parameters(), lr=1e-2), "cpu")
    ref = DistributedDataParallel(_model("cpu"))
    _train(ref, tl.optim.AdamW(ref.parameters(), lr=1e-2), "cpu")
    return {"params": _host(sharded), "ref": _host(ref), "backend": C.get_backend()}


@pytest.mark.parametrize("body", [zero1_rank, fsdp_rank], ids=["zero1-cupy", "fully_shard"])
def test_zero_over_nccl_equals_ddp(fake: fake_nccl.FakeNccl, body: Any) -> None:
    before = dict(fake.counts)
    got = C.spawn(body, nprocs=2, backend="threads", devices=["cuda:0", "cuda:1"], timeout=60)
    assert got is not None
    # The shards moved through NCCL: all-gathers (and fully_shard's reduce-scatters).
    used = {k: fake.counts[k] - before.get(k, 0) for k in fake.counts}
    assert used.get("ncclAllGather", 0) > 0, used
    if body is fsdp_rank:
        assert used.get("ncclReduceScatter", 0) > 0, used
    for rank, res in enumerate(got):
        assert res["params"] == res["ref"], f"rank {rank}: not DDP's parameters"
        if "state_on" in res:
            assert res["state_on"] == ["cupy"], res["state_on"]
    assert got[0]["params"] == got[1]["params"]
