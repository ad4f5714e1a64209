"""Seedable random number generation shared by creation functions, init and dropout."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._device import Device, _load_cupy

__all__ = ["Generator", "default_generator", "manual_seed"]


class Generator:
    """A seedable source of random numbers for every device.

    On the CPU it draws from NumPy's PCG64. On a GPU it keeps one CuPy generator per device,
    seeded from the host stream the first time that device is used, so results are
    reproducible for a given seed and order of calls. Parameter initialization (``rand``,
    ``randn`` with ``device`` given) draws on the host and copies, so a model initialized from a
    seed has the same values on every device.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.manual_seed(seed)

    def manual_seed(self, seed: int | None) -> Generator:
        """Reset the generator to ``seed`` (None draws fresh entropy)."""
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._cuda: dict[int, Any] = {}
        return self

    def cuda_rng(self, device: Device) -> Any:
        """The CuPy generator for ``device`` (created on first use)."""
        rng = self._cuda.get(device.index or 0)
        if rng is None:
            cp = _load_cupy()
            with cp.cuda.Device(device.index):
                rng = cp.random.default_rng(int(self.rng.integers(0, 2**63 - 1)))
            self._cuda[device.index or 0] = rng
        return rng

    def random(self, shape: tuple[int, ...], dtype: Any, device: Device) -> Any:
        """Uniform [0, 1) samples of ``shape`` on ``device`` (generated there)."""
        if device.type != "cuda":  # on the CPU; for a registered kind (remote), drawn here
            host = self.rng.random(shape, dtype=np.float32 if dtype == np.float16 else dtype)
            host = host.astype(dtype, copy=False)
            return host if device.type == "cpu" else device.xp.asarray(host)
        cp = _load_cupy()
        with cp.cuda.Device(device.index):
            rng = self.cuda_rng(device)
            dt = np.float32 if dtype == np.float16 else dtype
            return rng.random(shape, dtype=dt).astype(dtype, copy=False)

    def get_state(self) -> dict[str, Any]:
        """The host generator's state (a JSON-able dict)."""
        return dict(self.rng.bit_generator.state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`get_state`."""
        self.rng.bit_generator.state = state


default_generator = Generator(0)


def manual_seed(seed: int) -> Generator:
    """Seed the default generator (used when no ``generator=`` is given)."""
    return default_generator.manual_seed(seed)
