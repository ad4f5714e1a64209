"""ZeRO over the remote devices of one server: rank threads of the threads backend, each
rank's pieces of the optimizer state on its remote device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import collectives as C
import remote
import tensorlib as tl
import tensorlib.functional as F
from ddp import DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard

from .conftest import TOKEN, ServerProcess
from .test_ddp_remote import STEPS, B, _data, _model


def _zero1_rank(rank: int, world: int) -> dict[str, Any]:
    dev = C.get_device()
    model = _model()
    model.to(dev)
    net = DistributedDataParallel(model, bucket_cap_mb=0.05, first_bucket_mb=0.01)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=tl.optim.AdamW, lr=1e-2)
    xs, ys = _data(STEPS, world * B)
    sl = slice(rank * B, (rank + 1) * B)
    for x, y in zip(xs[:, sl], ys[:, sl], strict=True):
        loss = F.mse_loss(net(tl.tensor(x, device=dev)), tl.tensor(y, device=dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert opt.optim is not None
    kinds = {
        v.device.type
        for st in opt.optim.state.values()
        for v in st.values()
        if hasattr(v, "device")
    }
    return {"params": [p.numpy() for p in model.parameters()], "state_on": sorted(kinds)}


def _reference(world: int) -> list[np.ndarray]:
    model = _model()
    opt = tl.optim.AdamW(model.parameters(), lr=1e-2)
    xs, ys = _data(STEPS, world * B)
    for x, y in zip(xs, ys, strict=True):
        loss = F.mse_loss(model(tl.tensor(x)), tl.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.numpy() for p in model.parameters()]


def test_zero1_on_two_remote_devices_matches_one_process_on_the_global_batch(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu", "--device", "cpu")
    devs = remote.devices(server.address, token=TOKEN)
    got = C.spawn(_zero1_rank, args=(2,), nprocs=2, backend="threads", devices=devs, timeout=30)
    assert got is not None
    ref = _reference(2)
    for rank, res in enumerate(got):
        assert res["state_on"] == ["remote"], res["state_on"]
        for a, b in zip(res["params"], ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    for d in devs:
        remote.close(d)


def _fully_shard_refused(rank: int) -> str:
    model = _model()
    model.to(C.get_device())
    try:
        fully_shard(model)
    except NotImplementedError as e:
        return str(e)
    return "not refused"


def test_fully_shard_refuses_remote_parameters_with_the_reason(
    server_process: Callable[..., ServerProcess],
) -> None:
    # fully_shard frees a unit's gathered parameters by handing their pages back while
    # autograd's views stay valid (madvise on host memory); no remote or GPU array can do that
    # yet, so it says so rather than keep every unit gathered.
    server = server_process("--device", "cpu", "--device", "cpu")
    devs = remote.devices(server.address, token=TOKEN)
    got = C.spawn(_fully_shard_refused, nprocs=2, backend="threads", devices=devs, timeout=30)
    assert got is not None
    for msg in got:
        assert "shards NumPy (CPU) parameters only" in msg and "remote" in msg, msg
    for d in devs:
        remote.close(d)
