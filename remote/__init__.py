"""remote: devices that a server hosts, used from a client like local ones (Burn's remote
backend).

A server (``remote.serve([...])`` or ``python -m remote serve``) hosts devices; a client
lists them with :func:`devices` and then runs ordinary tensorlib code on them: ops stream to
the server without waiting (the client assigns ids and infers shapes and dtypes itself), and
only reads (``.item()``, ``.numpy()``, printing) and ``device.synchronize()`` wait. Rank
threads of ``spawn(..., backend="threads", devices=remote.devices(...))`` run DDP over the
devices of one server, reducing on it (``_engine``). See docs/remote.md.
"""

from . import _engine  # noqa: F401  (registers the threads backend's "remote" engine)
from ._client import close, devices, stats
from ._errors import RemoteAuthError, RemoteConnectionError, RemoteError, RemoteOpError
from ._server import Server, serve

__all__ = [
    "RemoteAuthError",
    "RemoteConnectionError",
    "RemoteError",
    "RemoteOpError",
    "Server",
    "close",
    "devices",
    "serve",
    "stats",
]
