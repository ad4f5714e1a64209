"""``Work``: the handle an asynchronous collective returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ._errors import CollectiveTimeoutError, collective_error

__all__ = ["Work"]


class Work:
    """A collective in flight.

    ``wait()`` blocks until it completed and returns its output (the in-place array for
    ``all_reduce``/``broadcast``, the new array for ``all_gather``...), or raises its error.
    ``is_completed()`` and ``exception()`` poll without blocking.
    """

    __slots__ = (
        "_done", "_error", "_event", "_finalize", "_help", "_output", "op", "rank", "seq"
    )  # fmt: skip

    def __init__(self, op: str, seq: int, rank: int, threaded: bool = True) -> None:
        self.op = op
        self.seq = seq
        self.rank = rank
        self._done = False
        # Only work completed by another thread needs an Event (creating one costs microseconds,
        # which blocking small collectives run inline would pay on every call).
        self._event = threading.Event() if threaded else None
        self._output: Any = None
        self._error: BaseException | None = None
        self._finalize: Callable[[Any], Any] | None = None
        # Set by the executor that queued it: runs it on the waiting thread if it is still
        # queued and nothing runs (no hand-over to the communication thread and back).
        self._help: Callable[[Work], None] | None = None

    # ------------------------------------------------------------------ completion (engine side)
    def set_result(self, output: Any) -> None:
        """Mark the work done with ``output`` (called by the engine)."""
        self._output = output
        self._done = True
        self._help = None  # nothing left to run; and the executor need not stay alive for it
        if self._event is not None:
            self._event.set()

    def set_error(self, error: BaseException) -> None:
        """Mark the work failed with ``error`` (called by the engine)."""
        self._error = error
        self._done = True
        self._help = None
        if self._event is not None:
            self._event.set()

    # ------------------------------------------------------------------ user side
    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective completed; return its output or raise its error.

        Args:
            timeout: seconds to wait at most (None: until the group's own timeout fires).

        Raises:
            CollectiveTimeoutError: if ``timeout`` passed first (the collective keeps running).
            CollectiveError: the collective's own failure.
        """
        if not self._done and timeout is None and self._help is not None:
            self._help(self)  # it may run here; with a timeout it must not block longer
        if not self._done and (self._event is None or not self._event.wait(timeout)):
            raise self.expired(timeout)
        return self._deliver()

    def expired(self, timeout: float | None) -> CollectiveTimeoutError:
        """The error of a ``wait(timeout)`` that gave up first."""
        return collective_error(
            CollectiveTimeoutError,
            f"Work.wait(timeout={timeout}) expired before the collective completed (it is "
            "still in flight)",
            rank=self.rank,
            op=self.op,
            seq=self.seq,
        )

    def _deliver(self) -> Any:
        """Once done: raise the collective's error, or return its (finalized) output."""
        if self._error is not None:
            raise self._error
        if self._finalize is not None:
            self._output = self._finalize(self._output)
            self._finalize = None
        return self._output

    def is_completed(self) -> bool:
        """True once the collective finished (successfully or not)."""
        return self._done

    def is_success(self) -> bool:
        """True once the collective finished without error."""
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        """The collective's error if it failed, else None (does not block)."""
        return self._error if self._done else None

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "pending")
        return f"<Work {self.op} #{self.seq} rank {self.rank} {state}>"


def completed(op: str, seq: int, rank: int, output: Any) -> Work:
    """A Work that is already done (synchronous engines, world size 1)."""
    w = Work(op, seq, rank, threaded=False)
    w.set_result(output)
    return w


def wait_all(works: list[Work], timeout: float | None = None) -> list[Any]:
    """Wait for every work (in order) and return their outputs."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for w in works:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        out.append(w.wait(left))
    return out
