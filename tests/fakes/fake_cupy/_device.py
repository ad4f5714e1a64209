"""The fake's GPUs: its knobs, the current device of each host thread, ``cupy.cuda.Device``,
``MemoryPointer`` and the ``cupy.cuda.runtime`` calls about devices."""

from __future__ import annotations

import threading
from typing import Any


class _Config:
    """Module-wide knobs of the fake (set them with :func:`reset` or :func:`install`)."""

    def __init__(self) -> None:
        self.device_count = 2
        self.peer_access = False
        # CuPy accepts NumPy/list index arrays, at the cost of a synchronous host-to-device copy
        # on every use; the fake refuses them unless this is set, so they are not left behind.
        self.allow_host_index = False


config = _Config()


class _Current(threading.local):
    # The current CUDA device is per host thread, as in the CUDA runtime.
    def __init__(self) -> None:
        self.device = 0


_current = _Current()


def reset(device_count: int = 2, peer_access: bool = False, allow_host_index: bool = False) -> None:
    """Set the fake's knobs (see :class:`_Config`) and make GPU 0 current on this thread."""
    config.device_count = device_count
    config.peer_access = peer_access
    config.allow_host_index = allow_host_index
    _current.device = 0


class CUDARuntimeError(RuntimeError):
    """What the CUDA runtime raises (here only for an invalid device ordinal)."""


def _check_ordinal(device_id: int) -> None:
    if not 0 <= device_id < config.device_count:
        raise CUDARuntimeError(
            f"cudaErrorInvalidDevice: invalid device ordinal {device_id} "
            f"({config.device_count} fake GPU(s))"
        )


class Device:
    """``cupy.cuda.Device``: ``with Device(i):`` makes GPU ``i`` current; ``use()`` for good."""

    def __init__(self, device: Any = None) -> None:
        if device is None:
            self.id = _current.device
        elif isinstance(device, Device):
            self.id = device.id
        else:
            self.id = int(device)
        self._previous: list[int] = []

    def __enter__(self) -> Device:
        _check_ordinal(self.id)
        self._previous.append(_current.device)
        _current.device = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _current.device = self._previous.pop()

    def use(self) -> None:
        """Make this device current (until changed again)."""
        _check_ordinal(self.id)
        _current.device = self.id

    def synchronize(self) -> None:
        """Wait for the device's null stream (a host synchronization)."""
        _check_ordinal(self.id)
        from ._stream import Stream, _note_sync  # _stream imports this module

        _note_sync("Device.synchronize")
        Stream.null._wait_for(Stream.null._submitted)

    @property
    def compute_capability(self) -> str:
        return "90"

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("fake-cuda-device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class MemoryPointer:
    """``cupy.cuda.MemoryPointer`` (``ptr`` is a host address here)."""

    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr = ptr
        self.device_id = device_id

    @property
    def device(self) -> Device:
        return Device(self.device_id)


# ---------------------------------------------------------------------------- cupy.cuda.runtime
def _get_device_count() -> int:
    return config.device_count


def _get_device() -> int:
    return _current.device


def _set_device(device_id: int) -> None:
    Device(device_id).use()


def _runtime_version() -> int:
    return 12080


def _device_properties(device_id: int) -> dict[str, Any]:
    _check_ordinal(device_id)
    return {
        "name": b"Fake GPU (host memory)",
        "totalGlobalMem": 8 * 2**30,
        "major": 9,
        "minor": 0,
        "multiProcessorCount": 1,
        "pciBusID": device_id,
    }


def _can_access_peer(device_id: int, peer_device_id: int) -> int:
    return int(config.peer_access)


def _is_available() -> bool:
    return config.device_count > 0
