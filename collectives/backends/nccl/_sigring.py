"""The nccl backend's signature check: every call's record exchanged on the stream, before it.

For each collective the backend copies the call's 128-byte signature record (see
``collectives._signature``) from pinned memory to the device, all-gathers the records of every
rank (``ncclAllGather``, n x 128 bytes) and copies them back to pinned memory, then records an
event; point-to-point calls send or receive one record instead. Nothing waits on the host: the
records are compared once the event completed (by whoever polls first), so a mismatch is found
by every rank, which gathered the same records, before its data call can hang.

A ring of :data:`RING` slots holds the records in flight; a slot is reused only once its
previous call's records were copied back and checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..._backend import Request
from ..._signature import (
    SIG_BYTES,
    SIG_WORDS,
    describe_record,
    mismatch_text,
    same_p2p_call,
    template,
)
from . import _lib as nccl_lib
from ._cuda import D2H, H2D, Cuda
from ._work import NcclWork

__all__ = ["RING", "SignatureRing"]

RING = 64  # signature slots in flight


class SignatureRing:
    """Pinned host and device buffers for :data:`RING` calls' records.

    Args:
        cuda: the group's CUDA seam.
        size: ranks in the group.
    """

    def __init__(self, cuda: Cuda, size: int) -> None:
        self.cuda = cuda
        self.size = size
        self._send_mem, send = cuda.pinned(RING * SIG_BYTES)
        self._recv_mem, recv = cuda.pinned(RING * size * SIG_BYTES)
        self.send = send.view(np.int64).reshape(RING, SIG_WORDS)
        self.recv = recv.view(np.int64).reshape(RING, size, SIG_WORDS)
        self._send_ptr = int(self._send_mem.ptr)
        self._recv_ptr = int(self._recv_mem.ptr)
        self._dev_send = cuda.empty(RING * SIG_BYTES, np.uint8)
        self._dev_recv = cuda.empty(RING * size * SIG_BYTES, np.uint8)
        self._dev_send_ptr = int(self._dev_send.data.ptr)
        self._dev_recv_ptr = int(self._dev_recv.data.ptr)
        self._next = 0
        self.owner: list[NcclWork | None] = [None] * RING

    def claim(self) -> tuple[int, NcclWork | None]:
        """The next slot, and the call that used it last (check its records first)."""
        slot = self._next
        self._next = (slot + 1) % RING
        return slot, self.owner[slot]

    def enqueue(
        self,
        slot: int,
        req: Request,
        work: NcclWork,
        lib: Any,
        comm: int,
        settle: Callable[[int, str, Request], None],
    ) -> None:
        """Put the exchange of ``req``'s record on the group's stream (slot ``slot``)."""
        cuda, stream = self.cuda, self.cuda.stream
        work.slot = slot
        self.owner[slot] = work
        words = template(req.signature)
        row = self.send[slot]
        row[:] = words
        row[0] = req.seq
        work.sig_words = words  # the cached template; the record is it with word 0 = seq
        send_dev = self._dev_send_ptr + slot * SIG_BYTES
        recv_dev = self._dev_recv_ptr + slot * self.size * SIG_BYTES
        recv_host = self._recv_ptr + slot * self.size * SIG_BYTES
        cuda.memcpy(send_dev, self._send_ptr + slot * SIG_BYTES, SIG_BYTES, H2D, stream)
        sptr = stream.ptr
        if req.op == "send":
            rc = lib.send(send_dev, SIG_BYTES, nccl_lib.UINT8, req.peer, comm, sptr)
            settle(rc, "ncclSend", req)
        elif req.op == "recv":
            rc = lib.recv(recv_dev, SIG_BYTES, nccl_lib.UINT8, req.peer, comm, sptr)
            settle(rc, "ncclRecv", req)
            cuda.memcpy(recv_host, recv_dev, SIG_BYTES, D2H, stream)
            work.sig_checked = False
        else:
            rc = lib.all_gather(send_dev, recv_dev, SIG_BYTES, nccl_lib.UINT8, comm, sptr)
            settle(rc, "ncclAllGather", req)
            cuda.memcpy(recv_host, recv_dev, self.size * SIG_BYTES, D2H, stream)
            work.sig_checked = False
        ev = cuda.event()
        ev.record(stream)
        work.sig_ev = ev

    def problem(self, w: NcclWork, ranks: tuple[int, ...]) -> str | None:
        """What is wrong with the records that arrived for ``w`` (None: the calls agree)."""
        if w.sig_words is None or w.slot < 0:
            return None
        mine = w.sig_words.copy()
        mine[0] = w.seq
        recs = self.recv[w.slot]
        if w.op == "recv":
            theirs = recs[0]
            if same_p2p_call(theirs, mine):
                return None
            return (
                f"rank {ranks[w.peer]} sent {describe_record(theirs)} but this rank expects "
                f"{describe_record(mine)}"
            )
        # One bytes comparison of every rank's record: ~0.7 us where np.array_equal over a
        # broadcast took ~6 us, on every collective.
        if recs[:, :15].tobytes() == mine[:15].tobytes() * self.size:
            return None
        text = mismatch_text(recs, ranks) or "records differ"
        return (
            f"ranks issued different collectives at the same point: {text} (the call's "
            "output is undefined)"
        )
