"""The cpu backend's lockstep protocol: posts, waits, signature checks and failure detection.

Synchronization is one monotonic counter per rank (header word ``W_CTR``). A *post* increments
it; :meth:`Lockstep.wait_all` waits until every peer's counter reached a target. Every
collective is a fixed sequence of (post, wait_all) phases that depends only on its signature,
so all ranks stay in lockstep. Waiting spins briefly, then polls while yielding the core, then
sleeps on a futex in the peer's header (a post wakes sleepers), so ranks that outnumber cores
do not burn the CPU.

The first post of a collective (:meth:`Lockstep.begin`) carries its signature record and data
location; after the first wait every rank compares all signatures, so mismatched calls fail on
every rank before any data moves. A rank that times out, sees a mismatch or raises sets its
abort flag with a reason; waiting peers check abort flags and whether the peers they wait for
are still alive, so a dead or failed rank makes every other rank fail within a fraction of a
second.

The common case of those steps (a collective's first post and its checks, a plain phase, the
small all-reduce's copy and reduction, a round of the large one) runs in a compiled helper
when one is built (``_cshm.c``, the same protocol, with the GIL released); it hands anything
unusual (a wait longer than the spin and yield phases, a mismatch, a peer's abort) back to the
Python code here. ``DPT_CPU_NATIVE=0`` keeps everything in Python; ``1`` requires the helper.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..._backend import GroupInfo, Request
from ..._errors import CollectiveMismatchError, CollectiveTimeoutError, PeerFailureError
from ..._proc import pid_alive
from ..._signature import SIG_BYTES, Signature, mismatch_text, record_bytes
from ..._types import ReduceOp
from .._reduce import native_code
from ._layout import (
    ABORT_CLOSED,
    ABORT_FAILED,
    ABORT_TIMEOUT,
    H_SIG,
    LOCATION,
    NO_LOCATION,
    REASON_BYTES,
    SIG_SLOT,
    U32_MASK,
    W_ABORT,
    W_CTR,
    W_PID,
    W_SLEEP,
    SegmentView,
    reached,
)
from ._shm import Futex

__all__ = ["Lockstep", "native_module"]

_NATIVE_ENV = "DPT_CPU_NATIVE"
_STREAM_ENV = "DPT_CPU_STREAM"
# What _cshm's begin() and phase() return (see _cshm.c).
RC_DONE, RC_WAIT, RC_REDUCE = 0, 1, 2
RC_WAIT2 = 5
RC_BEGUN = 6  # begin_rounds(), begin_zero_copy(): posted and checked, Python goes on
_AVG = ReduceOp.AVG  # an Enum member read from the class costs ~0.1 us, per call here
_COMPARED = SIG_BYTES - 8  # a record's bytes that ranks must share (all but the magic word)
_NO_LOCATION_BYTES = LOCATION.pack(*NO_LOCATION)
_U64 = 0xFFFFFFFFFFFFFFFF
# How long a compiled round sleeps on the futex (GIL released) before Python waits on: the
# delay in noticing a dead peer or the deadline (a peer's abort flag wakes it at once).
_CHUNK_SLEEP = 0.05


def native_module() -> Any:
    """The compiled helper ``_cshm``, or None: not built, or ``DPT_CPU_NATIVE=0``.

    Raises:
        ValueError: ``DPT_CPU_NATIVE`` is neither empty, 0 nor 1.
        RuntimeError: ``DPT_CPU_NATIVE=1`` but the helper is not built.
    """
    raw = os.environ.get(_NATIVE_ENV, "")
    if raw not in ("", "0", "1"):
        raise ValueError(
            f"{_NATIVE_ENV} must be 0 (pure Python), 1 (compiled) or unset, got {raw!r}"
        )
    if raw == "0":
        return None
    try:
        from . import _cshm
    except ImportError as exc:
        if raw == "1":
            raise RuntimeError(
                f"{_NATIVE_ENV}=1 but the cpu backend's compiled helper is not built ({exc}); "
                "reinstall with a C compiler present (pip install -e .) or unset it"
            ) from exc
        return None
    if (_cshm.H_SIG, _cshm.SIG_SLOT, _cshm.COMPARED) != (H_SIG, SIG_SLOT, _COMPARED):
        raise RuntimeError(
            "collectives.backends.cpu._cshm was built for another layout: rebuild it"
        )
    return _cshm


def stream_setting() -> int:
    """How the helper writes what the peers read (``DPT_CPU_STREAM``; the staged rounds, the
    small all-reduce from 16 KiB): -1 (unset or ``auto``) the way measured to cost less at the
    call's size, 0 plain stores, 1 streaming stores. Results are the same either way.

    Raises:
        ValueError: any other value.
    """
    raw = os.environ.get(_STREAM_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return -1
    if raw in ("0", "1"):
        return int(raw)
    raise ValueError(f"{_STREAM_ENV} must be auto, 0 (plain stores) or 1 (streaming), got {raw!r}")


def _native_code(sig: Signature) -> int:
    """The compiled reduction for ``sig``'s dtype and op, or -1 (NumPy reduces)."""
    if sig.dtype is None or sig.reduce_op is None:
        return -1
    return native_code(sig.dtype, sig.reduce_op)


class Lockstep:
    """Posts and waits over the segments of one group (see the module docstring).

    Args:
        info: the group.
        views: every rank's segment, in group-rank order (this rank's own included).
        native: the compiled helper's module (:func:`native_module`), or None: pure Python.
        stream: how the helper stores what peers read (:func:`stream_setting`).
    """

    def __init__(
        self, info: GroupInfo, views: list[SegmentView], native: Any = None, stream: int = -1
    ) -> None:
        self.info = info
        self.size = info.size
        self.rank = info.rank  # in the group
        self.views = views
        self.mine = views[info.rank]
        self.futex = Futex()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        # Spin (holding a core) only while ranks do not outnumber cores; then poll while
        # yielding the core; then sleep on a futex.
        self.spin = 20e-6 if self.size <= cores else 2e-6
        self.yield_time = 2e-3 if self.size <= cores else 200e-6
        self.slice = 0.005
        self._posts = 0
        # id(signature) -> (it, its record after the sequence number with no data location,
        # its compiled reduction code, whether its op is AVG)
        self._records: dict[int, tuple[Signature, bytes, int, bool]] = {}
        self._loc_records: dict[tuple[int, tuple[int, ...]], tuple[Signature, bytes]] = {}
        self.native: Any = None
        if native is not None and self.size > 1:
            self.native = native.Sync(
                self.rank,
                tuple(v.ctr_addr for v in views),
                tuple(v.slot_addrs[0] for v in views),
                tuple(v.slot_addrs[1] for v in views),
                tuple(v.res_addr for v in views),
                self.spin,
                stream,
            )

    # ------------------------------------------------------------------ posts
    def post(self) -> int:
        """Publish this rank's next post (Python; a first post goes through :meth:`begin`)."""
        self._posts += 1
        p = self._posts
        self.mine.hdr[W_CTR] = p & U32_MASK
        self.wake_if_sleeping(self.mine.ctr_addr)
        return p

    def wake_if_sleeping(self, address: int) -> None:
        """Wake whoever sleeps on ``address`` (a word of this rank's), if any peer sleeps."""
        for q, peer in enumerate(self.views):
            if q != self.rank and peer.hdr[W_SLEEP]:
                self.futex.wake(address)
                return

    def begin(self, req: Request, loc: tuple[int, int, int, int] = NO_LOCATION) -> int:
        """First post of a collective: signature out, wait for all, compare; returns the post."""
        rec = self._record(req.signature)[0] if loc is NO_LOCATION else self._located(req, loc)
        self._posts += 1
        post = self._posts
        if self.native is not None:
            if self.native.begin(post, req.seq, rec, None, 0, -1, self._limit(req)) != RC_DONE:
                self._settle(req, post, rec)
            return post
        self._publish(post, req.seq, rec)
        self._settle(req, post, rec)
        return post

    def begin_reduce(self, req: Request, arr: Any, par: int) -> bool:
        """The small all-reduce's first (and only) post, compiled: copy the C-contiguous
        ``arr`` into staging slot ``par``, post, wait, check, and reduce every rank's slot
        into ``arr`` when the helper has a loop for its dtype and op (True; AVG divided
        here), else False (the caller reduces). Only with :attr:`native`."""
        sig = req.signature
        hit = self._records.get(id(sig))  # _record's cache, read inline: this runs per call
        if hit is None or hit[0] is not sig:
            self._record(sig)
            hit = self._records[id(sig)]
        post = self._posts + 1
        limit = self.spin if req.on_thread else self.yield_time  # _limit(req), inline
        # It raises (a bad argument) before it posts anything; then the count stays.
        rc = self.native.begin(post, req.seq, hit[1], arr, par, hit[2], limit)
        self._posts = post
        if rc == RC_DONE:
            if hit[3]:  # AVG
                np.true_divide(arr, self.size, out=arr, casting="unsafe")
            return True
        if rc != RC_REDUCE:
            self._settle(req, post, hit[1])
        return False

    def chunk_code(self, sig: Signature) -> int:
        """The compiled reduction :meth:`reduce_rounds` and the zero-copy helper can run for
        ``sig`` (AVG only of floats), or -1: NumPy reduces. Only with :attr:`native`."""
        _, code = self._record(sig)
        avg = sig.reduce_op is ReduceOp.AVG
        return -1 if avg and code not in (0, 4) else code

    def reduce_rounds(
        self, req: Request, rest: Any, par: int, code: int, per: int
    ) -> tuple[int, int]:
        """The large all-reduce's rounds over ``rest`` (the array from the current round on),
        ``per`` items each, compiled (``_cshm`` rounds(): two posts a round, the first in
        slot ``par``; see ``cpu.py``'s ``_all_reduce_chunks``), as many as complete without
        a long wait. Returns ``(done, left)``: ``done`` rounds completed; then ``left`` is 2
        when that was all of them, else what is left of round ``done`` to the caller: 1 the
        copy of the peers' reduced slices (after this waited for its second post in Python),
        0 everything after its first post's wait (done here, in Python)."""
        p = self._posts + 1
        avg = req.reduce_op is _AVG
        # It raises (a bad argument) before it posts anything; then the count stays.
        rc, done = self.native.rounds(p, rest, par, code, avg, self._limit(req), _CHUNK_SLEEP, per)
        return done, self._after_rounds(req, rc, done, p)

    def begin_rounds(
        self, req: Request, flat: Any, loc: tuple[int, int, int, int], par: int, code: int, per: int
    ) -> tuple[int, int, int]:
        """A staged large all-reduce's first post (data location ``loc``) and, when every rank
        runs the compiled rounds, its rounds (as :meth:`reduce_rounds`), in one compiled call
        (``_cshm`` begin_rounds()). Returns ``(post, done, left)``: the first post's number;
        ``done`` -1 when the rounds did not start (the post is checked, as :meth:`begin`'s:
        the caller picks the protocol), else as :meth:`reduce_rounds`."""
        rec = self._located(req, loc)
        p = self._posts + 1
        avg = req.reduce_op is _AVG
        limit = self._limit(req)
        # It raises (a bad argument) before it posts anything; then the count stays.
        rc, done = self.native.begin_rounds(
            p, req.seq, rec, flat, par, code, avg, limit, _CHUNK_SLEEP, per
        )
        self._posts = p
        if done < 0:
            if rc != RC_BEGUN:
                self._settle(req, p, rec)
            return p, -1, 0
        return p, done, self._after_rounds(req, rc, done, p + 1)

    def begin_zero_copy(
        self,
        req: Request,
        loc: tuple[int, int, int, int],
        expected: bytes,
        code: int,
        addrs: tuple[int, ...],
        lo: int,
        hi: int,
        itemsize: int,
        scratch: int,
        block: int,
    ) -> int:
        """A zero-copy all-reduce in one compiled call (``_cshm`` begin_zero_copy()): the
        first post (data location ``loc``), and when every rank's location is as in
        ``expected`` (packed, rank order) the reduction over ``addrs`` (as zero_copy()) and
        the last post. Returns -1 when done, else the first post's number, posted and
        checked as :meth:`begin`'s (the caller goes on as after it)."""
        rec = self._located(req, loc)
        p = self._posts + 1
        avg = req.reduce_op is _AVG
        limit = self._limit(req)
        # It raises (a bad argument) before it posts anything; then the count stays.
        rc = self.native.begin_zero_copy(
            p, req.seq, rec, expected, code, avg, addrs, lo, hi, itemsize, scratch, block, limit
        )
        if rc in (RC_DONE, RC_WAIT2):
            self._posts = p + 1
            if rc == RC_WAIT2:
                self.wait_all(p + 1, req)
            return -1
        self._posts = p
        if rc != RC_BEGUN:
            self._settle(req, p, rec)
        return p

    def _after_rounds(self, req: Request, rc: int, done: int, first: int) -> int:
        """Count the posts of compiled rounds that began at post ``first`` and returned
        ``rc`` after ``done`` whole rounds; wait in Python for the one left unfinished.
        Returns what is left of it (see :meth:`reduce_rounds`)."""
        p = first + 2 * done
        if rc == RC_DONE:
            self._posts = p - 1
            return 2
        if rc == RC_WAIT:
            self._posts = p
            self.wait_all(p, req)
            return 0
        assert rc == RC_WAIT2, rc
        self._posts = p + 1
        self.wait_all(p + 1, req)
        return 1

    def _limit(self, req: Request) -> float:
        """How long the helper waits before handing the wait to :meth:`wait_word`: as long as
        that would spin and yield, so only the futex sleep is left to Python (on the
        communication thread, which :meth:`wait_word` never lets yield, only the spin)."""
        return self.spin if req.on_thread else self.yield_time

    def _publish(self, post: int, seq: int, rec: bytes) -> None:
        """Write post ``post``'s signature record (Python), then post it."""
        off = H_SIG + (post & 1) * SIG_SLOT
        self.mine.seg.buf[off : off + SIG_SLOT] = (seq & _U64).to_bytes(8, "little") + rec
        self.mine.hdr[W_CTR] = post & U32_MASK
        self.wake_if_sleeping(self.mine.ctr_addr)

    def _settle(self, req: Request, post: int, rec: bytes) -> None:
        """After posting ``post``: wait for all, compare signatures, look for aborts."""
        self.wait_all(post, req)
        sig = (req.seq & _U64).to_bytes(8, "little") + rec
        core = sig[:_COMPARED]
        off = H_SIG + (post & 1) * SIG_SLOT
        end = off + _COMPARED
        for q, peer in enumerate(self.views):
            if q != self.rank and peer.seg.buf[off:end] != core:
                self._mismatch(req, post, sig[:SIG_BYTES])
        # A rank arriving after its peers gave up (timeout) finds their posts: without this it
        # would "complete" a collective that failed everywhere else (signatures first, so a
        # mismatch is still reported as one on every rank).
        self.check_aborts(req)

    def _record(self, sig: Signature) -> tuple[bytes, int]:
        """``sig``'s record after its sequence number, with no data location (as
        ``record_bytes``), and its compiled reduction code.

        Cached by identity, holding ``sig`` (so its id is not reused): hashing a Signature
        hashes its ReduceOp, a Python-level call, and the group passes the same Signature
        object for repeated calls of one shape.
        """
        hit = self._records.get(id(sig))
        if hit is not None and hit[0] is sig:
            return hit[1], hit[2]
        rec = record_bytes(sig, 0)[8:] + _NO_LOCATION_BYTES
        code = _native_code(sig)
        if len(self._records) >= 256:
            self._records.clear()
        self._records[id(sig)] = (sig, rec, code, sig.reduce_op is ReduceOp.AVG)
        return rec, code

    def _located(self, req: Request, loc: tuple[int, int, int, int]) -> bytes:
        """``req``'s record with data location ``loc``; cached like :meth:`_record` (a large
        call repeated on one array makes the same one every time)."""
        sig = req.signature
        hit = self._loc_records.get((id(sig), loc))
        if hit is not None and hit[0] is sig:
            return hit[1]
        rec = record_bytes(sig, 0)[8:] + LOCATION.pack(*loc)
        if len(self._loc_records) >= 256:
            self._loc_records.clear()
        self._loc_records[(id(sig), loc)] = (sig, rec)
        return rec

    def phase(self, req: Request) -> None:
        """One more (post, wait for all) step of the current collective."""
        if self.native is not None:
            self._posts += 1
            if self.native.phase(self._posts, self._limit(req)) != RC_DONE:
                self.wait_all(self._posts, req)
            return
        self.wait_all(self.post(), req)

    def locations(self, post: int) -> tuple[tuple[int, int, int, int], ...]:
        """Every rank's data location from its signature of ``post``."""
        return tuple([view.location(post) for view in self.views])

    def _mismatch(self, req: Request, post: int, mine: bytes) -> None:
        raw = [mine if q == self.rank else v.signature(post) for q, v in enumerate(self.views)]
        records = np.frombuffer(b"".join(raw), dtype=np.int64).reshape(self.size, -1)
        text = mismatch_text(records, self.info.ranks) or "records differ"
        raise self.info.error(
            CollectiveMismatchError,
            req.op,
            req.seq,
            f"ranks issued different collectives at the same point: {text}",
        )

    # ------------------------------------------------------------------ waits
    def wait_all(self, target: int, req: Request) -> None:
        """Wait until every peer's post counter reached ``target``."""
        for q, peer in enumerate(self.views):
            if q != self.rank and not reached(peer.hdr[W_CTR], target):
                self.wait_word(peer.hdr, W_CTR, peer.ctr_addr, target, req, q)

    def wait_word(
        self, words: memoryview, idx: int, address: int, target: int, req: Request, q: int
    ) -> None:
        """Wait until counter ``words[idx]`` of rank ``q`` (at ``address``) reached ``target``,
        failing on an abort, a dead or departed peer, or the request's deadline."""
        # 1. Spin briefly: on an idle core a peer's post usually lands within microseconds.
        clock = time.perf_counter
        now = clock()
        spin_until = now + self.spin
        yield_until = now + self.yield_time
        while clock() < spin_until:
            if reached(words[idx], target):
                return
        # 2. Keep polling but give the core away each time (a peer may share this core);
        #    os.sched_yield also releases the GIL for the caller's other threads. Not on the
        #    communication thread: each yield hands the GIL to a main thread running Python,
        #    which keeps it for a switch interval; sleeping gives it away once.
        sched_yield = os.sched_yield
        while not req.on_thread and clock() < yield_until:
            if reached(words[idx], target):
                return
            sched_yield()
        # 3. Sleep on the peer's word; a post wakes sleepers. Time slices bound how late an
        #    abort, a dead peer or the deadline is noticed.
        mine = self.mine.hdr
        next_check = time.monotonic() + 0.2
        while True:
            mine[W_SLEEP] = 1
            value = words[idx]
            if reached(value, target):
                mine[W_SLEEP] = 0
                return
            self.futex.wait(address + 4 * idx, value, self.slice)
            mine[W_SLEEP] = 0
            if reached(words[idx], target):
                return
            self.check_aborts(req)
            if self.views[q].hdr[W_ABORT] == ABORT_CLOSED and not reached(words[idx], target):
                raise self.info.error(
                    PeerFailureError,
                    req.op,
                    req.seq,
                    f"rank {self.info.ranks[q]} left the group (destroy_process_group) before "
                    "reaching this collective",
                )
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.2
                self.check_alive(req)
            if now >= req.deadline:
                self._timeout(req, target, words is self.views[q].hdr, q)

    # ------------------------------------------------------------------ failures
    def check_aborts(self, req: Request) -> None:
        """Raise if a peer gave up (timed out or failed), with the reason it gave."""
        for q, peer in enumerate(self.views):
            kind = peer.hdr[W_ABORT] if q != self.rank else 0
            if kind and kind != ABORT_CLOSED:
                rank = self.info.ranks[q]
                if kind == ABORT_TIMEOUT:
                    # A peer that gave up first is no failure of that peer: every rank waiting
                    # on the missing ranks must see the timeout error it documents.
                    raise self.info.error(
                        CollectiveTimeoutError,
                        req.op,
                        req.seq,
                        f"rank {rank} timed out: {peer.abort_reason()}",
                    )
                raise self.info.error(
                    PeerFailureError, req.op, req.seq, f"rank {rank} failed: {peer.abort_reason()}"
                )

    def check_alive(self, req: Request) -> None:
        """Raise if a peer's process is gone."""
        for q, peer in enumerate(self.views):
            if q != self.rank and not pid_alive(peer.hdr[W_PID]):
                raise self.info.error(
                    PeerFailureError,
                    req.op,
                    req.seq,
                    f"rank {self.info.ranks[q]} (pid {peer.hdr[W_PID]}) is gone: its process "
                    "exited or was killed",
                )

    def _timeout(self, req: Request, target: int, collective: bool, q: int) -> None:
        if collective:
            missing = [
                self.info.ranks[r]
                for r, peer in enumerate(self.views)
                if r != self.rank and not reached(peer.hdr[W_CTR], target)
            ]
            detail = f"ranks {missing} never arrived"
        else:
            detail = f"rank {self.info.ranks[q]} never matched it"
        raise self.info.error(
            CollectiveTimeoutError,
            req.op,
            req.seq,
            f"timed out after {self.info.timeout:g} s; {detail} (all processes are alive: is a "
            "rank stuck, or skipping this collective?)",
        )

    def set_abort(self, reason: str, kind: int = ABORT_FAILED) -> None:
        """Tell every peer that this rank gave up, and why (they fail instead of waiting)."""
        data = reason.encode("utf-8", "replace")[: REASON_BYTES - 1] + b"\0"
        mine = self.mine
        mine.reason[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        mine.hdr[W_ABORT] = kind
        # Wake anyone sleeping on any of this rank's words so they notice now.
        self.futex.wake(mine.ctr_addr)
        for d in range(self.size):
            self.futex.wake(mine.sent_addr + 4 * d)
            self.futex.wake(mine.acked_addr + 4 * d)


def abort_kind(reason: Any) -> int:
    """The abort flag for a failure: timeouts are told apart (see :data:`ABORT_TIMEOUT`)."""
    return ABORT_TIMEOUT if isinstance(reason, CollectiveTimeoutError) else ABORT_FAILED
