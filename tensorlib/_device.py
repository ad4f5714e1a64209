"""Devices: ``"cpu"`` runs on NumPy, ``"cuda:N"`` on CuPy on GPU N.

Logical CPU devices ``"cpu:1"``, ``"cpu:2"``, ... are distinct devices on host memory (as JAX's
host platform device count): tensors on two of them cannot be mixed in one op, and ``.to``
between them copies. ``"cpu:0"`` is ``"cpu"``. :meth:`Device.enumerate` lists the devices of a
type (``"cpu"``: as many as :func:`set_cpu_device_count` or ``TENSORLIB_CPU_DEVICES`` ask for,
default 1; ``"cuda"``: every visible GPU; an object with a ``devices()`` method, such as
``remote.RemoteHost``: its devices), so code written for several GPUs runs on a laptop;
:meth:`Device.remote_options` ``(host).init()`` connects one device of such a host.

CuPy is optional and imported lazily, the first time a CUDA device is asked for. When it cannot
be used, the original reason is kept and every later request raises one clear
:class:`CudaUnavailableError` that says what is missing and how to install it.
"""

from __future__ import annotations

import enum
import os
import threading
from types import ModuleType
from typing import Any

import numpy as np

from . import _device_kinds

__all__ = [
    "CudaUnavailableError",
    "Device",
    "DeviceList",
    "DeviceType",
    "RemoteOptions",
    "cpu_device_count",
    "cuda_device_count",
    "cuda_is_available",
    "cuda_unavailable_reason",
    "device",
    "device_of",
    "is_device_spec",
    "set_cpu_device_count",
]

CPU_DEVICES_ENV = "TENSORLIB_CPU_DEVICES"
_cpu_count: int | None = None  # set_cpu_device_count's value; None: the environment's

_INSTALL_HINT = (
    "Install the GPU extra that matches your driver: `pip install .[cuda12]` (CUDA 12) or "
    "`pip install .[cuda13]` (CUDA 13)."
)


class CudaUnavailableError(RuntimeError):
    """A CUDA device was requested but CuPy, the driver or a GPU is missing."""


_cupy: ModuleType | None = None
_cupy_reason: str | None = None
_cupy_lock = threading.Lock()


def _load_cupy() -> ModuleType:
    """Import CuPy once and check that it sees at least one GPU."""
    global _cupy, _cupy_reason
    if _cupy is not None:
        return _cupy
    with _cupy_lock:
        if _cupy is not None:
            return _cupy
        if _cupy_reason is not None:
            raise CudaUnavailableError(_cupy_reason)
        try:
            import cupy
        except Exception as exc:  # ImportError, or a CuPy built for another CUDA version
            _cupy_reason = (
                f"CuPy is not installed or failed to import ({type(exc).__name__}: {exc}). "
                + _INSTALL_HINT
            )
            raise CudaUnavailableError(_cupy_reason) from exc
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as exc:  # no driver, or driver older than CuPy's CUDA
            _cupy_reason = (
                f"CuPy {cupy.__version__} is installed but found no usable NVIDIA driver "
                f"({type(exc).__name__}: {exc}). Check `nvidia-smi`; if the driver is older than "
                f"CuPy's CUDA version, install the other extra. " + _INSTALL_HINT
            )
            raise CudaUnavailableError(_cupy_reason) from exc
        if count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            _cupy_reason = (
                f"CuPy {cupy.__version__} is installed but no CUDA GPU is visible"
                + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
                + "."
            )
            raise CudaUnavailableError(_cupy_reason)
        _cupy = cupy
        return cupy


def cuda_is_available() -> bool:
    """Return True when CuPy imports and sees at least one GPU."""
    try:
        _load_cupy()
    except CudaUnavailableError:
        return False
    return True


def cuda_unavailable_reason() -> str | None:
    """Return why CUDA cannot be used, or None when it can."""
    try:
        _load_cupy()
    except CudaUnavailableError as exc:
        return str(exc)
    return None


def cuda_device_count() -> int:
    """Return the number of visible GPUs (0 when CUDA is unavailable)."""
    try:
        cp = _load_cupy()
    except CudaUnavailableError:
        return 0
    return int(cp.cuda.runtime.getDeviceCount())


class Device:
    """A place where arrays live, with the array module that computes on it.

    ``Device("cpu")`` uses NumPy; ``Device("cuda")`` / ``Device("cuda:N")`` use CuPy on GPU N.
    ``Device("cpu:N")`` is the N-th logical CPU device (NumPy too; ``"cpu:0"`` is ``"cpu"``).
    ``Device("scheme://...")`` names a device of a kind another package registered
    (``remote://HOST:PORT/INDEX`` once ``remote.devices`` reached that server).
    Devices are interned: equal specs give the same object, so ``is`` comparisons are valid.

    Attributes:
        type: ``"cpu"``, ``"cuda"``, or a registered kind's type (``"remote"``).
        index: GPU ordinal for CUDA devices, N for ``cpu:N`` (None for ``cpu``, which is
            ``cpu:0``), the kind's index for others.
    """

    __slots__ = ("_name", "index", "type")
    _cache: dict[str, Device] = {}  # noqa: RUF012  (class-level intern table)

    type: str
    index: int | None
    _name: str

    def __new__(cls, spec: str | Device = "cpu") -> Device:
        if isinstance(spec, Device):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"device must be a str like 'cpu' or 'cuda:0', got {spec!r}")
        cached = cls._cache.get(spec)
        if cached is not None:
            return cached
        name = spec.strip().lower()
        if "://" in name:
            return cls._of_kind(spec, name)
        if name == "cpu" or name == "cpu:0":
            kind, index = "cpu", None
        elif name.startswith("cpu:"):
            tail = name[4:]
            if not tail.isdigit():
                raise ValueError(f"invalid CPU device {spec!r}: expected 'cpu' or 'cpu:N'")
            kind, index = "cpu", int(tail)
        elif name == "cuda" or name.startswith("cuda:"):
            kind = "cuda"
            tail = name[5:] if name.startswith("cuda:") else ""
            if name == "cuda":  # only bare "cuda" means GPU 0; "cuda:" is a malformed spec
                index = 0
            elif tail.isdigit():
                index = int(tail)
            else:
                raise ValueError(f"invalid CUDA device {spec!r}: expected 'cuda' or 'cuda:N'")
        else:
            raise ValueError(
                f"unknown device {spec!r}: expected 'cpu', 'cpu:N', 'cuda' or 'cuda:N'"
            )
        canonical = f"{kind}:{index}" if index is not None else "cpu"
        if kind == "cuda" and canonical not in cls._cache:  # the first use checks the GPU exists
            cp = _load_cupy()
            count = int(cp.cuda.runtime.getDeviceCount())
            assert index is not None
            if index >= count:
                raise CudaUnavailableError(
                    f"device {canonical!r} requested but only {count} GPU(s) are visible"
                )
        return cls._intern(spec, canonical, kind, index)

    @classmethod
    def _intern(cls, spec: str, canonical: str, kind: str, index: int | None) -> Device:
        """The one Device named ``canonical`` (made on first use), cached under ``spec`` too."""
        dev = cls._cache.get(canonical)
        if dev is None:
            dev = object.__new__(cls)
            dev.type = kind
            dev.index = index
            dev._name = canonical
            cls._cache[canonical] = dev
        cls._cache[spec] = dev
        return dev

    @classmethod
    def _of_kind(cls, spec: str, name: str) -> Device:
        """The device ``spec`` names through the kind registered for its scheme."""
        scheme = name.split("://", 1)[0]
        kind = _device_kinds.kind_of_scheme(scheme)
        if kind is None:
            hint = " (import remote first)" if scheme == "remote" else ""
            raise ValueError(
                f"unknown device {spec!r}: no device kind {scheme!r} is registered{hint}"
            )
        canonical, index = kind.parse(name)
        return cls._intern(spec, canonical, kind.type, index)

    @staticmethod
    def enumerate(device_type: DeviceType | str | Any = "cpu") -> DeviceList:
        """Every device of ``device_type`` (Burn's ``Device::enumerate(DeviceType::...)``).

        Args:
            device_type: ``"cpu"`` (the logical CPU devices: :func:`cpu_device_count` of them,
                ``cpu``, ``cpu:1``, ...), ``"cuda"`` (every visible GPU, none without CUDA), a
                :class:`DeviceType`, or a host object with a ``devices()`` method (such as
                ``remote.RemoteHost``), whose devices are returned.

        Raises:
            ValueError: for a type that is none of these.
        """
        if isinstance(device_type, str):  # DeviceType is a str enum: its value is the type
            kind = str(device_type.value if isinstance(device_type, DeviceType) else device_type)
            if kind == "cpu":
                n = cpu_device_count()
                return DeviceList(Device(f"cpu:{i}") for i in range(n))
            if kind == "cuda":
                return DeviceList(Device(f"cuda:{i}") for i in range(cuda_device_count()))
            raise ValueError(
                f"Device.enumerate: unknown device type {device_type!r}; expected 'cpu', "
                "'cuda', a DeviceType, or a host with a devices() method (remote.RemoteHost)"
            )
        listing = getattr(device_type, "devices", None)
        if not callable(listing):
            raise ValueError(
                f"Device.enumerate: {device_type!r} is not a device type; expected 'cpu', "
                "'cuda', a DeviceType, or a host with a devices() method (remote.RemoteHost)"
            )
        return DeviceList(Device(d) for d in listing())

    @staticmethod
    def remote_options(host: Any) -> RemoteOptions:
        """Options to connect one device of ``host`` (Burn's ``Device::remote_options(&host)``);
        ``.init()`` connects and returns the device.

        Args:
            host: an object with a ``devices()`` method, such as ``remote.RemoteHost``.

        Raises:
            TypeError: ``host`` has no ``devices()`` method.
        """
        return RemoteOptions(host)

    @property
    def xp(self) -> Any:
        """The array module of this device: ``numpy``, ``cupy`` or a registered kind's."""
        if self.type == "cpu":
            return np
        if self.type == "cuda":
            return _load_cupy()
        return _device_kinds.kind_of_device(self).xp(self)

    @property
    def is_cuda(self) -> bool:
        """True for CUDA devices."""
        return self.type == "cuda"

    def synchronize(self) -> None:
        """Wait for all queued work on this device (a no-op on the CPU)."""
        if self.type == "cuda":
            cp = _load_cupy()
            with cp.cuda.Device(self.index):
                cp.cuda.Device(self.index).synchronize()
        elif self.type != "cpu":
            _device_kinds.kind_of_device(self).synchronize(self)

    def __enter__(self) -> Device:
        """Make this the current CUDA device for array creation (no-op on the CPU)."""
        if self.type == "cuda":
            cp = _load_cupy()
            ctx = cp.cuda.Device(self.index)
            ctx.__enter__()
            _ctx_stack.stack.append(ctx)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.type == "cuda":
            _ctx_stack.stack.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"device({self._name!r})"

    def __str__(self) -> str:
        return self._name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = Device(other)
            except (ValueError, TypeError, CudaUnavailableError):
                return False
        return self is other

    def __hash__(self) -> int:
        return hash(self._name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Device, (self._name,))


class _CtxStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []


_ctx_stack = _CtxStack()
CPU = Device("cpu")


class DeviceType(enum.StrEnum):
    """The device types :meth:`Device.enumerate` lists (Burn's ``DeviceType``; ``Cpu`` and
    ``Cuda`` are Burn's spellings of the same members). Remote hosts are passed as they are:
    ``Device.enumerate(remote.RemoteHost("host:port"))``, or ``DeviceType.Remote(host)``."""

    CPU = "cpu"
    CUDA = "cuda"
    Cpu = "cpu"
    Cuda = "cuda"

    @staticmethod
    def Remote(host: Any) -> Any:
        """``host`` itself: what :meth:`Device.enumerate` lists the devices of."""
        return host


class RemoteOptions:
    """Which device of a host :meth:`Device.remote_options` connects: the host's first
    (Burn's default device) unless :meth:`index` says otherwise (it returns new options).

    Args:
        host: an object with a ``devices()`` method, such as ``remote.RemoteHost``.
        index: the device's position in ``host.devices()``.

    Raises:
        TypeError: ``host`` has no ``devices()`` method, or ``index`` is not an int.
        ValueError: ``index`` is negative.
    """

    __slots__ = ("_host", "_index")

    def __init__(self, host: Any, index: int = 0) -> None:
        if not callable(getattr(host, "devices", None)):
            raise TypeError(
                f"Device.remote_options: {host!r} is not a host; expected an object with a "
                "devices() method, such as remote.RemoteHost('HOST:PORT')"
            )
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"Device.remote_options: index must be an int, got {index!r}")
        if index < 0:
            raise ValueError(f"Device.remote_options: index must be >= 0, got {index}")
        self._host = host
        self._index = index

    def index(self, index: int) -> RemoteOptions:
        """These options for the host's device at ``index`` (0, the default: its first).

        Raises:
            TypeError: ``index`` is not an int.
            ValueError: it is negative.
        """
        return RemoteOptions(self._host, index)

    def init(self) -> Device:
        """Connect to the host and return its device (Burn's ``.init()``).

        Returns:
            The device, ready for ``tl.ones(..., device=d)`` and ``model.to(d)``.

        Raises:
            ValueError: the host has no device at the chosen index.
            Exception: whatever the host's ``devices()`` raises when it cannot connect
                (``remote.RemoteAuthError``, ``remote.RemoteConnectionError``).
        """
        # Listing the devices connects and authenticates: a wrong token or an unreachable
        # server fails here, not at the first op (Burn's init returns that error).
        found = list(self._host.devices())
        if self._index >= len(found):
            raise ValueError(
                f"Device.remote_options: {self._host!r} hosts {len(found)} device(s); there is "
                f"no device at index {self._index}"
            )
        return Device(found[self._index])

    def __repr__(self) -> str:
        return f"Device.remote_options({self._host!r}).index({self._index})"


class DeviceList(list[Device]):
    """A list of devices; ``into_vec()`` (Burn's spelling) gives a plain list."""

    def into_vec(self) -> list[Device]:
        """The devices as a plain list."""
        return list(self)


def cpu_device_count() -> int:
    """How many logical CPU devices :meth:`Device.enumerate` lists: the value of
    :func:`set_cpu_device_count`, else ``TENSORLIB_CPU_DEVICES`` (default 1).

    Raises:
        ValueError: ``TENSORLIB_CPU_DEVICES`` is not a positive integer.
    """
    if _cpu_count is not None:
        return _cpu_count
    raw = os.environ.get(CPU_DEVICES_ENV, "1").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{CPU_DEVICES_ENV}={raw!r}: expected a positive integer (default 1)")
    return int(raw)


def set_cpu_device_count(count: int | None) -> None:
    """Make :meth:`Device.enumerate` ``("cpu")`` list ``count`` logical CPU devices (None: back
    to ``TENSORLIB_CPU_DEVICES``). ``Device("cpu:N")`` works whatever the count.

    Raises:
        ValueError: ``count`` is not a positive integer.
    """
    global _cpu_count
    if count is not None and (type(count) is not int or count < 1):
        raise ValueError(f"set_cpu_device_count: expected a positive integer, got {count!r}")
    _cpu_count = count


def device(spec: str | Device | None = None) -> Device:
    """Return the :class:`Device` for ``spec`` (``None`` means the CPU)."""
    if spec is None:
        return CPU
    return Device(spec)


def device_of(array: Any) -> Device:
    """Return the device an array lives on (NumPy -> cpu, CuPy -> cuda:N, a registered
    kind's array -> its device)."""
    if isinstance(array, np.ndarray | np.generic):
        return CPU
    mod = type(array).__module__
    if mod.startswith("cupy"):
        return Device(f"cuda:{array.device.id}")
    kind = _device_kinds.kind_of_array(array)
    if kind is not None:
        return kind.device_of(array)
    raise TypeError(f"expected a NumPy or CuPy array, got {type(array).__name__}")


def is_device_spec(value: Any) -> bool:
    """True for a Device or a string naming one (``"cpu"``, ``"cuda..."``, ``"scheme://..."``),
    as opposed to a dtype given where a device may be (``t.to("float64")``)."""
    if isinstance(value, Device):
        return True
    return isinstance(value, str) and (
        value == "cpu" or value.startswith(("cpu:", "cuda")) or "://" in value
    )
