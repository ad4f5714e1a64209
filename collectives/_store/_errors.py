"""The store's exceptions: every failure a caller can see is a ``StoreError``."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The store failed: unreachable, refused, closed, or it rejected a request."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store operation (connect, get, wait) did not complete within its timeout."""


class StoreConnectionError(StoreError, ConnectionError):
    """The connection to the store was lost (the process hosting it exited?)."""


class StoreAuthError(StoreError):
    """The store refused this client: wrong or missing shared secret, or protocol mismatch."""


class StoreLimitError(StoreError):
    """The store is full (its key or byte limit); the request did nothing."""
