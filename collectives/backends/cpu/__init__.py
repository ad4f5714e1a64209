"""The cpu backend: ranks of one host meet in a shared-memory segment (docs/collectives.md).

``_backend.py`` holds the backend (setup, algorithms), ``_layout.py`` the segment's layout,
``_sync.py`` the lockstep protocol (and the compiled helper, ``_cshm.c``), ``_shared.py``
the arrays it reads in place, ``_shm.py`` segments, the futex and the sweep of dead creators'
segments, ``_last_words.py`` what a dying rank tells its peers.
"""

from ._backend import CpuBackend
from ._sync import native_module

__all__ = ["CpuBackend", "native_module"]
