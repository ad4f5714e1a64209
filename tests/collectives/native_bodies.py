"""Bodies of ``test_cpu_native.py``: the cpu backend's compiled helper against its pure-Python
path, in the ranks of a :class:`~tests.collectives.harness.RankPool`."""

from __future__ import annotations

from typing import Any

import numpy as np

import collectives as C

# Every dtype and op the group reduces, through each of the helper's outcomes: reduced in C
# (sums and products, integer min/max), copied and synchronized in C but reduced by NumPy
# (float min/max, float16).
CASES = [
    (dtype, op)
    for dtype in ("float32", "float64", "float16", "int8", "int32", "int64", "uint8", "uint32")
    + ("uint64",)
    for op in ("SUM", "PROD", "MIN", "MAX", "AVG")
    if op != "AVG" or dtype.startswith("float")
]


_UFUNCS: dict[str, Any] = {"SUM": np.add, "AVG": np.add, "PROD": np.multiply}
_UFUNCS.update(MIN=np.minimum, MAX=np.maximum)


def uses_native() -> bool:
    """Whether this rank's cpu backend runs the compiled helper."""
    backend: Any = C.get_default_group().backend
    return backend.sync.native is not None


def wild(seed: int, rank: int, size: int, dtype: str) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s input: values over the dtype's whole range (integer sums and products
    wrap, float products overflow to inf), with -0.0, inf and NaN among the floats."""
    rng = np.random.default_rng([seed, rank, size])
    dt = np.dtype(dtype)
    if dt.kind == "f":
        v = rng.standard_normal(size) * 10.0 ** rng.integers(-3, 6, size)
        v = v.astype(dt)
        for i, special in enumerate((-0.0, np.inf, np.nan, 0.0)):
            if (rank + i) < size:
                v[(rank + i * 5) % size] = special
        return v
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size, dtype=dt, endpoint=True)


def same_bits(
    seed: int, sizes: list[int], zero_copy: bool = False, impatient: bool = False
) -> dict[str, Any]:
    """Every case of :data:`CASES` at every size, all_reduced twice: through the compiled
    helper, then (every rank switched over between the calls) in pure Python. Both must equal
    the in-order NumPy reduction bit for bit (NaNs where it has NaNs). ``zero_copy``: the
    arrays live in shared memory (``C.alloc``), so large ones take the zero-copy path.
    ``impatient``: the helper hands every wait that is not over at once to Python, so the
    compiled rounds of a large all-reduce stop part way and Python finishes the round and
    resumes them (``partial`` counts the compiled calls that stopped early or did not start
    the rounds)."""
    backend: Any = C.get_default_group().backend
    sync = backend.sync
    native = sync.native
    rank, n = C.get_rank(), C.get_world_size()
    checked = 0
    partial = 0
    if impatient:
        from collectives.backends.cpu import _sync as _cpu_sync

        saved = sync.spin, sync.yield_time, _cpu_sync._CHUNK_SLEEP
        sync.spin = sync.yield_time = _cpu_sync._CHUNK_SLEEP = 0.0
        rounds, begin_rounds = sync.reduce_rounds, sync.begin_rounds

        def counted(*args: Any) -> tuple[int, int]:
            nonlocal partial
            done, left = rounds(*args)
            partial += left != 2
            return done, left

        def begin_counted(*args: Any) -> tuple[int, int, int]:
            nonlocal partial
            post, done, left = begin_rounds(*args)
            partial += left != 2
            return post, done, left

        sync.reduce_rounds, sync.begin_rounds = counted, begin_counted
    # One allocation for every case (each alloc maps a segment per rank).
    shared = C.alloc(8 * max(sizes), "uint8") if zero_copy else None
    try:
        for dtype, op in CASES:
            for size in sizes:
                inputs = [wild(seed, r, size, dtype) for r in range(n)]
                ref = inputs[0].copy()
                uf = _UFUNCS[op]
                with np.errstate(all="ignore"):
                    for a in inputs[1:]:
                        uf(ref, a, out=ref)
                    if op == "AVG":
                        np.true_divide(ref, n, out=ref, casting="unsafe")
                for path, engine in (("compiled", native), ("python", None)):
                    sync.native = engine
                    x = inputs[rank].copy()
                    if shared is not None:
                        x = shared[: x.nbytes].view(x.dtype)
                        x[...] = inputs[rank]
                    with np.errstate(all="ignore"):
                        C.all_reduce(x, op)
                    if x.tobytes() != ref.tobytes():
                        bad = np.flatnonzero(x.view(np.uint8) != ref.view(np.uint8))
                        raise AssertionError(
                            f"[rank {rank}] {path} all_reduce {op} {dtype} size {size}: "
                            f"{bad.size} bytes differ from NumPy's in-order reduction; first "
                            f"element {bad[0] // x.itemsize}: got {x[bad[0] // x.itemsize]!r}, "
                            f"expected {ref[bad[0] // x.itemsize]!r}"
                        )
                    checked += size
    finally:
        sync.native = native
        if impatient:
            del sync.reduce_rounds, sync.begin_rounds
            sync.spin, sync.yield_time, _cpu_sync._CHUNK_SLEEP = saved
    return {"native": native is not None, "checked": checked, "partial": partial}


def stream_costs(counts: list[int], calls: int) -> list[list[float]]:
    """Per count, ``calls`` all-reduces of that many float32 values, each checked; then what
    the helper measured per byte of their work at that size, with plain and with streaming
    stores (0.0: that way never ran): of the small all-reduce up to 64 KiB, else of the staged
    rounds."""
    rank, n = C.get_rank(), C.get_world_size()
    backend: Any = C.get_default_group().backend
    out = []
    for count in counts:
        x = np.empty(count, dtype=np.float32)
        for i in range(calls):
            x[:] = rank + i
            C.all_reduce(x)
            want = n * i + n * (n - 1) / 2
            if not np.array_equal(x, np.full(count, want, dtype=np.float32)):
                raise AssertionError(f"{count} values, call {i}: got {x[:4]}..., want {want}")
        small = x.nbytes <= backend.small
        out.append(list(backend.sync.native.stream_costs(x.nbytes, small)))
    return out
