"""The cpu backend's shared arrays and the zero-copy all-reduce over them.

An array from :meth:`ProcessGroup.alloc` lives in one segment per rank, which every rank maps.
When every rank passes such an array to a large all-reduce, each says where its data is (a
*location*: flags, the allocation's id, the offset in it, bytes) and each rank reduces its
slice straight from every rank's array, in rank order, and writes the result into all of them
(then one more post: nobody returns, and reuses its array, before all slices landed).

The lookups on this path run on every call, so they are cached: an array's address
(``__array_interface__`` takes ~2 us) and the peers' addresses for their locations. With the
compiled helper a call that finds the peers where the last one with this location found them
is one C call (post, wait, check, reduce, post, wait); a large call's Python runs on caches its
own data just evicted, so each step it saves counts several times over.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..._backend import Request
from ..._types import ReduceOp
from .._reduce import reduce_in_order
from ._layout import LOCATION, SegmentView
from ._shm import Segment
from ._sync import Lockstep

__all__ = ["SharedArrays"]

Location = tuple[int, int, int, int]
_CACHE_MAX = 64  # entries per cache; a loop over more arrays than this only re-looks them up
_ZC_BLOCK = 256 << 10  # bytes per block of the zero-copy reduce (well inside L2)


class SharedArrays:
    """This rank's record of the group's shared allocations, and the zero-copy all-reduce.

    Args:
        sync: the group's lockstep protocol (posts, waits, the helper).
        mine: this rank's segment (its result area is the scratch of ranks past the first two).
        chunk: bytes of a staging slot (the pure-Python path's blocks beyond rank 1).
    """

    def __init__(self, sync: Lockstep, mine: SegmentView, chunk: int) -> None:
        self.sync = sync
        self.rank = sync.rank
        self.size = sync.size
        self.mine = mine
        self.chunk = chunk
        # (start address here, end address, allocation id, every rank's segment)
        self._allocs: list[tuple[int, int, int, list[Segment]]] = []
        # id(array) -> (a weak reference to it, its location or None): an id alone could be
        # reused by a later array at another address, the reference says it is the same one.
        self._located: dict[int, tuple[weakref.ref[Any], Location | None]] = {}
        # (every rank's location, dtype, count) -> (addresses, this rank's slice [lo, hi),
        # the locations packed as the ranks post them)
        self._plans: dict[tuple[Any, ...], tuple[tuple[int, ...], int, int, bytes]] = {}
        # (this rank's location, dtype, count) -> the plan of every rank's locations the last
        # time (so the one-call path looks up one key, not two)
        self._last: dict[tuple[Any, ...], tuple[tuple[int, ...], int, int, bytes]] = {}

    def add(self, address: int, size: int, alloc_id: int, segs: list[Segment]) -> None:
        """Record a new allocation: this rank's segment at ``address`` and every rank's."""
        self._allocs.append((address, address + size, alloc_id, segs))

    def location(self, arr: Any) -> Location | None:
        """Where ``arr``'s data is, if it lies inside one of the shared allocations."""
        if not self._allocs:
            return None
        hit = self._located.get(id(arr))
        if hit is not None and hit[0]() is arr:
            return hit[1]
        addr = arr.__array_interface__["data"][0]
        loc = None
        for lo, hi, alloc_id, _ in self._allocs:
            if lo <= addr and addr + arr.nbytes <= hi:
                loc = (1, alloc_id, addr - lo, arr.nbytes)
                break
        if len(self._located) >= _CACHE_MAX:
            self._located.clear()
        self._located[id(arr)] = (weakref.ref(arr), loc)
        return loc

    def view(self, q: int, loc: Location, dt: Any, count: int) -> Any:
        """Rank ``q``'s array at ``loc``, ``count`` items of ``dt``, as this process maps it."""
        _, alloc_id, offset, _nbytes = loc
        for _lo, _hi, aid, segs in self._allocs:
            if aid == alloc_id:
                return segs[q].u8[offset : offset + count * dt.itemsize].view(dt)
        raise RuntimeError(f"rank {q} refers to unknown shared allocation {alloc_id}")

    def plan(
        self, locs: tuple[Location, ...], dt: Any, count: int
    ) -> tuple[tuple[int, ...], int, int, bytes]:
        """Every rank's array at ``locs`` (addresses, in rank order), this rank's slice
        ``[lo, hi)`` of the items, and ``locs`` packed, for the compiled reduction."""
        key = (locs, dt, count)
        hit = self._plans.get(key)
        if hit is None:
            views = [self.view(q, loc, dt, count) for q, loc in enumerate(locs)]
            addrs = tuple(v.__array_interface__["data"][0] for v in views)
            n, me = self.size, self.rank
            packed = b"".join(LOCATION.pack(*loc) for loc in locs)
            hit = (addrs, (count * me) // n, (count * (me + 1)) // n, packed)
            if len(self._plans) >= _CACHE_MAX:
                self._plans.clear()
            self._plans[key] = hit
        return hit

    def begin_all_reduce(self, req: Request, flat: Any, loc: Location, code: int) -> int:
        """A zero-copy all-reduce of ``flat`` (this rank's location ``loc``; ``code`` the
        helper's reduction) in one compiled call, if the last call from ``loc`` of this dtype
        and size found every rank's array somewhere (the helper checks they are still there).
        Returns -1 when it is done, 0 when it did not start (no such call yet), else the first
        post's number: posted and checked, the peers elsewhere; the caller goes on."""
        dt = flat.dtype
        last = self._last.get((loc, dt, flat.size))
        if last is None:
            return 0
        addrs, lo, hi, packed = last
        block = self._block(dt)
        return self.sync.begin_zero_copy(
            req, loc, packed, code, addrs, lo, hi, dt.itemsize, self.mine.res_addr, block
        )

    def all_reduce(self, req: Request, flat: Any, locs: tuple[Location, ...], code: int) -> None:
        """The zero-copy all-reduce of ``flat`` after its first post, which found every rank's
        array at ``locs``; ``code`` >= 0: the helper reduces (else NumPy, the same order)."""
        dt = flat.dtype
        op = req.reduce_op
        assert op is not None
        if code >= 0:
            # One compiled call, the GIL released (the same order and blocks as below); the
            # next call from this location tries begin_all_reduce with these locations.
            plan = self.plan(locs, dt, flat.size)
            if len(self._last) >= _CACHE_MAX:
                self._last.clear()
            self._last[(locs[self.rank], dt, flat.size)] = plan
            addrs, lo, hi, _ = plan
            avg = op is ReduceOp.AVG
            scratch, block = self.mine.res_addr, self._block(dt)
            self.sync.native.zero_copy(code, avg, addrs, lo, hi, dt.itemsize, scratch, block)
        else:
            self._reduce_in_python(flat, locs, op)
        self.sync.phase(req)  # nobody returns (and reuses its array) before all slices landed

    def _reduce_in_python(self, flat: Any, locs: tuple[Location, ...], op: ReduceOp) -> None:
        dt, me, n = flat.dtype, self.rank, self.size
        views = [self.view(q, loc, dt, flat.size) for q, loc in enumerate(locs)]
        lo, hi = (flat.size * me) // n, (flat.size * (me + 1)) // n
        if me <= 1:
            # This rank's array is one of the first two operands, read before it is written
            # element by element, so it can take the result directly (no scratch pass). Work
            # in blocks that stay in cache, so copying the result to the peers reads it from
            # cache rather than memory.
            per = max(_ZC_BLOCK // dt.itemsize, 1)
            for start in range(lo, hi, per):
                stop = min(hi, start + per)
                mine = views[me][start:stop]
                reduce_in_order(mine, [v[start:stop] for v in views], op, n)
                for q, v in enumerate(views):
                    if q != me:
                        v[start:stop] = mine
        else:
            per = max(self.chunk // dt.itemsize, 1)
            res = self.mine.res.view(dt)
            for start in range(lo, hi, per):
                stop = min(hi, start + per)
                out = res[: stop - start]
                reduce_in_order(out, [v[start:stop] for v in views], op, n)
                for v in views:
                    v[start:stop] = out

    def _block(self, dt: Any) -> int:
        return min(_ZC_BLOCK, self.chunk) // dt.itemsize * dt.itemsize

    def unlink(self) -> None:
        """Remove every allocation's segment names (the mappings stay until unmapped)."""
        for _lo, _hi, _aid, segs in self._allocs:
            for s in segs:
                s.unlink()
