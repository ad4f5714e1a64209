"""The fake CuPy and the fake NCCL in place of the real ones, and everything put back after."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from collectives.backends.nccl import _load as _nccl_load

from . import fake_cupy, fake_nccl


@contextmanager
def fake_gpu_and_nccl() -> Iterator[fake_nccl.FakeNccl]:
    """Install both fakes (the fake CuPy only when it is not in place already), clear
    tensorlib's CUDA device cache so devices resolve against them, and restore it all."""
    from tensorlib import _device

    saved_modules = {k: sys.modules.get(k) for k in fake_cupy.make_modules()}
    saved_device = (_device._cupy, _device._cupy_reason)
    saved_cache = {k: v for k, v in _device.Device._cache.items() if v.type == "cuda"}
    already = type(sys.modules.get("cupy")).__name__ == "module" and getattr(
        sys.modules.get("cupy"), "__version__", ""
    ).endswith("fake")
    if not already:
        fake_cupy.install()
    _device._cupy = None
    _device._cupy_reason = None
    for spec in saved_cache:
        _device.Device._cache.pop(spec, None)
    nccl, previous = fake_nccl.install()
    try:
        yield nccl
    finally:
        _nccl_load.install(previous)
        if not already:
            for k, v in saved_modules.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
            _device._cupy, _device._cupy_reason = saved_device
            for spec in [k for k, v in _device.Device._cache.items() if v.type == "cuda"]:
                del _device.Device._cache[spec]
            _device.Device._cache.update(saved_cache)
