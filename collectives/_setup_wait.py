"""Setup waits on the rendezvous store that watch the peers (one implementation for backends).

While a group is set up (its backend is built for ``init_process_group`` or ``new_group``, a
collective ``alloc`` maps shared memory, NCCL's unique id is shared) each rank waits for store
keys the others publish. A plain ``store.wait`` would sit out the group's whole timeout when a
peer died, and then name a key. :class:`SetupWatch` waits in short slices and between them
looks at the signals the collectives watch:

* the pid of every member on this host, from the record ``init/rank/<r>`` ("world_size pid
  node [pid namespace]") that ``init_process_group`` wrote for every rank: a pid that is gone
  names the rank;
* ``world/left/<r>``: the rank destroyed its default group (it left the job);
* a backend's own failure record (``last_words``): e.g. the reason a rank published when an
  uncaught exception ended it, quoted in the error;
* the store itself: a lost connection while global rank 0 (the store's host) is gone names
  that rank instead of the socket.

A death is reported within a slice (at most :data:`_SLICE_MAX` seconds) as a
:class:`~collectives.PeerFailureError` naming the rank, its pid and the setup op; a peer that
is alive but never publishes is a :class:`~collectives.CollectiveTimeoutError` at the deadline
naming the ranks that never arrived.
"""

from __future__ import annotations

import contextlib
import platform
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ._backend import GroupInfo
from ._errors import CollectiveTimeoutError, PeerFailureError
from ._proc import pid_alive, pid_namespace
from ._store import StoreError

__all__ = ["SetupWatch", "register_last_words", "remember_peers", "setup_op"]

_SLICE_MIN, _SLICE_MAX = 0.02, 0.25  # seconds a slice of the store wait lasts (doubling)
# How often the store is asked which peers left (one request per peer): every second, and
# less often in large groups, so that a setup of n ranks costs the store O(16 n) requests/s.
_LEFT_EVERY = 1.0
_LEFT_PEERS_PER_S = 16
_STORE_HOST = 0  # global rank whose process hosts the TCP store (see _api._rendezvous)
_EXIT_GRACE = 1.0  # a killed process closes its sockets a moment before it is reaped

# Per store: global rank -> pid on this host, or None (another host, or no record). A rank's
# process never changes during a store's life, so each record is read once per process.
_PIDS: weakref.WeakKeyDictionary[Any, dict[int, int | None]] = weakref.WeakKeyDictionary()

LastWords = Callable[[], "dict[int, str]"]

# Backends that keep failure records (the cpu backend's abort words in shared memory) register
# a reader here, so every setup wait can quote them, whatever group it watches.
_LAST_WORDS: list[LastWords] = []


def remember_peers(store: Any, peers: Mapping[int, tuple[int, str]], global_rank: int) -> None:
    """Seed the pid records of ``store``'s job with what ``init_process_group`` read (every
    rank's pid and ``"host pid-namespace"``), so that a setup started after the store's host
    died still knows that host's pid and names it, instead of failing on the lost store."""
    try:
        known = _PIDS.setdefault(store, {})
    except TypeError:  # a store that takes no weak reference: the setups read the records
        return
    here = f"{platform.node()} {pid_namespace()}"
    for g, (pid, where) in peers.items():
        if g != global_rank:
            known.setdefault(g, pid if where == here else None)


def register_last_words(reader: LastWords) -> None:
    """Let every :class:`SetupWatch` quote ``reader()`` (global rank -> the reason it gave
    for ending, e.g. an uncaught exception)."""
    if reader not in _LAST_WORDS:
        _LAST_WORDS.append(reader)


def _registered_last_words() -> dict[int, str]:
    said: dict[int, str] = {}
    for reader in _LAST_WORDS:
        for rank, reason in reader().items():
            said.setdefault(rank, reason)
    return said


def setup_op(info: GroupInfo) -> str:
    """The user-facing call that builds ``info``'s group (for error messages)."""
    return "init_process_group" if info.name == "world" else "new_group"


class SetupWatch:
    """Store waits of one setup step of one group that fail fast when a peer is gone.

    Args:
        info: the group being set up (its ``store`` is waited on).
        op: the call the user made (``"new_group"``, ``"alloc"``...), for messages.
        seq: the call's sequence number in the group, if it has one (``alloc``).
        last_words: ``f()``: global rank -> the reason it gave for ending (an uncaught
            exception it reported); a backend's own failure records.
    """

    def __init__(
        self,
        info: GroupInfo,
        op: str,
        seq: int | None = None,
        last_words: LastWords | None = None,
    ) -> None:
        self.info = info
        self.op = op
        self.seq = seq
        self.store = info.store
        self._last_words = last_words if last_words is not None else _registered_last_words
        self._next_left = 0.0

    # ------------------------------------------------------------------ waits
    def wait(self, keys: Mapping[str, int], deadline: float, what: str) -> None:
        """Wait until every key of ``keys`` exists.

        Args:
            keys: store key -> the group rank that publishes it.
            deadline: ``time.monotonic()`` by which all must exist.
            what: what the keys mean, for a timeout (``"published its segment"``).

        Raises:
            PeerFailureError: a member is gone (names it, its pid and the op).
            CollectiveTimeoutError: the deadline passed while every member was alive; names
                the ranks whose keys are missing.
        """
        self._pids()  # read the records now: they help even once the store is lost
        pause = _SLICE_MIN
        pending = list(keys)
        while True:
            try:
                self.store.wait(pending, max(0.001, min(pause, deadline - time.monotonic())))
                return
            except TimeoutError:
                pass
            except StoreError as exc:
                self._store_lost(exc)
            self.check(what)
            if time.monotonic() >= deadline:
                missing = sorted(
                    {self.info.ranks[r] for k, r in keys.items() if not self.store.check([k])}
                )
                raise self.info.error(
                    CollectiveTimeoutError,
                    self.op,
                    self.seq,
                    f"ranks {missing} did not {what} within {self.info.timeout:g} s (every "
                    "member on this host is alive: is a rank stuck, or skipping this call?)",
                )
            pause = min(pause * 2, _SLICE_MAX)

    def get(self, key: str, rank: int, deadline: float, what: str) -> bytes:
        """:meth:`wait` for one key published by group rank ``rank``, then its value."""
        self.wait({key: rank}, deadline, what)
        with self.guard():
            return bytes(self.store.get(key, timeout=1.0))

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around other store calls of the setup: a lost store whose host (global rank 0) is
        gone becomes a PeerFailureError naming that rank."""
        self._pids()
        try:
            yield
        except StoreError as exc:
            if isinstance(exc, TimeoutError):
                raise
            self._store_lost(exc)

    # ------------------------------------------------------------------ liveness
    def check(self, what: str = "") -> None:
        """Raise PeerFailureError if a member is known to be gone (see the module docstring).

        Args:
            what: what this rank was waiting for, added to the message.
        """
        info = self.info
        during = f" while this rank waited for it to {what}" if what else ""
        pids = self._pids()
        last = self._last_words() if self._last_words is not None else {}
        for r, g in enumerate(info.ranks):
            if r == info.rank:
                continue
            pid = pids.get(g)
            words = last.get(g)
            if words is not None:
                shown = f" (pid {pid})" if pid is not None else ""
                raise self._error(f"rank {g}{shown} failed: {words}{during}")
            if pid is not None and not pid_alive(pid):
                raise self._error(
                    f"rank {g} (pid {pid}) is gone: its process exited or was killed{during}"
                )
        now = time.monotonic()
        if now >= self._next_left:
            self._next_left = now + _LEFT_EVERY * max(1.0, info.size / _LEFT_PEERS_PER_S)
            for r, g in enumerate(info.ranks):
                if r != info.rank and self._has(f"world/left/{g}"):
                    raise self._error(
                        f"rank {g} left the job (destroy_process_group) before this {self.op}"
                    )

    def _error(self, detail: str) -> PeerFailureError:
        return self.info.error(PeerFailureError, self.op, self.seq, detail)

    def _store_lost(self, exc: StoreError) -> None:
        """Name the store's host when it is gone; else re-raise the store's error."""
        pid = self._pids().get(_STORE_HOST)
        end = time.monotonic() + _EXIT_GRACE
        while pid is not None and pid_alive(pid) and time.monotonic() < end:
            time.sleep(0.01)
        if pid is not None and not pid_alive(pid):
            raise self._error(
                f"rank {_STORE_HOST} (pid {pid}) is gone: its process exited or was killed, "
                f"and with it the rendezvous store it hosted ({exc})"
            ) from exc
        raise exc

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except StoreError:
            return False  # the store's own failure shows in the wait itself

    def _pids(self) -> dict[int, int]:
        """Global rank -> pid of the members (and the store's host) that run on this host."""
        try:
            known = _PIDS.setdefault(self.store, {})
        except TypeError:  # a store that takes no weak reference: read, do not keep
            known = {}
        node = platform.node()
        for g in {*self.info.ranks, _STORE_HOST}:
            if g not in known and g != self.info.global_rank:
                known[g] = self._read_pid(g, node)
        return {g: pid for g, pid in known.items() if pid is not None}

    def _read_pid(self, g: int, node: str) -> int | None:
        key = f"init/rank/{g}"
        try:
            if not self.store.check([key]):
                return None  # a store not made by init_process_group (tests, thread ranks)
            fields = self.store.get(key, timeout=1.0).decode().split()
        except (StoreError, UnicodeDecodeError):
            return None
        # A pid means the same process to us only in our pid namespace: an optional fourth
        # field names the writer's; without it, the same node name must do (containers that
        # share a host name but not a pid namespace would need that field).
        if len(fields) < 3 or fields[2] != node or fields[3:4] not in ([], [pid_namespace()]):
            return None
        try:
            return int(fields[1])
        except ValueError:
            return None
