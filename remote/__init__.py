"""remote: devices that a server hosts, used from a client like local ones (Burn's remote
backend).

A server (``remote.serve([...])`` or ``python -m remote serve``) hosts devices; a client
lists them with :func:`devices` and then runs ordinary tensorlib code on them: ops stream to
the server without waiting (the client assigns ids and infers shapes and dtypes itself), and
only reads (``.item()``, ``.numpy()``, printing) and ``device.synchronize()`` wait. Rank
threads of ``spawn(..., backend="threads", devices=remote.devices(...))`` run DDP over the
devices of one server, reducing on it (``client._engine``). See docs/remote.md.

Layout: ``client/`` (what runs in the user's process) and ``server/`` (what ``serve`` runs)
never import each other; both build on the protocol here, whose codec is the only code that
writes or reads the format: ``_wire`` (frames, the op table, values), ``_handshake`` (a
connection's first frames), ``_records`` (a session's records and replies); and ``_conn``
(frames on a socket), ``_tls`` (both ends' TLS), ``_errors``.
"""

from ._errors import RemoteAuthError, RemoteConnectionError, RemoteError, RemoteOpError
from .client import RemoteHost, close, devices, stats
from .server import RemoteServer, Server, TokenAuthorizer, serve

__all__ = [
    "RemoteAuthError",
    "RemoteConnectionError",
    "RemoteError",
    "RemoteHost",
    "RemoteOpError",
    "RemoteServer",
    "Server",
    "TokenAuthorizer",
    "close",
    "devices",
    "serve",
    "stats",
]
