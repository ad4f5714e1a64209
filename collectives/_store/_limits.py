"""What one store server holds at most, so no client can exhaust the host or lock ranks out.

Every limit is generous for real jobs (DDP keeps a few keys a rank; thousands of ranks stay
far below them) and can be set by an environment variable read when the server starts:

=============================  ===============  ==================================================
variable                       default          what it bounds
=============================  ===============  ==================================================
``DPT_STORE_MAX_PENDING``      256 (at most a   connections that have not completed the handshake;
                               quarter of the   when full, the oldest is dropped for a new one, so
                               fd limit)        idle peers can never hold the door shut
``DPT_STORE_MAX_KEYS``         1048576          keys in the store; a SET, ADD or COMPARE_SET that
                                                would add one more fails with ``StoreLimitError``
``DPT_STORE_MAX_BYTES``        2 GiB            bytes of keys + values held; a request that would
                                                go over fails with ``StoreLimitError``
=============================  ===============  ==================================================

Fixed per-connection bounds (not settable): a peer gets ``HANDSHAKE_TIMEOUT`` seconds to
prove itself; the server stops reading from a connection while more than
``MAX_QUEUED_REPLY_BYTES`` of its replies wait unread, or while it holds more than
``MAX_BUFFERED_REQUEST_BYTES`` of requests queued behind a waiting GET/WAIT (TCP then holds
the sender back). A stuck or greedy client thus costs at most about one largest frame, the
two bounds and its socket buffers.
"""

from __future__ import annotations

import os
import resource
from typing import NamedTuple

from ._errors import StoreError

MAX_PENDING_ENV = "DPT_STORE_MAX_PENDING"
MAX_KEYS_ENV = "DPT_STORE_MAX_KEYS"
MAX_BYTES_ENV = "DPT_STORE_MAX_BYTES"

DEFAULT_MAX_PENDING = 256
DEFAULT_MAX_KEYS = 1 << 20
DEFAULT_MAX_BYTES = 2 << 30

# A legitimate client answers the greeting in one round trip.
HANDSHAKE_TIMEOUT = 10.0
MAX_QUEUED_REPLY_BYTES = 8 << 20
MAX_BUFFERED_REQUEST_BYTES = 4 << 20


class Limits(NamedTuple):
    """The server's caps (see the module docstring)."""

    max_pending: int
    max_keys: int
    max_bytes: int


def _from_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise StoreError(f"{name}={raw!r}: expected a positive integer (default {default})")
    return value


def _default_max_pending() -> int:
    # Idle peers must never take the file descriptors the server needs for real ranks.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_PENDING
    return max(1, min(DEFAULT_MAX_PENDING, soft // 4))


def limits_from_env() -> Limits:
    """The limits, from the environment where set.

    Raises:
        StoreError: a variable is set to something other than a positive integer.
    """
    return Limits(
        max_pending=_from_env(MAX_PENDING_ENV, _default_max_pending()),
        max_keys=_from_env(MAX_KEYS_ENV, DEFAULT_MAX_KEYS),
        max_bytes=_from_env(MAX_BYTES_ENV, DEFAULT_MAX_BYTES),
    )
