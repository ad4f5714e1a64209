"""Test bodies that run inside every rank of a :class:`~tests.collectives.harness.RankPool`.

Each body uses the module-level collectives API on the default group, checks its own result
against a NumPy reference (every rank can rebuild every rank's input from the seed), raises
``AssertionError`` with the details on a mismatch, and returns a small JSON summary that the
test asserts on as well (so a body that checked nothing cannot pass).

Inputs differ per rank and per call (seeded by ``seed``, rank and iteration), are never all
zeros, and integers stay small enough that no reduction over 4 ranks overflows int8.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, cast

import numpy as np

import collectives as C
import tensorlib as tl

FLOATS = ("float16", "float32", "float64")
INTS = ("int8", "uint8", "int32", "int64")

_TOL = {
    "float16": (1e-2, 1e-2),
    "float32": (1e-5, 1e-5),
    "float64": (1e-12, 1e-12),
}

_UFUNCS = {
    "SUM": np.add,
    "AVG": np.add,
    "PROD": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
}


# ---------------------------------------------------------------------------- data & references
def data(seed: int, rank: int, shape: Any, dtype: str, it: int = 0) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s input for call ``it``: nonzero, small, different per rank and call.

    Floats lie in +-[0.25, 2), signed integers in {-3..-1, 1..3}, unsigned in {1, 2, 3}, so a
    product over 4 ranks fits int8/uint8 and float16 (and generation stays cheap).
    """
    rng = np.random.default_rng([seed, rank, it])
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        v = rng.random(shape, dtype=np.float32) * np.float32(3.5) - np.float32(1.75)
        v += np.copysign(np.float32(0.25), v)
        return v.astype(dt)
    if dt.kind in "iu":
        k = rng.integers(0, 6, size=shape, dtype=np.uint8)
        return (_SIGNED if dt.kind == "i" else _UNSIGNED).astype(dt)[k]
    if dt.kind == "b":
        out = rng.integers(0, 2, size=shape, dtype=np.uint8).astype(bool)
        if out.size:
            out.flat[0] = True
        return out
    raise ValueError(f"no generator for {dtype}")


_SIGNED = np.array([-3, -2, -1, 1, 2, 3], dtype=np.int64)
_UNSIGNED = np.array([1, 2, 3, 1, 2, 3], dtype=np.int64)


def reference(arrays: list[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    """NumPy reduction of ``arrays`` (rank order) in their dtype; AVG divides by the count."""
    uf = _UFUNCS[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        uf(out, a, out=out)
    if op == "AVG":
        out = (out / len(arrays)).astype(arrays[0].dtype)
    return out


def check(got: Any, expected: Any, what: str) -> None:
    """Exact for integers and bool, per-dtype tolerance for floats; the message says where."""
    got = np.asarray(got)
    expected = np.asarray(expected)
    ctx = f"[rank {C.get_rank()} of {C.get_world_size()}] {what}"
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(
            f"{ctx}: got shape {got.shape} {got.dtype}, expected {expected.shape} {expected.dtype}"
        )
    if got.dtype.kind == "f":
        rtol, atol = _TOL[str(got.dtype)]
        ok = np.isclose(got.astype(np.float64), expected.astype(np.float64), rtol, atol)
    else:
        ok = got == expected
    if not np.all(ok):
        bad = np.flatnonzero(~np.asarray(ok).reshape(-1))
        i = int(bad[0])
        raise AssertionError(
            f"{ctx}: {bad.size} of {got.size} elements differ; first at flat index {i}: got "
            f"{got.reshape(-1)[i]!r}, expected {expected.reshape(-1)[i]!r}"
        )


def _world() -> tuple[int, int]:
    return C.get_rank(), C.get_world_size()


def _reducible(dtype: str, op: str) -> bool:
    return op != "AVG" or np.dtype(dtype).kind == "f"


# ---------------------------------------------------------------------------- identity
def whoami() -> dict[str, Any]:
    """Rank, size, backend and pid as the library reports them."""
    return {
        "rank": C.get_rank(),
        "size": C.get_world_size(),
        "backend": C.get_backend(),
        "local_rank": C.get_local_rank(),
        "pid": os.getpid(),
    }


# ---------------------------------------------------------------------------- collectives
def all_reduce(seed: int, dtype: str, op: str, sizes: list[int], iters: int = 2) -> int:
    """In-place all_reduce of 1-d arrays of every size; later iterations repeat the sizes >= 7
    (new data in the other staging slot). Returns the elements checked."""
    rank, n = _world()
    checked = 0
    for it in range(iters):
        for size in sizes if it == 0 else [s for s in sizes if s >= 7]:
            x = data(seed, rank, size, dtype, it)
            y = C.all_reduce(x, op)
            assert y is x, "all_reduce must return its (in-place) input"
            ref = reference([data(seed, r, size, dtype, it) for r in range(n)], op)
            check(x, ref, f"all_reduce {op} {dtype} size {size} iter {it}")
            checked += x.size
    return checked


def all_reduce_tensor_2d(seed: int) -> int:
    """all_reduce on a tensorlib Tensor and on 2-d / 3-d arrays, with ReduceOp members."""
    rank, n = _world()
    checked = 0
    for it, shape in enumerate([(3, 5), (2, 3, 4), (70, 300)]):
        x = data(seed, rank, shape, "float32", it)
        C.all_reduce(x, C.ReduceOp.MAX)
        check(
            x,
            reference([data(seed, r, shape, "float32", it) for r in range(n)], "MAX"),
            f"all_reduce 2-d {shape}",
        )
        checked += x.size
        t = tl.Tensor(data(seed, rank, shape, "float64", it + 10))
        out = C.all_reduce(t, C.ReduceOp.SUM)
        assert out is t, "all_reduce on a Tensor returns the Tensor"
        assert isinstance(t.data, np.ndarray)
        ref = reference([data(seed, r, shape, "float64", it + 10) for r in range(n)], "SUM")
        check(t.data, ref, f"all_reduce Tensor {shape}")
        checked += t.data.size
    return checked


def broadcast(seed: int, dtype: str, sizes: list[int], iters: int = 1) -> int:
    """Broadcast from every source rank; every rank ends with the source's data."""
    rank, n = _world()
    checked = 0
    for it in range(iters):
        for src in range(n):
            for size in sizes:
                x = data(seed, rank, size, dtype, it * 100 + src)
                y = C.broadcast(x, src)
                assert y is x
                check(
                    x,
                    data(seed, src, size, dtype, it * 100 + src),
                    f"broadcast src={src} {dtype} size {size}",
                )
                checked += x.size
    return checked


def reduce(seed: int, dtype: str, op: str, sizes: list[int]) -> int:
    """Reduce into every destination (sizes < 7 only into the last one); the others keep their
    input unchanged."""
    rank, n = _world()
    checked = 0
    for dst in range(n):
        for size in sizes if dst == n - 1 else [s for s in sizes if s >= 7]:
            x = data(seed, rank, size, dtype, dst)
            C.reduce(x, dst, op)
            if rank == dst:
                ref = reference([data(seed, r, size, dtype, dst) for r in range(n)], op)
                check(x, ref, f"reduce {op} dst={dst} {dtype} size {size}")
            else:
                check(
                    x,
                    data(seed, rank, size, dtype, dst),
                    f"reduce {op} dst={dst}: a non-destination's input must stay unchanged",
                )
            checked += x.size
    return checked


def all_gather(seed: int, dtype: str, sizes: list[int]) -> int:
    """all_gather into a new array and into ``out=`` (1-d and 2-d), rank order."""
    rank, n = _world()
    checked = 0
    for size in sizes:
        for shape in [(size,), (size, 2)] if size < 100_000 else [(size,)]:
            x = data(seed, rank, shape, dtype, size)
            before = x.copy()
            expected = np.stack([data(seed, r, shape, dtype, size) for r in range(n)])
            got = C.all_gather(x)
            check(got, expected, f"all_gather {dtype} shape {shape}")
            check(x, before, "all_gather must leave its input unchanged")
            out = np.full((n, *shape), 0, dtype=dtype)
            res = C.all_gather(x, out=out)
            assert res is out, "all_gather(out=) returns out"
            check(out, expected, f"all_gather(out=) {dtype} shape {shape}")
            checked += got.size + out.size
    return checked


def all_gather_tensor(seed: int) -> int:
    """all_gather of a Tensor returns a Tensor of shape (world, *shape)."""
    rank, n = _world()
    t = tl.Tensor(data(seed, rank, (4, 3), "float32"))
    got = C.all_gather(t)
    assert isinstance(got, tl.Tensor), f"all_gather(Tensor) returned {type(got).__name__}"
    check(
        got.data,
        np.stack([data(seed, r, (4, 3), "float32") for r in range(n)]),
        "all_gather Tensor",
    )
    return int(got.data.size)


def reduce_scatter(seed: int, dtype: str, op: str, blocks: list[int]) -> int:
    """reduce_scatter of (n*k,) and (n*k, 3) inputs; rank r gets block r of the reduction."""
    rank, n = _world()
    checked = 0
    for k in blocks:
        for shape in [(n * k,), (n * k, 3)]:
            x = data(seed, rank, shape, dtype, k)
            before = x.copy()
            full = reference([data(seed, r, shape, dtype, k) for r in range(n)], op)
            mine = full[rank * k : (rank + 1) * k]
            if len(shape) == 1:
                got = C.reduce_scatter(x, op)
            else:
                got = np.zeros((k, *shape[1:]), dtype=dtype)
                assert C.reduce_scatter(x, op, out=got) is got
            check(got, mine, f"reduce_scatter {op} {dtype} shape {shape}")
            check(x, before, "reduce_scatter must leave its input unchanged")
            checked += got.size
    return checked


def all_to_all(seed: int, dtype: str, blocks: list[int]) -> int:
    """all_to_all: block i of rank j's output is block j of rank i's input."""
    rank, n = _world()
    checked = 0
    for k in blocks:
        for shape in [(n * k,), (n * k, 2)]:
            x = data(seed, rank, shape, dtype, k)
            expected = np.concatenate(
                [data(seed, r, shape, dtype, k)[rank * k : (rank + 1) * k] for r in range(n)]
            ).reshape(shape)
            got = C.all_to_all(x)
            check(got, expected, f"all_to_all {dtype} shape {shape}")
            out = np.zeros_like(x)
            assert C.all_to_all(x, out=out) is out
            check(out, expected, f"all_to_all(out=) {dtype} shape {shape}")
            checked += got.size + out.size
    return checked


def barrier(directory: str, rounds: int = 3) -> int:
    """No rank leaves a barrier before every rank reached it (files mark the arrivals)."""
    rank, n = _world()
    for r in range(rounds):
        # Late ranks are really late: a rank that left early would find a file missing.
        time.sleep(0.02 * ((rank + r) % n))
        with open(os.path.join(directory, f"round{r}-rank{rank}"), "w") as f:
            f.write("here")
        assert C.barrier() is None
        missing = [
            q for q in range(n) if not os.path.exists(os.path.join(directory, f"round{r}-rank{q}"))
        ]
        assert not missing, f"[rank {rank}] left barrier round {r} before ranks {missing} arrived"
    return rounds


def send_recv_ring(seed: int, dtype: str, sizes: list[int], senders_first: str) -> int:
    """Ring: rank r sends to r+1 and receives from r-1. ``senders_first`` picks who sends first
    ("even" or "odd"); blocking sends larger than two p2p chunks need that alternation."""
    rank, n = _world()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    checked = 0
    first = (rank % 2 == 0) == (senders_first == "even")
    if n % 2 == 1 and rank == n - 1:
        # With an odd ring the last rank and rank 0 have the same parity: let it receive first
        # so that the chain of sends can always drain.
        first = False
    for size in sizes:
        mine = data(seed, rank, size, dtype, size)
        got = np.zeros_like(mine)
        if first:
            assert C.send(mine, nxt) is None
            assert C.recv(got, prv) is got
        else:
            C.recv(got, prv)
            C.send(mine, nxt)
        check(got, data(seed, prv, size, dtype, size), f"recv from {prv} {dtype} size {size}")
        checked += got.size
    return checked


def send_many_then_recv(seed: int, count: int, delay: float) -> int:
    """Rank 0 sends ``count`` messages of different shapes/dtypes to rank 1 before rank 1
    receives any of them (eager sends must not overwrite each other)."""
    rank, _n = _world()
    specs = [((i % 5) * 3 + 1, ("float32", "int64", "uint8")[i % 3]) for i in range(count)]
    if rank == 0:
        for i, (size, dtype) in enumerate(specs):
            C.send(data(seed, 0, size, dtype, i), 1)
        return count
    if rank == 1:
        time.sleep(delay)
        for i, (size, dtype) in enumerate(specs):
            got = np.zeros(size, dtype=dtype)
            C.recv(got, 0)
            check(got, data(seed, 0, size, dtype, i), f"message {i}")
        return count
    return 0


def send_recv_async(seed: int, size: int) -> int:
    """Every rank posts an async send to r+1 and an async recv from r-1, then waits both."""
    rank, n = _world()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    mine = data(seed, rank, size, "float64")
    got = np.zeros_like(mine)
    ws = C.send(mine, nxt, async_op=True)
    wr = C.recv(got, prv, async_op=True)
    assert isinstance(ws, C.Work) and isinstance(wr, C.Work)
    assert ws.wait(timeout=30) is None
    assert wr.wait(timeout=30) is got
    assert ws.exception() is None and wr.exception() is None
    check(got, data(seed, prv, size, "float64"), "async recv")
    return int(got.size)


def objects(seed: int) -> dict[str, Any]:
    """broadcast_object from every source and all_gather_object: nested JSON and unicode."""
    rank, n = _world()

    def value(r: int) -> Any:
        return {
            "rank": r,
            "seed": seed,
            "nested": [1, 2.5, None, True, {"deep": ["x" * r, -r]}],
            "unicode": "naïve café ✓ 日本語 " + "🚀" * (r + 1),
            "tuple": (r, "t"),
        }

    def arrived(r: int) -> Any:
        v = value(r)
        v["tuple"] = list(v["tuple"])  # JSON has no tuples
        return v

    for src in range(n):
        got = C.broadcast_object(value(rank) if rank == src else None, src)
        assert got == arrived(src), f"broadcast_object from {src}: got {got!r}"
    gathered = C.all_gather_object(value(rank))
    assert gathered == [arrived(r) for r in range(n)], f"all_gather_object: got {gathered!r}"
    # Scalars and empty values travel too.
    assert C.all_gather_object(None) == [None] * n
    assert C.broadcast_object("", 0) == ""
    assert C.all_gather_object(rank * 1.5) == [r * 1.5 for r in range(n)]
    return {"sources": n, "gathered": len(gathered)}


def objects_not_json() -> list[str]:
    """Every rank passes a value JSON cannot encode: each raises TypeError before moving data;
    the group stays usable."""
    errors = []
    for bad in [{1, 2}, object(), {"k": b"bytes"}]:
        try:
            C.all_gather_object(bad)
        except TypeError as exc:
            errors.append(str(exc))
        else:
            raise AssertionError(f"all_gather_object({bad!r}) did not raise")
    assert C.all_gather_object("still fine") == ["still fine"] * C.get_world_size()
    return errors


def broadcast_object_not_json(src: int) -> dict[str, str]:
    """The source passes a non-JSON value: it raises TypeError, and the other ranks get an
    error too instead of waiting for data that never comes."""
    rank, _n = _world()
    try:
        C.broadcast_object({1, 2} if rank == src else None, src)
    except Exception as exc:
        result = {"type": type(exc).__name__, "message": str(exc)}
    else:
        raise AssertionError("broadcast_object of a set did not raise")
    assert C.broadcast_object({"ok": rank}, src) == {"ok": src}, "group unusable afterwards"
    return result


def subgroups(seed: int, members: list[int], src: int) -> dict[str, Any]:
    """Collectives inside ``new_group(members)``: members are a set numbered in global rank
    order (as in PyTorch), roots are global ranks, and non-members get errors. Returns what
    this rank saw."""
    rank, n = _world()
    g = C.new_group(members)
    try:
        out = _subgroup_work(seed, g, sorted(members), src)
        # The default group still works while the subgroup exists.
        w = np.full(2, rank + 1, dtype=np.int64)
        C.all_reduce(w)
        check(w, np.full(2, n * (n + 1) // 2, dtype=np.int64), "default group after subgroup")
        return out
    finally:
        C.destroy_process_group(g)


def _subgroup_work(seed: int, g: Any, members: list[int], src: int) -> dict[str, Any]:
    rank, _ = _world()
    if rank not in members:
        assert not g.is_member()
        errors = []
        for call in (
            lambda: C.all_reduce(np.ones(3), group=g),
            lambda: C.barrier(group=g),
            lambda: C.broadcast(np.ones(3), src, group=g),
        ):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))
            else:
                raise AssertionError("a collective on a group without this rank did not raise")
        return {"member": False, "errors": errors}
    m = len(members)
    assert C.get_rank(g) == members.index(rank), f"group rank of {rank} in {members}"
    assert C.get_world_size(g) == m
    x = data(seed, rank, 11, "float64")
    C.all_reduce(x, "SUM", group=g)
    check(
        x,
        reference([data(seed, r, 11, "float64") for r in members], "SUM"),
        f"all_reduce in group {members}",
    )
    b = data(seed, rank, 5, "int32", 1)
    C.broadcast(b, src, group=g)  # src is a global rank
    check(b, data(seed, src, 5, "int32", 1), f"broadcast from global rank {src}")
    gathered = C.all_gather(data(seed, rank, 3, "int64", 2), group=g)
    check(
        gathered,
        np.stack([data(seed, r, 3, "int64", 2) for r in members]),
        f"all_gather in group {members} (group-rank order)",
    )
    objs = C.all_gather_object({"g": rank}, group=g)
    assert objs == [{"g": r} for r in members], objs
    if m > 1:
        # Point to point inside the group also takes global ranks.
        first, last = members[0], members[-1]
        msg = data(seed, first, 9, "float32", 3)
        if rank == first:
            C.send(msg, last, group=g)
        elif rank == last:
            got = np.zeros_like(msg)
            C.recv(got, first, group=g)
            check(got, msg, f"recv in group {members} from global rank {first}")
    return {"member": True, "group_rank": C.get_rank(g), "group_size": m}


def subgroup_bad_root(members: list[int], outsider: int) -> str:
    """A member naming a root that is not in the group fails locally, naming the members."""
    rank, _ = _world()
    g = C.new_group(members)
    try:
        if rank not in members:
            return ""
        try:
            assert isinstance(g, C.ProcessGroup)
            C.broadcast(np.ones(2), outsider, group=g)
        except ValueError as exc:
            return str(exc)
        raise AssertionError(f"broadcast(src={outsider}) in group {members} did not raise")
    finally:
        C.destroy_process_group(g)


def alloc_all_reduce(seed: int, size: int, pattern: str, dtype: str = "float32") -> int:
    """all_reduce on arrays from ``collectives.alloc``: on every rank (``"all"``), on even
    ranks only (``"mixed"``), or a slice of an alloc'd array on every rank (``"slice"``)."""
    rank, n = _world()
    buf = C.alloc((size + 8,), dtype)
    assert buf.shape == (size + 8,) and buf.dtype == np.dtype(dtype)
    assert not buf.any(), "alloc must return zeroed memory"
    checked = 0
    try:
        for it in range(3):
            mine = data(seed, rank, size, dtype, it)
            if pattern == "all" or (pattern == "mixed" and rank % 2 == 0):
                x = buf[:size]
            elif pattern == "slice":
                x = buf[8 : 8 + size]
            else:
                x = np.empty(size, dtype=dtype)
            x[...] = mine
            for op in ("SUM", "MAX"):
                x[...] = mine
                C.all_reduce(x, op)
                ref = reference([data(seed, r, size, dtype, it) for r in range(n)], op)
                check(x, ref, f"all_reduce {op} on alloc ({pattern}) iter {it}")
                checked += x.size
        if pattern == "slice":
            assert not buf[:8].any(), "all_reduce of a slice wrote outside the slice"
    finally:
        del buf
    return checked


def alloc_views_cycle(seed: int, size: int, rounds: int) -> int:
    """all_reduce on new views of one alloc'd array, at offsets that differ by rank
    and change from call to call (even ranks' every third call, so that their peers move
    while they stay), some view objects used again, more of them than the backend
    remembers: every call must reduce the arrays the ranks passed this time."""
    rank, n = _world()
    buf = C.alloc((size + 16,), "float32")
    kept = [buf[o : o + size] for o in range(3)]  # the same objects, used again below
    for it in range(rounds):
        offset = (it * 5 + rank) % 16 if rank % 2 else (it // 3) % 4
        x = kept[offset] if offset < 3 and it % 2 else buf[offset : offset + size]
        x[...] = data(seed, rank, size, "float32", it)
        C.all_reduce(x)
        ref = reference([data(seed, r, size, "float32", it) for r in range(n)], "SUM")
        check(x, ref, f"all_reduce of the view at offset {offset}, call {it}")
    return rounds


# ---------------------------------------------------------------------------- async
def async_in_flight(seed: int) -> int:
    """Several different collectives in flight, then waited in order."""
    rank, n = _world()
    a = data(seed, rank, 1000, "float32", 0)
    b = data(seed, rank, 77, "int64", 1)
    c = data(seed, rank, 5, "float64", 2)
    d = data(seed, rank, 300_001, "float32", 3)
    works = [
        C.all_reduce(a, "SUM", async_op=True),
        C.broadcast(b, n - 1, async_op=True),
        C.all_gather(c, async_op=True),
        C.all_reduce(d, "MIN", async_op=True),
        C.barrier(async_op=True),
    ]
    for w in works:
        assert isinstance(w, C.Work), f"async_op=True returned {type(w).__name__}"
    # A blocking call issued behind queued async work runs after it (same order on all ranks).
    e = data(seed, rank, 9, "int32", 4)
    C.all_reduce(e, "MAX")
    outs = [w.wait(timeout=60) for w in works]
    assert outs[0] is a and outs[1] is b and outs[3] is d and outs[4] is None
    for w in works:
        assert w.is_completed() and w.exception() is None, repr(w)
    check(a, reference([data(seed, r, 1000, "float32", 0) for r in range(n)], "SUM"), "async a")
    check(b, data(seed, n - 1, 77, "int64", 1), "async broadcast")
    check(outs[2], np.stack([data(seed, r, 5, "float64", 2) for r in range(n)]), "async gather")
    check(d, reference([data(seed, r, 300_001, "float32", 3) for r in range(n)], "MIN"), "async d")
    check(e, reference([data(seed, r, 9, "int32", 4) for r in range(n)], "MAX"), "blocking e")
    return len(works)


def async_overlap(seed: int, size: int) -> dict[str, Any]:
    """A large async all_reduce runs on the group's communication thread while this thread
    computes; the Work completes with the right result."""
    rank, n = _world()
    group = C.get_default_group()
    threads: list[str] = []
    backend = group.backend
    original = backend.run

    def traced(req: Any) -> None:
        threads.append(threading.current_thread().name)
        original(req)

    backend.run = traced  # type: ignore[method-assign]
    try:
        x = data(seed, rank, size, "float32")
        work = C.all_reduce(x, async_op=True)
        m = np.random.default_rng(rank).standard_normal((200, 200))
        for _ in range(5):
            m = np.tanh(m @ m.T / 200.0)
        deadline = time.monotonic() + 60
        while not work.is_completed():
            assert time.monotonic() < deadline, "async all_reduce never completed"
            time.sleep(0.001)
        assert work.exception() is None, f"async all_reduce failed: {work.exception()!r}"
        assert work.wait() is x
    finally:
        del backend.run
    check(x, reference([data(seed, r, size, "float32") for r in range(n)], "SUM"), "overlap")
    main = threading.main_thread().name
    assert threads and all(t != main for t in threads), (
        f"async all_reduce ran on {threads}, expected the group's communication thread"
    )
    return {"threads": threads, "checksum": float(np.abs(m).sum())}


def many_in_flight(seed: int, count: int) -> int:
    """``count`` small async all_reduces in flight at once, then all waited."""
    rank, n = _world()
    xs = [data(seed, rank, 1 + i % 13, "float64", i) for i in range(count)]
    ops = ["SUM", "MAX", "MIN", "PROD", "AVG"]
    works = [C.all_reduce(x, ops[i % 5], async_op=True) for i, x in enumerate(xs)]
    for i, (w, x) in enumerate(zip(works, xs, strict=True)):
        assert w.wait(timeout=60) is x
        ref = reference([data(seed, r, 1 + i % 13, "float64", i) for r in range(n)], ops[i % 5])
        check(x, ref, f"in-flight all_reduce #{i} ({ops[i % 5]})")
    assert all(w.is_completed() and w.exception() is None for w in works)
    return count


# ---------------------------------------------------------------------------- determinism
def determinism(seed: int, size: int) -> str:
    """float32 SUM all_reduce of random data: every rank's result has the same bytes. Returns
    the SHA-256 of the result (the parent compares runs)."""
    rank, _n = _world()
    rng = np.random.default_rng([seed, rank])
    x = (rng.standard_normal(size) * 10 ** rng.uniform(-3, 3, size)).astype(np.float32)
    C.all_reduce(x)
    digest = hashlib.sha256(x.tobytes()).hexdigest()
    everyone = C.all_gather(np.frombuffer(bytes.fromhex(digest), dtype=np.uint8).copy())
    digests = {bytes(row).hex() for row in everyone}
    assert len(digests) == 1, f"ranks disagree on the all_reduce result bytes: {sorted(digests)}"
    return digest


# ---------------------------------------------------------------------------- validation
NEXT = "#<next seq>"  # in a case's message fragments: "#N", the number the call would have had

# A case: its name, the exception type, the call, then fragments its message must contain.
_Case = tuple[str, type[Exception], Callable[[], object], *tuple[str, ...]]


def _expect(
    cases: list[dict[str, Any]], name: str, exc_type: type[BaseException], fn: Any, *needles: str
) -> None:
    seq = C.get_default_group().seq
    needles = tuple(f"#{seq + 1}" if s == NEXT else s for s in needles)
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        cases.append({"case": name, "type": type(exc).__name__, "message": text})
        missing = [s for s in needles if s not in text]
        assert not missing, f"{name}: message {text!r} lacks {missing}"
    except Exception as exc:
        raise AssertionError(
            f"{name}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"
        ) from exc
    else:
        raise AssertionError(f"{name}: no error raised")
    after = C.get_default_group().seq
    assert after == seq, f"{name}: a rejected call consumed sequence number(s) {seq}..{after}"


def _validation_cases(rank: int, n: int) -> list[_Case]:
    """Every kind of bad argument, for rank ``rank`` of ``n`` (the last two need ``n > 1``)."""
    f32 = np.ones(8, dtype=np.float32)
    ro = _readonly(np.ones(8, dtype=np.float32))
    # fmt: off
    cases: list[_Case] = [
        ("complex dtype", TypeError, lambda: C.all_reduce(np.ones(4, dtype=np.complex64)),
         "all_reduce", NEXT, "unsupported dtype complex64"),
        ("object dtype", TypeError, lambda: C.broadcast(np.array(["a"], dtype=object), 0),
         "broadcast", NEXT),
        ("list input", TypeError, lambda: C.all_reduce([1.0, 2.0]), "all_reduce"),
        ("non-contiguous", ValueError, lambda: C.all_reduce(np.ones(16, dtype=np.float32)[::2]),
         "all_reduce", NEXT, "not C-contiguous"),
        ("non-contiguous all_gather", ValueError,
         lambda: C.all_gather(np.ones((4, 4), dtype=np.float32).T),
         "all_gather", "not C-contiguous"),
        ("read-only all_reduce", ValueError, lambda: C.all_reduce(ro),
         "all_reduce", NEXT, "read-only"),
        ("read-only broadcast", ValueError, lambda: C.broadcast(ro, 0), "broadcast", "read-only"),
        ("read-only reduce", ValueError, lambda: C.reduce(ro, 0), "reduce", "read-only"),
        ("read-only out", ValueError,
         lambda: C.all_gather(f32, out=_readonly(np.zeros((n, 8), np.float32))),
         "all_gather", "read-only"),
        ("broadcast src out of range", ValueError, lambda: C.broadcast(f32, n),
         "broadcast", NEXT, f"src={n}", "not a member"),
        ("broadcast src negative", ValueError, lambda: C.broadcast(f32, -1), "src=-1"),
        ("broadcast src not an int", TypeError, lambda: C.broadcast(f32, cast(Any, "0")),
         "src must be an int"),
        ("broadcast src bool", TypeError, lambda: C.broadcast(f32, True), "src"),
        ("reduce dst out of range", ValueError, lambda: C.reduce(f32, n + 3),
         "reduce", NEXT, f"dst={n + 3}"),
        ("send dst out of range", ValueError, lambda: C.send(f32, n), "send", f"dst={n}"),
        ("recv src out of range", ValueError, lambda: C.recv(f32, -2), "recv", "src=-2"),
        ("send to self", ValueError, lambda: C.send(f32, rank), "send", "this rank itself"),
        ("recv from self", ValueError, lambda: C.recv(f32, rank), "recv", "this rank itself"),
        ("AVG on ints", TypeError, lambda: C.all_reduce(np.ones(4, dtype=np.int32), "AVG"),
         "all_reduce", NEXT, "AVG needs a floating dtype"),
        ("AVG on ints reduce_scatter", TypeError,
         lambda: C.reduce_scatter(np.ones(4 * n, dtype=np.int64), C.ReduceOp.AVG),
         "reduce_scatter", "AVG"),
        ("bad op string", ValueError, lambda: C.all_reduce(f32.copy(), "median"),
         "all_reduce", NEXT, "median"),
        ("op as int", ValueError, lambda: C.reduce(f32.copy(), 0, cast(Any, 3)), "reduce"),
        ("reduce bool", TypeError, lambda: C.all_reduce(np.ones(4, dtype=bool)),
         "all_reduce", "bool"),
        ("all_gather out shape", ValueError,
         lambda: C.all_gather(f32, out=np.zeros((n, 7), dtype=np.float32)),
         "all_gather", NEXT, f"shape {(n, 8)}"),
        ("all_gather out dtype", ValueError,
         lambda: C.all_gather(f32, out=np.zeros((n, 8), dtype=np.float64)),
         "all_gather", "dtype float32"),
        ("reduce_scatter out shape", ValueError,
         lambda: C.reduce_scatter(np.ones(2 * n, np.float32), out=np.zeros(3, np.float32)),
         "reduce_scatter"),
        ("all_to_all out dtype", ValueError,
         lambda: C.all_to_all(np.ones(2 * n, np.float32), out=np.zeros(2 * n, np.int32)),
         "all_to_all"),
        ("reduce_scatter 0-d", ValueError,
         lambda: C.reduce_scatter(np.array(1.0, dtype=np.float32)),
         "reduce_scatter", "divisible"),
    ]
    if n > 1:
        cases += [
            ("reduce_scatter not divisible", ValueError,
             lambda: C.reduce_scatter(np.ones(n + 1, np.float32)),
             "reduce_scatter", NEXT, f"divisible by the group size {n}"),
            ("all_to_all not divisible", ValueError,
             lambda: C.all_to_all(np.ones((2 * n + 1, 3), np.float32)),
             "all_to_all", "divisible"),
        ]
    cases.append(("alloc dtype", TypeError, lambda: C.alloc(4, np.complex128), "alloc"))
    # fmt: on
    return cases


def validation() -> list[dict[str, Any]]:
    """Every kind of bad argument fails locally with a message naming rank, op and the
    sequence number the call would have had; then the group still works."""
    rank, n = _world()
    cases: list[dict[str, Any]] = []
    for name, exc_type, call, *needles in _validation_cases(rank, n):
        _expect(cases, name, exc_type, call, f"[rank {rank}]", *needles)
    # Nothing moved and no sequence number was used: the group works.
    x = np.full(3, rank + 1.0)
    C.all_reduce(x)
    check(x, np.full(3, n * (n + 1) / 2), "all_reduce after rejected calls")
    return cases


def _readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a.flags.writeable = False
    return a


# ---------------------------------------------------------------------------- reliability
def _outcome(exc: BaseException, t0: float) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "elapsed": time.monotonic() - t0,
        "classes": [c.__name__ for c in type(exc).__mro__],
        "op": getattr(exc, "op", None),
        "seq": getattr(exc, "seq", None),
        "rank": getattr(exc, "rank", None),
    }


def _try(fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        out = _outcome(exc, t0)
        out["traceback"] = traceback.format_exc()[-2000:]
        return out
    return {"type": None, "elapsed": time.monotonic() - t0}


def mismatch(kind: str) -> dict[str, Any]:
    """Ranks call different collectives at the same point (``kind`` says how they differ).
    Returns what the mismatched call raised and what the next call raised."""
    rank, n = _world()
    C.all_reduce(np.ones(4))  # a good collective first: the mismatch is at #2
    odd = rank == n - 1
    x = np.ones(16, dtype=np.float32)
    if kind == "op":
        call = (lambda: C.broadcast(x, 0)) if odd else (lambda: C.all_reduce(x))
    elif kind == "shape":
        call = lambda: C.all_reduce(np.ones(17 if odd else 16, np.float32))  # noqa: E731
    elif kind == "dtype":
        call = lambda: C.all_reduce(np.ones(16, np.float64 if odd else np.float32))  # noqa: E731
    elif kind == "root":
        call = lambda: C.broadcast(x, 1 if odd else 0)  # noqa: E731
    elif kind == "reduce_op":
        call = lambda: C.all_reduce(x, "MAX" if odd else "SUM")  # noqa: E731
    elif kind == "large_shape":
        call = lambda: C.all_reduce(np.ones(300_000 + (1 if odd else 0), np.float32))  # noqa: E731
    else:
        raise ValueError(kind)
    first = _try(call)
    after = _try(lambda: C.all_reduce(np.ones(4)))
    return {"first": first, "after": after}


def skip_collective(sleep: float, skipper: int) -> dict[str, Any]:
    """Rank ``skipper`` sleeps instead of joining all_reduce #2; the others time out."""
    rank, _ = _world()
    C.all_reduce(np.ones(4))
    if rank == skipper:
        time.sleep(sleep)
        return {"type": None, "slept": sleep, "pid": os.getpid()}
    out = _try(lambda: C.all_reduce(np.ones(1000, dtype=np.float32)))
    out["pid"] = os.getpid()
    return out


def allreduce_until_error(
    size: int, victim: int, kill_after: float, limit: float
) -> dict[str, Any]:
    """Loop large all_reduces. Rank ``victim`` SIGKILLs itself ``kill_after`` s in (from a
    thread, so it dies in the middle of a collective); the others report the error, when it
    came (wall clock, comparable with the parent's) and what the next collective raised."""
    rank, _ = _world()
    if rank == victim:
        timer = threading.Timer(kill_after, lambda: os.kill(os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    x = np.ones(size, dtype=np.float32)
    count = 0
    t0 = time.monotonic()
    end = t0 + limit
    while time.monotonic() < end:
        try:
            C.all_reduce(x, "MAX")
        except Exception as exc:
            out = _outcome(exc, t0)
            out.update(count=count, wall=time.time())
            out["next"] = _try(lambda: C.all_reduce(np.ones(8)))
            return out
        count += 1
    return {"type": None, "count": count}


def leave_early(leaver: int) -> dict[str, Any]:
    """Rank ``leaver`` destroys its group (its process stays alive) instead of joining
    all_reduce #2; the others must fail fast, not at the group timeout."""
    rank, _ = _world()
    C.all_reduce(np.ones(4))
    if rank == leaver:
        C.destroy_process_group()
        return {"type": None, "left": True}
    return _try(lambda: C.all_reduce(np.ones(1000, dtype=np.float32)))


def collective_after_peer_death(timeout_hint: float) -> dict[str, Any]:
    """The next collective after a peer died (while idle) fails fast naming it."""
    out = _try(lambda: C.all_reduce(np.ones(1000)))
    out["next"] = _try(lambda: C.barrier())
    out["hint"] = timeout_hint
    return out


def recv_from_dead_peer(src: int) -> dict[str, Any]:
    """A recv from a rank that died fails fast."""
    return _try(lambda: C.recv(np.zeros(10), src))


def raise_uncaught(victim: int, message: str, delay: float) -> dict[str, Any]:
    """Rank ``victim`` raises an uncaught exception (the worker lets it end the process); the
    others are in an all_reduce and report the error they get."""
    rank, _ = _world()
    if rank == victim:
        time.sleep(delay)
        raise ValueError(message)
    return _try(lambda: C.all_reduce(np.ones(64)))


def ping(seed: int) -> int:
    """A small SUM all_reduce with a known answer (rank + 1 summed)."""
    rank, n = _world()
    x = np.full(4, rank + 1, dtype=np.int64)
    C.all_reduce(x)
    check(x, np.full(4, n * (n + 1) // 2, dtype=np.int64), "ping")
    return int(x[0])


def shm_names() -> list[str]:
    """This process's /dev/shm mappings (names still linked or not)."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line:
                names.add(line.split("/dev/shm/", 1)[1].split()[0])
    return sorted(names)


def late_rank(sleep: float, late: int) -> dict[str, Any]:
    """Rank ``late`` joins all_reduce #2 only after the others timed out on it."""
    rank, _ = _world()
    C.all_reduce(np.ones(4))
    if rank == late:
        time.sleep(sleep)
    x = np.full(100, rank + 1.0)
    out = _try(lambda: C.all_reduce(x))
    out["value"] = float(x[0])
    return out


def alloc_buckets_async(seed: int, sizes: list[int]) -> int:
    """DDP's pattern: one alloc'd buffer cut into bucket views, each all_reduced (AVG)
    asynchronously, all in flight at once, then waited."""
    rank, n = _world()
    buf = C.alloc(sum(sizes), "float32")
    views = []
    start = 0
    for size in sizes:
        views.append(buf[start : start + size])
        start += size
    for it in range(2):
        for i, v in enumerate(views):
            v[...] = data(seed, rank, v.size, "float32", it * 100 + i)
        works = [C.all_reduce(v, "AVG", async_op=True) for v in views]
        for i, (w, v) in enumerate(zip(works, views, strict=True)):
            assert w.wait(timeout=60) is v
            ref = reference(
                [data(seed, r, v.size, "float32", it * 100 + i) for r in range(n)], "AVG"
            )
            check(v, ref, f"bucket {i} iteration {it}")
    return int(buf.size)


def work_wait_timeout(directory: str) -> dict[str, Any]:
    """``Work.wait(timeout)`` expiring raises CollectiveTimeoutError but leaves the collective
    running: it completes once the late rank joins, and the group stays usable."""
    rank, n = _world()
    flag = os.path.join(directory, "rank0-gave-up-waiting")
    x = np.full(5, rank + 1.0)
    if rank == 0:
        work = C.all_reduce(x, async_op=True)
        t0 = time.monotonic()
        try:
            work.wait(timeout=0.2)
        except C.CollectiveTimeoutError as exc:
            message = str(exc)
        else:
            raise AssertionError("Work.wait(timeout=0.2) returned while rank 1 had not joined")
        waited = time.monotonic() - t0
        assert not work.is_completed() and work.exception() is None
        with open(flag, "w") as f:
            f.write("go")
        assert work.wait(timeout=60) is x
    else:
        assert wait_for_file(flag, 60), "rank 0 never gave up waiting"
        C.all_reduce(x)
        message, waited = "", 0.0
    check(x, np.full(5, n * (n + 1) / 2), "all_reduce completed after Work.wait timed out")
    assert ping(0) == n * (n + 1) // 2
    return {"message": message, "waited": waited}


def async_then_peer_dies(count: int) -> dict[str, Any]:
    """Queue ``count`` async all_reduces; a peer is killed meanwhile (by the test). Every Work
    fails, none hangs: the first with the peer's failure, the rest as aborted."""
    xs = [np.ones(200_000, dtype=np.float32) for _ in range(count)]
    t0 = time.monotonic()
    works = [C.all_reduce(x, async_op=True) for x in xs]
    kinds = []
    for w in works:
        try:
            w.wait(timeout=60)
            kinds.append("ok")
        except C.CollectiveError as exc:
            kinds.append(type(exc).__name__)
            assert w.is_completed() and w.exception() is exc
    return {"kinds": kinds, "elapsed": time.monotonic() - t0}


def wait_for_file(path: str, limit: float) -> bool:
    """Block until ``path`` exists (used to line ranks up with the test)."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def cupy_arrays(seed: int) -> int:
    """CuPy arrays (the fake over host memory) and Tensors on cuda:0: in-place results land in
    the device array, new results are device arrays on the input's device."""
    import cupy

    rank, n = _world()
    checked = 0
    for size in (7, 100_003):
        host = data(seed, rank, size, "float32")
        x = cupy.asarray(host)
        y = C.all_reduce(x, "SUM")
        assert y is x, "all_reduce returns the user's CuPy array"
        check(
            x.get(),
            reference([data(seed, r, size, "float32") for r in range(n)], "SUM"),
            f"all_reduce cupy size {size}",
        )
        b = cupy.asarray(data(seed, rank, size, "int32", 1))
        C.broadcast(b, n - 1)
        check(b.get(), data(seed, n - 1, size, "int32", 1), "broadcast cupy")
        g = C.all_gather(cupy.asarray(data(seed, rank, size, "float64", 2)))
        assert type(g).__module__.startswith("cupy"), f"all_gather returned {type(g)}"
        check(
            g.get(),
            np.stack([data(seed, r, size, "float64", 2) for r in range(n)]),
            "all_gather cupy",
        )
        checked += 3 * size
    rs = C.reduce_scatter(cupy.asarray(data(seed, rank, 6 * n, "float32", 3)), "MAX")
    assert type(rs).__module__.startswith("cupy")
    full = reference([data(seed, r, 6 * n, "float32", 3) for r in range(n)], "MAX")
    check(rs.get(), full[rank * 6 : (rank + 1) * 6], "reduce_scatter cupy")
    out = cupy.zeros((n, 4), dtype="int64")
    assert C.all_gather(cupy.asarray(data(seed, rank, 4, "int64", 4)), out=out) is out
    check(out.get(), np.stack([data(seed, r, 4, "int64", 4) for r in range(n)]), "out= cupy")
    t = tl.Tensor(data(seed, rank, (3, 4), "float32", 5), device="cuda:0")
    assert C.all_reduce(t, "AVG") is t
    check(
        t.data.get(),
        reference([data(seed, r, (3, 4), "float32", 5) for r in range(n)], "AVG"),
        "all_reduce Tensor on cuda:0",
    )
    if n > 1:
        msg = cupy.asarray(data(seed, rank, 11, "float32", 6))
        got = cupy.zeros(11, dtype="float32")
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        if rank % 2 == 0:
            C.send(msg, nxt)
            C.recv(got, prv)
        else:
            C.recv(got, prv)
            C.send(msg, nxt)
        check(got.get(), data(seed, prv, 11, "float32", 6), "recv into cupy")
    return checked


def sleep(seconds: float) -> float:
    """Do nothing for a while (harness tests: a rank that never answers in time)."""
    time.sleep(seconds)
    return seconds


def fail(message: str) -> None:
    """Raise an AssertionError (harness tests: a failing body)."""
    raise AssertionError(message)
