"""The threads backend: ranks as threads of one process, meeting in memory.

``_backend.py`` holds the backend; ``_engines.py`` the engine registry by device kind (remote
registers its own through :func:`register_engine`), ``_meet.py`` the in-memory meeting
(rendezvous, signatures, barriers, mailboxes, abort), ``_numpy.py`` and ``_nccl.py`` the
engines, ``_store.py`` the in-process store.
"""

from .._reduce import reduce_in_order
from . import _backend  # noqa: F401  (registers the backend)
from ._engines import (
    EngineSpec,
    ThreadEngine,
    ThreadJob,
    device_kind,
    engine_kinds,
    register_engine,
    unregister_engine,
)
from ._meet import Meeting
from ._numpy import NumpyEngine

__all__ = [
    "EngineSpec",
    "Meeting",
    "NumpyEngine",
    "ThreadEngine",
    "ThreadJob",
    "device_kind",
    "engine_kinds",
    "reduce_in_order",
    "register_engine",
    "unregister_engine",
]
