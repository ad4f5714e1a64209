"""Which addresses name this machine, and which one the store server binds to.

The server binds exactly the address ``host`` names (a loopback one such as 127.0.0.2 or
Debian's 127.0.1.1 included, since that is what peers dial); it never binds to an address it
was not asked for, and refuses one that is not this host's. Bound to every interface (0.0.0.0,
::) it wants a secret; bound to another network address without one, it warns.
"""

from __future__ import annotations

import ipaddress
import socket
import warnings

from ._errors import StoreError

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
_LOOPBACK_V4 = "127.0.0.1"
_LOOPBACK_V6 = "::1"
# Named here (not imported from ``_connection``) to keep this module free of the client.
SECRET_HINT = "DPT_STORE_SECRET"


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
    """The address the server binds to for ``host``: the one it names, which peers dial.

    ``localhost`` binds 127.0.0.1; another name binds the first address of this host it
    resolves to (a name that Debian maps to 127.0.1.1 binds that).

    Raises:
        StoreError: ``host`` is not an address of this machine.
    """
    plain = strip_brackets(host)
    if plain.lower() in _LOOPBACK_NAMES and plain.lower() != "ip6-localhost":
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


def check_exposure(bound: str, host: str, secret: bytes | None) -> None:
    """Refuse to listen on every interface without a secret; warn for another network address.

    Args:
        bound: the address the server is about to bind (``bind_address(host)``).
        host: the address as the user gave it (MASTER_ADDR), for messages.
        secret: the shared secret, if any.

    Raises:
        StoreError: ``bound`` is the wildcard address and there is no secret.
    """
    if secret is not None:
        return
    ip = ipaddress.ip_address(bound)
    how = (
        f"set {SECRET_HINT} on every rank (e.g. export DPT_STORE_SECRET=$(python -c "
        "'import secrets; print(secrets.token_hex(16))'))"
    )
    if ip.is_unspecified:
        raise StoreError(
            f"refusing to host the store on {host!r}, every interface of this host, without a "
            "shared secret: anyone who can reach this host could join the job or feed ranks "
            f"false rendezvous data. To allow it, {how}; or set MASTER_ADDR to the one "
            "address of this host that the ranks share (127.0.0.1 when they all run here)"
        )
    if not ip.is_loopback:
        warnings.warn(
            f"the store listens on {bound} (MASTER_ADDR={host}) without a shared secret: any "
            f"process that can reach that address can join the job. {how[0].upper()}{how[1:]}",
            RuntimeWarning,
            stacklevel=4,
        )


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
