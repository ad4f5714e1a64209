"""The ``cpu`` backend: ranks on one host exchange data through shared memory.

Design (after DeepSpeed's SHM all-reduce):

* Every rank owns one segment: a header (its post counter, flags, pid, the signatures of its
  last two posts, an abort reason, point-to-point counters) and data areas: two staging slots
  (used alternately, so consecutive collectives need no extra barrier), one result area, and a
  pair of buffers per peer for send/recv. Every rank maps every peer's segment.
* Synchronization is one monotonic counter per rank. A *post* increments it; ``wait_all(k)``
  waits until every peer's counter reached ``k``. Every collective is a fixed sequence of
  (post, wait_all) phases that depends only on its signature, so all ranks stay in lockstep.
  Waiting spins briefly, then sleeps on a futex in the peer's header (a post wakes sleepers),
  so ranks that outnumber cores do not burn the CPU.
* The first post of a collective carries its signature (sequence number, op, dtype, shape,
  root, reduce op); after the first wait every rank compares all signatures, so mismatched
  calls fail on every rank before any data moves.
* Large all-reduce: per chunk, each rank copies its chunk into its slot, posts, reduces *its own
  slice* of the chunk from every rank's slot into its result area (fixed order 0..n-1), posts,
  then copies every rank's reduced slice into its output. Every element is reduced exactly once,
  in rank order, so results are bitwise identical on every rank and from run to run.
  Small messages use one phase: every rank reduces everything in the same fixed order.
* Zero copy: arrays from :meth:`ProcessGroup.alloc` live in shared memory that every rank maps;
  when all ranks pass such arrays, each rank reduces its slice straight from the peers' arrays
  and writes the result into all of them (two phases, no staging copies).
* Failures: a rank that times out, sees a mismatch or raises sets its abort flag with a reason;
  waiting peers check abort flags and whether the peers they wait for are still alive, so a
  dead or failed rank makes every other rank fail within a fraction of a second.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._backend import Backend, GroupInfo, Request
from .._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerFailureError,
)
from .._registry import register_backend
from .._types import (
    CODE_DTYPES,
    CODE_OPS,
    CODE_REDUCES,
    DTYPE_CODES,
    OP_CODES,
    REDUCE_CODES,
    ReduceOp,
)
from . import _shm
from ._proc import pid_alive
from ._shm import Futex, Segment

__all__ = ["CpuBackend"]

_M = 0xFFFFFFFF
_HALF = 0x80000000

# Header layout (bytes).
_W_CTR, _W_SLEEP, _W_ABORT, _W_PID = 0, 1, 2, 3  # word indexes of the first four u32
_ABORT_TIMEOUT = 2  # _W_ABORT value of a rank that timed out (1: any other failure)
_ABORT_CLOSED = 3  # the rank destroyed its group: only an error for whoever still waits on it
_H_SIG = 64
_SIG_BYTES = 128
_H_REASON = _H_SIG + 2 * _SIG_BYTES
_REASON_BYTES = 1024
_H_P2P = _H_REASON + _REASON_BYTES

# Signature: the first _CORE bytes must be equal on all ranks; the rest says where data is.
_SIG_CORE = struct.Struct("<IIHHii8q")
_SIG_LOC = struct.Struct("<Iqqq")
_CORE = _SIG_CORE.size
_NO_LOC = (0, -1, 0, 0)
_NO_LOC_BYTES = _SIG_LOC.pack(*_NO_LOC)
_MAX_DIMS = 8
_ZC_BLOCK = 256 << 10  # bytes per block of the zero-copy reduce (well inside L2)

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer number of bytes, got {raw!r}") from None
    if value < 4096:
        raise ValueError(f"{name} must be at least 4096, got {value}")
    return value


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _ge(value: int, target: int) -> bool:
    """``value >= target`` for wrapping 32-bit counters."""
    return ((value - target) & _M) < _HALF


def _reduce(out: Any, sources: list[Any], op: ReduceOp, n: int) -> None:
    """``out = sources[0] op sources[1] op ...`` in order; ``out`` may be the first or second
    source itself (elementwise in place), never a later one."""
    uf = _UFUNCS[op]
    if len(sources) == 1:
        np.copyto(out, sources[0])
    else:
        uf(sources[0], sources[1], out=out)
        for s in sources[2:]:
            uf(out, s, out=out)
    if op is ReduceOp.AVG and n > 1:
        np.true_divide(out, n, out=out, casting="unsafe")


class _Peer:
    """One rank's segment as seen from this process."""

    def __init__(self, seg: Segment, backend: CpuBackend) -> None:
        b = backend
        self.seg = seg
        self.hdr = seg.words(0, 4)
        self.ctr_addr = seg.address
        self.sent = seg.words(b._h_sent, b.n)
        self.acked = seg.words(b._h_acked, b.n)
        self.sent_addr = seg.address + b._h_sent
        self.acked_addr = seg.address + b._h_acked
        u8 = seg.u8
        self.slots = [u8[b._slot[0] : b._slot[0] + b.chunk], u8[b._slot[1] : b._slot[1] + b.chunk]]
        self.res = u8[b._res : b._res + b.chunk]
        self.pbuf = [
            [
                u8[b._p2p + (d * 2 + k) * b.p2p_chunk : b._p2p + (d * 2 + k + 1) * b.p2p_chunk]
                for k in (0, 1)
            ]
            for d in range(b.n)
        ]
        # One signature per p2p buffer (indexed like pbuf): a sender may post a second message
        # before the receiver has read the first one's signature.
        self.psig = [
            [
                u8[b._h_psig + (d * 2 + k) * _SIG_BYTES : b._h_psig + (d * 2 + k + 1) * _SIG_BYTES]
                for k in (0, 1)
            ]
            for d in range(b.n)
        ]
        self.reason = u8[_H_REASON : _H_REASON + _REASON_BYTES]


class CpuBackend(Backend):
    """Shared-memory collectives for ranks on one host (see the module docstring)."""

    name = "cpu"

    def __init__(self, info: GroupInfo) -> None:
        super().__init__(info)
        if info.size > 1 and info.store is None:
            raise ValueError("the cpu backend needs a rendezvous store for world size > 1")
        self.n = n = info.size
        self.me = info.rank
        self.chunk = _align(_env_int("DPT_CPU_CHUNK_BYTES", 4 << 20), 64)
        self.p2p_chunk = _align(_env_int("DPT_CPU_P2P_CHUNK_BYTES", 1 << 20), 64)
        self.small = min(64 << 10, self.chunk)
        self._h_sent = _H_P2P
        self._h_acked = _H_P2P + 4 * n
        self._h_psig = _align(_H_P2P + 8 * n, 64)
        header = _align(self._h_psig + 2 * _SIG_BYTES * n, 4096)
        self._slot = (header, header + self.chunk)
        self._res = header + 2 * self.chunk
        self._p2p = self._res + self.chunk
        total = self._p2p + 2 * n * self.p2p_chunk
        self.futex = Futex()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        # Spin (holding a core) only while ranks do not outnumber cores; then poll while
        # yielding the core; then sleep on a futex.
        self.spin = 20e-6 if n <= cores else 2e-6
        self.yield_time = 2e-3 if n <= cores else 200e-6
        self.slice = 0.005
        self._posts = 0
        self._slot_parity = 0
        self._sent = [0] * n  # chunks sent to each peer
        self._recvd = [0] * n  # chunks received from each peer
        self._allocs: list[tuple[int, int, int, list[Segment]]] = []
        self._closed = False
        self._sig_cache: dict[Any, bytes] = {}
        self._own = Segment.create(total, f"{info.name}-r{info.rank}")
        try:
            me_peer = _Peer(self._own, self)
            me_peer.hdr[_W_PID] = os.getpid() & _M
            self.peers = self._exchange(self._own, "seg", [me_peer])
        except BaseException:
            self._own.close()
            raise
        self.mine = self.peers[self.me]
        _LIVE.add(self)

    # ------------------------------------------------------------------ setup
    def _exchange(self, seg: Segment, what: str, mine: list[_Peer] | None) -> list[Any]:
        """Publish ``seg``'s name, map every peer's, wait until all mapped, unlink ours."""
        info = self.info
        if self.n == 1:
            seg.unlink()
            return [mine[0] if mine else seg]
        store = info.store
        prefix = f"{info.name}/cpu/{what}"
        host = _host_id()
        layout = f"{self.chunk}:{self.p2p_chunk}"
        store.set(f"{prefix}/{self.me}", f"{seg.name} {host} {layout}")
        keys = [f"{prefix}/{r}" for r in range(self.n)]
        store.wait(keys, info.timeout)
        # Check every peer's entry before mapping any: a rank that fails the check unlinks its
        # segment, so a rank that mapped first would report a FileNotFoundError instead.
        names: dict[int, str] = {}
        for r in range(self.n):
            if r == self.me:
                continue
            name, peer_host, peer_layout = store.get(f"{prefix}/{r}").decode().split()
            names[r] = name
            if peer_layout != layout:
                raise ValueError(
                    f"[rank {info.global_rank}] rank {info.ranks[r]} uses cpu-backend chunk "
                    f"sizes {peer_layout} but this rank {layout}: set DPT_CPU_CHUNK_BYTES and "
                    "DPT_CPU_P2P_CHUNK_BYTES the same on every rank"
                )
            if peer_host != host:
                raise RuntimeError(
                    f"[rank {info.global_rank}] the cpu backend needs every rank on one host, "
                    f"but rank {info.ranks[r]} runs elsewhere; use the mpi or nccl backend"
                )
        out: list[Any] = []
        try:
            for r in range(self.n):
                if r == self.me:
                    out.append(mine[0] if mine else seg)
                    continue
                peer_seg = Segment.attach(names[r])
                out.append(_Peer(peer_seg, self) if mine else peer_seg)
            if store.add(f"{prefix}/mapped", 1) == self.n:
                store.set(f"{prefix}/all", b"1")
            self._wait_mapped(store, f"{prefix}/all", out if mine else self.peers)
        except BaseException:
            # Only a segment's creator unlinks it after everyone mapped it: a rank that died
            # here would leave its file in /dev/shm. Every rank knows the names, so remove them
            # (the setup fails on every rank anyway).
            for name in names.values():
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(_shm.shm_dir(), name))
            raise
        seg.unlink()
        return out

    def _wait_mapped(self, store: Any, key: str, peers: list[Any]) -> None:
        """Wait for ``key`` (every rank mapped every segment), failing fast if a peer died:
        a plain store wait would sit out the whole group timeout."""
        info = self.info
        deadline = time.monotonic() + info.timeout
        while True:
            try:
                store.wait([key], max(0.01, min(0.5, deadline - time.monotonic())))
                return
            except TimeoutError:
                pass
            for q, peer in enumerate(peers):
                pid = peer.hdr[_W_PID] if isinstance(peer, _Peer) else 0
                if q != self.me and not pid_alive(pid):
                    raise PeerFailureError(
                        f"[rank {info.global_rank}] cpu backend setup of {info.describe()}: "
                        f"rank {info.ranks[q]} (pid {pid}) is gone: its process exited or was "
                        "killed while the group was being set up",
                        rank=info.global_rank,
                    )
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"[rank {info.global_rank}] cpu backend setup of {info.describe()}: not "
                    f"every rank mapped the shared-memory segments within {info.timeout:g} s",
                    rank=info.global_rank,
                )

    # ------------------------------------------------------------------ synchronization
    def _post(self, sig: bytes | None = None) -> int:
        """Publish this rank's next post (with a signature on a collective's first post)."""
        self._posts += 1
        p = self._posts
        if sig is not None:
            off = _H_SIG + (p & 1) * _SIG_BYTES
            self._own.buf[off : off + len(sig)] = sig
        self.mine.hdr[_W_CTR] = p & _M
        self._wake_if_sleeping(self.mine.ctr_addr)
        return p

    def _wake_if_sleeping(self, address: int) -> None:
        for q, peer in enumerate(self.peers):
            if q != self.me and peer.hdr[_W_SLEEP]:
                self.futex.wake(address)
                return

    def _wait_all(self, target: int, req: Request) -> None:
        for q, peer in enumerate(self.peers):
            if q != self.me and not _ge(peer.hdr[_W_CTR], target):
                self._slow_wait(peer.hdr, _W_CTR, peer.ctr_addr, target, req, q)

    def _slow_wait(
        self, words: memoryview, idx: int, address: int, target: int, req: Request, q: int
    ) -> None:
        # 1. Spin briefly: on an idle core a peer's post usually lands within microseconds.
        clock = time.perf_counter
        now = clock()
        spin_until = now + self.spin
        yield_until = now + self.yield_time
        while clock() < spin_until:
            if _ge(words[idx], target):
                return
        # 2. Keep polling but give the core away each time (a peer may share this core);
        #    os.sched_yield also releases the GIL for the caller's other threads.
        sched_yield = os.sched_yield
        while clock() < yield_until:
            if _ge(words[idx], target):
                return
            sched_yield()
        # 3. Sleep on the peer's word; a post wakes sleepers. Time slices bound how late an
        #    abort, a dead peer or the deadline is noticed.
        mine = self.mine.hdr
        next_check = time.monotonic() + 0.2
        while True:
            mine[_W_SLEEP] = 1
            value = words[idx]
            if _ge(value, target):
                mine[_W_SLEEP] = 0
                return
            self.futex.wait(address + 4 * idx, value, self.slice)
            mine[_W_SLEEP] = 0
            if _ge(words[idx], target):
                return
            self._check_aborts(req)
            if self.peers[q].hdr[_W_ABORT] == _ABORT_CLOSED and not _ge(words[idx], target):
                raise PeerFailureError(
                    self._where(req) + f": rank {self.info.ranks[q]} left the group "
                    "(destroy_process_group) before reaching this collective",
                    rank=self.info.global_rank,
                    op=req.op,
                    seq=req.seq,
                )
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.2
                self._check_alive(req)
            if now >= req.deadline:
                self._timeout(req, target, words is self.peers[q].hdr, q)

    def _check_aborts(self, req: Request) -> None:
        for q, peer in enumerate(self.peers):
            if q != self.me and peer.hdr[_W_ABORT] and peer.hdr[_W_ABORT] != _ABORT_CLOSED:
                raw = peer.reason.tobytes().split(b"\0", 1)[0].decode("utf-8", "replace")
                if peer.hdr[_W_ABORT] == _ABORT_TIMEOUT:
                    # A peer that gave up first is no failure of that peer: every rank waiting
                    # on the missing ranks must see the timeout error it documents.
                    raise CollectiveTimeoutError(
                        self._where(req) + f": rank {self.info.ranks[q]} timed out: {raw}",
                        rank=self.info.global_rank,
                        op=req.op,
                        seq=req.seq,
                    )
                raise PeerFailureError(
                    self._where(req) + f": rank {self.info.ranks[q]} failed: {raw}",
                    rank=self.info.global_rank,
                    op=req.op,
                    seq=req.seq,
                )

    def _check_alive(self, req: Request) -> None:
        for q, peer in enumerate(self.peers):
            if q != self.me and not pid_alive(peer.hdr[_W_PID]):
                raise PeerFailureError(
                    self._where(req)
                    + f": rank {self.info.ranks[q]} (pid {peer.hdr[_W_PID]}) is gone: its "
                    "process exited or was killed",
                    rank=self.info.global_rank,
                    op=req.op,
                    seq=req.seq,
                )

    def _timeout(self, req: Request, target: int, collective: bool, q: int) -> None:
        if collective:
            missing = [
                self.info.ranks[r]
                for r, peer in enumerate(self.peers)
                if r != self.me and not _ge(peer.hdr[_W_CTR], target)
            ]
            detail = f"ranks {missing} never arrived"
        else:
            detail = f"rank {self.info.ranks[q]} never matched it"
        raise CollectiveTimeoutError(
            self._where(req) + f": timed out after {self.info.timeout:g} s; {detail} "
            "(all processes are alive: is a rank stuck, or skipping this collective?)",
            rank=self.info.global_rank,
            op=req.op,
            seq=req.seq,
        )

    def _where(self, req: Request) -> str:
        return f"[rank {self.info.global_rank}] {req.op} #{req.seq} ({self.info.describe()})"

    def abort(self, reason: CollectiveError) -> None:
        """Record the failure and tell the peers (they fail instead of waiting)."""
        first = self.error is None
        super().abort(reason)
        if self._closed or not first:
            return  # peers know the first failure; a later GroupAbortedError must not mask it
        kind = _ABORT_TIMEOUT if isinstance(reason, CollectiveTimeoutError) else 1
        _set_abort(self, str(reason), kind)

    # ------------------------------------------------------------------ signatures
    def _signature(self, req: Request, loc: tuple[int, int, int, int] = _NO_LOC) -> bytes:
        sig = req.signature
        tail = self._sig_cache.get(sig)
        if tail is None:
            shape = list(sig.shape)
            ndim = len(shape)
            if ndim > _MAX_DIMS:
                shape = shape[: _MAX_DIMS - 1] + [zlib.crc32(repr(tuple(sig.shape)).encode())]
            shape += [0] * (_MAX_DIMS - len(shape))
            dtype = DTYPE_CODES.get(sig.dtype, 0) if sig.dtype is not None else 0
            core = _SIG_CORE.pack(
                0, OP_CODES[req.op], dtype, REDUCE_CODES[sig.reduce_op], sig.root, ndim, *shape
            )
            tail = core[4:]
            if len(self._sig_cache) > 1024:
                self._sig_cache.clear()
            self._sig_cache[sig] = tail
        loc_bytes = _NO_LOC_BYTES if loc is _NO_LOC else _SIG_LOC.pack(*loc)
        return (req.seq & _M).to_bytes(4, "little") + tail + loc_bytes

    def _check_signatures(self, req: Request, post: int, mine: bytes) -> None:
        """Raise CollectiveMismatchError on every rank unless all signatures of ``post`` agree."""
        off = _H_SIG + (post & 1) * _SIG_BYTES
        core = mine[:_CORE]
        for q, peer in enumerate(self.peers):
            if q != self.me and peer.seg.buf[off : off + _CORE] != core:
                self._mismatch(req, post & 1, mine)

    def _locations(self, post: int, mine: bytes) -> list[tuple[int, ...]]:
        """Every rank's data location fields from its signature of ``post``."""
        off = _H_SIG + (post & 1) * _SIG_BYTES + _CORE
        end = off + _SIG_LOC.size
        return [
            _SIG_LOC.unpack(mine[_CORE:] if q == self.me else peer.seg.buf[off:end])
            for q, peer in enumerate(self.peers)
        ]

    def _mismatch(self, req: Request, par: int, mine: bytes) -> None:
        groups: dict[bytes, list[int]] = {}
        off = _H_SIG + par * _SIG_BYTES
        for q, peer in enumerate(self.peers):
            raw = peer.seg.buf[off : off + _CORE] if q != self.me else mine[:_CORE]
            groups.setdefault(raw, []).append(self.info.ranks[q])
        parts = [f"ranks {ranks} called {_describe_sig(raw)}" for raw, ranks in groups.items()]
        raise CollectiveMismatchError(
            self._where(req)
            + ": ranks issued different collectives at the same point: "
            + "; ".join(parts),
            rank=self.info.global_rank,
            op=req.op,
            seq=req.seq,
        )

    def _begin(self, req: Request, loc: tuple[int, int, int, int] = _NO_LOC) -> int:
        """First post of a collective: signature out, wait for all, compare; returns the post."""
        sig = self._signature(req, loc)
        post = self._post(sig)
        self._wait_all(post, req)
        self._check_signatures(req, post, sig)
        # A rank arriving after its peers gave up (timeout) finds their posts: without this it
        # would "complete" a collective that failed everywhere else (signatures first, so a
        # mismatch is still reported as one on every rank).
        self._check_aborts(req)
        return post

    def _phase(self, req: Request) -> None:
        self._wait_all(self._post(), req)

    def _next_slot(self) -> int:
        par = self._slot_parity
        self._slot_parity ^= 1
        return par

    # ------------------------------------------------------------------ dispatch
    def run(self, req: Request) -> None:
        if self.n == 1:
            if req.op in ("all_gather", "reduce_scatter", "all_to_all"):
                req.out[...] = req.array.reshape(req.out.shape)
            return
        handler = getattr(self, "_op_" + req.op)
        handler(req)

    # ------------------------------------------------------------------ collectives
    def _op_barrier(self, req: Request) -> None:
        self._begin(req)

    def _op_all_reduce(self, req: Request) -> None:
        flat = req.array.reshape(-1)
        if flat.nbytes <= self.small:
            self._all_reduce_small(req, flat)
            return
        # Large: a signature-only first post says where each rank's data is, so that ranks
        # whose arrays all live in shared memory can skip staging altogether.
        loc = self._zero_copy_loc(flat) or _NO_LOC
        post = self._begin(req, loc)
        locs = self._locations(post, self._signature(req, loc))
        if all(entry[0] == 1 for entry in locs):
            self._all_reduce_zero_copy(req, flat, locs)
        else:
            self._all_reduce_chunks(req, flat, first_done=True)

    def _all_reduce_small(self, req: Request, flat: Any) -> None:
        par = self._next_slot()
        nb = flat.nbytes
        self.mine.slots[par][:nb] = flat.view(np.uint8)
        self._begin(req)
        dt = flat.dtype
        sources = [p.slots[par][:nb].view(dt) for p in self.peers]
        assert req.reduce_op is not None
        _reduce(flat, sources, req.reduce_op, self.n)

    def _slices(self, count: int) -> list[tuple[int, int]]:
        n = self.n
        return [((count * i) // n, (count * (i + 1)) // n) for i in range(n)]

    def _all_reduce_chunks(
        self, req: Request, flat: Any, first_done: bool, gather_to: int = -1
    ) -> None:
        """Chunked reduce (each rank reduces its slice) then gather (or only to ``gather_to``).

        With ``first_done`` the signature post happened already and carried no data, so the
        first chunk's data goes out with a plain post.
        """
        dt = flat.dtype
        isz = dt.itemsize
        per = max(self.chunk // isz, 1)
        total = flat.size
        me, op, n = self.me, req.reduce_op, self.n
        assert op is not None
        start = 0
        first = not first_done
        while True:
            m = min(per, total - start)
            par = self._next_slot()
            bounds = self._slices(m)
            chunk = flat[start : start + m]
            slot = self.mine.slots[par].view(dt)[:m]
            # Peers read every slice but this rank's own; copy those only.
            for q, (lo, hi) in enumerate(bounds):
                if q != me and hi > lo:
                    slot[lo:hi] = chunk[lo:hi]
            if first:
                self._begin(req)
                first = False
            else:
                self._phase(req)
            lo, hi = bounds[me]
            if hi > lo:
                sources = [
                    chunk[lo:hi] if q == me else p.slots[par].view(dt)[lo:hi]
                    for q, p in enumerate(self.peers)
                ]
                _reduce(self.mine.res.view(dt)[lo:hi], sources, op, n)
            self._phase(req)
            if gather_to < 0 or gather_to == me:
                for q, (lo, hi) in enumerate(bounds):
                    if hi > lo:
                        chunk[lo:hi] = self.peers[q].res.view(dt)[lo:hi]
            start += m
            if start >= total:
                return

    def _all_reduce_zero_copy(self, req: Request, flat: Any, locs: list[Any]) -> None:
        dt = flat.dtype
        me = self.me
        views = [self._peer_view(q, loc, dt, flat.size) for q, loc in enumerate(locs)]
        lo, hi = self._slices(flat.size)[me]
        op = req.reduce_op
        assert op is not None
        if me <= 1:
            # This rank's array is one of the first two operands, read before it is written
            # element by element, so it can take the result directly (no scratch pass). Work
            # in blocks that stay in cache, so copying the result to the peers reads it from
            # cache rather than memory.
            per = max(_ZC_BLOCK // dt.itemsize, 1)
            for start in range(lo, hi, per):
                stop = min(hi, start + per)
                mine = views[me][start:stop]
                _reduce(mine, [v[start:stop] for v in views], op, self.n)
                for q, v in enumerate(views):
                    if q != me:
                        v[start:stop] = mine
        else:
            per = max(self.chunk // dt.itemsize, 1)
            res = self.mine.res.view(dt)
            for start in range(lo, hi, per):
                stop = min(hi, start + per)
                out = res[: stop - start]
                _reduce(out, [v[start:stop] for v in views], op, self.n)
                for v in views:
                    v[start:stop] = out
        self._phase(req)  # nobody returns (and reuses its array) before all slices landed

    def _op_reduce(self, req: Request) -> None:
        flat = req.array.reshape(-1)
        if flat.nbytes <= self.small:
            par = self._next_slot()
            nb = flat.nbytes
            self.mine.slots[par][:nb] = flat.view(np.uint8)
            self._begin(req)
            if self.me == req.root:
                assert req.reduce_op is not None
                sources = [p.slots[par][:nb].view(flat.dtype) for p in self.peers]
                _reduce(flat, sources, req.reduce_op, self.n)
            return
        self._all_reduce_chunks(req, flat, first_done=False, gather_to=req.root)

    def _op_broadcast(self, req: Request) -> None:
        flat = req.array.reshape(-1).view(np.uint8)
        total = flat.size
        root = req.root
        start = 0
        first = True
        while True:
            m = min(self.chunk, total - start)
            par = self._next_slot()
            if self.me == root and m:
                self.mine.slots[par][:m] = flat[start : start + m]
            if first:
                self._begin(req)
                first = False
            else:
                self._phase(req)
            if self.me != root and m:
                flat[start : start + m] = self.peers[root].slots[par][:m]
            start += m
            if start >= total:
                return

    def _op_all_gather(self, req: Request) -> None:
        src = req.array.reshape(-1).view(np.uint8)
        out = req.out.reshape(self.n, -1).view(np.uint8)
        total = src.size
        out[self.me] = src
        start = 0
        first = True
        while True:
            m = min(self.chunk, total - start)
            par = self._next_slot()
            if m:
                self.mine.slots[par][:m] = src[start : start + m]
            if first:
                self._begin(req)
                first = False
            else:
                self._phase(req)
            if m:
                for q, peer in enumerate(self.peers):
                    if q != self.me:
                        out[q, start : start + m] = peer.slots[par][:m]
            start += m
            if start >= total:
                return

    def _exchange_blocks(self, req: Request) -> Iterator[tuple[int, int, list[Any]]]:
        """Chunk by chunk, hand block ``j`` of the input (first axis) to rank ``j``.

        Yields ``(start, m, pieces)`` per chunk once every rank posted it: ``pieces[q]`` is
        elements ``start:start+m`` of the block rank ``q`` holds for this rank (this rank's
        own block for ``q == me``). The consumer must be done with them before resuming.
        """
        dt = req.array.dtype
        blocks = req.array.reshape(self.n, -1)
        per = max(self.chunk // (self.n * dt.itemsize), 1)
        total = blocks.shape[1]
        me, n = self.me, self.n
        start = 0
        first = True
        while True:
            m = min(per, total - start)
            par = self._next_slot()
            slot = self.mine.slots[par].view(dt)
            for j in range(n):
                if j != me and m:
                    slot[j * per : j * per + m] = blocks[j, start : start + m]
            if first:
                self._begin(req)
                first = False
            else:
                self._phase(req)
            pieces = [
                blocks[me, start : start + m]
                if q == me
                else p.slots[par].view(dt)[me * per : me * per + m]
                for q, p in enumerate(self.peers)
            ]
            yield start, m, pieces
            start += m
            if start >= total:
                return

    def _op_reduce_scatter(self, req: Request) -> None:
        out = req.out.reshape(-1)
        op = req.reduce_op
        assert op is not None
        for start, m, pieces in self._exchange_blocks(req):
            if m:
                _reduce(out[start : start + m], pieces, op, self.n)

    def _op_all_to_all(self, req: Request) -> None:
        out_blocks = req.out.reshape(self.n, -1)
        for start, m, pieces in self._exchange_blocks(req):
            for q, piece in enumerate(pieces):
                if m:
                    out_blocks[q, start : start + m] = piece

    # ------------------------------------------------------------------ point to point
    def _op_send(self, req: Request) -> None:
        d = req.peer
        src = req.array.reshape(-1).view(np.uint8)
        total = src.size
        peer = self.peers[d]
        sig = self._signature(req)
        start = 0
        first = True
        while True:
            m = min(self.p2p_chunk, total - start)
            idx = self._sent[d]
            # Buffer idx % 2 is free once the receiver consumed chunk idx - 2.
            if idx >= 2 and not _ge(peer.acked[self.me], idx - 1):
                self._slow_wait(peer.acked, self.me, peer.acked_addr, (idx - 1) & _M, req, d)
            if first:
                self.mine.psig[d][idx & 1][: len(sig)] = np.frombuffer(sig, dtype=np.uint8)
                first = False
            if m:
                self.mine.pbuf[d][idx & 1][:m] = src[start : start + m]
            self._sent[d] = idx + 1
            self.mine.sent[d] = (idx + 1) & _M
            self._wake_if_sleeping(self.mine.sent_addr + 4 * d)
            start += m
            if start >= total:
                return

    def _op_recv(self, req: Request) -> None:
        s = req.peer
        dst = req.array.reshape(-1).view(np.uint8)
        total = dst.size
        peer = self.peers[s]
        start = 0
        first = True
        while True:
            m = min(self.p2p_chunk, total - start)
            idx = self._recvd[s]
            if not _ge(peer.sent[self.me], idx + 1):
                self._slow_wait(peer.sent, self.me, peer.sent_addr, (idx + 1) & _M, req, s)
            if first:
                first = False
                mine = self._signature(req)
                theirs = peer.psig[self.me][idx & 1][: len(mine)].tobytes()
                # Compare seq, dtype and shape; not the op code (send vs recv) nor the root
                # field, which holds the *other* side's rank on each end.
                if (
                    theirs[8:12] != mine[8:12]
                    or theirs[16:_CORE] != mine[16:_CORE]
                    or (theirs[:4] != mine[:4])
                ):
                    raise CollectiveMismatchError(
                        self._where(req)
                        + f": rank {self.info.ranks[s]} sent {_describe_sig(theirs)} but this "
                        f"rank expects {_describe_sig(mine)}",
                        rank=self.info.global_rank,
                        op=req.op,
                        seq=req.seq,
                    )
            if m:
                dst[start : start + m] = peer.pbuf[self.me][idx & 1][:m]
            self._recvd[s] = idx + 1
            self.mine.acked[s] = (idx + 1) & _M
            self._wake_if_sleeping(self.mine.acked_addr + 4 * s)
            start += m
            if start >= total:
                return

    # ------------------------------------------------------------------ zero copy
    def alloc(self, shape: tuple[int, ...], dtype: Any, seq: int) -> Any:
        """Collectively allocate a zeroed array in shared memory that every rank maps."""
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        seg = Segment.create(max(nbytes, 1), f"{self.info.name}-a{seq}-r{self.me}")
        try:
            segs = self._exchange(seg, f"alloc{seq}", None)
        except BaseException:
            seg.close()
            raise
        self._allocs.append((seg.address, seg.address + seg.size, seq, segs))
        return seg.u8[:nbytes].view(dt).reshape(shape)

    def _zero_copy_loc(self, flat: Any) -> tuple[int, int, int, int] | None:
        if not self._allocs:
            return None
        addr = flat.__array_interface__["data"][0]
        for lo, hi, alloc_id, _ in self._allocs:
            if lo <= addr and addr + flat.nbytes <= hi:
                return (1, alloc_id, addr - lo, flat.nbytes)
        return None

    def _peer_view(self, q: int, loc: tuple[int, ...], dt: Any, count: int) -> Any:
        _, alloc_id, offset, _nbytes = loc
        for _lo, _hi, aid, segs in self._allocs:
            if aid == alloc_id:
                return segs[q].u8[offset : offset + count * dt.itemsize].view(dt)
        raise RuntimeError(f"rank {q} refers to unknown shared allocation {alloc_id}")

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        super().close()
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self.error is None and self.n > 1:
            # Peers still waiting on this rank fail now instead of at their timeout.
            with contextlib.suppress(Exception):
                _set_abort(self, "destroyed its process group", _ABORT_CLOSED)
        for _lo, _hi, _aid, segs in self._allocs:
            for s in segs:
                s.unlink()
        with contextlib.suppress(Exception):
            self._own.unlink()


def _describe_sig(raw: bytes) -> str:
    fields = _SIG_CORE.unpack(raw[:_CORE])
    seq, op, dtype, red, root, ndim = fields[:6]
    shape = fields[6 : 6 + min(ndim, _MAX_DIMS)]
    parts = [f"dtype={CODE_DTYPES.get(dtype, '?')}", f"shape={tuple(shape)}"]
    if root >= 0 and CODE_OPS.get(op) in ("broadcast", "reduce"):
        parts.append(f"root={root}")
    if CODE_REDUCES.get(red) is not None:
        parts.append(f"op={CODE_REDUCES[red]}")
    return f"{CODE_OPS.get(op, '?')} #{seq}(" + ", ".join(parts) + ")"


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{os.uname().nodename}/{boot}"


def _set_abort(backend: CpuBackend, reason: str, kind: int = 1) -> None:
    data = reason.encode("utf-8", "replace")[: _REASON_BYTES - 1] + b"\0"
    mine = backend.mine
    mine.reason[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    mine.hdr[_W_ABORT] = kind
    # Wake anyone sleeping on any of this rank's words so they notice now.
    backend.futex.wake(mine.ctr_addr)
    for d in range(backend.n):
        backend.futex.wake(mine.sent_addr + 4 * d)
        backend.futex.wake(mine.acked_addr + 4 * d)


_LIVE: set[CpuBackend] = set()
_prev_excepthook = sys.excepthook


def _excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    # An uncaught exception is about to end this process: tell the peers why, so they report
    # "rank 1 failed: ValueError: ..." instead of only noticing that the process is gone.
    for b in list(_LIVE):
        with contextlib.suppress(Exception):
            _set_abort(b, f"uncaught {tp.__name__}: {value}")
    _prev_excepthook(tp, value, tb)


sys.excepthook = _excepthook

register_backend(
    "cpu",
    CpuBackend,
    probe=_shm.probe,
    description="shared memory between ranks on one host (NumPy; CuPy staged through host)",
)
