"""Exceptions raised by collectives. Every one names the rank, the op and its sequence number."""

from __future__ import annotations

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GroupAbortedError",
    "PeerFailureError",
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
