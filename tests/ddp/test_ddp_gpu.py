"""DistributedDataParallel on GPUs: buckets in device memory, and gradients averaged over NCCL.

Marked ``gpu``: they skip without a usable GPU (tests/conftest.py says why). The world-size-1
test also runs on tests/fakes' CuPy in every CI run (tests/test_fake_gpu.py); the NCCL tests
need a real GPU and libnccl (benchmarks/gpu_check.py runs them).

The reference for every case is one process on the CPU (NumPy) training the same initial
weights on the global batch: N ranks with per-rank batch B must end where it ends.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import nn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

D_IN, HIDDEN, D_OUT = 6, 32, 3
STEPS, PER_RANK = 6, 8
LR = 0.1


def _model(device: str) -> nn.Module:
    gen = tl.Generator(1234)
    net = nn.Sequential(
        nn.Linear(D_IN, HIDDEN, generator=gen),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN, generator=gen),
        nn.Tanh(),
        nn.Linear(HIDDEN, D_OUT, generator=gen),
    )
    return net.to(device)


def _batch(step: int, world: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The global batch of ``step``: ``world * PER_RANK`` rows; rank r takes rows r*B..(r+1)*B."""
    rng = np.random.default_rng([7, step])
    x = rng.standard_normal((world * PER_RANK, D_IN)).astype(np.float32)
    y = rng.standard_normal((world * PER_RANK, D_OUT)).astype(np.float32)
    return x, y


def _train(model: nn.Module, device: str, world: int, rank: int) -> list[float]:
    opt = tl.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, world)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        xb = tl.tensor(x[rows], device=device)
        yb = tl.tensor(y[rows], device=device)
        loss = ((model(xb) - yb) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


def _host_params(model: nn.Module) -> list[np.ndarray[Any, Any]]:
    return [np.asarray(p.to("cpu").data) for p in model.parameters()]


def _reference(world: int) -> list[np.ndarray[Any, Any]]:
    """One CPU process on the global batch (the mean over it = the mean of the ranks' means)."""
    model = _model("cpu")
    opt = tl.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, world)
        loss = ((model(tl.tensor(x)) - tl.tensor(y)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _host_params(model)


# ---------------------------------------------------------------------------- world size 1
def test_ddp_on_a_gpu_at_world_size_one_matches_the_plain_model() -> None:
    """Buckets live in device memory, every .grad is a view into one, and training gives what
    the plain model gives on the GPU (and, to float32 tolerance, on the CPU)."""
    import collectives as C
    from ddp import DistributedDataParallel

    C.destroy_process_group()
    C.init_process_group("serial", rank=0, world_size=1)
    try:
        plain = _model("cuda")
        wrapped = DistributedDataParallel(_model("cuda"))
        _train(plain, "cuda", 1, 0)
        _train(wrapped, "cuda", 1, 0)
        for b in wrapped.reducer.buckets:
            assert type(b.buffer).__module__.split(".")[0] == "cupy", type(b.buffer)
        for p in wrapped.parameters():
            assert p.grad is not None and p.grad.device.type == "cuda"
        for got, want in zip(_host_params(wrapped), _host_params(plain), strict=True):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(_host_params(wrapped), _reference(1), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    finally:
        C.destroy_process_group()


# ---------------------------------------------------------------------------- NCCL
def _nccl_rank(local_rank: int) -> dict[str, Any]:
    """One spawned rank: DDP over the default (nccl) group on this rank's GPU."""
    import collectives as C
    from ddp import DistributedDataParallel

    rank, world = C.get_rank(), C.get_world_size()
    model = DistributedDataParallel(_model("cuda"))
    losses = _train(model, "cuda", world, rank)
    return {
        "backend": C.get_backend(),
        "rank": rank,
        "losses": losses,
        "params": [p.ravel().tolist() for p in _host_params(model)],
    }


def _nccl_or_skip(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import collectives

    if os.environ.get("TENSORLIB_FAKE_CUPY") == "1":
        pytest.skip("NCCL needs a real GPU (the fake CuPy has no device memory for libnccl)")
    why = collectives.backend_unavailable_reason("nccl")
    if why is not None:
        pytest.skip(f"the nccl backend is not usable here: {why}")
    if world > tl.cuda_device_count():
        from collectives.backends.nccl import load_library as load
        from collectives.backends.nccl import version_code

        if load().version < version_code(2, 30, 0):
            pytest.skip(
                f"{world} ranks on {tl.cuda_device_count()} GPU(s) need NCCL >= 2.30 "
                "(ranks sharing a GPU)"
            )
        monkeypatch.setenv("DPT_ALLOW_SHARED_GPU", "1")
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")


@pytest.mark.parametrize("world", [1, 2])
def test_ddp_over_nccl_matches_one_process_on_the_global_batch(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import collectives as C

    _nccl_or_skip(world, monkeypatch)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    results = C.spawn(_nccl_rank, nprocs=world, backend="nccl", timeout=120)
    assert results is not None and len(results) == world
    assert {r["backend"] for r in results} == {"nccl"}
    first = results[0]["params"]
    for r in results[1:]:
        assert r["params"] == first, f"rank {r['rank']} ended with different parameters"
    for got, want in zip(first, _reference(world), strict=True):
        np.testing.assert_allclose(np.array(got, np.float32), want.ravel(), rtol=1e-4, atol=1e-5)


def _nccl_join_rank(local_rank: int) -> dict[str, Any]:
    """One spawned rank under ddp.join: rank r has STEPS - r batches, Adam's state on the GPU."""
    import collectives as C
    import ddp
    from ddp import DistributedDataParallel

    rank, world = C.get_rank(), C.get_world_size()
    model = DistributedDataParallel(_model("cuda"))
    opt = tl.optim.Adam(model.parameters(), lr=1e-2)
    with ddp.join(model, optimizers=[opt]):
        for step in range(STEPS - rank):
            x, y = _batch(step, world)
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            loss = (
                (model(tl.tensor(x[rows], device="cuda")) - tl.tensor(y[rows], device="cuda")) ** 2
            ).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    moments = [
        np.asarray(v.get() if hasattr(v, "get") else v).ravel().tolist()  # CuPy -> host
        for state in opt.state_dict()["state"].values()
        for v in state.values()
        if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0
    ]
    return {"params": [p.ravel().tolist() for p in _host_params(model)], "moments": moments}


def test_join_over_nccl_leaves_every_rank_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uneven inputs on the GPU: rank 1 runs out a step early; at the end of the block both
    ranks hold the same parameters and Adam moments (copied from rank 0, on the device)."""
    import collectives as C

    _nccl_or_skip(2, monkeypatch)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    results = C.spawn(_nccl_join_rank, nprocs=2, backend="nccl", timeout=120)
    assert results is not None and len(results) == 2
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["moments"] and results[0]["moments"] == results[1]["moments"]
