"""The one in-order host reduction (collectives/backends/_reduce.py): its compiled path gives
the bits of its NumPy path, for every dtype and op, and falls back where it cannot run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from collectives import ReduceOp
from collectives.backends import _reduce
from collectives.backends._reduce import native_code, reduce_in_order
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
