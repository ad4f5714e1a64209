"""The ``cpu`` backend: ranks on one host exchange data through shared memory.

Design (after DeepSpeed's SHM all-reduce):

* Every rank owns one segment (its layout: ``_layout``) that every rank maps: a header
  (post counter, flags, pid, signatures, abort reason, point-to-point counters) and data areas:
  two staging slots used alternately, one result area, and a pair of buffers per peer.
* Every collective is a fixed sequence of (post, wait-for-all) phases that depends only on its
  signature, so all ranks stay in lockstep; the first post carries the signature, so mismatched
  calls fail on every rank before any data moves, and a dead or failed rank makes every other
  rank fail within a fraction of a second (the protocol: ``_sync``).
* Large all-reduce: per chunk, each rank copies its chunk into its slot, posts, reduces *its own
  slice* of the chunk from every rank's slot into its result area (fixed order 0..n-1), posts,
  then copies every rank's reduced slice into its output. Every element is reduced exactly once,
  in rank order, so results are bitwise identical on every rank and from run to run. With the
  compiled helper the rounds are one C call (``Lockstep.reduce_rounds``), and short rounds when
  every rank has it (see ``_COMPILED``). Small messages use one phase: every rank reduces
  everything in the same fixed order.
* Zero copy: arrays from :meth:`ProcessGroup.alloc` live in shared memory that every rank maps;
  when all ranks pass such arrays, each rank reduces its slice straight from the peers' arrays
  and writes the result into all of them (two phases, no staging copies).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..._backend import Backend, GroupInfo, Request
from ..._errors import CollectiveError, CollectiveMismatchError, where
from ..._proc import host_id
from ..._registry import register_backend
from ..._setup_wait import SetupWatch, setup_op
from ..._signature import Signature, describe_record, record_bytes, same_p2p_call
from .._reduce import reduce_in_order
from . import _last_words as last_words
from . import _shm
from ._layout import (
    ABORT_CLOSED,
    NO_LOCATION,
    U32_MASK,
    W_ABORT,
    W_PID,
    Layout,
    SegmentView,
    env_bytes,
    reached,
)
from ._shared import SharedArrays
from ._shm import Segment
from ._sync import Lockstep, abort_kind, native_module, stream_setting

__all__ = ["CpuBackend"]

# A large all-reduce's location flag bit: this rank runs the compiled rounds. If all do, one
# over 1 MiB goes in rounds of _COMPILED_ROUND bytes (data stays in cache; a compiled phase is
# cheap, a Python one is not; up to 1 MiB one round was faster), else of DPT_CPU_CHUNK_BYTES.
_COMPILED = 2
_COMPILED_ROUND, _SHORT_ABOVE = 256 << 10, 1 << 20
# (signature, a weak reference to the array, code, location, staged round bytes and items)
_LargePlan = tuple[Signature, "weakref.ref[Any]", int, tuple[int, int, int, int], int, int]


def _chunks(total: int, per: int) -> Iterator[tuple[int, int]]:
    """``(start, count)`` of each round of a collective over ``total`` items, ``per`` at a
    time; one empty round when ``total`` is 0 (every rank still posts, so all stay in step)."""
    start = 0
    while True:
        m = min(per, total - start)
        yield start, m
        start += m
        if start >= total:
            return


def _attach(name: str, watch: SetupWatch) -> Segment:
    """Map a peer's segment; a name already gone means its creator died (and the next init's
    sweep removed it): name the rank, as the waits do, rather than a bare FileNotFoundError."""
    try:
        return Segment.attach(name)
    except FileNotFoundError:
        watch.check("publish its segment")
        raise


class CpuBackend(Backend):
    """Shared-memory collectives for ranks on one host (see the module docstring)."""

    name = "cpu"

    def __init__(self, info: GroupInfo) -> None:
        super().__init__(info)
        if info.size > 1 and info.store is None:
            raise ValueError("the cpu backend needs a rendezvous store for world size > 1")
        self.size = n = info.size
        self.rank = info.rank  # in the group
        # Before any segment exists: DPT_CPU_NATIVE=1 without the helper fails here, cleanly.
        native = native_module() if n > 1 else None
        stream = stream_setting()
        self.layout = Layout(
            n,
            env_bytes("DPT_CPU_CHUNK_BYTES", 4 << 20),
            env_bytes("DPT_CPU_P2P_CHUNK_BYTES", 1 << 20),
        )
        self.chunk = self.layout.chunk
        self.p2p_chunk = self.layout.p2p_chunk
        self.small = min(64 << 10, self.chunk)
        self._slot_parity = 0
        self._sent = [0] * n  # chunks sent to each peer
        self._recvd = [0] * n  # chunks received from each peer
        # (slot parity, dtype, count) -> this rank's slot and every rank's, as typed views.
        self._small_views: dict[tuple[int, Any, int], tuple[Any, list[Any]]] = {}
        self._large_plan: _LargePlan | None = None  # the last large all-reduce's
        self._closed = False
        self._own = Segment.create(self.layout.total, f"{info.name}-r{info.rank}")
        try:
            own_view = SegmentView(self._own, self.layout)
            own_view.hdr[W_PID] = os.getpid() & U32_MASK
            watch = SetupWatch(info, setup_op(info))
            segs = self._exchange(self._own, "seg", watch)
        except BaseException:
            self._own.close()
            raise
        self.views = [own_view if s is self._own else SegmentView(s, self.layout) for s in segs]
        self.mine = own_view
        self.sync = Lockstep(info, self.views, native, stream)
        self.shared = SharedArrays(self.sync, own_view, self.chunk)
        if n > 1:
            last_words.track(self)

    # ------------------------------------------------------------------ setup
    def _exchange(self, seg: Segment, what: str, watch: SetupWatch) -> list[Segment]:
        """Publish ``seg``'s name, map every peer's, wait until all mapped, unlink ours.

        Returns every rank's segment (``seg`` itself for this rank). The waits fail fast,
        naming the rank, when a peer dies meanwhile (``watch``).
        """
        info = self.info
        if self.size == 1:
            seg.unlink()
            return [seg]
        me, store, n = self.rank, info.store, self.size
        prefix = f"{info.name}/cpu/{what}"
        host, layout = host_id(), self.layout.describe()
        deadline = time.monotonic() + info.timeout
        with watch.guard():
            store.set(f"{prefix}/{me}", f"{seg.name} {host} {layout}")
        watch.wait({f"{prefix}/{r}": r for r in range(n)}, deadline, "publish its segment")
        # Check every peer's entry before mapping any: a rank that fails the check unlinks its
        # segment, so a rank that mapped first would report a FileNotFoundError instead.
        names: dict[int, str] = {}
        for r in range(n):
            if r == me:
                continue
            with watch.guard():
                entry = store.get(f"{prefix}/{r}", timeout=1.0)
            name, peer_host, peer_layout = entry.decode().split()
            names[r] = name
            if peer_layout != layout:
                raise ValueError(
                    f"{where(info.global_rank)}: rank {info.ranks[r]} uses cpu-backend chunk "
                    f"sizes {peer_layout} but this rank {layout}: set DPT_CPU_CHUNK_BYTES and "
                    "DPT_CPU_P2P_CHUNK_BYTES the same on every rank"
                )
            if peer_host != host:
                raise RuntimeError(
                    f"{where(info.global_rank)}: the cpu backend needs every rank on one host, "
                    f"but rank {info.ranks[r]} runs elsewhere; use the mpi or nccl backend"
                )
        segs: list[Segment] = []
        try:
            segs = [seg if r == me else _attach(names[r], watch) for r in range(n)]
            with watch.guard():
                store.set(f"{prefix}/mapped/{me}", b"1")
            mapped = {f"{prefix}/mapped/{r}": r for r in range(n)}
            watch.wait(mapped, deadline, "map every rank's segment")
        except BaseException:
            # Only a segment's creator unlinks it after everyone mapped it: a rank that died
            # here would leave its file in /dev/shm. Every rank knows the names, so remove them
            # (the setup fails on every rank anyway).
            for name in names.values():
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(_shm.shm_dir(), name))
            raise
        seg.unlink()
        return segs

    def abort(self, reason: CollectiveError) -> None:
        """Record the failure and tell the peers (they fail instead of waiting)."""
        first = self.error is None
        super().abort(reason)
        if self._closed or not first or self.size == 1:
            return  # peers know the first failure; a later GroupAbortedError must not mask it
        self.sync.set_abort(str(reason), abort_kind(reason))

    def _next_slot(self) -> int:
        par = self._slot_parity
        self._slot_parity ^= 1
        return par

    def _round(self, req: Request, first: bool) -> None:
        """The post that publishes a round's staged data (a collective's first post carries
        its signature and checks everyone's)."""
        if first:
            self.sync.begin(req)
        else:
            self.sync.phase(req)

    # ------------------------------------------------------------------ collectives
    def _do_barrier(self, req: Request) -> None:
        self.sync.begin(req)

    def run(self, req: Request) -> None:
        """Execute ``req``; a small all-reduce straight away (the per-call path that matters
        most: with the helper, one compiled call does it), the rest through
        :meth:`Backend.run`'s dispatch."""
        if req.op == "all_reduce" and self.size > 1:
            arr = req.array
            if arr.nbytes > self.small:
                self._do_all_reduce(req)
                return
            par = self._slot_parity
            self._slot_parity = par ^ 1
            sync = self.sync
            if sync.native is None:
                self._all_reduce_small(req, arr, par, staged=False)
            elif not sync.begin_reduce(req, arr, par):
                self._all_reduce_small(req, arr, par, staged=True)
            return
        super().run(req)

    def _do_all_reduce(self, req: Request) -> None:
        arr = req.array
        flat = arr if arr.ndim == 1 else arr.reshape(-1)
        sync = self.sync
        # A call repeated on the same array (a DDP bucket, a training loop's buffer) reuses
        # the last one's plan: this Python runs on caches the last call's data evicted.
        plan = self._large_plan
        if plan is None or plan[0] is not req.signature or plan[1]() is not arr:
            plan = self._large_plan = self._plan_large(req, arr)
        _, _, code, loc, per_bytes, per = plan
        post = -1
        if code >= 0:
            if not loc[0] & 1:
                # Staged, compiled: the first post and (every rank compiled) the rounds in one
                # call; Python between them would run on caches the last call's data evicted.
                post, done, left = sync.begin_rounds(req, flat, loc, self._slot_parity, code, per)
                if done >= 0:
                    self._slot_parity ^= done & 1
                    if left != 2:
                        self._all_reduce_chunks(
                            req, flat, True, code=code, per_bytes=per_bytes, resume=(done, left)
                        )
                    return
            else:
                post = self.shared.begin_all_reduce(req, flat, loc, code)
                if post < 0:
                    return  # done in one compiled call
        if post <= 0:
            post = sync.begin(req, loc)
        locs = sync.locations(post)
        if all(entry[0] & 1 for entry in locs):
            self.shared.all_reduce(req, flat, locs, code)
        else:
            short = flat.nbytes > _SHORT_ABOVE and all(e[0] & _COMPILED for e in locs)
            per = min(self.chunk, _COMPILED_ROUND) if short else self.chunk
            self._all_reduce_chunks(req, flat, first_done=True, code=code, per_bytes=per)

    def _plan_large(self, req: Request, arr: Any) -> _LargePlan:
        """What a large all-reduce of ``arr`` finds out before its first post: the helper's
        reduction (-1: none), this rank's data location and the staged rounds' bytes and
        items."""
        # Large: a signature-only first post says where each rank's data is (flag bit 0: in
        # shared memory, so that ranks whose arrays all are can skip staging altogether) and
        # whether it runs compiled rounds (bit 1; then all ranks may take short ones).
        sync = self.sync
        code = -1 if sync.native is None else sync.chunk_code(req.signature)
        loc = self.shared.location(arr) or NO_LOCATION
        if code >= 0:
            loc = (loc[0] | _COMPILED, loc[1], loc[2], loc[3])
        short = arr.nbytes > _SHORT_ABOVE
        per_bytes = min(self.chunk, _COMPILED_ROUND) if short else self.chunk
        per = max(per_bytes // arr.dtype.itemsize, 1)
        return (req.signature, weakref.ref(arr), code, loc, per_bytes, per)

    def _all_reduce_small(self, req: Request, arr: Any, par: int, staged: bool) -> None:
        """One phase: every rank stages its (contiguous) ``arr`` in slot ``par``, then reduces
        every rank's copy in rank order into it (``staged``: the helper did all but the
        reduction already)."""
        flat = arr if arr.ndim == 1 else arr.reshape(-1)
        own, sources = self._small_slots(par, flat.dtype, flat.size)
        if not staged:
            np.copyto(own, flat)
            self.sync.begin(req)
        assert req.reduce_op is not None
        reduce_in_order(flat, sources, req.reduce_op, self.size)

    def _small_slots(self, par: int, dt: Any, count: int) -> tuple[Any, list[Any]]:
        """This rank's slot ``par`` and every rank's, as ``count`` items of ``dt`` (cached:
        building the views costs more than a small message's copy)."""
        key = (par, dt, count)
        hit = self._small_views.get(key)
        if hit is None:
            nb = count * dt.itemsize
            sources = [p.slots[par][:nb].view(dt) for p in self.views]
            hit = (sources[self.rank], sources)
            if len(self._small_views) >= 256:
                self._small_views.clear()
            self._small_views[key] = hit
        return hit

    def _slices(self, count: int) -> list[tuple[int, int]]:
        n = self.size
        return [((count * i) // n, (count * (i + 1)) // n) for i in range(n)]

    def _all_reduce_chunks(
        self,
        req: Request,
        flat: Any,
        first_done: bool,
        gather_to: int = -1,
        code: int = -1,
        per_bytes: int = 0,
        resume: tuple[int, int] | None = None,
    ) -> None:
        """Chunked reduce (each rank reduces its slice) then gather (or only to ``gather_to``),
        in rounds of ``per_bytes`` (default: the chunk).

        With ``first_done`` the signature post happened already and carried no data, so the
        first chunk's data goes out with a plain post. ``code`` >= 0 (an all-reduce only): the
        rounds are compiled (``Lockstep.reduce_rounds``, the same posts as here), one call
        for all of them unless a wait is long; this loop finishes a round it left. ``resume``
        ``(done, left)``: compiled rounds ran already, as ``reduce_rounds`` returns them.
        """
        dt = flat.dtype
        isz = dt.itemsize
        per = max((per_bytes or self.chunk) // isz, 1)
        me, op, n = self.rank, req.reduce_op, self.size
        assert op is not None
        sync = self.sync
        rounds = list(_chunks(flat.size, per))
        i, pending = resume if resume is not None else (0, -1)
        while i < len(rounds):
            left = 0
            if pending >= 0:
                left, pending = pending, -1
            elif code >= 0:
                rest = flat[rounds[i][0] :]
                done, left = sync.reduce_rounds(req, rest, self._slot_parity, code, per)
                self._slot_parity ^= done & 1
                i += done
                if left == 2:
                    return
            start, m = rounds[i]
            i += 1
            par = self._next_slot()
            chunk = flat[start : start + m]
            bounds = self._slices(m)
            if left == 0:
                if code < 0:
                    self._stage(req, chunk, par, bounds, start == 0 and not first_done)
                lo, hi = bounds[me]
                if hi > lo:
                    sources = [
                        chunk[lo:hi] if q == me else p.slots[par].view(dt)[lo:hi]
                        for q, p in enumerate(self.views)
                    ]
                    reduce_in_order(self.mine.res.view(dt)[lo:hi], sources, op, n)
                sync.phase(req)
            if gather_to < 0 or gather_to == me:
                for q, (lo, hi) in enumerate(bounds):
                    if hi > lo:
                        chunk[lo:hi] = self.views[q].res.view(dt)[lo:hi]

    def _stage(self, req: Request, chunk: Any, par: int, bounds: Any, first: bool) -> None:
        """Copy the slices of ``chunk`` that peers reduce into slot ``par``, then post."""
        slot = self.mine.slots[par].view(chunk.dtype)[: chunk.size]
        # Peers read every slice but this rank's own; copy those only.
        for q, (lo, hi) in enumerate(bounds):
            if q != self.rank and hi > lo:
                slot[lo:hi] = chunk[lo:hi]
        self._round(req, first)

    def _do_reduce(self, req: Request) -> None:
        flat = req.array.reshape(-1)
        if flat.nbytes <= self.small:
            par = self._next_slot()
            nb = flat.nbytes
            self.mine.slots[par][:nb] = flat.view(np.uint8)
            self.sync.begin(req)
            if self.rank == req.root:
                assert req.reduce_op is not None
                sources = [p.slots[par][:nb].view(flat.dtype) for p in self.views]
                reduce_in_order(flat, sources, req.reduce_op, self.size)
            return
        self._all_reduce_chunks(req, flat, first_done=False, gather_to=req.root)

    def _do_broadcast(self, req: Request) -> None:
        flat = req.array.reshape(-1).view(np.uint8)
        total = flat.size
        root = req.root
        for i, (start, m) in enumerate(_chunks(total, self.chunk)):
            par = self._next_slot()
            if self.rank == root and m:
                self.mine.slots[par][:m] = flat[start : start + m]
            self._round(req, i == 0)
            if self.rank != root and m:
                flat[start : start + m] = self.views[root].slots[par][:m]

    def _do_all_gather(self, req: Request) -> None:
        src = req.array.reshape(-1).view(np.uint8)
        out = req.out.reshape(self.size, -1).view(np.uint8)
        total = src.size
        out[self.rank] = src
        for i, (start, m) in enumerate(_chunks(total, self.chunk)):
            par = self._next_slot()
            if m:
                self.mine.slots[par][:m] = src[start : start + m]
            self._round(req, i == 0)
            if m:
                for q, peer in enumerate(self.views):
                    if q != self.rank:
                        out[q, start : start + m] = peer.slots[par][:m]

    def _exchange_blocks(self, req: Request) -> Iterator[tuple[int, int, list[Any]]]:
        """Chunk by chunk, hand block ``j`` of the input (first axis) to rank ``j``.

        Yields ``(start, m, pieces)`` per chunk once every rank posted it: ``pieces[q]`` is
        elements ``start:start+m`` of the block rank ``q`` holds for this rank (this rank's
        own block for ``q == me``). The consumer must be done with them before resuming.
        """
        dt = req.array.dtype
        blocks = req.array.reshape(self.size, -1)
        per = max(self.chunk // (self.size * dt.itemsize), 1)
        total = blocks.shape[1]
        me, n = self.rank, self.size
        for i, (start, m) in enumerate(_chunks(total, per)):
            par = self._next_slot()
            slot = self.mine.slots[par].view(dt)
            for j in range(n):
                if j != me and m:
                    slot[j * per : j * per + m] = blocks[j, start : start + m]
            self._round(req, i == 0)
            pieces = [
                blocks[me, start : start + m]
                if q == me
                else p.slots[par].view(dt)[me * per : me * per + m]
                for q, p in enumerate(self.views)
            ]
            yield start, m, pieces

    def _do_reduce_scatter(self, req: Request) -> None:
        out = req.out.reshape(-1)
        op = req.reduce_op
        assert op is not None
        for start, m, pieces in self._exchange_blocks(req):
            if m:
                reduce_in_order(out[start : start + m], pieces, op, self.size)

    def _do_all_to_all(self, req: Request) -> None:
        out_blocks = req.out.reshape(self.size, -1)
        for start, m, pieces in self._exchange_blocks(req):
            for q, piece in enumerate(pieces):
                if m:
                    out_blocks[q, start : start + m] = piece

    # ------------------------------------------------------------------ point to point
    def _do_send(self, req: Request) -> None:
        d = req.peer
        src = req.array.reshape(-1).view(np.uint8)
        total = src.size
        peer = self.views[d]
        sig = np.frombuffer(record_bytes(req.signature, req.seq), dtype=np.uint8)
        for i, (start, m) in enumerate(_chunks(total, self.p2p_chunk)):
            idx = self._sent[d]
            # Buffer idx % 2 is free once the receiver consumed chunk idx - 2.
            if idx >= 2 and not reached(peer.acked[self.rank], idx - 1):
                target = (idx - 1) & U32_MASK
                self.sync.wait_word(peer.acked, self.rank, peer.acked_addr, target, req, d)
            if i == 0:
                self.mine.psig[d][idx & 1][:] = sig
            if m:
                self.mine.pbuf[d][idx & 1][:m] = src[start : start + m]
            self._sent[d] = idx + 1
            self.mine.sent[d] = (idx + 1) & U32_MASK
            self.sync.wake_if_sleeping(self.mine.sent_addr + 4 * d)

    def _do_recv(self, req: Request) -> None:
        s = req.peer
        dst = req.array.reshape(-1).view(np.uint8)
        total = dst.size
        peer = self.views[s]
        for i, (start, m) in enumerate(_chunks(total, self.p2p_chunk)):
            idx = self._recvd[s]
            if not reached(peer.sent[self.rank], idx + 1):
                target = (idx + 1) & U32_MASK
                self.sync.wait_word(peer.sent, self.rank, peer.sent_addr, target, req, s)
            if i == 0:
                self._check_sent(req, peer.psig[self.rank][idx & 1])
            if m:
                dst[start : start + m] = peer.pbuf[self.rank][idx & 1][:m]
            self._recvd[s] = idx + 1
            self.mine.acked[s] = (idx + 1) & U32_MASK
            self.sync.wake_if_sleeping(self.mine.acked_addr + 4 * s)

    def _check_sent(self, req: Request, sent: Any) -> None:
        """Refuse a message whose sender's record does not match this receive."""
        mine = np.frombuffer(record_bytes(req.signature, req.seq), dtype=np.int64)
        theirs = sent.view(np.int64).copy()
        if not same_p2p_call(theirs, mine):
            raise self.info.error(
                CollectiveMismatchError,
                req.op,
                req.seq,
                f"rank {self.info.ranks[req.peer]} sent {describe_record(theirs)} but this "
                f"rank expects {describe_record(mine)}",
            )

    # ------------------------------------------------------------------ zero copy
    def alloc(self, shape: tuple[int, ...], dtype: Any, seq: int) -> Any:
        """Collectively allocate a zeroed array in shared memory that every rank maps."""
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        seg = Segment.create(max(nbytes, 1), f"{self.info.name}-a{seq}-r{self.rank}")
        try:
            watch = SetupWatch(self.info, "alloc", seq)
            segs = self._exchange(seg, f"alloc{seq}", watch)
        except BaseException:
            seg.close()
            raise
        self.shared.add(seg.address, seg.size, seq, segs)
        return seg.u8[:nbytes].view(dt).reshape(shape)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        super().close()
        if self._closed:
            return
        self._closed = True
        last_words.forget(self)
        if self.error is None and self.size > 1 and not self.mine.hdr[W_ABORT]:
            # Peers still waiting on this rank fail now instead of at their timeout. (A reason
            # told already, an uncaught exception's, stays: it says more than "destroyed".)
            with contextlib.suppress(Exception):
                self.sync.set_abort("destroyed its process group", ABORT_CLOSED)
        self.shared.unlink()
        with contextlib.suppress(Exception):
            self._own.unlink()


register_backend(
    "cpu",
    CpuBackend,
    probe=_shm.probe,
    description="shared memory between ranks on one host (NumPy; CuPy staged through host)",
)
