"""ZeRO on GPUs: ``ZeroRedundancyOptimizer`` with CuPy parameters (its flat pieces, the inner
optimizer's state and the all-gather buckets in device memory), over NCCL on a real GPU; and
``fully_shard``'s refusal of GPU parameters, which it does not shard yet.

Marked ``gpu``: they skip without a usable GPU (tests/conftest.py says why). The world-size-1
tests also run on tests/fakes' CuPy in every CI run (tests/test_fake_gpu.py); the NCCL test
needs a real GPU and libnccl (benchmarks/gpu_check.py runs it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tests.ddp.test_ddp_gpu import _batch, _host_params, _model, _nccl_or_skip

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

STEPS, PER_RANK = 6, 8


def _train(model: Any, opt: Any, world: int, rank: int) -> None:
    for step in range(STEPS):
        x, y = _batch(step, world)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        xb, yb = tl.tensor(x[rows], device="cuda"), tl.tensor(y[rows], device="cuda")
        opt.zero_grad()
        ((model(xb) - yb) ** 2).mean().backward()
        opt.step()


def test_zero1_on_a_gpu_at_world_size_one_matches_plain_adamw() -> None:
    """The pieces, AdamW's moments and the gather buffers stay in device memory, and the
    parameters end where plain AdamW on the GPU ends them, bit for bit."""
    import collectives as C
    from ddp import DistributedDataParallel, ZeroRedundancyOptimizer, memory_stats

    C.destroy_process_group()
    C.init_process_group("serial", rank=0, world_size=1)
    try:
        plain = _model("cuda")
        plain_opt = tl.optim.AdamW(plain.parameters(), lr=1e-2)
        wrapped = DistributedDataParallel(_model("cuda"))
        opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=tl.optim.AdamW, lr=1e-2)
        _train(plain, plain_opt, 1, 0)
        _train(wrapped, opt, 1, 0)
        assert opt.optim is not None
        for state in opt.optim.state.values():
            for v in state.values():
                if getattr(v, "ndim", 0) > 0:
                    data = v.data if isinstance(v, tl.Tensor) else v
                    assert type(data).__module__.split(".")[0] == "cupy", type(data)
        for got, want in zip(_host_params(wrapped), _host_params(plain), strict=True):
            np.testing.assert_array_equal(got, want)
        # Parameters, gradients and AdamW's two moments, all counted on the device.
        p = sum(q.numel() for q in wrapped.parameters()) * 4
        stats = memory_stats(wrapped, opt)
        assert stats["parameters"] == p and stats["optimizer"] == 2 * p, stats
    finally:
        C.destroy_process_group()


def test_fully_shard_refuses_gpu_parameters_with_the_reason() -> None:
    import collectives as C
    from ddp import fully_shard

    C.destroy_process_group()
    C.init_process_group("serial", rank=0, world_size=1)
    try:
        with pytest.raises(NotImplementedError, match=r"shards NumPy \(CPU\) parameters only"):
            fully_shard(_model("cuda"))
    finally:
        C.destroy_process_group()


def _nccl_zero_rank(local_rank: int) -> dict[str, Any]:
    """One spawned rank: DDP + ZeroRedundancyOptimizer(AdamW) over nccl on this rank's GPU,
    and plain DDP + AdamW on the same batches (the reference)."""
    import collectives as C
    from ddp import DistributedDataParallel, ZeroRedundancyOptimizer

    rank, world = C.get_rank(), C.get_world_size()
    sharded = DistributedDataParallel(_model("cuda"))
    opt = ZeroRedundancyOptimizer(sharded.parameters(), optimizer_class=tl.optim.AdamW, lr=1e-2)
    _train(sharded, opt, world, rank)
    ref = DistributedDataParallel(_model("cuda"))
    _train(ref, tl.optim.AdamW(ref.parameters(), lr=1e-2), world, rank)
    return {
        "params": [p.ravel().tolist() for p in _host_params(sharded)],
        "ref": [p.ravel().tolist() for p in _host_params(ref)],
    }


@pytest.mark.real_gpu
def test_zero1_over_nccl_equals_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks, each stepping half of AdamW's state: DDP's parameters, bit for bit (the
    update is elementwise on the same averaged gradients), the same on both ranks."""
    import collectives as C

    _nccl_or_skip(2, monkeypatch)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    results = C.spawn(_nccl_zero_rank, nprocs=2, backend="nccl", timeout=120)
    assert results is not None and len(results) == 2
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["params"] == results[0]["ref"]
