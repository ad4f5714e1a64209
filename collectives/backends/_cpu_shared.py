"""The cpu backend's shared arrays: what :meth:`ProcessGroup.alloc` made, and where they are.

An array from ``alloc`` lives in one segment per rank, which every rank maps. When every rank
passes such an array to an all-reduce, each says where its data is (a *location*: flag, the
allocation's id, the offset in it, bytes) and every rank works on the peers' arrays directly.

Both lookups run on every zero-copy call, so both are cached: finding an array's address
(``__array_interface__`` takes ~2 us) and turning the peers' locations into addresses and
typed views. A large call's Python work runs with caches that its own data just evicted, so
each step it saves counts several times over.
"""

from __future__ import annotations

import weakref
from typing import Any

from ._shm import Segment

__all__ = ["SharedArrays"]

Location = tuple[int, int, int, int]
_CACHE_MAX = 64  # entries per cache; a loop over more arrays than this only re-looks them up


class SharedArrays:
    """This rank's record of the group's shared allocations.

    Args:
        rank: this rank's index in the group.
        size: ranks in the group.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        # (start address here, end address, allocation id, every rank's segment)
        self._allocs: list[tuple[int, int, int, list[Segment]]] = []
        # id(array) -> (a weak reference to it, its location or None): an id alone could be
        # reused by a later array at another address, the reference says it is the same one.
        self._located: dict[int, tuple[weakref.ref[Any], Location | None]] = {}
        # (every rank's location, dtype, count) -> (addresses, this rank's slice [lo, hi))
        self._plans: dict[tuple[Any, ...], tuple[tuple[int, ...], int, int]] = {}

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

    def plan(self, locs: tuple[Location, ...], dt: Any, count: int) -> tuple[Any, int, int]:
        """Every rank's array at ``locs`` (addresses, in rank order) and this rank's slice
        ``[lo, hi)`` of the items, for the compiled zero-copy reduction."""
        key = (locs, dt, count)
        hit = self._plans.get(key)
        if hit is None:
            views = [self.view(q, loc, dt, count) for q, loc in enumerate(locs)]
            addrs = tuple(v.__array_interface__["data"][0] for v in views)
            n, me = self.size, self.rank
            hit = (addrs, (count * me) // n, (count * (me + 1)) // n)
            if len(self._plans) >= _CACHE_MAX:
                self._plans.clear()
            self._plans[key] = hit
        return hit

    def unlink(self) -> None:
        """Remove every allocation's segment names (the mappings stay until unmapped)."""
        for _lo, _hi, _aid, segs in self._allocs:
            for s in segs:
                s.unlink()
