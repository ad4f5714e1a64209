"""A small TCP key-value store for rendezvous, hosted by rank 0.

``TCPStore(host, port, is_server=True)`` starts the server on a daemon thread of this process
and connects to it like every other client; ranks > 0 create ``TCPStore(host, port,
is_server=False)``, which retries while the server is not up yet. Keys are strings, values are
bytes. ``get`` and ``wait`` block (on the server, without holding up other clients) until the
keys exist or their timeout passes.

Security: the server binds exactly the address ``host`` names, which must be this machine's
(every interface only with a secret); with a shared secret (argument, or the
``DPT_STORE_SECRET`` environment variable) server and client each prove it to the other by
challenge-response and then seal every frame, so a client never trusts a server that cannot
prove it, nor frames altered on the way. Nothing from the wire is ever unpickled or
evaluated; unauthenticated peers may only send frames of at most ``MAX_HELLO_FRAME`` bytes,
and ``_limits`` caps what any peer can make the server hold.

Where things are: ``_wire`` (the protocol's specification, constants and frame codec),
``_framing`` (frames and their seal, shared with ``remote`` as ``collectives.framing``),
``_actions`` (what each request does, one handler per opcode), ``_server`` (the selector loop,
handshake and waiting requests), ``_client`` (``TCPStore``: requests, replies, the connection
pool), ``_connection`` (connecting with retries, the client's handshake, the secret),
``_addresses`` (loopback and local-address checks, the bind address), ``_limits`` (caps on
pending handshakes, keys, bytes and per-connection buffers), ``_errors`` (the exceptions).

This package imports nothing outside the standard library.
"""

from __future__ import annotations

from ._addresses import is_local_address, is_loopback
from ._client import TCPStore
from ._connection import SECRET_ENV_VAR
from ._errors import (
    StoreAuthError,
    StoreConnectionError,
    StoreError,
    StoreLimitError,
    StoreTimeoutError,
)
from ._wire import (
    MAGIC,
    MAX_FRAME_BYTES,
    MAX_HELLO_FRAME,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MAX_WAIT_KEYS,
    PROTOCOL_VERSION,
)

__all__ = [
    "MAGIC",
    "MAX_FRAME_BYTES",
    "MAX_HELLO_FRAME",
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_WAIT_KEYS",
    "PROTOCOL_VERSION",
    "SECRET_ENV_VAR",
    "StoreAuthError",
    "StoreConnectionError",
    "StoreError",
    "StoreLimitError",
    "StoreTimeoutError",
    "TCPStore",
    "is_local_address",
    "is_loopback",
]
