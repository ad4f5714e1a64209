"""remote's server: what ``remote.serve`` and ``python -m remote serve`` run.

Listening, the handshake and heartbeats (``_server``), one session's table and its frames
run in order (``_worker``), the fixed op table (``_ops``), and collectives among one server's
sessions (``_collective``). It speaks to clients only through the protocol in
``remote._wire``.
"""

from ._server import Server, serve

__all__ = ["Server", "serve"]
