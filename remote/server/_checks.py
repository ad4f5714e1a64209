"""The argument checks of :func:`remote.serve` and :class:`remote.RemoteServer`: every argument
is checked, and named, before anything starts listening."""

from __future__ import annotations

import socket
from collections.abc import Iterable

import tensorlib as tl

__all__ = [
    "check_devices",
    "check_host",
    "check_limit",
    "check_port",
    "check_resolvable",
    "check_tls",
]


def check_devices(devices: object, who: str) -> tuple[str, ...]:
    # A str is one device, not a list of one-letter ones: say so rather than host 'c', 'p'...
    if isinstance(devices, str | tl.Device):
        raise TypeError(f"{who}: devices must be a list, e.g. [{str(devices)!r}], got {devices!r}")
    if not isinstance(devices, Iterable):
        raise TypeError(
            f"{who}: devices must be a list of 'cpu', 'cuda:N' or tensorlib Devices, "
            f"got {devices!r}"
        )
    items = list(devices)
    bad = [d for d in items if not isinstance(d, str | tl.Device)]
    if bad:
        raise TypeError(
            f"{who}: devices must be 'cpu', 'cuda:N' or tensorlib Devices, got {bad[0]!r} "
            f"in {items!r}"
        )
    if not items:
        raise ValueError(f"{who}: give at least one device")
    return tuple(str(d) for d in items)


def check_host(host: object, who: str) -> str:
    if not isinstance(host, str):
        raise TypeError(f"{who}: host must be a str, got {host!r}")
    if not host.strip():
        raise ValueError(f"{who}: host must not be empty")
    return host.strip()


def check_resolvable(host: str, port: int) -> None:
    # The family the server binds with (an IPv6 literal has a colon): a name that does not
    # resolve is a bad argument, not a bare gaierror from bind().
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(
            f"serve: host {host!r} does not resolve ({exc.strerror}); expected an address "
            "of this machine to listen on, e.g. '127.0.0.1', '0.0.0.0' or '::1'"
        ) from None


def check_port(port: object, who: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"{who}: port must be an int, got {port!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"{who}: port must be in 0-65535, got {port}")
    return port


def check_tls(tls: object, who: str) -> bool | tuple[str, str]:
    if isinstance(tls, bool):
        return tls
    if isinstance(tls, tuple) and len(tls) == 2 and all(isinstance(p, str) for p in tls):
        return (tls[0], tls[1])
    raise TypeError(f"{who}: expected tls=True/False or (certfile, keyfile), got {tls!r}")


def check_limit(limit: object, who: str) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"{who}: max_session_bytes must be an int (bytes) or None, got {limit!r}")
    if limit <= 0:
        raise ValueError(f"{who}: max_session_bytes must be positive, got {limit}")
    return limit
