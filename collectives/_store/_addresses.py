"""Which addresses name this machine, and which one the store server binds to.

The server binds to loopback unless ``host`` names another address of this machine; it never
binds to an address it was not asked for, and refuses one that is not this host's.
"""

from __future__ import annotations

import ipaddress
import socket

from ._errors import StoreError

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
_LOOPBACK_V4 = "127.0.0.1"
_LOOPBACK_V6 = "::1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback name or address (``localhost``, ``127.x.x.x``, ``::1``).

    A name other than ``localhost`` counts when every address it resolves to is loopback.

    Args:
        host: a host name or an IPv4/IPv6 literal (brackets allowed).

    Returns:
        True for loopback; False otherwise, also when the name does not resolve.
    """
    host = strip_brackets(host)
    if host.lower() in _LOOPBACK_NAMES:
        return True
    addresses = _resolve(host)
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (so a server here can bind to it).

    Loopback counts. Otherwise each address the name resolves to is tried with a UDP bind to
    port 0, which succeeds exactly for this host's own addresses (and the wildcard).

    Args:
        host: a host name or an IPv4/IPv6 literal.

    Returns:
        True if a socket can be bound to (one of) the address(es) ``host`` names.
    """
    if is_loopback(host):
        return True
    return _first_bindable(strip_brackets(host)) is not None


def strip_brackets(host: str) -> str:
    """``"[::1]"`` -> ``"::1"``; other hosts unchanged (but for surrounding blanks)."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def family_of(address: str) -> socket.AddressFamily:
    """The socket family of an IP address literal."""
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def bind_address(host: str) -> str:
    """The address the server binds to for ``host``: loopback, or this host's address.

    Raises:
        StoreError: ``host`` is not an address of this machine.
    """
    plain = strip_brackets(host)
    if is_loopback(plain):
        try:
            if ipaddress.ip_address(plain).version == 6:
                return _LOOPBACK_V6
        except ValueError:
            pass
        return _LOOPBACK_V4
    addr = _first_bindable(plain)
    if addr is None:
        resolved = _resolve(plain)
        seen = f" (resolves to {', '.join(resolved)})" if resolved else " (does not resolve)"
        raise StoreError(
            f"cannot host the store on {host!r}{seen}: it is not an address of this machine "
            f"({socket.gethostname()}). The store server runs on the rank-0 host, which "
            "MASTER_ADDR must name; check MASTER_ADDR."
        )
    return addr


def connect_address(bound: str) -> str:
    """Where a client on this host reaches a server bound to ``bound``.

    That is ``bound`` itself, but loopback for the wildcard address.
    """
    if ipaddress.ip_address(bound).is_unspecified:
        return _LOOPBACK_V6 if family_of(bound) == socket.AF_INET6 else _LOOPBACK_V4
    return bound


def _resolve(host: str) -> list[str]:
    try:
        return [ipaddress.ip_address(host).compressed]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            addr = str(sockaddr[0]).split("%", 1)[0]  # drop an IPv6 zone id
            if addr not in out:
                out.append(addr)
    return out


def _first_bindable(host: str) -> str | None:
    for addr in _resolve(host):
        try:
            with socket.socket(family_of(addr), socket.SOCK_DGRAM) as s:
                s.bind((addr, 0))
            return addr
        except OSError:
            continue
    return None
