"""The nccl backend: one NCCL communicator per group, driven through ctypes (docs/nccl.md).

``_backend.py`` holds the backend (init, enqueue, completion, failure, lifecycle); ``_ops.py``
the per-op enqueue, ``_sigring.py`` the signature check, ``_watch.py`` the watchdog,
``_peers.py`` the store-key protocol, ``_work.py`` its ``Work``, ``_setup.py`` init and split,
``_cuda.py`` the CUDA seam, ``_lib.py`` the ctypes binding and ``_load.py`` loading it.
"""

from . import _lib as binding  # the binding's constants, for tools
from ._backend import NcclBackend, load_library
from ._lib import Nccl, NcclError, NcclUnavailableError, version_code, version_tuple

__all__ = [
    "Nccl",
    "NcclBackend",
    "NcclError",
    "NcclUnavailableError",
    "binding",
    "load_library",
    "version_code",
    "version_tuple",
]
