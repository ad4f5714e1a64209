"""A server hosting ``cuda:0``: the same training run as the local CuPy one."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import remote

from .conftest import TOKEN, ServerProcess, train_mlp


@pytest.mark.gpu
@pytest.mark.real_gpu
def test_a_server_hosting_cuda_matches_the_local_cupy_run(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cuda:0")
    dev = remote.devices(server.address, token=TOKEN)[0]
    local_params, local_losses = train_mlp("cuda:0", steps=20)
    remote_params, remote_losses = train_mlp(dev, steps=20)
    np.testing.assert_allclose(remote_losses, local_losses, rtol=1e-12)
    for a, b in zip(local_params, remote_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    remote.close(dev)
