"""The c10d rendezvous of ``collectives.run``: rounds on the store that assign node ranks.

Every node's launcher connects to the store (:mod:`collectives._store`, with its mutual
secret authentication) at the endpoint; the launcher on the endpoint's host serves it. Keys
live under ``rdzv/<id>/``:

- ``round``: the newest round a launcher joined (where a newcomer starts looking).
- ``r<k>/joined``: a counter; joining round ``k`` adds 1, and the value is the node's place in
  the join order. ``r<k>/node<i>`` is the i-th joiner's record (address, a free port for rank
  0's store, workers, host name, pid).
- ``r<k>/closed``: the number of nodes the round took, set once (compare-and-set) by the first
  launcher that sees ``MAX`` joined, or ``MIN`` joined and the last call over. Joiners at or
  past that number are too late and join round ``k + 1`` (which the running nodes notice).
- ``r<k>/hb<i>``: node i's heartbeat counter; ``r<k>/end``: why the round ended (the first
  record set wins: a worker's failure with its report, a lost node, a node leaving, a node
  waiting to join); ``r<k>/done<i>`` and ``r<k>/bye<i>``: node i's workers all succeeded,
  and node i saw every node done.
- ``failures``: failed rounds so far (against ``--max-restarts``).

Node rank i of a round is its i-th joiner; its workers' global ranks follow the earlier
nodes' workers; rank 0's address is node 0's. Values are JSON text, checked on reading;
nothing from the store is unpickled or evaluated.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from .._store import StoreAuthError, StoreError, StoreTimeoutError, TCPStore, is_local_address
from ._launcher import free_port
from ._rdzv_config import RdzvConfig

__all__ = ["NodeInfo", "Rendezvous", "RendezvousError", "Round"]

_POLL_S = 0.1


class RendezvousError(RuntimeError):
    """The rendezvous could not be reached, refused this node, or a round did not fill."""


@dataclass(frozen=True)
class NodeInfo:
    """One node's record in a round."""

    addr: str  # the address the other nodes reach this node at
    port: int  # a free port there, for rank 0's store should this node be node 0
    nproc: int
    host: str
    pid: int

    def describe(self) -> str:
        """``"host (127.0.0.1, launcher pid 123)"``, for reports."""
        return f"{self.host} ({self.addr}, launcher pid {self.pid})"


@dataclass(frozen=True)
class Round:
    """A closed round as one node sees it."""

    number: int
    node_rank: int
    nodes: tuple[NodeInfo, ...]

    @property
    def world_size(self) -> int:
        """Workers in the round."""
        return sum(n.nproc for n in self.nodes)

    @property
    def rank_offset(self) -> int:
        """The global rank of this node's local rank 0."""
        return sum(n.nproc for n in self.nodes[: self.node_rank])

    @property
    def master(self) -> tuple[str, int]:
        """Rank 0's store: node 0's address and port."""
        return self.nodes[0].addr, self.nodes[0].port


def _local_address_towards(host: str, port: int) -> str:
    """The address of this machine that ``host`` sees our packets from (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


class Rendezvous:
    """This node's launcher's handle on the rendezvous store."""

    def __init__(self, cfg: RdzvConfig, nproc: int) -> None:
        """Serve the store (on the endpoint's host) or connect to it.

        Raises:
            RendezvousError: the store cannot be reached within the join timeout, or it
                refused this node (another secret), or serving it failed.
        """
        self.cfg = cfg
        self.nproc = nproc
        self.prefix = f"rdzv/{cfg.rdzv_id}"
        self.store = self._open()
        self.is_host = self.store.is_server
        addr = _local_address_towards(cfg.host, cfg.port)
        self.me = NodeInfo(addr, 0, nproc, socket.gethostname(), os.getpid())

    def _open(self) -> TCPStore:
        cfg = self.cfg
        where = f"the rendezvous store at {cfg.endpoint}"
        serve = cfg.is_host if cfg.is_host is not None else is_local_address(cfg.host)
        try:
            if serve:
                try:
                    return TCPStore(cfg.host, cfg.port, is_server=True, timeout=30.0)
                except StoreError as exc:
                    cause = exc.__cause__
                    in_use = isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE
                    if cfg.is_host or not in_use:
                        raise
                    # Another launcher on this host serves it already: join as a client.
            return TCPStore(
                cfg.host,
                cfg.port,
                is_server=False,
                timeout=30.0,
                connect_timeout=cfg.join_timeout,
            )
        except StoreAuthError as exc:
            raise RendezvousError(
                f"{where} refused this node: {exc}. Every node's launcher needs the same "
                "DPT_STORE_SECRET"
            ) from None
        except StoreTimeoutError as exc:
            raise RendezvousError(
                f"{where} is unreachable after the join timeout ({cfg.join_timeout:g} s): "
                f"{exc}. Is the launcher on {cfg.host} running, and is --rdzv-endpoint the "
                "same on every node?"
            ) from None
        except StoreError as exc:
            raise RendezvousError(f"cannot serve or reach {where}: {exc}") from None

    def close(self) -> None:
        """Close the connection (and stop the store when this node serves it)."""
        self.store.close()

    # ------------------------------------------------------------------ keys
    def key(self, round_no: int, name: str) -> str:
        """The key ``name`` of round ``round_no``."""
        return f"{self.prefix}/r{round_no}/{name}"

    def _int(self, key: str) -> int:
        return self.store.add(key, 0)

    def current_round(self) -> int:
        """The newest round any launcher joined (where a newcomer starts)."""
        return self._int(f"{self.prefix}/round")

    def failures(self) -> int:
        """Failed rounds so far."""
        return self._int(f"{self.prefix}/failures")

    # ------------------------------------------------------------------ joining
    def join(self, round_no: int, stop: Callable[[], bool] = lambda: False) -> Round | None:
        """Join round ``round_no`` (or a later one when it closed without us) until it closes.

        Returns:
            The round; None when ``stop()`` turned true while waiting (a signal).

        Raises:
            RendezvousError: no round gathered ``min_nodes`` within the join timeout.
        """
        deadline = time.monotonic() + self.cfg.join_timeout
        r = round_no
        while True:
            if self.store.check([self.key(r, "closed")]):
                r += 1
                continue
            index = self.store.add(self.key(r, "joined"), 1) - 1
            port = free_port(self.me.addr) if _bindable(self.me.addr) else free_port()
            info = NodeInfo(self.me.addr, port, self.nproc, self.me.host, self.me.pid)
            self.store.set(self.key(r, f"node{index}"), json.dumps(info.__dict__))
            self._raise_round(r)
            size = self._wait_closed(r, deadline, stop)
            if size is None:
                return None
            if index < size:
                nodes = tuple(self._node(r, i) for i in range(size))
                return Round(r, index, nodes)
            r += 1  # too late for this round: the next one, which the running nodes see

    def _raise_round(self, r: int) -> None:
        key = f"{self.prefix}/round"
        while True:
            current = self._int(key)
            if current >= r or self.store.compare_set(key, str(current), str(r)) == str(r).encode():
                return

    def _wait_closed(self, r: int, deadline: float, stop: Callable[[], bool]) -> int | None:
        cfg = self.cfg
        closed = self.key(r, "closed")
        last_call_from: float | None = None
        while True:
            try:
                self.store.wait([closed], timeout=_POLL_S)
                return _parse_int(self.store.get(closed), closed)
            except StoreTimeoutError:
                pass
            if stop():
                return None
            joined = self._int(self.key(r, "joined"))
            now = time.monotonic()
            size = 0
            if joined >= cfg.max_nodes:
                size = cfg.max_nodes
            elif joined >= cfg.min_nodes:
                last_call_from = last_call_from if last_call_from is not None else now
                if now - last_call_from >= cfg.last_call_timeout:
                    size = joined
            if size:
                value = self.store.compare_set(closed, b"", str(size))
                return _parse_int(value, closed)
            if now > deadline:
                raise RendezvousError(
                    f"rendezvous round {r} at {cfg.endpoint} (id {cfg.rdzv_id!r}) did not "
                    f"gather {cfg.min_nodes} node(s) within the join timeout "
                    f"({cfg.join_timeout:g} s): {joined} joined. Are the other nodes' "
                    "launchers running with the same --rdzv-endpoint and --rdzv-id?"
                )

    def _node(self, r: int, i: int) -> NodeInfo:
        key = self.key(r, f"node{i}")
        raw = self.store.get(key, timeout=self.cfg.join_timeout)
        try:
            d = json.loads(raw)
            info = NodeInfo(
                str(d["addr"]), int(d["port"]), int(d["nproc"]), str(d["host"]), int(d["pid"])
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousError(f"malformed node record at {key!r}: {exc}") from None
        if info.nproc < 1 or not 0 < info.port < 65536:
            raise RendezvousError(f"malformed node record at {key!r}: {raw!r}")
        return info

    # ------------------------------------------------------------------ a running round
    def beat(self, rnd: Round) -> None:
        """One heartbeat of this node in ``rnd``."""
        self.store.add(self.key(rnd.number, f"hb{rnd.node_rank}"), 1)

    def beats(self, rnd: Round) -> list[int]:
        """Every node's heartbeat counter in ``rnd``."""
        return [self._int(self.key(rnd.number, f"hb{i}")) for i in range(len(rnd.nodes))]

    def someone_waiting(self, rnd: Round) -> bool:
        """Whether a launcher waits to join the next round."""
        return self.store.check([self.key(rnd.number + 1, "joined")])

    def post_end(self, rnd: Round, record: dict[str, Any]) -> dict[str, Any]:
        """Say why ``rnd`` ended; returns the record that won (the first one set)."""
        key = self.key(rnd.number, "end")
        if record.get("reason") == "failure":
            record = dict(record, failures=self.failures() + 1)
        value = self.store.compare_set(key, b"", json.dumps(record))
        won = parse_end(value, key)
        if won == record and record.get("reason") == "failure":
            self.store.add(f"{self.prefix}/failures", 1)
        return won

    def end_record(self, rnd: Round, timeout: float) -> dict[str, Any] | None:
        """The record of why ``rnd`` ended, waiting up to ``timeout`` for it; None if none."""
        key = self.key(rnd.number, "end")
        try:
            self.store.wait([key], timeout=timeout)
        except StoreTimeoutError:
            return None
        return parse_end(self.store.get(key), key)

    def mark(self, rnd: Round, what: str) -> None:
        """Set ``<what><node rank>`` of ``rnd`` (``done``: workers succeeded; ``bye``: leaving)."""
        self.store.set(self.key(rnd.number, f"{what}{rnd.node_rank}"), b"1")

    def all_marked(self, rnd: Round, what: str, skip: Collection[object] = ()) -> bool:
        """Whether every node of ``rnd`` (but those in ``skip``) has set ``<what><rank>``."""
        keys = [self.key(rnd.number, f"{what}{i}") for i in range(len(rnd.nodes)) if i not in skip]
        return not keys or self.store.check(keys)


def parse_end(raw: bytes, key: str) -> dict[str, Any]:
    """An end record from the store (JSON object with a ``reason``), checked."""
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("reason"), str):
        raise RendezvousError(f"malformed end record at {key!r}: {raw[:200]!r}")
    return record


def _parse_int(raw: bytes, key: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise RendezvousError(f"malformed value at {key!r}: {raw[:100]!r}") from None


def _bindable(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False
