"""DDP over the remote devices of one server: rank threads of the threads backend, the
gradients reduced on the server (``remote.client._engine``, ``remote.server._collective``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collectives as C
import remote
import tensorlib as tl
import tensorlib.functional as F
from ddp import DistributedDataParallel
from tensorlib import nn, optim

from .conftest import TOKEN, ServerProcess

B = 8  # per-rank batch
STEPS = 4


def _model() -> nn.Module:
    tl.manual_seed(0)  # in a rank thread: that thread's own default generator
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 32)).to(tl.float64)


def _data(steps: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.normal(size=(steps, n, 64)), rng.normal(size=(steps, n, 32))


def _train(model: nn.Module, dev: Any, xs: np.ndarray, ys: np.ndarray, opt_kind: str) -> None:
    params = list(model.parameters())
    opt = optim.SGD(params, lr=0.1) if opt_kind == "sgd" else optim.Adam(params, lr=1e-2)
    for x, y in zip(xs, ys, strict=True):
        loss = F.mse_loss(model(tl.tensor(x, device=dev)), tl.tensor(y, device=dev))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _ddp_rank(rank: int, opt_kind: str, world: int) -> dict[str, Any]:
    """One rank thread: DDP on its remote device over its slice of each global batch."""
    dev = C.get_device()
    model = _model()
    model.to(dev)
    net = DistributedDataParallel(model, bucket_cap_mb=0.05, first_bucket_mb=0.01)
    xs, ys = _data(STEPS, world * B)
    sl = slice(rank * B, (rank + 1) * B)
    _train(net, dev, xs[:1, sl], ys[:1, sl], opt_kind)  # a first step, not counted below
    on_server = dev.type == "remote"
    before = remote.stats(dev) if on_server else {}
    _train(net, dev, xs[:, sl], ys[:, sl], opt_kind)
    dev.synchronize()
    after = remote.stats(dev) if on_server else {}
    moved = sum(after[k] - before[k] for k in after)
    return {
        "params": [p.numpy() for p in model.parameters()],
        "moved_per_step": moved / STEPS,
        "grad_bytes": sum(p.numel() * 8 for p in model.parameters()),
    }


def _reference(opt_kind: str, world: int) -> list[np.ndarray]:
    model = _model()
    xs, ys = _data(STEPS, world * B)
    _train(model, "cpu", xs[:1], ys[:1], opt_kind)
    _train(model, "cpu", xs, ys, opt_kind)
    return [p.numpy() for p in model.parameters()]


@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
def test_ddp_on_two_remote_devices_matches_one_process_on_the_global_batch(
    server_process: Callable[..., ServerProcess], opt_kind: str
) -> None:
    """2 rank threads on 2 remote cpu devices of one server, batch B each = one local process
    with batch 2B (float64, 1e-12), bit for bit the rank threads on the CPU; a step moves far
    fewer bytes than the gradients hold."""
    server = server_process("--device", "cpu", "--device", "cpu")
    devs = remote.devices(server.address, token=TOKEN)
    got = C.spawn(
        _ddp_rank, args=(opt_kind, 2), nprocs=2, backend="threads", devices=devs, timeout=20
    )
    assert got is not None
    ref = _reference(opt_kind, 2)
    for rank, res in enumerate(got):
        for a, b in zip(res["params"], ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
        # The gradients stay on the server: a step sends records and the batch, not them.
        assert res["moved_per_step"] < res["grad_bytes"] / 10, res
    assert all(
        np.array_equal(a, b) for a, b in zip(got[0]["params"], got[1]["params"], strict=True)
    )
    # The server reduces in rank order, as the NumPy engine does: the same bits.
    here = C.spawn(_ddp_rank, args=(opt_kind, 2), nprocs=2, backend="threads", timeout=20)
    assert here is not None
    for a, b in zip(got[0]["params"], here[0]["params"], strict=True):
        assert np.array_equal(a, b)
    for d in devs:
        remote.close(d)


def _never(rank: int) -> None:
    raise AssertionError("the group should have been refused")


def test_devices_of_two_servers_in_one_group_are_refused_clearly(
    server_process: Callable[..., ServerProcess],
) -> None:
    a = server_process("--device", "cpu")
    b = server_process("--device", "cpu")
    devs = [remote.devices(a.address, token=TOKEN)[0], remote.devices(b.address, token=TOKEN)[0]]
    with pytest.raises(C.SpawnError) as info:
        C.spawn(_never, nprocs=2, backend="threads", devices=devs, timeout=10)
    assert info.value.exc_type == "ValueError"
    assert "hosted by one server" in str(info.value)
    assert a.address in str(info.value) and b.address in str(info.value)


def test_one_device_for_two_ranks_is_refused_clearly(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu")
    dev = remote.devices(server.address, token=TOKEN)[0]
    with pytest.raises(C.SpawnError, match="its own remote device"):
        C.spawn(_never, nprocs=2, backend="threads", devices=[dev, dev], timeout=10)


def _until_killed(rank: int, reached: threading.Event) -> None:
    dev = C.get_device()
    model = _model()
    model.to(dev)
    net = DistributedDataParallel(model)
    xs, ys = _data(1, B)
    for step in range(10_000):
        _train(net, dev, xs, ys, "sgd")
        float(net(tl.tensor(xs[0], device=dev)).sum().item())  # a read each step
        if step == 2 and rank == 0:
            reached.set()


def test_a_server_killed_mid_step_fails_every_rank_with_remote_connection_error(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu", "--device", "cpu")
    devs = remote.devices(server.address, token=TOKEN, timeout=5)
    reached = threading.Event()

    def killer() -> None:
        if reached.wait(30):
            server.kill()

    threading.Thread(target=killer, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(C.SpawnError) as info:
        C.spawn(
            _until_killed, args=(reached,), nprocs=2, backend="threads", devices=devs,
            timeout=20, grace_period=10,
        )  # fmt: skip
    took = time.monotonic() - start
    text = str(info.value)
    assert reached.is_set()
    assert info.value.exc_type is not None and info.value.exc_type.endswith("RemoteConnectionError")
    other = 1 - info.value.rank
    assert f"rank {other} also failed: RemoteConnectionError" in text, text
    assert "still running" not in text
    print(f"spawn returned {took:.2f} s after start")


def test_train_ddp_example_runs_its_rank_threads_on_a_remote_server(
    server_process: Callable[..., ServerProcess], tmp_path: Any
) -> None:
    """``examples/train_ddp.py --threads 2 --remote HOST:PORT --token-file F`` trains the
    main job on the server's two devices."""
    import subprocess
    import sys

    from .conftest import ROOT, env

    server = server_process("--device", "cpu", "--device", "cpu")
    token = tmp_path / "tok"
    token.write_text(TOKEN)
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_ddp.py"), "--threads", "2",
        "--remote", server.address, "--token-file", str(token), "--epochs", "1",
        "--no-progress", "--checkpoint", str(tmp_path / "c.npz"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "accuracy" in proc.stdout.lower(), proc.stdout


def test_a_member_that_never_arrives_poisons_the_others_output_on_the_server(
    local_server: remote.Server,
) -> None:
    """The server's rendezvous does not wait forever: after the record's timeout the tensor
    of the member that came is poisoned, and its next read says who never arrived."""
    from remote._wire import OP_CODES
    from remote.client._client import session_of

    dev = remote.devices(local_server.address, token=TOKEN)[0]
    x = tl.tensor(np.ones(4), device=dev).data
    sess = session_of(dev)
    # all_reduce (kind 0) SUM #1 of a 2-member group whose member 1 never comes; 0.3 s.
    args = (x._id, x._id, 1, 2, 1, 0, 2, 0, 0, -1, 0.3)
    sess.issue(OP_CODES["collective"], 0, x._id, args)
    with pytest.raises(remote.RemoteOpError, match=r"members \[1\] of 2 never arrived"):
        x.get()
    remote.close(dev)
