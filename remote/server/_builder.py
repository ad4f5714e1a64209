"""Burn's server builder: :class:`RemoteServer` with :class:`TokenAuthorizer`, an immutable
builder over :func:`serve`, which stays the primary API; both check their arguments with
``_checks`` before anything starts listening.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorlib as tl

from .._handshake import check_token
from ._checks import check_devices, check_host, check_limit, check_port, check_tls
from ._server import Server, serve

__all__ = ["RemoteServer", "TokenAuthorizer"]


class TokenAuthorizer:
    """A server's shared-secret check: clients must prove they know ``token``.

    Args:
        token: a non-empty str or bytes; surrounding whitespace (a file's trailing newline)
            is stripped, as clients strip theirs. The repr never shows it.

    Raises:
        TypeError: ``token`` is not str or bytes.
        ValueError: it is empty (or only whitespace).
    """

    __slots__ = ("_token",)

    def __init__(self, token: str | bytes) -> None:
        self._token = check_token(token, "TokenAuthorizer")

    @property
    def token(self) -> bytes:
        """The secret (UTF-8, whitespace stripped), for :func:`remote.serve`."""
        return self._token

    def __repr__(self) -> str:
        return "TokenAuthorizer(***)"


class RemoteServer:
    """A builder of :func:`remote.serve` (immutable; ``with_*`` return new builders).

    ``RemoteServer(["cpu", "cpu"]).with_authorizer(TokenAuthorizer(t)).serve()`` returns the
    running :class:`remote.Server` (it serves on background threads; close it or use it as a
    context manager).

    Args:
        devices: the local devices to host (``"cpu"``, ``"cuda:0"``, tensorlib devices...).

    Raises:
        TypeError: ``devices`` is a single str, not a list of them.
        ValueError: ``devices`` is empty.
    """

    __slots__ = ("_authorizer", "_devices", "_host", "_max_session_bytes", "_port", "_tls")

    def __init__(self, devices: Sequence[str | tl.Device]) -> None:
        self._devices = check_devices(devices, "RemoteServer")
        self._authorizer: TokenAuthorizer | None = None
        self._host = "127.0.0.1"
        self._port = 0
        self._tls: bool | tuple[str, str] = False
        self._max_session_bytes: int | None = None

    def _copy(self, **changes: object) -> RemoteServer:
        new = RemoteServer(self._devices)
        for slot in self.__slots__:
            object.__setattr__(new, slot, changes.get(slot, getattr(self, slot)))
        return new

    def with_authorizer(self, authorizer: TokenAuthorizer) -> RemoteServer:
        """This server requiring ``authorizer``'s token of every client.

        Raises:
            TypeError: ``authorizer`` is not a :class:`TokenAuthorizer`.
        """
        if not isinstance(authorizer, TokenAuthorizer):
            raise TypeError(
                f"RemoteServer.with_authorizer: expected a remote.TokenAuthorizer, got "
                f"{type(authorizer).__name__}"
            )
        return self._copy(_authorizer=authorizer)

    def with_host(self, host: str) -> RemoteServer:
        """This server listening on ``host`` (default 127.0.0.1; others need an authorizer).

        Raises:
            TypeError: ``host`` is not a str.
            ValueError: it is empty.
        """
        return self._copy(_host=check_host(host, "RemoteServer.with_host"))

    def with_port(self, port: int) -> RemoteServer:
        """This server listening on ``port`` (0, the default: any free one).

        Raises:
            TypeError: ``port`` is not an int.
            ValueError: it is outside 0-65535.
        """
        return self._copy(_port=check_port(port, "RemoteServer.with_port"))

    def with_tls(self, tls: bool | tuple[str, str] = True) -> RemoteServer:
        """This server speaking TLS: True for a fresh self-signed certificate, or
        ``(certfile, keyfile)`` PEM paths; clients pin ``Server.fingerprint``.

        Raises:
            TypeError: ``tls`` is neither a bool nor a pair of paths.
        """
        return self._copy(_tls=check_tls(tls, "RemoteServer.with_tls"))

    def with_max_session_bytes(self, limit: int | None) -> RemoteServer:
        """This server limiting what one session's arrays may hold (None: no limit).

        Raises:
            TypeError: ``limit`` is neither an int nor None.
            ValueError: it is not positive.
        """
        limit = check_limit(limit, "RemoteServer.with_max_session_bytes")
        return self._copy(_max_session_bytes=limit)

    def serve(self) -> Server:
        """Start serving (on background threads; this returns at once).

        Returns:
            The running :class:`remote.Server`: ``address`` for clients, ``close()``.

        Raises:
            ValueError: a non-loopback host without an authorizer, a host that does not
                resolve, or a device that is not local.
            RemoteError: TLS without ``cryptography``.
        """
        token = self._authorizer.token if self._authorizer is not None else None
        return serve(
            list(self._devices),
            host=self._host,
            port=self._port,
            token=token,
            tls=self._tls,
            max_session_bytes=self._max_session_bytes,
        )

    def __repr__(self) -> str:
        auth = ", authorizer=TokenAuthorizer(***)" if self._authorizer is not None else ""
        tls = ", tls" if self._tls else ""
        return f"RemoteServer({list(self._devices)!r}, {self._host}:{self._port}{auth}{tls})"
