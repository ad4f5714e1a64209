"""How the ranks of one NCCL group learn about each other: keys in the rendezvous store.

NCCL itself says nothing about a peer that died, failed or left; the backend's ranks publish
what the others need under ``<group>/nccl/`` in the store:

===================  ====================================================================
key                  value
===================  ====================================================================
``joined/<r>``       ``"<pid> <host id>"``: rank r started init (liveness checks on one host;
                     which ranks never joined, for an init timeout)
``uid``              the ``ncclUniqueId`` group rank 0 made (128 bytes)
``progress/<r>``     the last collective sequence number rank r enqueued (published while a
                     call is slow, so a timeout can name the ranks that never arrived)
``abort``            the first failure of any rank, an :class:`AbortNotice` (set once)
``closed/<r>``       rank r destroyed the group after enqueuing this sequence number
``closed``           a counter of ``closed/<r>`` keys (one cheap read tells if any is new)
===================  ====================================================================
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..._backend import GroupInfo
from ..._errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from ..._proc import host_id
from ..._setup_wait import SetupWatch

__all__ = ["UNCAUGHT", "AbortNotice", "PeerBoard", "last_words"]

UNCAUGHT = "uncaught "  # how a published failure says that the rank's process is ending
_ABORT_KINDS = ("timeout", "mismatch", "failed")
_MAX_NOTICE_CHARS = 4000


@dataclass(frozen=True)
class AbortNotice:
    """A rank's first failure, as it tells the other ranks of its group.

    Attributes:
        kind: ``"timeout"`` (the rank gave up waiting: no failure of its own), ``"mismatch"``
            or ``"failed"``.
        rank: the global rank that failed.
        message: its error message.
    """

    kind: str
    rank: int
    message: str

    @classmethod
    def of(cls, err: CollectiveError, rank: int) -> AbortNotice:
        """The notice of ``err`` on global rank ``rank``."""
        if isinstance(err, CollectiveTimeoutError):
            kind = "timeout"
        elif isinstance(err, CollectiveMismatchError):
            kind = "mismatch"
        else:
            kind = "failed"
        return cls(kind, rank, str(err)[:_MAX_NOTICE_CHARS])

    def encode(self) -> bytes:
        """JSON (nothing is ever unpickled from the store)."""
        doc = {"kind": self.kind, "rank": self.rank, "message": self.message}
        return json.dumps(doc).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> AbortNotice:
        """Parse :meth:`encode`'s output; anything else becomes a ``failed`` notice that
        quotes it (a peer's failure is still a failure, however it was written)."""
        try:
            doc = json.loads(raw.decode("utf-8"))
            kind, rank, message = doc["kind"], doc["rank"], doc["message"]
            if kind in _ABORT_KINDS and type(rank) is int and isinstance(message, str):
                return cls(kind, rank, message)
        except (ValueError, TypeError, KeyError):
            pass
        return cls("failed", -1, raw.decode("utf-8", "replace")[:_MAX_NOTICE_CHARS])

    def describe(self) -> str:
        """``rank 3 timed out: ...`` / ``rank 3 failed: ...``."""
        who = f"rank {self.rank}" if self.rank >= 0 else "a rank"
        verb = "timed out" if self.kind == "timeout" else "failed"
        return f"{who} {verb}: {self.message}"


class PeerBoard:
    """The store keys of one NCCL group (see the module docstring); all calls are no-ops
    without a store or at world size 1."""

    def __init__(self, info: GroupInfo) -> None:
        self.info = info
        self.store = info.store if info.size > 1 else None
        self._published = -1
        self._closed_seen = 0
        self._departed: dict[int, int] = {}
        self._processes: dict[int, tuple[int, str]] | None = None

    def key(self, what: str) -> str:
        """The full store key of ``what``."""
        return f"{self.info.name}/nccl/{what}"

    # ------------------------------------------------------------------ init
    def announce(self) -> None:
        """Publish this rank's pid and host."""
        if self.store is not None:
            self.store.set(self.key(f"joined/{self.info.rank}"), f"{os.getpid()} {host_id()}")

    def share_unique_id(
        self, make: Callable[[], bytes], deadline: float, watch: SetupWatch
    ) -> bytes:
        """Group rank 0's ``ncclUniqueId`` (rank 0 makes it with ``make``).

        Raises:
            PeerFailureError: a peer died (or left) meanwhile (``watch`` names it).
            CollectiveTimeoutError: rank 0 did not publish it by ``deadline``.
        """
        if self.store is None:
            return make()
        if self.info.rank == 0:
            uid = make()
            with watch.guard():
                self.store.set(self.key("uid"), uid)
            return uid
        return watch.get(self.key("uid"), 0, deadline, "publish the NCCL unique id")

    def not_joined(self) -> list[int]:
        """Global ranks that never announced themselves (best effort: [] on store errors)."""
        if self.store is None:
            return []
        try:
            return [
                self.info.ranks[r]
                for r in range(self.info.size)
                if not self.store.check([self.key(f"joined/{r}")])
            ]
        except Exception:
            return []

    # ------------------------------------------------------------------ progress
    def publish(self, issued: int, force: bool = False) -> None:
        """Say that this rank enqueued collectives up to ``issued`` (best effort)."""
        if self.store is not None and (force or issued != self._published):
            with contextlib.suppress(Exception):
                self.store.set(self.key(f"progress/{self.info.rank}"), str(issued))
                self._published = issued

    def behind(self, seq: int) -> list[int]:
        """Global ranks whose published progress is before ``seq``, after a short grace for
        late publications."""
        if self.store is None:
            return []
        grace = time.monotonic() + min(1.0, self.info.timeout / 2)
        while True:
            missing = []
            for r in range(self.info.size):
                if r == self.info.rank:
                    continue
                key = self.key(f"progress/{r}")
                try:
                    seen = int(self.store.get(key, timeout=0.01)) if self.store.check([key]) else 0
                except Exception:
                    seen = 0
                if seen < seq:
                    missing.append(self.info.ranks[r])
            if not missing or time.monotonic() >= grace:
                return missing
            time.sleep(0.05)

    # ------------------------------------------------------------------ failure and departure
    def tell_abort(self, err: CollectiveError) -> None:
        """Publish this rank's failure, unless a rank published one first (best effort)."""
        if self.store is not None:
            notice = AbortNotice.of(err, self.info.global_rank)
            with contextlib.suppress(Exception):
                self.store.compare_set(self.key("abort"), b"", notice.encode())

    def say_goodbye(self, issued: int) -> None:
        """Say that this rank leaves after collective ``issued`` (best effort)."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(self.key(f"closed/{self.info.rank}"), str(issued))
                self.store.add(self.key("closed"), 1)

    def look(self) -> tuple[AbortNotice | None, dict[int, int], dict[int, tuple[int, str]]]:
        """What the peers said: the first failure (or None), the peers that left (group rank:
        last sequence number), and every rank's ``(pid, host id)``.

        Raises:
            Exception: the store's own error when it cannot be reached.
        """
        store = self.store
        if store is None:
            return None, {}, {}
        notice = None
        if store.check([self.key("abort")]):
            notice = AbortNotice.decode(store.get(self.key("abort"), timeout=1.0))
        closed = store.add(self.key("closed"), 0)
        if closed > self._closed_seen:
            for r in range(self.info.size):
                key = self.key(f"closed/{r}")
                if r != self.info.rank and r not in self._departed and store.check([key]):
                    self._departed[r] = int(store.get(key, timeout=1.0))
            self._closed_seen = closed
        if self._processes is None:
            procs = {}
            for r in range(self.info.size):
                raw = store.get(self.key(f"joined/{r}"), timeout=1.0).decode().split()
                procs[r] = (int(raw[0]), raw[1])
            self._processes = procs
        return notice, dict(self._departed), dict(self._processes)


def last_words(boards: list[PeerBoard]) -> dict[int, str]:
    """Global rank -> the failure it published on one of ``boards`` (groups this process
    shares with it) because an uncaught exception ends its process; setup waits quote it.
    One or two store requests per board."""
    said: dict[int, str] = {}
    for board in boards:
        store = board.store
        if store is None:
            continue
        key = board.key("abort")
        with contextlib.suppress(Exception):
            if store.check([key]):
                notice = AbortNotice.decode(store.get(key, timeout=1.0))
                if notice.rank >= 0 and f"] {UNCAUGHT}" in notice.message:
                    said.setdefault(notice.rank, notice.message)
    return said
