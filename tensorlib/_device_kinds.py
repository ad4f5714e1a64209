"""Device kinds that live outside tensorlib, named by a URL-like spec (``"remote://h:p/0"``).

tensorlib knows two device types itself, ``cpu`` (NumPy) and ``cuda`` (CuPy). Another package
(``remote``) adds a kind by registering a :class:`DeviceKind` for a scheme and for the array
type its ``xp`` returns; tensorlib then resolves ``Device("scheme://...")`` through it and asks
it for the device of such arrays, and for copies to and from the host. tensorlib never imports
those packages: the registry is filled in by them.

A kind may also supply fused versions of multi-op updates (like torch's ``fused=`` optimizer
kernels) as a ``fused_ops`` mapping of names to functions; tensorlib asks for one by name
(:func:`fused_op`) and falls back to its own op-by-op code when there is none. The one name
used so far is ``"adam"`` (``tensorlib.optim.Adam.step``; its contract is there).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from ._device import Device

__all__ = [
    "DeviceKind",
    "fused_op",
    "kind_of_array",
    "kind_of_device",
    "kind_of_scheme",
    "register",
]


class DeviceKind(Protocol):
    """What tensorlib needs of a device kind it does not implement itself.

    Attributes:
        type: the :attr:`Device.type` of its devices (e.g. ``"remote"``).
    """

    type: str

    def parse(self, spec: str) -> tuple[str, int]:
        """Check ``spec`` (lower-cased) and return its canonical name and device index.

        Raises:
            ValueError: when ``spec`` names no device of this kind (say why).
        """
        ...

    def xp(self, device: Device) -> Any:
        """The array module of ``device`` (NumPy's functions, returning this kind's arrays)."""
        ...

    def synchronize(self, device: Device) -> None:
        """Wait until every operation issued on ``device`` has run."""
        ...

    def device_of(self, array: Any) -> Device:
        """The device an array of this kind lives on."""
        ...

    def to_host(self, array: Any) -> np.ndarray[Any, Any]:
        """A NumPy copy of ``array``."""
        ...

    def from_host(self, array: np.ndarray[Any, Any], device: Device) -> Any:
        """A copy of the NumPy ``array`` on ``device``."""
        ...


_lock = threading.Lock()
_by_scheme: dict[str, DeviceKind] = {}
_by_type: dict[str, DeviceKind] = {}
_by_array_type: dict[type, DeviceKind] = {}


def register(scheme: str, kind: DeviceKind, array_types: tuple[type, ...]) -> None:
    """Make ``Device("<scheme>://...")`` resolve through ``kind``, whose arrays are ``array_types``.

    Raises:
        ValueError: when ``scheme`` or ``kind.type`` is taken by another kind, or is a
            built-in device type.
    """
    with _lock:
        if kind.type in ("cpu", "cuda") or scheme in ("cpu", "cuda"):
            raise ValueError(f"device kind {scheme!r}: 'cpu' and 'cuda' are built in")
        old = _by_scheme.get(scheme)
        if old is not None and old is not kind:
            raise ValueError(f"device scheme {scheme!r} is already registered by {old!r}")
        _by_scheme[scheme] = kind
        _by_type[kind.type] = kind
        for t in array_types:
            _by_array_type[t] = kind


def kind_of_scheme(scheme: str) -> DeviceKind | None:
    """The kind registered for ``scheme``, or None."""
    return _by_scheme.get(scheme)


def kind_of_device(device: Device) -> DeviceKind:
    """The kind of a device that is neither cpu nor cuda."""
    kind = _by_type.get(device.type)
    if kind is None:  # pragma: no cover - Device only makes such devices through a kind
        raise ValueError(f"no device kind is registered for device type {device.type!r}")
    return kind


def kind_of_array(array: Any) -> DeviceKind | None:
    """The kind whose arrays are of ``array``'s type, or None."""
    return _by_array_type.get(type(array))


def fused_op(array: Any, name: str) -> Any:
    """The fused update ``name`` that the kind of ``array`` supplies, or None (always None
    for NumPy and CuPy arrays, and for kinds without a ``fused_ops`` entry ``name``)."""
    kind = _by_array_type.get(type(array))
    if kind is None:
        return None
    return getattr(kind, "fused_ops", {}).get(name)
