"""The one in-order host reduction (collectives/backends/_reduce.py): its compiled path gives
the bits of its NumPy path, for every dtype and op, and falls back where it cannot run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from collectives import ReduceOp
from collectives.backends import _reduce
from collectives.backends._reduce import native_code, reduce_in_order, reduce_to_all
from collectives.backends.cpu._sync import native_module

DTYPES = ["float32", "float64", "int32", "int64", "int8", "uint8"]
needs_native = pytest.mark.skipif(
    native_module() is None, reason="the cpu backend's compiled helper is not built"
)


def _numpy_reduce(out: Any, sources: list[Any], op: ReduceOp, n: int) -> None:
    uf = _reduce.UFUNCS[op]
    uf(sources[0], sources[1], out=out)
    for s in sources[2:]:
        uf(out, s, out=out)
    if op is ReduceOp.AVG and n > 1:
        np.true_divide(out, n, out=out, casting="unsafe")


def _sources(dtype: str, n: int, count: int = 1001) -> list[Any]:
    rng = np.random.default_rng([n, count])
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(count).astype(dtype) for _ in range(n)]
    return [rng.integers(-100, 100, count).astype(dtype) for _ in range(n)]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_compiled_path_gives_numpys_bits(dtype: str, op: ReduceOp, n: int) -> None:
    src = _sources(dtype, n)
    want = np.empty_like(src[0])
    _numpy_reduce(want, src, op, n)
    got = np.empty_like(src[0])
    reduce_in_order(got, src, op, n)
    assert got.tobytes() == want.tobytes(), (dtype, op, n)
    # In place into the first source, as the engines reduce.
    first = src[0].copy()
    reduce_in_order(first, [first, *src[1:]], op, n)
    assert first.tobytes() == want.tobytes()


@needs_native
def test_compiled_loops_are_used_where_they_exist_and_numpy_elsewhere() -> None:
    assert native_code(np.float32, ReduceOp.SUM) == 0
    assert native_code(np.float64, ReduceOp.AVG) == 4
    assert native_code(np.float32, ReduceOp.MAX) == -1  # NumPy's NaN rules
    assert native_code(np.dtype(">f4"), ReduceOp.SUM) == -1  # not native byte order
    a, b = _sources("float64", 2, 64)
    # Strided, mixed dtypes, an AVG over fewer sources than ranks: NumPy reduces, correctly.
    out = np.empty(32)
    reduce_in_order(out, [a[::2], b[::2]], ReduceOp.SUM, 2)
    assert np.array_equal(out, a[::2] + b[::2])
    out = np.empty(64)
    reduce_in_order(out, [a, b.astype(np.float32)], ReduceOp.SUM, 2)
    assert np.array_equal(out, a + b.astype(np.float32))
    out = np.empty(64)
    reduce_in_order(out, [a, b], ReduceOp.AVG, 4)
    assert np.array_equal(out, (a + b) / 4)
    ints = [np.arange(5), np.arange(5)]
    out = np.empty(5, dtype=np.int64)
    reduce_in_order(out, ints, ReduceOp.AVG, 2)
    assert np.array_equal(out, np.arange(5))


@needs_native
def test_the_compiled_entry_point_refuses_bad_buffers() -> None:
    reduce_into = native_module().reduce_into
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="source 1 has 12 bytes"):
        reduce_into(0, False, a, [a, np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="2 to 64 sources"):
        reduce_into(0, False, a, [a])
    with pytest.raises(ValueError, match="no compiled reduction"):
        reduce_into(2, False, a, [a, a])  # float32 min
    with pytest.raises(ValueError, match="contiguous"):
        reduce_into(0, False, a[::2], [a[::2], a[::2]])


# ---------------------------------------------------------------------------- reduce_to_all
# Every dtype the groups reduce, compiled or not (float min/max, float16, bool, complex: NumPy).
ALL_DTYPES = [*_reduce.NATIVE_DTYPES, "int16", "float16", "bool", "complex64"]


def _any_sources(dtype: str, n: int, count: int) -> list[Any]:
    rng = np.random.default_rng([n, count, len(dtype)])
    kind = np.dtype(dtype).kind
    if kind == "b":
        return [rng.integers(0, 2, count).astype(bool) for _ in range(n)]
    if kind == "c":
        return [
            (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype)
            for _ in range(n)
        ]
    if kind == "f":
        out = [rng.standard_normal(count).astype(dtype) for _ in range(n)]
        out[0][:3] = [np.nan, -0.0, np.inf]  # NumPy's rules for these, on every path
        return out
    info = np.iinfo(dtype)
    return [rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True) for _ in range(n)]


def _in_order(sources: list[Any], op: ReduceOp, n: int) -> Any:
    want = np.empty_like(sources[0])
    reduce_in_order(want, sources, op, n)
    return want


@pytest.fixture(params=["compiled", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """reduce_to_all through the helper (when built) and through NumPy alone (no helper)."""
    if request.param == "compiled" and native_module() is None:
        pytest.skip("the cpu backend's compiled helper is not built")
    if request.param == "numpy":
        _reduce._reduce_into()
        monkeypatch.setattr(_reduce, "_native_many", None)
    monkeypatch.setattr(_reduce, "_PLANS", {})
    return str(request.param)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_reduce_to_all_gives_the_in_order_bits_in_every_output(
    path: str, dtype: str, op: ReduceOp, n: int
) -> None:
    src = _any_sources(dtype, n, 1001)
    want = _in_order(src, op, n)
    outs = [np.full_like(want, 7) for _ in range(3)]
    reduce_to_all(outs, src, op, n, parallel=True)
    for o in outs:
        assert o.tobytes() == want.tobytes(), (dtype, op, n)
    # In place, as the threads backend reduces: every source is also an output.
    mine = [s.copy() for s in src]
    reduce_to_all(mine, mine, op, n, parallel=True)
    assert all(m.tobytes() == want.tobytes() for m in mine)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 64])
@pytest.mark.parametrize("shape", [(300_007,), (701, 433)], ids=["1d", "2d"])
def test_reduce_to_all_over_parts_on_every_core(path: str, n: int, shape: tuple[int, ...]) -> None:
    """Parts that split into chunks unevenly, on the pool's threads, each output written only
    there; outputs that are sources (the first, a later one) or fresh arrays."""
    count = int(np.prod(shape)) if n < 64 else 20_011
    src = [s.reshape(shape) if n < 64 else s for s in _any_sources("float32", n, count)]
    size = src[0].size
    want = _in_order(src, ReduceOp.AVG, n).reshape(-1)
    for lo, hi in [(0, size), (5, size - 3), (size // 3, size // 3 + 1), (7, 7)]:
        fresh = [np.full_like(src[0], -1.0) for _ in range(2)]
        mine = [s.copy() for s in src]
        outs = [*fresh, mine[-1]] if n > 2 else [*fresh, *mine]
        reduce_to_all(outs, mine, ReduceOp.AVG, n, lo, hi, parallel=True)
        for o in outs:
            flat = o.reshape(-1)
            assert flat[lo:hi].tobytes() == want[lo:hi].tobytes(), (n, lo, hi)
        for f in fresh:
            assert np.all(f.reshape(-1)[:lo] == -1.0) and np.all(f.reshape(-1)[hi:] == -1.0)


def test_reduce_to_all_takes_any_array_numpy_can(path: str) -> None:
    """Strided, of mixed dtypes, fewer sources than AVG's divisor, one source: NumPy's loops,
    the same results."""
    a, b, c = _sources("float64", 3, 64)
    out = np.empty(32)
    reduce_to_all([out], [a[::2], b[::2]], ReduceOp.SUM, 2)
    assert np.array_equal(out, a[::2] + b[::2])
    outs = [np.empty(64), np.empty(64)]
    reduce_to_all(outs, [a, b.astype(np.float32)], ReduceOp.SUM, 2, parallel=True)
    assert all(np.array_equal(o, a + b.astype(np.float32)) for o in outs)
    reduce_to_all(outs, [a, b], ReduceOp.AVG, 4)
    assert all(np.array_equal(o, (a + b) / 4) for o in outs)
    reduce_to_all(outs, [c], ReduceOp.AVG, 1)
    assert all(np.array_equal(o, c) for o in outs)
    # Every output a later source: reduced aside first, then copied.
    x = [s.copy() for s in (a, b, c)]
    reduce_to_all([x[2]], x, ReduceOp.PROD, 3)
    assert np.array_equal(x[2], a * b * c)
    with pytest.raises(ValueError, match="1-D or C-contiguous"):
        reduce_to_all([np.empty((8, 8))[:, ::2]], [a[:32].reshape(8, 4)] * 2, ReduceOp.SUM, 2, 1, 5)


@needs_native
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code", range(32))
def test_the_compiled_many_output_loop_matches_reduce_into(
    code: int, workers: int, stream: bool
) -> None:
    """Every compiled reduction (AVG where there is one), chunks shared with the pool's threads
    (three, more than this machine may have cores), plain and streaming stores: the bits of
    the one-output loop, in every output."""
    cshm = native_module()
    if code < 8 and code % 4 >= 2:  # float min/max: NumPy's
        with pytest.raises(ValueError, match="no compiled reduction"):
            cshm.reduce_into_many(code, False, [np.empty(2)], [np.empty(2)] * 2, 0, 2, 1, 0)
        return
    dtype = _reduce.NATIVE_DTYPES[code // 4]
    for avg in [False, True] if code in (0, 4) else [False]:
        src = _any_sources(dtype, 3, 200_003)
        want = np.empty_like(src[0])
        cshm.reduce_into(code, avg, want, src)
        outs = [np.empty_like(want) for _ in range(2)]
        assert cshm.reduce_into_many(code, avg, outs, src, 0, want.size, workers, stream)
        assert all(o.tobytes() == want.tobytes() for o in outs), (code, avg)
        # A later source as an output: each block is reduced aside before it is written.
        copies = [s.copy() for s in src]
        mixed = [np.empty_like(want), copies[2]]
        assert cshm.reduce_into_many(code, avg, mixed, copies, 0, want.size, workers, stream)
        assert all(o.tobytes() == want.tobytes() for o in mixed), (code, avg)
        assert cshm.reduce_into_many(code, avg, src, src, 0, want.size, workers, stream)
        assert all(s.tobytes() == want.tobytes() for s in src), (code, avg)


@needs_native
def test_the_compiled_many_output_loop_refuses_or_declines_bad_buffers() -> None:
    """Errors for what no caller may pass; False (nothing written) for what NumPy reduces."""
    many = native_module().reduce_into_many
    a, b = np.zeros(8, np.float32), np.ones(8, np.float32)
    out = np.full(8, 5.0, np.float32)
    with pytest.raises(ValueError, match="1 to 64 outputs and 2 to 64 sources"):
        many(0, False, [out], [a], 0, 8, 1, False)
    with pytest.raises(ValueError, match="1 to 64 outputs"):
        many(0, False, [], [a, b], 0, 8, 1, False)
    with pytest.raises(ValueError, match="source 1 has 12 bytes"):
        many(0, False, [out], [a, b[:3]], 0, 8, 1, False)
    with pytest.raises(ValueError, match=r"items \[2, 9\) of 8"):
        many(0, False, [out], [a, b], 2, 9, 1, False)
    with pytest.raises(ValueError, match="out 0 overlaps source 1"):
        big = np.zeros(9, np.float32)
        many(0, False, [big[1:]], [a, big[:8]], 0, 8, 1, False)
    with pytest.raises(ValueError, match="outs 0 and 1 overlap"):
        many(0, False, [out, out], [a, b], 0, 8, 1, False)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(8, np.float32)
        ro.flags.writeable = False
        many(0, False, [ro], [a, b], 0, 8, 1, False)
    with pytest.raises(ValueError, match="no compiled reduction"):
        many(1, True, [out], [a, b], 0, 8, 1, False)  # AVG of a product
    assert not many(0, False, [out], [a, np.ones(16, np.float32)[::2]], 0, 8, 1, False)
    assert not many(0, False, [out], [a, b.astype(np.int32)], 0, 8, 1, False)
    assert not many(4, False, [out], [a, b], 0, 8, 1, False)  # float64's code, float32 arrays
    assert not many(0, False, [out], [a, [1.0] * 8], 0, 8, 1, False)
    assert np.all(out == 5.0), "a refused call wrote"
