"""Where the rank threads of a ``threads`` job meet: the job, and one meeting per group.

A :class:`ThreadJob` is one ``spawn(backend="threads")`` call: its devices (one a rank), its
in-process store, and its groups' :class:`Meeting` objects. A meeting is what the members of
one group share in memory, and the whole protocol of an engine that moves data in this
process (the NumPy engine; a remote engine reuses it to agree on the arrays before it asks the
server):

* :meth:`Meeting.begin`: a rank posts the call's signature record and one *item* (a reference
  to its array: nothing is copied), waits until every member posted, and gets every member's
  item. Every rank compares all records first, so mismatched calls fail on every rank, naming
  the ranks and both calls, before any data moves.
* :meth:`Meeting.phase`: a barrier between the steps of one collective (after each rank
  reduced its slice of the peers' arrays, nobody returns and reuses its array before all
  finished reading it).
* :meth:`Meeting.send` / :meth:`Meeting.recv`: a mailbox per (sender, receiver); a send
  copies the array and returns (eagerly buffered), a receive waits for the message.

Waits block on one condition variable (no spinning, so ranks may outnumber cores) in slices
that end at the request's deadline. A rank that fails (a mismatch, a timeout, an error of its
own, or its thread raised: :meth:`ThreadJob.fail`) aborts the meeting with its reason and
wakes every waiter, which fails at once naming that rank; a rank that destroyed the group is
named the same way by peers that wait for it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._backend import GroupInfo, Request
from ..._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerFailureError,
)
from ..._signature import SIG_BYTES, describe_record, mismatch_text, record_bytes, same_p2p_call
from ._store import LocalStore

__all__ = ["Meeting", "ThreadJob"]

_COMPARED = SIG_BYTES - 8  # a record's bytes that calls must share (all but the magic word)
_SLICE = 0.5  # longest single wait: how late a deadline can be noticed at worst

FailureHook = Callable[[int, str], None]


class ThreadJob:
    """The shared state of one threads job (see the module docstring).

    Args:
        devices: one device per rank (rank order).
        timeout: the store's default wait (the groups' collective timeout).
    """

    def __init__(self, devices: Sequence[Any], timeout: float) -> None:
        self.devices = list(devices)
        self.size = len(self.devices)
        self.store = LocalStore(timeout, job=self)
        self._lock = threading.Lock()
        self._meetings: dict[tuple[str, int], Meeting] = {}
        self._made: dict[tuple[int, str], int] = {}  # (global rank, group name) -> times made
        self._hooks: list[FailureHook] = []
        self.failed: dict[int, str] = {}  # global rank -> why its thread ended in error

    def meeting(self, info: GroupInfo) -> Meeting:
        """The meeting of ``info``'s group (made by the first member that asks).

        Ranks make their groups in the same order, so the k-th group of a name that rank r
        makes is the k-th its peers make: a group destroyed and made again meets afresh.
        """
        with self._lock:
            mine = (info.global_rank, info.name)
            k = self._made.get(mine, 0)
            self._made[mine] = k + 1
            key = (info.name, k)
            meeting = self._meetings.get(key)
            if meeting is None:
                meeting = self._meetings[key] = Meeting(info.ranks)
                self._hooks.append(meeting.rank_failed)
            return meeting

    def on_failure(self, hook: FailureHook) -> None:
        """Call ``hook(global_rank, reason)`` when a rank's thread fails (engines that keep
        no meeting, e.g. NCCL's, abort their communicator there)."""
        with self._lock:
            self._hooks.append(hook)
            said = dict(self.failed)
        for rank, reason in said.items():
            hook(rank, reason)

    def fail(self, rank: int, exc: BaseException) -> None:
        """Rank ``rank``'s thread raised ``exc``: every group it is in fails, at once."""
        reason = f"its thread raised {type(exc).__name__}: {exc}"
        with self._lock:
            if rank in self.failed:
                return
            self.failed[rank] = reason
            hooks = list(self._hooks)
        for hook in hooks:
            hook(rank, reason)


class _Abort:
    """A member's failure, as its peers report it."""

    __slots__ = ("kind", "message", "rank")

    def __init__(self, rank: int, kind: str, message: str) -> None:
        self.rank = rank  # global rank
        self.kind = kind  # "timeout", "failed" or "left"
        self.message = message


class Meeting:
    """What the members of one group share (see the module docstring).

    Args:
        ranks: the members' global ranks, in group-rank order.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)
        self.size = n = len(self.ranks)
        self._cond = threading.Condition(threading.Lock())
        self._items: list[Any] = [None] * n
        self._sigs: list[bytes] = [b""] * n
        self._entered = [0] * n  # barriers each member entered
        self._seq = [0] * n  # the last collective each member began
        self._count = 0  # members in the current barrier
        self._gen = 0  # barriers completed
        self._abort: _Abort | None = None
        self._left: set[int] = set()  # group ranks that destroyed the group
        self._mail: dict[tuple[int, int], deque[tuple[bytes, Any]]] = {}
        self._snap: tuple[list[Any], list[bytes], BaseException | None] = ([], [], None)

    # ------------------------------------------------------------------ collectives
    def begin(
        self,
        me: int,
        req: Request,
        item: Any,
        info: GroupInfo,
        finish: Callable[[list[Any]], None] | None = None,
    ) -> list[Any]:
        """Post ``item`` with ``req``'s record, wait for every member, compare the records;
        every member's item (group-rank order).

        With ``finish``, the last member to arrive calls ``finish(items)`` before it releases
        the others (only when the records agree): a small collective done by one thread in
        one step costs one wake-up instead of a barrier per step. It runs under the meeting's
        lock, which is harmless then (every member has arrived and waits for it; a large
        all-reduce spreads its work over the cpu helper's worker threads meanwhile); an error
        it raises fails the call on every member.
        """
        sig = record_bytes(req.signature, req.seq)
        with self._cond:
            self._failed(info, req)
            self._items[me] = item
            self._sigs[me] = sig
            self._seq[me] = req.seq
            self._barrier(me, req, info, finish)
            items, sigs, failure = self._snap
        if failure is not None:
            raise info.error(
                CollectiveError,
                req.op,
                req.seq,
                f"the reduction failed: {type(failure).__name__}: {failure}",
            ) from failure
        core = sig[:_COMPARED]
        if any(s[:_COMPARED] != core for s in sigs):
            records = np.frombuffer(b"".join(sigs), dtype=np.int64).reshape(self.size, -1)
            text = mismatch_text(records, self.ranks) or "records differ"
            raise info.error(
                CollectiveMismatchError,
                req.op,
                req.seq,
                f"ranks issued different collectives at the same point: {text}",
            )
        return items

    def phase(self, me: int, req: Request, info: GroupInfo) -> None:
        """Wait until every member reached the same step of the current collective."""
        with self._cond:
            self._failed(info, req)
            self._barrier(me, req, info)

    def _barrier(
        self,
        me: int,
        req: Request,
        info: GroupInfo,
        finish: Callable[[list[Any]], None] | None = None,
    ) -> None:
        """(Lock held.) Enter the next barrier; return once every member entered it (the last
        to enter runs ``finish``, see :meth:`begin`)."""
        self._entered[me] += 1
        target = self._entered[me]
        self._count += 1
        if self._count == self.size:
            # What every member posted, as of this barrier: a fast member may post its next
            # call before a slow one woke up (the next barrier cannot complete before that).
            items, sigs = list(self._items), list(self._sigs)
            failure: BaseException | None = None
            if finish is not None and all(x[:_COMPARED] == sigs[0][:_COMPARED] for x in sigs):
                try:
                    finish(items)
                except Exception as exc:  # every member raises it (begin)
                    failure = exc
            self._snap = (items, sigs, failure)
            self._count = 0
            self._gen += 1
            self._cond.notify_all()
            return
        gen = self._gen

        def missing() -> list[int]:
            return [q for q in range(self.size) if self._entered[q] < target]

        while self._gen == gen:
            self._wait(info, req, lambda: self._gen != gen, missing)

    def _wait(
        self,
        info: GroupInfo,
        req: Request,
        done: Callable[[], bool],
        missing: Callable[[], list[int]],
    ) -> None:
        """(Lock held.) One slice of a wait; unless ``done()`` then, the checks: a failure,
        a member that left without coming, the deadline. (A wait that completed succeeds even
        if a member failed right after: it may have found the next call mismatched.)"""
        left = req.deadline - time.monotonic()
        if left > 0:
            self._cond.wait(min(left, _SLICE))
        if done():
            return
        self._failed(info, req)
        absent = missing()
        gone = [q for q in absent if q in self._left]
        if gone:
            raise info.error(
                PeerFailureError,
                req.op,
                req.seq,
                f"rank {self.ranks[gone[0]]} left the group (destroy_process_group) before "
                "reaching this collective",
            )
        if time.monotonic() >= req.deadline and absent:
            if req.op in ("send", "recv"):
                detail = f"rank {info.ranks[req.peer]} never matched it"
            else:
                detail = f"ranks {[self.ranks[q] for q in absent]} never arrived"
            raise info.error(
                CollectiveTimeoutError,
                req.op,
                req.seq,
                f"timed out after {info.timeout:g} s; {detail} (is a rank thread stuck, or "
                "skipping this collective?)",
            )

    def _failed(self, info: GroupInfo, req: Request) -> None:
        """(Lock held.) Raise if a member gave up, with the reason it gave."""
        ab = self._abort
        if ab is None:
            return
        if ab.kind == "timeout":
            raise info.error(
                CollectiveTimeoutError, req.op, req.seq, f"rank {ab.rank} timed out: {ab.message}"
            )
        raise info.error(PeerFailureError, req.op, req.seq, f"rank {ab.rank} failed: {ab.message}")

    # ------------------------------------------------------------------ point to point
    def send(self, me: int, req: Request, info: GroupInfo) -> None:
        """Queue a copy of ``req.array`` for the peer; returns at once."""
        message = (record_bytes(req.signature, req.seq), np.array(req.array, copy=True))
        with self._cond:
            self._failed(info, req)
            self._mail.setdefault((me, req.peer), deque()).append(message)
            self._cond.notify_all()

    def recv(self, me: int, req: Request, info: GroupInfo) -> None:
        """Wait for the peer's next message to this rank and copy it into ``req.array``."""
        box = (req.peer, me)
        with self._cond:
            while not self._mail.get(box):
                self._wait(info, req, lambda: bool(self._mail.get(box)), lambda: [req.peer])
            sig, data = self._mail[box].popleft()
        mine = np.frombuffer(record_bytes(req.signature, req.seq), dtype=np.int64)
        theirs = np.frombuffer(sig, dtype=np.int64)
        if not same_p2p_call(theirs, mine):
            raise info.error(
                CollectiveMismatchError,
                req.op,
                req.seq,
                f"rank {info.ranks[req.peer]} sent {describe_record(theirs)} but this rank "
                f"expects {describe_record(mine)}",
            )
        req.array[...] = data.reshape(req.array.shape)

    # ------------------------------------------------------------------ failures
    def abort(self, me: int, reason: CollectiveError) -> None:
        """Member ``me`` gave up with ``reason``: every waiting member fails now."""
        kind = "timeout" if isinstance(reason, CollectiveTimeoutError) else "failed"
        self._set(_Abort(self.ranks[me], kind, str(reason)))

    def rank_failed(self, rank: int, reason: str) -> None:
        """Global rank ``rank``'s thread failed (see :meth:`ThreadJob.fail`)."""
        if rank in self.ranks:
            self._set(_Abort(rank, "failed", reason))

    def _set(self, ab: _Abort) -> None:
        with self._cond:
            if self._abort is None:
                self._abort = ab
            self._cond.notify_all()

    def leave(self, me: int) -> None:
        """Member ``me`` destroyed the group: peers that wait for it fail, naming it."""
        with self._cond:
            self._left.add(me)
            self._cond.notify_all()
