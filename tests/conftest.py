"""Shared fixtures: the devices to test on, with CUDA skipped (with its reason) when absent."""

from __future__ import annotations

import os
from typing import Any

import pytest

import tensorlib as tl
from tensorlib import _device

# TENSORLIB_FAKE_CUPY=1 runs the `gpu` tests on tests/fakes/fake_cupy/ (host memory that is as
# strict as CuPy about mixing in NumPy arrays), so GPU code paths are exercised without a GPU.
FAKE_CUPY = os.environ.get("TENSORLIB_FAKE_CUPY") == "1"
if FAKE_CUPY:
    from tests.fakes import fake_cupy

    fake_cupy.install()
    # Forget anything tensorlib learned about CuPy before the fake was in place.
    _device._cupy = None
    _device._cupy_reason = None
    for _spec in [k for k, v in _device.Device._cache.items() if v.type == "cuda"]:
        del _device.Device._cache[_spec]

# Hypothesis: deterministic in CI so a red run can be reproduced, and bounded in time.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci",
        derandomize=True,
        deadline=None,
        max_examples=25,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("dev", deadline=None, max_examples=25)
    settings.load_profile("ci" if os.environ.get("CI") else "dev")
except ImportError:  # pragma: no cover - hypothesis is in the dev extra
    pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests with the precise reason CUDA is unusable here."""
    if FAKE_CUPY:
        # The fake is installed in this process only: tests whose GPU work runs in processes
        # they start would meet the real (absent) CuPy there.
        real = pytest.mark.skip(
            reason="needs a real GPU: its GPU work runs in subprocesses, where the fake CuPy "
            "(TENSORLIB_FAKE_CUPY=1) is not installed"
        )
        for item in items:
            if item.get_closest_marker("real_gpu") is not None:
                item.add_marker(real)
    reason = tl.cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no usable CUDA GPU: {reason}")
    count = 0
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
            count += 1
    config.stash[_GPU_SKIPS] = (count, reason)


_GPU_SKIPS = pytest.StashKey[tuple[int, str]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line for all skipped GPU tests instead of one per test."""
    if FAKE_CUPY:
        terminalreporter.write_line(
            "gpu-marked tests ran on the FAKE CuPy (TENSORLIB_FAKE_CUPY=1), not on a GPU"
        )
    count, reason = config.stash.get(_GPU_SKIPS, (0, ""))
    if count:
        terminalreporter.write_line(
            f"{count} gpu-marked tests skipped: no usable CUDA GPU: {reason}"
        )
