"""The nccl backend's Work: a collective enqueued on the group's stream, and what it holds."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._backend import Request
from ..._work import Work

if TYPE_CHECKING:
    from ._backend import NcclBackend

__all__ = ["NcclWork"]


class NcclWork(Work):
    """A collective enqueued on the group's stream (see the nccl module's docstring).

    It holds the events that bound the call on the stream, the signature slot it used, the
    arrays NCCL reads and writes (CuPy's pool would otherwise reuse them before the stream is
    done) and the staged NumPy arrays to copy back once it completed.
    """

    __slots__ = (
        "_backend",
        "deadline",
        "end",
        "host_sync",
        "peer",
        "refs",
        "sig_checked",
        "sig_ev",
        "sig_words",
        "slot",
        "start",
        "submitted",
        "writebacks",
    )

    def __init__(self, backend: NcclBackend, req: Request) -> None:
        super().__init__(req.op, req.seq, backend.info.global_rank, threaded=False)
        self._backend = backend
        now = time.monotonic()
        self.submitted = now
        self.deadline = now + backend.info.timeout
        self.start: Any = None
        self.sig_ev: Any = None
        self.end: Any = None
        self.slot = -1
        self.sig_words: np.ndarray[Any, Any] | None = None
        self.sig_checked = True
        self.refs: list[Any] = []
        self.writebacks: list[tuple[Any, np.ndarray[Any, Any]]] = []
        self.host_sync = False
        self.peer = req.peer

    def wait(self, timeout: float | None = None) -> Any:
        """Return the output once it is safe to use from the caller's current stream.

        Device arrays without ``timeout``: the caller's stream waits for the collective (no
        host synchronization). With ``timeout``, for NumPy arrays and for barriers the host
        waits, at most ``timeout`` seconds (CollectiveTimeoutError; the collective goes on).
        """
        b = self._backend
        if not self._done:
            if timeout is not None or self.host_sync:
                if not b.block(self, timeout):
                    raise self.expired(timeout)
            else:
                b.stream_wait(self)
        return self._deliver()

    def is_completed(self) -> bool:
        """True once the collective finished (or failed); polls the GPU and the group."""
        if not self._done:
            self._backend.poll()
        return self._done

    def is_success(self) -> bool:
        """True once the collective finished without error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The collective's error if it failed (polls; never blocks)."""
        return self._error if self.is_completed() else None
