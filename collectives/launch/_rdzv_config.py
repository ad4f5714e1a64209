"""The rendezvous settings of ``collectives.run``: endpoint, id, node range and timeouts.

torchrun's spellings: ``--rdzv-endpoint HOST[:PORT]`` (port 29400 when left out, IPv6 in
brackets), ``--nnodes N`` or ``MIN:MAX``, and ``--rdzv-conf key=value,...`` with

- ``join_timeout`` (seconds, default 600): how long a round may take to gather ``MIN`` nodes;
- ``last_call_timeout`` (default 30): once ``MIN`` nodes have joined, how long the round
  stays open for more (up to ``MAX``; a round with ``MAX`` nodes closes at once);
- ``keep_alive_interval`` (default 5) and ``keep_alive_max_attempt`` (default 3): each node's
  launcher beats every interval, and a node silent for interval x attempts is lost;
- ``is_host`` (``true``/``false``): whether this node's launcher serves the rendezvous store
  (default: when the endpoint's host is an address of this machine and its port is free).

Unknown keys are an error rather than ignored.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_RDZV_PORT", "RdzvConfig", "parse_endpoint", "parse_nnodes", "parse_rdzv_conf"]

DEFAULT_RDZV_PORT = 29400
_DEFAULTS: Mapping[str, float] = {
    "join_timeout": 600.0,
    "last_call_timeout": 30.0,
    "keep_alive_interval": 5.0,
    "keep_alive_max_attempt": 3.0,
}


@dataclass(frozen=True)
class RdzvConfig:
    """How this node's launcher meets the others'.

    Attributes:
        host: the rendezvous endpoint's host (brackets stripped).
        port: its port.
        rdzv_id: the job's id; launchers with another id never meet this one.
        min_nodes: the fewest nodes a round may close with.
        max_nodes: the most nodes a round takes (it closes at once when that many joined).
        join_timeout: seconds a round may take to gather ``min_nodes``.
        last_call_timeout: seconds a round stays open for more nodes once ``min_nodes`` joined.
        keep_alive_interval: seconds between a launcher's heartbeats.
        keep_alive_max_attempt: heartbeats a node may miss before it counts as lost.
        is_host: serve the store here (True), only connect (False), or decide (None).
    """

    host: str
    port: int
    rdzv_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = _DEFAULTS["join_timeout"]
    last_call_timeout: float = _DEFAULTS["last_call_timeout"]
    keep_alive_interval: float = _DEFAULTS["keep_alive_interval"]
    keep_alive_max_attempt: int = int(_DEFAULTS["keep_alive_max_attempt"])
    is_host: bool | None = None

    @property
    def lost_after(self) -> float:
        """Seconds of silence after which a node counts as lost."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @property
    def endpoint(self) -> str:
        """``host:port`` (IPv6 in brackets), for messages."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_nnodes(source: str, text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4).

    Raises:
        ValueError: not ``N`` or ``MIN:MAX`` with 1 <= MIN <= MAX (names ``source``).
    """
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{source} must be a number of nodes N or a range MIN:MAX, got {text!r}"
        ) from None
    if lo < 1:
        raise ValueError(f"{source}: the number of nodes must be >= 1, got {text!r}")
    if lo > hi:
        raise ValueError(f"{source}: MIN must be <= MAX in MIN:MAX, got {text!r} ({lo} > {hi})")
    return lo, hi


def parse_endpoint(source: str, text: str) -> tuple[str, int]:
    """``"head:29400"`` -> ("head", 29400); ``"[::1]:5"`` -> ("::1", 5); no port: 29400.

    Raises:
        ValueError: malformed, a port out of range, or a host that does not resolve.
    """
    raw = text.strip()
    host, port_text = raw, ""
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise ValueError(f"{source}: unbalanced brackets in {text!r}; expected [IPV6]:PORT")
        host, rest = raw[1:end], raw[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{source}: expected [IPV6]:PORT, got {text!r}")
        port_text = rest[1:]
    elif raw.count(":") == 1:
        host, port_text = raw.split(":")
    if not host:
        raise ValueError(f"{source}: expected HOST:PORT, got {text!r}")
    port = DEFAULT_RDZV_PORT
    if port_text:
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"{source}: the port must be a number, got {text!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"{source}: the port must be in [1, 65535], got {port}")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(
            f"{source}: the rendezvous endpoint's host {host!r} does not resolve ({exc}); "
            "it must name the node whose launcher serves the rendezvous"
        ) from None
    return host, port


def parse_rdzv_conf(source: str, text: str) -> dict[str, float | bool]:
    """``"join_timeout=5,last_call_timeout=1"`` -> the settings it names (see the module).

    Raises:
        ValueError: an unknown key, a malformed item or value (names ``source``).
    """
    out: dict[str, float | bool] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ValueError(f"{source}: expected key=value items, got {item!r}")
        if key == "is_host":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{source}: is_host must be true or false, got {value!r}")
            out[key] = value.lower() in ("true", "1")
            continue
        if key not in _DEFAULTS:
            known = ", ".join([*_DEFAULTS, "is_host"])
            raise ValueError(f"{source}: unknown key {key!r} (known: {known})")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        minimum = 1.0 if key == "keep_alive_max_attempt" else 0.0
        if not (math.isfinite(number) and number >= minimum) or (
            key == "keep_alive_interval" and number <= 0
        ):
            raise ValueError(f"{source}: {key} must be a number >= {minimum:g}, got {value!r}")
        out[key] = number
    return out
