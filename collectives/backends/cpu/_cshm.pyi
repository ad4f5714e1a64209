"""Types of the cpu backend's compiled helper (``_cshm.c``; used by ``_cpu_sync``)."""

from typing import Any

H_SIG: int
SIG_SLOT: int
COMPARED: int

class Sync:
    """Posts and waits of one rank over its group's segment headers."""

    def __init__(
        self,
        rank: int,
        headers: tuple[int, ...],
        slots0: tuple[int, ...],
        slots1: tuple[int, ...],
        res: tuple[int, ...],
        spin: float,
        stream: int = -1,
    ) -> None: ...
    def stream_costs(self, nbytes: int, small: bool, /) -> tuple[float, float]: ...
    def begin(
        self,
        post: int,
        seq: int,
        record: bytes,
        array: Any,
        parity: int,
        code: int,
        limit: float,
        /,
    ) -> int: ...
    def phase(self, post: int, limit: float, /) -> int: ...
    def rounds(
        self,
        post: int,
        array: Any,
        parity: int,
        code: int,
        avg: bool,
        limit: float,
        sleep: float,
        per: int,
        /,
    ) -> tuple[int, int]: ...
    def begin_rounds(
        self,
        post: int,
        seq: int,
        record: bytes,
        array: Any,
        parity: int,
        code: int,
        avg: bool,
        limit: float,
        sleep: float,
        per: int,
        /,
    ) -> tuple[int, int]: ...
    def begin_zero_copy(
        self,
        post: int,
        seq: int,
        record: bytes,
        expected: bytes,
        code: int,
        avg: bool,
        arrays: tuple[int, ...],
        lo: int,
        hi: int,
        itemsize: int,
        scratch: int,
        block: int,
        limit: float,
        /,
    ) -> int: ...
    def zero_copy(
        self,
        code: int,
        avg: bool,
        arrays: tuple[int, ...],
        lo: int,
        hi: int,
        itemsize: int,
        scratch: int,
        block: int,
        /,
    ) -> None: ...

def reduce_into(code: int, avg: bool, out: Any, sources: Any, /) -> None:
    """``out = sources[0] op sources[1] op ...`` with the compiled loop of ``code`` (GIL
    released); C-contiguous buffers of one size, 2 to 64 sources."""

def reduce_into_many(
    code: int,
    avg: bool,
    outs: Any,
    sources: Any,
    lo: int,
    hi: int,
    workers: int,
    stream: bool,
    /,
) -> bool:
    """Items ``[lo, hi)`` of every output = ``sources[0] op sources[1] op ...`` with the
    compiled loop of ``code``, each block reduced once and written to every output (GIL
    released), on up to ``workers`` threads (this one and the pool's); streaming stores to
    outputs that are no source when ``stream``. 1-64 outputs, 2-64 sources, one size; an
    output is a source itself or overlaps none. False (nothing written) when some array is
    not C-contiguous or of another item format."""

def pool_stop() -> None:
    """End the pool's worker threads (a later call asking for more than one starts them)."""

def pool_threads() -> int:
    """How many worker threads the pool has now."""
