"""The nccl backend's watchdog: it polls collectives nobody waits on, and looks at the peers.

One thread per group, started with its first collective and idle (sleeping on a condition)
while nothing is pending. Each round it finishes completed calls, checks signature records
that arrived and fails a call that passed its deadline; once the oldest call has been pending
for a while it also publishes this rank's progress and reads what the peers published (see
``_peers``): a failure, a departure, or a local peer process that is gone.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from ..._backend import P2P_OPS, GroupInfo
from ..._errors import CollectiveError, CollectiveTimeoutError, PeerFailureError
from ..._proc import host_id, pid_alive
from ._peers import PeerBoard
from ._work import NcclWork

__all__ = ["NcclWatchdog"]

_REMOTE_AGE = 0.25  # a call pending this long makes the watchdog look at the store
_REMOTE_EVERY = 0.25  # ...at most this often
_POLL_MIN, _POLL_MAX = 0.002, 0.02  # poll interval bounds (seconds)


class NcclWatchdog:
    """The watchdog half of :class:`~collectives.backends.nccl.NcclBackend` (a mixin)."""

    # Set by the backend.
    info: GroupInfo
    board: PeerBoard
    error: CollectiveError | None
    rank: int
    _lock: threading.RLock
    _wake: threading.Condition
    _pending: deque[NcclWork]
    _closing: bool
    _issued: int
    _watchdog: threading.Thread | None
    _watch_idle: bool
    _next_remote: float

    if TYPE_CHECKING:

        def _progress(self, now: float) -> NcclWork | None: ...

        def _timeout(self, w: NcclWork) -> None: ...

        def _fail_call(self, w: NcclWork, err: CollectiveError) -> None: ...

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name=f"collectives-nccl-{self.info.name}", daemon=True
            )
            self._watchdog.start()
        elif self._watch_idle:
            self._wake.notify_all()

    def _watch(self) -> None:
        pause = _POLL_MIN
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._watch_idle = True
                    self._wake.wait(1.0)
                    pause = _POLL_MIN
                self._watch_idle = False
                if self._closing:
                    return
                before = len(self._pending)
                now = time.monotonic()
                try:
                    timed_out = self._progress(now)
                except Exception:  # never let the watchdog die silently
                    timed_out = None
                oldest = self._pending[0] if self._pending else None
                progressed = len(self._pending) < before
            if timed_out is not None:
                self._timeout(timed_out)
            elif (
                oldest is not None
                and now - oldest.submitted >= _REMOTE_AGE
                and now >= self._next_remote
            ):
                self._next_remote = now + _REMOTE_EVERY
                self._remote_checks(oldest)
            pause = _POLL_MIN if progressed else min(pause * 2, _POLL_MAX)
            time.sleep(pause)

    def _remote_checks(self, oldest: NcclWork) -> None:
        """A call is slow: publish our progress, and look for failed, departed or dead peers."""
        if self.board.store is None or self.error is not None:
            return
        self.board.publish(self._issued)
        try:
            notice, departed, processes = self.board.look()
        except Exception as exc:
            if time.monotonic() - oldest.submitted > 2.0:
                self._peer_error(
                    oldest,
                    PeerFailureError,
                    f"the rendezvous store (hosted by global rank {self.info.ranks[0]}) is "
                    f"unreachable ({type(exc).__name__}: {exc}): is that rank gone?",
                )
            return
        with self._lock:
            self._progress(time.monotonic())  # our own findings come first
            if oldest._done or self.error is not None:
                return
        if notice is not None:
            cls = CollectiveTimeoutError if notice.kind == "timeout" else PeerFailureError
            self._peer_error(oldest, cls, notice.describe())
            return
        for r, last in departed.items():
            if (oldest.peer == r) if oldest.op in P2P_OPS else (oldest.seq > last):
                self._peer_error(
                    oldest,
                    PeerFailureError,
                    f"rank {self.info.ranks[r]} left the group (destroy_process_group) before "
                    "reaching this collective",
                )
                return
        here = host_id()
        for r, (pid, host) in processes.items():
            if r != self.rank and host == here and not pid_alive(pid):
                self._peer_error(
                    oldest,
                    PeerFailureError,
                    f"rank {self.info.ranks[r]} (pid {pid}) is gone: its process exited or was "
                    "killed",
                )
                return

    def _peer_error(self, w: NcclWork, cls: type[CollectiveError], text: str) -> None:
        self._fail_call(w, self.info.error(cls, w.op, w.seq, text))
