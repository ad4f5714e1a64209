"""``collectives.run --rdzv-backend c10d``: rounds, restarts across nodes, elastic membership.

Each node's launcher runs :class:`ElasticSupervisor`, which repeats:

1. Join a rendezvous round (:mod:`collectives.launch._rendezvous`); the round gives this
   node's rank (its place in the join order), the world size and rank 0's address.
2. Start the workers with ``DPT_RESTART_COUNT``/``TORCHELASTIC_RESTART_COUNT`` set to the
   round's number (so every round after the first is a restart for them, a newcomer's
   included), and watch them and the round (:class:`_Watch`: heartbeats, the round's end).
3. The round ends for every node at once when one record is set in the store (the first
   wins): a worker failed (its node ends its workers and reports rank, exit and traceback,
   and the record carries that report to every node), a node is lost (no heartbeat for
   ``keep_alive_interval`` x ``keep_alive_max_attempt`` seconds), a node's launcher left (it
   got a signal), or a launcher waits to join while the round has fewer than ``MAX`` nodes.
4. Every node decides the same way what comes next (:func:`decide`): after a failure, a new
   round while restarts are left (``--max-restarts`` counts failures only), else every node
   exits with the failed worker's status; after a lost or departed node, a new round when at
   least ``MIN`` nodes remain, else exit 1 naming the node; after a newcomer, a new round.
5. When every worker of every node has succeeded, every launcher exits 0. The launcher that
   serves the store waits (briefly) until the others have seen the end before it stops it.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from .._store import StoreError
from ..run import _POLL_S, PROG, _Placement, _Supervisor, _Worker
from ._launcher import describe_exit, pick_first, shutdown, signal_name
from ._rdzv_config import RdzvConfig
from ._rendezvous import Rendezvous, RendezvousError, Round

__all__ = ["ElasticSupervisor", "decide"]

_SECONDARY_ERRORS = ("PeerFailureError", "GroupAbortedError")


class _Watch(threading.Thread):
    """Beats this node's heartbeat and watches the round until its end record appears."""

    def __init__(self, rdzv: Rendezvous, rnd: Round, cfg: RdzvConfig) -> None:
        super().__init__(name=f"dpt-rdzv-watch:{rnd.number}", daemon=True)
        self.rdzv, self.rnd, self.cfg = rdzv, rnd, cfg
        self.end: dict[str, Any] | None = None  # the round's end record, once set
        self.error: str | None = None  # the store was lost
        self._stop_event = threading.Event()

    def stop(self) -> None:
        """Stop watching. Not waited for: the thread may sit in a store wait of up to one
        interval, which returns (or fails, when the store is closed) and then ends it."""
        self._stop_event.set()

    def run(self) -> None:
        rdzv, rnd, cfg = self.rdzv, self.rnd, self.cfg
        n, me = len(rnd.nodes), rnd.node_rank
        seen = [-1] * n
        changed = [time.monotonic()] * n
        try:
            while not self._stop_event.is_set():
                rdzv.beat(rnd)
                record = rdzv.end_record(rnd, timeout=cfg.keep_alive_interval)
                if record is not None:
                    self.end = record
                    return
                if self._stop_event.is_set():
                    return
                now = time.monotonic()
                for i, count in enumerate(rdzv.beats(rnd)):
                    if count != seen[i]:
                        seen[i], changed[i] = count, now
                lost = [i for i in range(n) if i != me and now - changed[i] > cfg.lost_after]
                if lost:
                    node = rnd.nodes[lost[0]]
                    self.end = rdzv.post_end(
                        rnd,
                        {
                            "reason": "lost",
                            "node": lost[0],
                            "who": node.describe(),
                            "text": f"no heartbeat for {cfg.lost_after:g} s (seen by node {me})",
                        },
                    )
                    return
                if n < cfg.max_nodes and rdzv.someone_waiting(rnd):
                    self.end = rdzv.post_end(rnd, {"reason": "join", "node": me})
                    return
        except (StoreError, RendezvousError) as exc:
            if not self._stop_event.is_set():
                self.error = str(exc)


def decide(end: dict[str, Any], rnd: Round, cfg: RdzvConfig, max_restarts: int) -> int | None:
    """What every node does after ``rnd`` ended as ``end`` says: None for a new round, else
    the exit status."""
    reason = end.get("reason")
    if reason == "failure":
        return None if int(end.get("failures", 1)) <= max_restarts else int(end.get("code", 1))
    if reason in ("lost", "left"):
        return None if len(rnd.nodes) - 1 >= cfg.min_nodes else 1
    if reason == "join":
        return None
    return 1


def _decision_line(end: dict[str, Any], rnd: Round, cfg: RdzvConfig, max_restarts: int) -> str:
    code = decide(end, rnd, cfg, max_restarts)
    reason, nxt = end.get("reason"), rnd.number + 1
    if reason == "failure":
        used = int(end.get("failures", 1))
        if code is None:
            return (
                f"{PROG}: restarting every node's workers in rendezvous round {nxt} (restart "
                f"{used} of {max_restarts}, DPT_RESTART_COUNT={nxt})"
            )
        if max_restarts == 0:
            return f"{PROG} exits with code {code}"
        return f"{PROG}: restarts exhausted ({max_restarts} used); {PROG} exits with code {code}"
    if reason == "join":
        return (
            f"{PROG}: a node is waiting to join: every node's workers restart in round {nxt} "
            "(a membership change, not counted against --max-restarts)"
        )
    left = len(rnd.nodes) - 1
    if code is None:
        return (
            f"{PROG}: continuing in round {nxt} without it ({left} node(s) remain, --nnodes "
            f"{cfg.min_nodes}:{cfg.max_nodes}; a membership change, not counted against "
            "--max-restarts); the workers resume from their checkpoint"
        )
    return (
        f"{PROG}: {left} node(s) remain, fewer than the {cfg.min_nodes} the job needs "
        f"(--nnodes {_nnodes(cfg)}); {PROG} exits with code {code}"
    )


def _headline(end: dict[str, Any]) -> str:
    return "workers restarting" if end.get("reason") == "join" else "job failed"


def _nnodes(cfg: RdzvConfig) -> str:
    lo, hi = cfg.min_nodes, cfg.max_nodes
    return str(lo) if lo == hi else f"{lo}:{hi}"


class ElasticSupervisor(_Supervisor):
    """The supervisor of one node in a c10d rendezvous (see the module docstring)."""

    rdzv: Rendezvous
    rnd: Round
    watch: _Watch | None

    @property
    def _rcfg(self) -> RdzvConfig:
        if self.cfg.rdzv is None:
            raise RuntimeError("ElasticSupervisor needs a config with a c10d rendezvous")
        return self.cfg.rdzv

    def _run(self, gpus: list[str] | None) -> int:
        """Join the rendezvous and run its rounds (the signal handlers installed by ``run``)."""
        self.watch = None
        self._end: dict[str, Any] | None = None
        self._leaving = False  # this launcher got a signal: no new round
        try:
            self.rdzv = Rendezvous(self._rcfg, self.cfg.nproc_per_node)
        except RendezvousError as exc:
            self._say(f"{PROG}: error: {exc}\n")
            return 1
        try:
            return self._rounds(gpus)
        except (RendezvousError, StoreError) as exc:
            self._say(f"{PROG}: error: rendezvous at {self._rcfg.endpoint}: {exc}\n")
            return 1
        finally:
            self._leave()

    # ------------------------------------------------------------------ rounds
    def _rounds(self, gpus: list[str] | None) -> int:
        cfg = self.cfg
        number = self.rdzv.current_round()
        while True:
            rnd = self.rdzv.join(number, stop=lambda: bool(self.signals.received))
            if rnd is None:
                sig = self.signals.received[0]
                self._say(f"{PROG}: received {signal_name(sig)} while joining; exiting\n")
                return 128 + sig
            self._begin(rnd)
            try:
                code = self._attempt(gpus, port=rnd.master[1])
                if code == 0 and self._end is None and not self._leaving:
                    code = self._wait_all_done()
            finally:
                if self.watch is not None:
                    self.watch.stop()
            if self._leaving or self._end is None:
                return code
            decision = decide(self._end, rnd, self._rcfg, cfg.max_restarts)
            if decision is not None:
                return decision
            number = rnd.number + 1

    def _begin(self, rnd: Round) -> None:
        cfg = self.cfg
        self.rnd = rnd
        self.attempt = rnd.number
        self._end = None
        addr, port = rnd.master
        self.placement = _Placement(
            node_rank=rnd.node_rank,
            nnodes=len(rnd.nodes),
            rank_offset=rnd.rank_offset,
            world_size=rnd.world_size,
            master_addr=addr,
        )
        self._say(
            f"{PROG}: rendezvous round {rnd.number} at {self._rcfg.endpoint}: this is node "
            f"{rnd.node_rank} of {len(rnd.nodes)} (ranks {rnd.rank_offset}.."
            f"{rnd.rank_offset + cfg.nproc_per_node - 1} of {rnd.world_size}; rank 0 at "
            f"{addr}:{port}; DPT_RESTART_COUNT={rnd.number})\n"
        )
        self.watch = _Watch(self.rdzv, rnd, self._rcfg)
        self.watch.start()

    def _title(self, what: str) -> str:
        return f"{what} (rendezvous round {self.rnd.number}, node {self.rnd.node_rank})"

    def _wait_all_done(self) -> int:
        """This node's workers succeeded: wait for every node's, or for the round to end."""
        self.rdzv.mark(self.rnd, "done")
        while True:
            if self.signals.received:
                return self._on_signal(self.signals.received[0])
            code = self._external_end()
            if code is not None:
                return code
            if self.rdzv.all_marked(self.rnd, "done"):
                return 0
            time.sleep(_POLL_S)

    def _leave(self) -> None:
        """Tell the others this node has seen the end; the store's host waits for them all."""
        rdzv, cfg = getattr(self, "rdzv", None), self.cfg
        if rdzv is None or cfg.rdzv is None:
            return
        try:
            if hasattr(self, "rnd"):
                rdzv.mark(self.rnd, "bye")
                if rdzv.is_host:
                    # Gone nodes say no goodbye; the others may still need the store.
                    end = self._end or {}
                    gone = {end.get("node")} if end.get("reason") in ("lost", "left") else set()
                    deadline = time.monotonic() + min(self._rcfg.lost_after + 1.0, 10.0)
                    while not rdzv.all_marked(self.rnd, "bye", skip=gone):
                        if time.monotonic() > deadline:
                            break
                        time.sleep(_POLL_S)
        except (StoreError, RendezvousError):
            pass
        finally:
            rdzv.close()

    # ------------------------------------------------------------------ how a round ends
    def _external_end(self) -> int | None:
        watch = self.watch
        if watch is None or (watch.end is None and watch.error is None):
            return None
        states = self._end_workers()
        cfg = self.cfg
        if watch.end is None:
            self._end = {"reason": "store"}
            self._report(
                self._title("job failed"),
                f"lost the rendezvous store at {self._rcfg.endpoint}: {watch.error}\n"
                f"this node's workers: {states}\n{PROG} exits with code 1",
            )
            return 1
        end = self._end = watch.end
        self._report(self._title(_headline(end)), self._describe_end(end, states))
        code = decide(end, self.rnd, self._rcfg, cfg.max_restarts)
        return 1 if code is None else code

    def _describe_end(self, end: dict[str, Any], states: str) -> str:
        cfg = self.cfg
        reason, node = end.get("reason"), end.get("node")
        if reason == "failure":
            head = f"node {node} ({end.get('who', '?')}) reported a failed worker:\n"
            head += str(end.get("text", ""))
        elif reason == "lost":
            head = f"node {node}, {end.get('who', '?')}, was lost: {end.get('text', '')}"
        elif reason == "left":
            head = f"node {node}, {end.get('who', '?')}, left: {end.get('text', '')}"
        else:
            head = f"node {node} saw a launcher waiting to join"
        tail = _decision_line(end, self.rnd, self._rcfg, cfg.max_restarts)
        return f"{head}\nthis node's workers: {states}\n{tail}"

    def _end_workers(self) -> str:
        """End every worker of this node (the round ended elsewhere); their states."""
        self._signals_handled = len(self.signals.received)
        endings = shutdown(self.workers, self.cfg.grace_period, wait=self._wait_escalating)
        self._drain_all()
        parts = []
        for w, ending in zip(self.workers, endings, strict=True):
            rc = w.proc.returncode
            if ending.killed:
                state = "killed by SIGKILL"
            elif ending.signaled and rc == -signal.SIGTERM:
                state = "terminated by SIGTERM"
            elif rc is None:
                state = "still running"
            else:
                state = describe_exit(rc)
            parts.append(f"rank {w.rank} {state}")
        return "; ".join(parts) or "none running"

    def _on_failure(self, failed: list[_Worker]) -> int:
        cfg = self.cfg
        first = pick_first([self._failure_of(w) for w in failed])
        code, text = self._failure_text(first)
        earlier = None
        if str(first.exc_type or "").endswith(_SECONDARY_ERRORS):
            earlier = self._wait_for_cause()
        record = {
            "reason": "failure",
            "node": self.rnd.node_rank,
            "who": self.rnd.nodes[self.rnd.node_rank].describe(),
            "code": code,
            "text": text[-16000:],
        }
        # Post before ending the other workers, so the other nodes end theirs at once.
        end = earlier if earlier is not None else self.rdzv.post_end(self.rnd, record)
        others = self._end_others(first)
        self._end = end
        if end.get("reason") == "failure" and end.get("node") == self.rnd.node_rank:
            body = f"{text}\nother ranks on this node: {others}\n"
            body += _decision_line(end, self.rnd, self._rcfg, cfg.max_restarts)
            self._report(self._title("job failed"), body)
        else:
            failed_too = f"rank {first.rank} {describe_exit(first.returncode or 1)}"
            states = failed_too if others == "none" else f"{failed_too}; {others}"
            self._report(self._title(_headline(end)), self._describe_end(end, states))
        decision = decide(end, self.rnd, self._rcfg, cfg.max_restarts)
        return code if decision is None else decision

    def _wait_for_cause(self) -> dict[str, Any] | None:
        """A worker says another rank failed first: give that rank's node time to say so, or
        the heartbeats time to show it lost (its launcher died with it)."""
        deadline = time.monotonic() + self._rcfg.lost_after + self._rcfg.keep_alive_interval + 1
        while time.monotonic() < deadline:
            watch = self.watch
            if watch is not None and watch.end is not None:
                return watch.end
            if watch is None or watch.error is not None or not watch.is_alive():
                break
            self._drain(_POLL_S)
        return self.watch.end if self.watch is not None else None

    def _on_signal(self, sig: int) -> int:
        code = super()._on_signal(sig)
        self._leaving = True
        try:
            self._end = self.rdzv.post_end(
                self.rnd,
                {
                    "reason": "left",
                    "node": self.rnd.node_rank,
                    "who": self.rnd.nodes[self.rnd.node_rank].describe(),
                    "text": f"its launcher received {signal_name(sig)}",
                },
            )
        except (StoreError, RendezvousError):
            pass
        return code
