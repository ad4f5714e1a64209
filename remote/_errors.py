"""The errors of remote devices."""

from __future__ import annotations

__all__ = ["RemoteAuthError", "RemoteConnectionError", "RemoteError", "RemoteOpError"]


class RemoteError(RuntimeError):
    """Base class of every error about a remote device or its server."""


class RemoteAuthError(RemoteError):
    """The token (or the pinned TLS fingerprint) did not match on one side or the other."""


class RemoteConnectionError(RemoteError):
    """The server could not be reached, or the connection to it was lost."""


class RemoteOpError(RemoteError):
    """An op failed on the server; raised at the client's next read.

    Attributes:
        op: the op's name (``"matmul"``).
        site: where the client issued it (``"train.py:42 in step"``), or ``"?"``.
    """

    def __init__(self, message: str, op: str = "?", site: str = "?") -> None:
        super().__init__(message)
        self.op = op
        self.site = site
