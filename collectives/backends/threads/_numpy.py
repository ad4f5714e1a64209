"""The threads backend's NumPy engine: collectives among rank threads, in process memory.

Every collective starts with :meth:`~._engines.ThreadEngine.meet`: each rank posts a
reference to its array (and its signature), and gets every rank's. Then:

* **all_reduce**: rank r reduces slice r of the flat arrays, in rank order 0..n-1, and
  writes it into every rank's array (:func:`~collectives.backends._reduce.reduce_to_all`:
  with the cpu helper built, block by block from cache in one pass, else into rank 0's array
  and copies of it; either way without the GIL, so the slices are reduced in parallel, no
  Python loop over elements); a barrier, and every rank has the whole result. Every element
  is reduced once, in the same order as the cpu backend's, so results are bitwise identical
  on every rank and to the cpu backend.
  Up to 256 KiB the last rank to arrive reduces the whole array for all in one step (the
  ranks share one interpreter lock, so slices of a small array run one after the other
  anyway, and the second barrier would cost a thread wake-up); broadcast likewise. With the
  cpu helper's compiled loops at any size: its worker threads share the reduction, on every
  core, without the interpreter lock.
* **reduce**: the same, into the root's array only (through a scratch slice, since the
  root's array is also an input).
* **broadcast / all_gather / all_to_all / reduce_scatter**: each rank copies (or reduces)
  what it needs straight from the peers' arrays; a barrier keeps every input alive and
  unchanged until all have read it.
* **barrier**: the meeting itself. **send / recv**: a mailbox (the send copies the array).

Nothing is staged: no shared-memory segment, no copy through the store. CuPy arrays are staged
through host memory by the group (use ``cuda`` devices for the NCCL engine instead).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._backend import GroupInfo, Request
from .._reduce import reduce_in_order, reduce_to_all, reduces_on_cores
from ._engines import ThreadEngine, ThreadJob, register_engine

__all__ = ["NumpyEngine"]

# Up to this size one thread (the last to arrive) reduces the whole array for every rank: the
# rank threads share one interpreter lock, so splitting a small reduction across them buys no
# parallelism and costs a second barrier (a thread wake-up, tens of microseconds). Above it
# NumPy releases the lock in its loops and the slices run on every core.
_ONE_THREAD_BYTES = 256 * 1024


class NumpyEngine(ThreadEngine):
    """The NumPy engine (see the module docstring)."""

    def __init__(self, info: GroupInfo, job: ThreadJob) -> None:
        super().__init__(info, job)

    def _slice(self, count: int) -> tuple[int, int]:
        n, r = self.size, self.rank
        return (count * r) // n, (count * (r + 1)) // n

    # ------------------------------------------------------------------ reductions
    def _do_all_reduce(self, req: Request) -> None:
        flat = req.array.reshape(-1)
        op, n = req.reduce_op, self.size
        assert op is not None  # the group sets it on every reducing request
        # With the compiled helper's worker threads the last rank to arrive reduces the whole
        # array on every core too, without the second barrier (2 ranks, 1 MiB: 56-65 us, the
        # slices 160-210; from 16 MiB alike).
        if flat.nbytes <= _ONE_THREAD_BYTES or reduces_on_cores(flat.dtype, op, n, n):

            def finish(flats: list[Any]) -> None:
                reduce_to_all(flats, flats, op, n, parallel=True)

            self.meet(req, flat, finish)
            return
        flats = self.meet(req, flat)
        lo, hi = self._slice(flat.size)
        if hi > lo:
            reduce_to_all(flats, flats, op, n, lo, hi)
        self.phase(req)

    def _do_reduce(self, req: Request) -> None:
        flat = req.array.reshape(-1)
        flats = self.meet(req, flat)
        lo, hi = self._slice(flat.size)
        if hi > lo:
            assert req.reduce_op is not None
            root = flats[req.root]
            # The root's array is an input of every slice: reduce into scratch unless it is
            # the first operand (read before it is written, element by element).
            out = root[lo:hi] if req.root == 0 else np.empty(hi - lo, dtype=flat.dtype)
            reduce_in_order(out, [f[lo:hi] for f in flats], req.reduce_op, self.size)
            if req.root != 0:
                root[lo:hi] = out
        self.phase(req)

    def _do_reduce_scatter(self, req: Request) -> None:
        blocks = req.array.reshape(self.size, -1)
        peers = self.meet(req, blocks)
        assert req.reduce_op is not None
        out = req.out.reshape(-1)
        if out.size:
            reduce_in_order(out, [p[self.rank] for p in peers], req.reduce_op, self.size)
        self.phase(req)

    # ------------------------------------------------------------------ data movement
    def _do_broadcast(self, req: Request) -> None:
        flat = req.array.reshape(-1)
        if flat.nbytes <= _ONE_THREAD_BYTES:
            root = req.root

            def finish(flats: list[Any]) -> None:
                for q, f in enumerate(flats):
                    if q != root:
                        f[...] = flats[root]

            self.meet(req, flat, finish)
            return
        src = self.meet(req, flat)[req.root]
        if self.rank != req.root and flat.size:
            flat[...] = src
        self.phase(req)

    def _do_all_gather(self, req: Request) -> None:
        src = req.array.reshape(-1)
        peers = self.meet(req, src)
        out = req.out.reshape(self.size, -1)
        if src.size:
            for q, p in enumerate(peers):
                out[q] = p
        self.phase(req)

    def _do_all_to_all(self, req: Request) -> None:
        blocks = req.array.reshape(self.size, -1)
        peers = self.meet(req, blocks)
        out = req.out.reshape(self.size, -1)
        if out.size:
            for q, p in enumerate(peers):
                out[q] = p[self.rank]
        self.phase(req)

    def _do_barrier(self, req: Request) -> None:
        self.meet(req, None)

    # ------------------------------------------------------------------ point to point
    def _do_send(self, req: Request) -> None:
        self.meeting.send(self.rank, req, self.info)

    def _do_recv(self, req: Request) -> None:
        self.meeting.recv(self.rank, req, self.info)


register_engine(
    "cpu",
    NumpyEngine,
    description="NumPy arrays reduced in process memory, each rank thread its slice",
)
