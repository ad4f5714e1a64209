"""Exceptions raised by collectives, and the one helper that builds them.

Every collective error names the rank, the op and its sequence number, in one format:
``[rank 3] all_reduce #7 (group 'world' of 4 rank(s)): <what happened>``. Build them with
:func:`where` and :func:`collective_error` (or :meth:`GroupInfo.error
<collectives._backend.GroupInfo.error>`, which fills in the group), never by hand.
"""

from __future__ import annotations

import signal
from typing import TypeVar

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GroupAbortedError",
    "PeerFailureError",
    "SpawnError",
    "collective_error",
    "signal_name",
    "unusable_error",
    "where",
]


class CollectiveError(RuntimeError):
    """A collective failed. ``rank``, ``op`` and ``seq`` say where (None when not applicable)."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        op: str | None = None,
        seq: int | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.op = op
        self.seq = seq

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the fields when the error crosses a process boundary (spawn reports it home).
        return (_rebuild, (type(self), str(self), self.rank, self.op, self.seq))


def _rebuild(
    cls: type[CollectiveError], message: str, rank: int | None, op: str | None, seq: int | None
) -> CollectiveError:
    err = cls.__new__(cls)
    CollectiveError.__init__(err, message, rank=rank, op=op, seq=seq)
    return err


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout; names the ranks missing."""


class CollectiveMismatchError(CollectiveError):
    """Ranks issued different collectives (op, dtype, shape, root) at the same sequence number."""


class PeerFailureError(CollectiveError):
    """Another rank of the group died or failed, so this collective cannot complete."""


class GroupAbortedError(CollectiveError):
    """The group is unusable because an earlier collective failed (the cause is in the text)."""


ErrorT = TypeVar("ErrorT", bound=CollectiveError)


def where(
    rank: int,
    op: str = "",
    seq: int | None = None,
    group: str | None = None,
    who: str | None = None,
) -> str:
    """The head of every collective message: ``[rank 3] all_reduce #7 (group 'world' ...)``.

    Args:
        rank: the global rank reporting.
        op: the op (empty: the message is about the rank or group, not one call).
        seq: the op's sequence number in its group (None: not numbered, e.g. ``init``).
        group: the group's description (:meth:`GroupInfo.describe`), or None to leave it out.
        who: who reports, where it is not a rank: a device-list context names the device
            (``[cpu:1] all_reduce #7 (DistributedContext of cpu, cpu:1)``).
    """
    head = f"[rank {rank}]" if who is None else f"[{who}]"
    if op:
        head += f" {op}" if seq is None else f" {op} #{seq}"
    return head if group is None else f"{head} ({group})"


def collective_error(
    cls: type[ErrorT],
    detail: str,
    *,
    rank: int,
    op: str = "",
    seq: int | None = None,
    group: str | None = None,
    cause: BaseException | None = None,
    who: str | None = None,
) -> ErrorT:
    """``cls("<where>: <detail>")`` with its ``rank``, ``op`` and ``seq`` fields set.

    Args:
        cls: the error class.
        detail: what happened (and, where it helps, what to do).
        rank, op, seq, group, who: see :func:`where`.
        cause: becomes the error's ``__cause__`` (as ``raise ... from cause`` would).
    """
    head = where(rank, op, seq, group, who)
    # "[rank 3] all_reduce #7: detail", but "[rank 3] detail" when it is about no call.
    sep = ": " if op or group else " "
    err = cls(head + sep + detail, rank=rank, op=op or None, seq=seq)
    if cause is not None:
        err.__cause__ = cause
    return err


def unusable_error(
    cause: BaseException, *, rank: int, op: str, seq: int | None, group: str
) -> GroupAbortedError:
    """The error of every call on a group that an earlier failure (``cause``) broke."""
    return collective_error(
        GroupAbortedError,
        f"the group is unusable after an earlier failure: {cause}",
        rank=rank,
        op=op,
        seq=seq,
        group=group,
    )


def signal_name(signum: int) -> str:
    """``9 -> "SIGKILL"``; unknown numbers become ``"signal 42"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class SpawnError(RuntimeError):
    """A rank started by :func:`spawn` or :class:`Parallel` failed.

    The message names the rank that failed first and includes its own traceback, or the signal
    that killed it.

    Attributes:
        rank: the global rank that failed first.
        exit_code: its exit code, ``-N`` when killed by signal N, None when it reported an error
            but had to be killed before it exited.
        signal_name: e.g. ``"SIGKILL"`` when it died by a signal, else None.
        exc_type: the qualified name of its exception, when it raised one.
        traceback_text: its formatted traceback, when it raised one.
        attempts: how many attempts ran (1 without restarts); the rest describes the last.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exit_code: int | None = None,
        exc_type: str | None = None,
        traceback_text: str | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.rank = rank
        self.exit_code = exit_code
        self.signal_name = (
            signal_name(-exit_code) if exit_code is not None and exit_code < 0 else None
        )
        self.exc_type = exc_type
        self.traceback_text = traceback_text
