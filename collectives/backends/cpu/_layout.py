"""The cpu backend's shared-memory segment: its layout, and one rank's segment as others see it.

Every rank owns one segment, the same layout on every rank of a group::

    header                 u32 words: [0] post counter, [1] "sleeping" flag, [2] abort kind,
                           [3] pid; at H_SIG two signature slots (the record of the
                           collective whose first post is odd / even, then its data location);
                           at H_REASON the abort reason (UTF-8, NUL-terminated); at H_P2P the
                           point-to-point counters (chunks sent to / acknowledged from each
                           peer) and one signature record per point-to-point buffer
    slots[0], slots[1]     staging areas of ``chunk`` bytes, used alternately so consecutive
                           collectives need no extra barrier
    res                    ``chunk`` bytes: this rank's reduced slice of a large all-reduce
    pbuf[peer][0..1]       ``p2p_chunk`` bytes each: double-buffered messages to each peer

Counters are 32-bit and wrap; compare them with :func:`reached`.
"""

from __future__ import annotations

import os
import struct

from ..._signature import SIG_BYTES
from ._shm import Segment

__all__ = [
    "ABORT_CLOSED",
    "ABORT_FAILED",
    "ABORT_TIMEOUT",
    "H_REASON",
    "H_SIG",
    "LOCATION",
    "NO_LOCATION",
    "REASON_BYTES",
    "SIG_SLOT",
    "U32_MASK",
    "W_ABORT",
    "W_CTR",
    "W_PID",
    "W_SLEEP",
    "Layout",
    "SegmentView",
    "env_bytes",
    "reached",
]

U32_MASK = 0xFFFFFFFF
_U32_HALF = 0x80000000

# Header words (u32 indexes).
W_CTR, W_SLEEP, W_ABORT, W_PID = 0, 1, 2, 3
# W_ABORT values: why a rank gave up.
ABORT_FAILED = 1  # an error (mismatch, a failing engine, an uncaught exception)
ABORT_TIMEOUT = 2  # it timed out: no failure of its own, so peers report the timeout too
ABORT_CLOSED = 3  # it destroyed its group: only an error for whoever still waits on it

# Where a collective's data is: (in shared memory?, allocation id, offset, bytes). All ranks
# with their data in memory from ``alloc`` reduce it in place (zero copy).
LOCATION = struct.Struct("<qqqq")
NO_LOCATION = (0, -1, 0, 0)

H_SIG = 64
SIG_SLOT = SIG_BYTES + LOCATION.size  # a signature record, then the data location
H_REASON = H_SIG + 2 * SIG_SLOT
REASON_BYTES = 1024
H_P2P = H_REASON + REASON_BYTES


def reached(value: int, target: int) -> bool:
    """``value >= target`` for wrapping 32-bit counters."""
    return ((value - target) & U32_MASK) < _U32_HALF


def env_bytes(name: str, default: int) -> int:
    """A size in bytes from the environment (at least 4096)."""
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


class Layout:
    """Byte offsets of the areas of a group's segments (see the module docstring).

    Args:
        size: ranks in the group.
        chunk: bytes of a staging slot (``DPT_CPU_CHUNK_BYTES``).
        p2p_chunk: bytes of a point-to-point buffer (``DPT_CPU_P2P_CHUNK_BYTES``).
    """

    def __init__(self, size: int, chunk: int, p2p_chunk: int) -> None:
        self.size = size
        self.chunk = _align(chunk, 64)
        self.p2p_chunk = _align(p2p_chunk, 64)
        self.sent = H_P2P
        self.acked = H_P2P + 4 * size
        self.psig = _align(H_P2P + 8 * size, 64)
        header = _align(self.psig + 2 * SIG_BYTES * size, 4096)
        self.slots = (header, header + self.chunk)
        self.res = header + 2 * self.chunk
        self.p2p = self.res + self.chunk
        self.total = self.p2p + 2 * size * self.p2p_chunk

    def describe(self) -> str:
        """``chunk:p2p_chunk``: what every rank of a group must agree on."""
        return f"{self.chunk}:{self.p2p_chunk}"


class SegmentView:
    """One rank's segment as this process sees it: views of its header words and areas."""

    def __init__(self, seg: Segment, layout: Layout) -> None:
        lay, n = layout, layout.size
        self.seg = seg
        self.hdr = seg.words(0, 4)
        self.ctr_addr = seg.address
        self.sent = seg.words(lay.sent, n)
        self.acked = seg.words(lay.acked, n)
        self.sent_addr = seg.address + lay.sent
        self.acked_addr = seg.address + lay.acked
        self.slot_addrs = (seg.address + lay.slots[0], seg.address + lay.slots[1])
        self.res_addr = seg.address + lay.res
        u8 = seg.u8
        chunk, p2p = lay.chunk, lay.p2p_chunk
        self.slots = [
            u8[lay.slots[0] : lay.slots[0] + chunk],
            u8[lay.slots[1] : lay.slots[1] + chunk],
        ]
        self.res = u8[lay.res : lay.res + chunk]
        self.pbuf = [
            [u8[lay.p2p + (d * 2 + k) * p2p : lay.p2p + (d * 2 + k + 1) * p2p] for k in (0, 1)]
            for d in range(n)
        ]
        # One signature per p2p buffer (indexed like pbuf): a sender may post a second message
        # before the receiver has read the first one's signature.
        self.psig = [
            [
                u8[lay.psig + (d * 2 + k) * SIG_BYTES : lay.psig + (d * 2 + k + 1) * SIG_BYTES]
                for k in (0, 1)
            ]
            for d in range(n)
        ]
        self.reason = u8[H_REASON : H_REASON + REASON_BYTES]

    def signature(self, post: int) -> bytes:
        """The signature record this rank published with post number ``post``."""
        off = H_SIG + (post & 1) * SIG_SLOT
        return self.seg.buf[off : off + SIG_BYTES]

    def location(self, post: int) -> tuple[int, int, int, int]:
        """Where this rank's data for the collective that began at ``post`` is."""
        off = H_SIG + (post & 1) * SIG_SLOT + SIG_BYTES
        flag, alloc_id, offset, nbytes = LOCATION.unpack_from(self.seg.buf, off)
        return flag, alloc_id, offset, nbytes

    def abort_reason(self) -> str:
        """The reason this rank gave when it set its abort flag."""
        return self.reason.tobytes().split(b"\0", 1)[0].decode("utf-8", "replace")
