"""Training on a remote device gives what training here gives, bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import remote

from .conftest import TOKEN, ServerProcess, train_mlp


def test_digits_mlp_on_a_remote_cpu_matches_the_local_run_bitwise(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu")
    dev = remote.devices(server.address, token=TOKEN)[0]
    local_params, local_losses = train_mlp("cpu")
    before = remote.stats(dev)
    remote_params, remote_losses = train_mlp(dev)
    after = remote.stats(dev)
    assert remote_losses == local_losses
    for a, b in zip(local_params, remote_params, strict=True):
        assert a.dtype == b.dtype == np.float64
        assert np.array_equal(a, b)
    # One round trip a step (loss.item()), plus one read per parameter at the end.
    steps, params = 50, len(local_params)
    assert after["round_trips"] - before["round_trips"] == steps + params
    # The forward and backward ops (Linear and cross-entropy one fused record each way), and
    # the whole AdamW update as one fused record a step.
    assert 10 * steps < after["ops"] - before["ops"] < 30 * steps
    assert after["bytes_sent"] > before["bytes_sent"]
    remote.close(dev)
