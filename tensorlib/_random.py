"""Seedable random number generation shared by creation functions, init and dropout.

``default_generator`` is the process's generator, except in a thread that was given its own
with :func:`set_thread_generator` (each rank thread of collectives' ``threads`` backend is):
there every default draw and ``manual_seed`` use that thread's generator, so rank threads
seeding and drawing at once neither race nor see each other's streams.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ._device import Device, _load_cupy

__all__ = ["Generator", "default_generator", "manual_seed", "set_thread_generator"]


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


class _DefaultGenerator(Generator):
    """The default generator: the process's own state, or the calling thread's generator
    when :func:`set_thread_generator` gave it one."""

    def __init__(self, seed: int | None) -> None:
        self._local = threading.local()
        self._shared = Generator(seed)

    def _target(self) -> Generator:
        own: Generator | None = getattr(self._local, "generator", None)
        return own if own is not None else self._shared

    # The state Generator's methods read and write, routed to the thread's generator.
    @property
    def rng(self) -> np.random.Generator:
        return self._target().rng

    @rng.setter
    def rng(self, value: np.random.Generator) -> None:
        self._target().rng = value

    @property
    def seed(self) -> int | None:
        return self._target().seed

    @seed.setter
    def seed(self, value: int | None) -> None:
        self._target().seed = value

    @property
    def _cuda(self) -> dict[int, Any]:
        return self._target()._cuda

    @_cuda.setter
    def _cuda(self, value: dict[int, Any]) -> None:
        self._target()._cuda = value


default_generator: Generator = _DefaultGenerator(0)


def set_thread_generator(generator: Generator | None) -> None:
    """Make ``generator`` the default generator of the calling thread (None: the process's
    again). Other threads keep theirs.

    Raises:
        TypeError: when ``generator`` is not a tensorlib Generator or None.
    """
    if generator is not None and (
        not isinstance(generator, Generator) or isinstance(generator, _DefaultGenerator)
    ):
        raise TypeError(
            f"set_thread_generator takes a tensorlib.Generator or None, got {generator!r}"
        )
    assert isinstance(default_generator, _DefaultGenerator)
    default_generator._local.generator = generator


def manual_seed(seed: int) -> Generator:
    """Seed the default generator (used when no ``generator=`` is given): the process's, or
    in a thread given its own by :func:`set_thread_generator`, that thread's."""
    return default_generator.manual_seed(seed)
