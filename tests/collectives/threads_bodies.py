"""Rank bodies of test_threads_backend.py that run in process pools (the other backends)."""

from __future__ import annotations

import collectives as C


def device_and_backend() -> list[str]:
    """``[str(get_device()), device type]`` as a rank of a process backend sees them."""
    dev = C.get_device()
    return [str(dev), dev.type]
