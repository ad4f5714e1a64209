"""remote's server: what ``remote.serve`` and ``python -m remote serve`` run.

Listening, the handshake and heartbeats (``_server``), one session's table and its frames
run in order (``_worker``), the fixed op table (``_ops``), collectives among one server's
sessions (``_collective``), and Burn's builder over ``serve`` (``_builder``). It speaks to
clients only through the protocol in ``remote._wire``.
"""

from ._builder import RemoteServer, TokenAuthorizer
from ._server import Server, serve

__all__ = ["RemoteServer", "Server", "TokenAuthorizer", "serve"]
