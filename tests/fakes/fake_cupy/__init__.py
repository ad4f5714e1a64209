"""A fake CuPy over host memory, so that GPU code paths run (and fail loudly) without a GPU.

:func:`install` puts ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime``, ``cupy.random`` and
``cupyx`` into ``sys.modules`` (``tests/conftest.py`` does it when ``TENSORLIB_FAKE_CUPY=1``).
An array keeps its data in a private NumPy array, but it is *not* a NumPy array, and it is as
strict as real CuPy wherever code that is wrong on a GPU would still pass on NumPy:

* ``isinstance(x, numpy.ndarray)`` is False (as for a real CuPy array; an ndarray subclass would
  take NumPy branches such as ``a.get() if not isinstance(a, np.ndarray) else a``), and
  ``numpy.asarray(x)`` or any implicit conversion raises ``TypeError`` ("Implicit conversion to
  a NumPy array is not allowed"): code must call ``x.get()``.
* Kernels (operators, ufuncs, reductions, ``where``, ``concatenate``...) refuse NumPy arrays,
  0-d ones included (``TypeError: Unsupported type <class 'numpy.ndarray'>``); Python and NumPy
  scalars are fine. Their results are fake arrays, 0-d ones too (never NumPy scalars).
* New arrays live on the *current* device (``with cupy.cuda.Device(1): ...``), views on their
  base's; ``x.device.id`` tells which. A kernel given an array from another device raises
  ``ValueError``, as CuPy does where GPUs have no peer access (with peer access CuPy computes
  on the current device, silently leaving the result on another GPU than its input).
* NumPy or list *index arrays* raise ``TypeError``: CuPy accepts them but copies them to the
  device synchronously on every use (``config.allow_host_index = True`` accepts them).
* ``a[basic_index] = numpy_array`` raises ``ValueError`` ("non-scalar numpy.ndarray cannot be
  used for fill"), ``cupyx.scatter_add`` accepts only CuPy's dtypes, ``Generator.random`` only
  float32/float64, copying a strided array between devices raises ``NotImplementedError``, and
  ``empty`` is filled with NaN (or the largest integer) the way device memory holds garbage.
* Only the API built in :func:`make_modules` exists; anything else raises ``AttributeError``.
* Integer index arrays are *not* bounds-checked, as in CuPy: ``a[idx]``, ``a[idx] = v`` and
  ``cupyx.scatter_add`` wrap an index ``i`` of an axis of ``n`` to ``i mod n`` (a Python int
  index still raises ``IndexError``, as in CuPy).

Streams are asynchronous as on a GPU (see ``_stream``): kernels run on the host at once, but
the null stream's events complete a moment after their record; other streams are ordered
queues with a thread each, for the asynchronous work a communication library enqueues
(``memcpyAsync``, ``ndarray.set(stream=)``, the fake NCCL), with events that complete when the
work before them has run. Streams and events belong to a device (recording an event on another
device's stream raises), and :func:`host_syncs` lists what made a host thread wait for the
device, so a test can require a step without host synchronization.

Deliberate differences: NumPy 2's type promotion rules apply (those of CuPy 14, which the
project requires), kernels compute at once (their streams' asynchrony is modelled, see
above), and broadcast views are read-only.

The package: ``_device`` (knobs, devices, the runtime's device calls), ``_stream`` (streams,
events, pinned memory, ``memcpyAsync``), ``_array`` (``ndarray`` and the kernel plumbing),
``_functions`` (``cupy``/``cupy.random``/``cupyx`` functions and the table of what ``cupy``
holds); this module builds the modules from them.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import MutableMapping
from typing import Any

from ._array import ndarray
from ._device import (
    CUDARuntimeError,
    Device,
    MemoryPointer,
    _can_access_peer,
    _device_properties,
    _get_device,
    _get_device_count,
    _is_available,
    _runtime_version,
    _set_device,
    config,
    reset,
)
from ._functions import _MODULES, API, CONSTANTS, Generator, default_rng, scatter_add
from ._stream import (
    _MEMCPY_KINDS,
    Event,
    PinnedMemoryPointer,
    Stream,
    _memcpy_async,
    alloc_pinned_memory,
    get_current_stream,
    get_elapsed_time,
    host_syncs,
)
from ._stream import (
    _stream_for as _stream_for,  # fake_nccl resolves cudaStream_t handles with it
)

__all__ = [
    "CUDARuntimeError",
    "Device",
    "Event",
    "Generator",
    "MemoryPointer",
    "PinnedMemoryPointer",
    "Stream",
    "alloc_pinned_memory",
    "config",
    "get_current_stream",
    "get_elapsed_time",
    "host_syncs",
    "install",
    "make_modules",
    "ndarray",
    "reset",
    "scatter_add",
]


# Tracebacks and error records name the public classes as before the fake became a package.
_CLASSES = (CUDARuntimeError, Device, MemoryPointer, Stream, Event, PinnedMemoryPointer, Generator)
for _cls in _CLASSES:
    _cls.__module__ = __name__


def _module(name: str, attrs: dict[str, Any], package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name, f"Fake {name} (tests/fakes/fake_cupy): host memory, no GPU.")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        mod.__path__ = []
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def make_modules() -> dict[str, types.ModuleType]:
    """Fresh ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime``, ``cupy.random``, ``cupyx`` modules."""
    runtime = _module(
        "cupy.cuda.runtime",
        {
            "CUDARuntimeError": CUDARuntimeError,
            "getDeviceCount": _get_device_count,
            "getDevice": _get_device,
            "setDevice": _set_device,
            "runtimeGetVersion": _runtime_version,
            "driverGetVersion": _runtime_version,
            "getDeviceProperties": _device_properties,
            "deviceCanAccessPeer": _can_access_peer,
            "is_hip": False,
            "memcpyAsync": _memcpy_async,
            **{f"memcpy{kind}": code for code, kind in _MEMCPY_KINDS.items()},
        },
    )
    cuda = _module(
        "cupy.cuda",
        {
            "Device": Device,
            "MemoryPointer": MemoryPointer,
            "runtime": runtime,
            "is_available": _is_available,
            "get_device_id": _get_device,
            "Stream": Stream,
            "Event": Event,
            "get_current_stream": get_current_stream,
            "get_elapsed_time": get_elapsed_time,
            "alloc_pinned_memory": alloc_pinned_memory,
            "PinnedMemoryPointer": PinnedMemoryPointer,
        },
        package=True,
    )
    random = _module("cupy.random", {"Generator": Generator, "default_rng": default_rng})
    cupy = _module("cupy", {**CONSTANTS, **API, "cuda": cuda, "random": random}, package=True)
    cupyx = _module("cupyx", {"scatter_add": scatter_add}, package=True)
    modules = {
        "cupy": cupy,
        "cupy.cuda": cuda,
        "cupy.cuda.runtime": runtime,
        "cupy.random": random,
        "cupyx": cupyx,
    }
    _MODULES.clear()
    _MODULES.update(modules)
    return modules


def install(
    target: MutableMapping[str, Any] | None = None,
    *,
    device_count: int = 2,
    peer_access: bool = False,
    allow_host_index: bool = False,
) -> dict[str, types.ModuleType]:
    """Put the fake modules into ``target`` (``sys.modules`` by default) and reset the fake.

    Returns the modules, e.g. to undo with ``monkeypatch.setitem`` instead: pass a dict and
    install each entry yourself.
    """
    reset(device_count=device_count, peer_access=peer_access, allow_host_index=allow_host_index)
    modules = make_modules()
    (sys.modules if target is None else target).update(modules)
    return modules
