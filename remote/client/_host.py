"""Burn's name for a client's view of a server: :class:`RemoteHost` (an address with a
credential and a pinned fingerprint, as Burn's remote device address), an immutable builder
over :func:`remote.devices`, which stays the primary API.
"""

from __future__ import annotations

import tensorlib as tl

from .._handshake import check_token
from ._client import check_address, check_fingerprint, check_timeout
from ._client import devices as _devices

__all__ = ["RemoteHost"]


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
    _token: bytes | None
    _fingerprint: str | None

    def __init__(self, address: str) -> None:
        check_address(address, "RemoteHost")
        object.__setattr__(self, "_address", address.strip())
        object.__setattr__(self, "_token", None)
        object.__setattr__(self, "_fingerprint", None)

    def _replace(self, token: bytes | None, fingerprint: str | None) -> RemoteHost:
        new = RemoteHost(self._address)
        object.__setattr__(new, "_token", token)
        object.__setattr__(new, "_fingerprint", fingerprint)
        return new

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("RemoteHost is immutable; use with_credential/with_fingerprint")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("RemoteHost is immutable")

    def with_credential(self, token: str | bytes) -> RemoteHost:
        """This host with the server's token (a non-empty str or bytes; surrounding
        whitespace stripped, as the server strips its token file's).

        Raises:
            TypeError: ``token`` is not str or bytes.
            ValueError: it is empty.
        """
        return self._replace(check_token(token, "RemoteHost.with_credential"), self._fingerprint)

    def with_fingerprint(self, fingerprint: str) -> RemoteHost:
        """This host reached over TLS, pinning the server certificate's SHA-256 fingerprint.

        Raises:
            TypeError: ``fingerprint`` is not a str.
            ValueError: it is not 64 hex digits (colons and case ignored).
        """
        fp = check_fingerprint(fingerprint, "RemoteHost.with_fingerprint")
        return self._replace(self._token, fp)

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
            TypeError, ValueError: ``timeout`` is not a positive number.
            RemoteAuthError: a wrong or missing token, or a wrong fingerprint.
            RemoteConnectionError: the server cannot be reached.
        """
        seconds = check_timeout(timeout, "RemoteHost.devices")
        return _devices(self._address, self._token, self._fingerprint, seconds)

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
