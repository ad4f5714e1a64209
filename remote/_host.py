"""Burn's names for the two ends: :class:`RemoteHost` (a client's view of a server, as
Burn's ``RemoteDevice``/host address with a credential) and :class:`RemoteServer` with
:class:`TokenAuthorizer` (Burn's server builder). Both are thin, immutable builders over
:func:`remote.devices` and :func:`remote.serve`, which stay the primary API; this module sits
above ``client`` and ``server`` (as ``remote/__init__`` does), so it may import both.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import tensorlib as tl

from .client import devices as _devices
from .server import Server, serve

__all__ = ["RemoteHost", "RemoteServer", "TokenAuthorizer"]

# The same shape remote.devices parses: HOST:PORT, an IPv6 host in brackets.
_ADDRESS = re.compile(r"\[?([^\[\]]+?)\]?:(\d+)")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def _check_address(address: object) -> str:
    if not isinstance(address, str):
        raise TypeError(f"RemoteHost: address must be a 'HOST:PORT' str, got {address!r}")
    m = _ADDRESS.fullmatch(address.strip())
    if m is None or not m.group(1).strip():
        raise ValueError(f"RemoteHost: address must be 'HOST:PORT', got {address!r}")
    port = int(m.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"RemoteHost: address {address!r} has port {port}; expected 1-65535")
    return address.strip()


def _check_token(token: object, who: str) -> str | bytes:
    if not isinstance(token, (str, bytes)):
        raise TypeError(f"{who}: token must be a str or bytes, got {type(token).__name__}")
    if not token:
        raise ValueError(f"{who}: token must not be empty")
    return token


def _check_fingerprint(fingerprint: object) -> str:
    # remote.devices pins SHA-256 hex, colons and case ignored (what `serve --tls` prints).
    if not isinstance(fingerprint, str):
        raise TypeError(
            f"RemoteHost: fingerprint must be a str (SHA-256 hex), got {type(fingerprint).__name__}"
        )
    if _FINGERPRINT.fullmatch(fingerprint.replace(":", "").strip().lower()) is None:
        raise ValueError(
            "RemoteHost: fingerprint must be the server certificate's SHA-256 as 64 hex digits "
            f"(colons allowed), got {fingerprint!r}"
        )
    return fingerprint


class RemoteHost:
    """A server's address with what proves the client may use it (immutable).

    ``RemoteHost("HOST:PORT").with_credential(token)`` then ``.devices()`` or
    ``tl.Device.enumerate(host)``; ``with_*`` return new hosts. The repr never shows the token.

    Args:
        address: ``"HOST:PORT"`` of a ``remote.serve`` / ``python -m remote serve``.

    Raises:
        TypeError: ``address`` is not a str.
        ValueError: it is not ``HOST:PORT`` with a port in 1-65535.
    """

    __slots__ = ("_address", "_fingerprint", "_token")

    _address: str
    _token: str | bytes | None
    _fingerprint: str | None

    def __init__(self, address: str) -> None:
        object.__setattr__(self, "_address", _check_address(address))
        object.__setattr__(self, "_token", None)
        object.__setattr__(self, "_fingerprint", None)

    def _replace(self, token: str | bytes | None, fingerprint: str | None) -> RemoteHost:
        new = RemoteHost(self._address)
        object.__setattr__(new, "_token", token)
        object.__setattr__(new, "_fingerprint", fingerprint)
        return new

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("RemoteHost is immutable; use with_credential/with_fingerprint")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("RemoteHost is immutable")

    def with_credential(self, token: str | bytes) -> RemoteHost:
        """This host with the server's token (a non-empty str or bytes).

        Raises:
            TypeError: ``token`` is not str or bytes.
            ValueError: it is empty.
        """
        return self._replace(_check_token(token, "RemoteHost.with_credential"), self._fingerprint)

    def with_fingerprint(self, fingerprint: str) -> RemoteHost:
        """This host reached over TLS, pinning the server certificate's SHA-256 fingerprint.

        Raises:
            TypeError: ``fingerprint`` is not a str.
            ValueError: it is not 64 hex digits (colons and case ignored).
        """
        return self._replace(self._token, _check_fingerprint(fingerprint))

    @property
    def address(self) -> str:
        """``"HOST:PORT"`` as given."""
        return self._address

    @property
    def fingerprint(self) -> str | None:
        """The pinned TLS fingerprint (None: plain TCP)."""
        return self._fingerprint

    @property
    def has_credential(self) -> bool:
        """Whether a token was given (the token itself is not exposed)."""
        return self._token is not None

    def devices(self, timeout: float = 5.0) -> list[tl.Device]:
        """The server's devices, as :func:`remote.devices` lists them.

        Args:
            timeout: seconds without an answer or heartbeat after which the server is lost.

        Raises:
            RemoteAuthError: a wrong or missing token, or a wrong fingerprint.
            RemoteConnectionError: the server cannot be reached.
        """
        return _devices(self._address, self._token, self._fingerprint, timeout)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RemoteHost):
            return NotImplemented
        return (self._address, self._token, self._fingerprint) == (
            other._address,
            other._token,
            other._fingerprint,
        )

    def __hash__(self) -> int:
        return hash((self._address, self._token, self._fingerprint))

    def __repr__(self) -> str:
        # The token is a secret: say only whether there is one.
        cred = ", credential=***" if self._token is not None else ""
        fp = f", fingerprint={self._fingerprint!r}" if self._fingerprint else ""
        return f"RemoteHost({self._address!r}{cred}{fp})"


class TokenAuthorizer:
    """A server's shared-secret check: clients must prove they know ``token``.

    Args:
        token: a non-empty str or bytes. The repr never shows it.

    Raises:
        TypeError: ``token`` is not str or bytes.
        ValueError: it is empty.
    """

    __slots__ = ("_token",)

    def __init__(self, token: str | bytes) -> None:
        self._token = _check_token(token, "TokenAuthorizer")

    @property
    def token(self) -> str | bytes:
        """The secret, for :func:`remote.serve`."""
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
        if isinstance(devices, (str, tl.Device)):
            raise TypeError(f"RemoteServer: devices must be a list, e.g. [{str(devices)!r}]")
        specs = tuple(str(d) for d in devices)
        if not specs:
            raise ValueError("RemoteServer: give at least one device")
        self._devices = specs
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
        if not isinstance(host, str):
            raise TypeError(f"RemoteServer.with_host: host must be a str, got {host!r}")
        if not host.strip():
            raise ValueError("RemoteServer.with_host: host must not be empty")
        return self._copy(_host=host.strip())

    def with_port(self, port: int) -> RemoteServer:
        """This server listening on ``port`` (0, the default: any free one).

        Raises:
            TypeError: ``port`` is not an int.
            ValueError: it is outside 0-65535.
        """
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"RemoteServer.with_port: port must be an int, got {port!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"RemoteServer.with_port: port must be in 0-65535, got {port}")
        return self._copy(_port=port)

    def with_tls(self, tls: bool | tuple[str, str] = True) -> RemoteServer:
        """This server speaking TLS: True for a fresh self-signed certificate, or
        ``(certfile, keyfile)`` PEM paths; clients pin ``Server.fingerprint``.

        Raises:
            TypeError: ``tls`` is neither a bool nor a pair of paths.
        """
        ok = isinstance(tls, bool) or (
            isinstance(tls, tuple) and len(tls) == 2 and all(isinstance(p, str) for p in tls)
        )
        if not ok:
            raise TypeError(
                f"RemoteServer.with_tls: expected True/False or (certfile, keyfile), got {tls!r}"
            )
        return self._copy(_tls=tls)

    def with_max_session_bytes(self, limit: int | None) -> RemoteServer:
        """This server limiting what one session's arrays may hold (None: no limit).

        Raises:
            TypeError: ``limit`` is neither an int nor None.
            ValueError: it is not positive.
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"RemoteServer.with_max_session_bytes: expected an int, got {limit!r}")
        if limit is not None and limit <= 0:
            raise ValueError(f"RemoteServer.with_max_session_bytes: must be positive, got {limit}")
        return self._copy(_max_session_bytes=limit)

    def serve(self) -> Server:
        """Start serving (on background threads; this returns at once).

        Returns:
            The running :class:`remote.Server`: ``address`` for clients, ``close()``.

        Raises:
            ValueError: a non-loopback host without an authorizer, or a device that is not
                local.
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
