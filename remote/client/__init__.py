"""remote's client: what runs in the user's process.

Reaching a server and its device kind (``_client``), one session a device (``_session``:
records, frames, reads), the array handle and its arithmetic (``_array``), its movement
and indexing (``_movement``: which results are views), the device's ``xp`` (``_namespace``),
shape and dtype inference (``_infer``), the fused ops tensorlib asks the
device kind for (``_fused``), the threads backend's engine for remote arrays
(``_engine``) and ``DistributedContext``'s engine for remote device lists
(``_context_engine``), and Burn's ``RemoteHost`` over ``devices`` (``_host``). It speaks to
the server only through the protocol in ``remote._wire``.
"""

from . import (
    _context_engine,  # noqa: F401  (registers DistributedContext's "remote" engine)
    _engine,  # noqa: F401  (registers the threads backend's "remote" engine)
)
from ._client import close, devices, stats
from ._host import RemoteHost

__all__ = ["RemoteHost", "close", "devices", "stats"]
