"""What the shared bodies return, checked in one place for every backend that runs them.

``test_collectives.py`` (process pools: serial, cpu, mpi) and ``test_nccl.py`` (rank threads on
the fake libnccl, processes on a GPU) run the same bodies of ``bodies.py``. Each function here
runs one body on a pool and asserts on the summary it returns, so what a body promises is
written once. The failure outcomes (mismatch, timeout, a rank that leaves or comes late) are
checked here the same way for test_reliability.py (cpu), test_mpi.py and test_nccl.py; each
test adds what only its backend promises. (conftest.py has pytest rewrite the asserts here.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

# The dtype x op grid every backend runs (AVG only on floating dtypes).
FLOATS = ["float16", "float32", "float64"]
INTS = ["int8", "uint8", "int32", "int64"]
NUMERIC = FLOATS + INTS
OPS = ["SUM", "PROD", "MIN", "MAX", "AVG"]
DTYPE_OPS = [(d, op) for d in NUMERIC for op in OPS if op != "AVG" or d in FLOATS]
BLOCKS = [0, 1, 7, 1025]  # reduce_scatter / all_to_all block lengths: empty, one, odd, > 1 KiB


class Pool(Protocol):
    """A set of ranks that runs a body on each (harness.RankPool, nccl_threads.RankThreads)."""

    world_size: int

    def run(
        self, fn: str, kwargs: Mapping[str, Any] | None = None, *, deadline: float = 60.0
    ) -> list[Any]: ...


class _Reply(Protocol):
    ok: bool
    result: Any

    def describe(self) -> str: ...


def results(replies: Sequence[_Reply]) -> list[Any]:
    """The results of replies that must all be ok (else every failed rank's description)."""
    bad = [r.describe() for r in replies if not r.ok]
    assert not bad, "\n".join(bad)
    return [r.result for r in replies]


def _at_least_7(sizes: Sequence[int]) -> int:
    return sum(s for s in sizes if s >= 7)  # the sizes bodies repeat (iterations, destinations)


# ============================================================================ collectives
def all_reduce(
    pool: Pool, seed: int, dtype: str, op: str, sizes: Sequence[int], iters: int = 2
) -> None:
    kwargs = {"seed": seed, "dtype": dtype, "op": op, "sizes": list(sizes), "iters": iters}
    got = pool.run("bodies:all_reduce", kwargs)
    assert got == [sum(sizes) + (iters - 1) * _at_least_7(sizes)] * pool.world_size


def all_reduce_tensor_2d(pool: Pool, seed: int) -> None:
    got = pool.run("bodies:all_reduce_tensor_2d", {"seed": seed})
    assert sum(int(r) for r in got) == pool.world_size * 2 * (15 + 24 + 21_000)


def broadcast(pool: Pool, seed: int, dtype: str, sizes: Sequence[int]) -> None:
    got = pool.run("bodies:broadcast", {"seed": seed, "dtype": dtype, "sizes": list(sizes)})
    assert got == [pool.world_size * sum(sizes)] * pool.world_size


def reduce(pool: Pool, seed: int, dtype: str, op: str, sizes: Sequence[int]) -> None:
    kwargs = {"seed": seed, "dtype": dtype, "op": op, "sizes": list(sizes)}
    got = pool.run("bodies:reduce", kwargs)
    n = pool.world_size
    assert got == [sum(sizes) + (n - 1) * _at_least_7(sizes)] * n


def all_gather(pool: Pool, seed: int, dtype: str, sizes: Sequence[int]) -> None:
    got = pool.run("bodies:all_gather", {"seed": seed, "dtype": dtype, "sizes": list(sizes)})
    n = pool.world_size
    # Into a new array and into out=, 1-d and (below 100_000 elements) 2-d of width 2.
    assert got == [2 * n * sum(3 * s if s < 100_000 else s for s in sizes)] * n


def all_gather_tensor(pool: Pool, seed: int) -> None:
    got = pool.run("bodies:all_gather_tensor", {"seed": seed})
    assert got == [12 * pool.world_size] * pool.world_size


def reduce_scatter(pool: Pool, seed: int, dtype: str, op: str, blocks: Sequence[int]) -> None:
    kwargs = {"seed": seed, "dtype": dtype, "op": op, "blocks": list(blocks)}
    got = pool.run("bodies:reduce_scatter", kwargs)
    assert got == [sum(4 * k for k in blocks)] * pool.world_size


def all_to_all(pool: Pool, seed: int, dtype: str, blocks: Sequence[int]) -> None:
    got = pool.run("bodies:all_to_all", {"seed": seed, "dtype": dtype, "blocks": list(blocks)})
    n = pool.world_size
    assert got == [2 * n * sum(3 * k for k in blocks)] * n


def barrier(pool: Pool, directory: str) -> None:
    assert pool.run("bodies:barrier", {"directory": directory}) == [3] * pool.world_size


# ============================================================================ point to point
def send_recv_ring(
    pool: Pool, seed: int, dtype: str, sizes: Sequence[int], senders_first: str
) -> None:
    kwargs = {"seed": seed, "dtype": dtype, "sizes": list(sizes), "senders_first": senders_first}
    got = pool.run("bodies:send_recv_ring", kwargs)
    assert got == [sum(sizes)] * pool.world_size


def send_many_then_recv(pool: Pool, seed: int, count: int = 6, delay: float = 0.2) -> None:
    got = pool.run("bodies:send_many_then_recv", {"seed": seed, "count": count, "delay": delay})
    assert got[:2] == [count, count]


def send_recv_async(pool: Pool, seed: int, size: int) -> None:
    got = pool.run("bodies:send_recv_async", {"seed": seed, "size": size})
    assert got == [size] * pool.world_size


# ============================================================================ objects, groups
def objects(pool: Pool, seed: int) -> None:
    n = pool.world_size
    assert pool.run("bodies:objects", {"seed": seed}) == [{"sources": n, "gathered": n}] * n


def objects_not_json(pool: Pool) -> None:
    for errors in pool.run("bodies:objects_not_json"):
        assert len(errors) == 3
        assert all("JSON" in e for e in errors), errors


def broadcast_object_not_json(pool: Pool, src: int, deadline: float = 60.0) -> None:
    got = pool.run("bodies:broadcast_object_not_json", {"src": src}, deadline=deadline)
    for rank, res in enumerate(got):
        if rank == src:
            assert res["type"] == "TypeError" and "JSON" in res["message"], res
        else:
            assert f"source rank {src}" in res["message"], res


def subgroups(pool: Pool, seed: int, members: list[int], src: int) -> None:
    got = pool.run("bodies:subgroups", {"seed": seed, "members": members, "src": src})
    for rank, res in enumerate(got):
        if rank in members:
            assert res == {
                "member": True,
                "group_rank": sorted(members).index(rank),  # global rank order
                "group_size": len(members),
            }
        else:
            assert res["member"] is False
            assert len(res["errors"]) == 3
            assert all(f"rank {rank}" in e and "not a member" in e for e in res["errors"])


def validation(pool: Pool) -> None:
    """Every rank ran every case (the body checks each error's type and text)."""
    got = pool.run("bodies:validation")
    names = [c["case"] for c in got[0]]
    assert len(names) == 29 + (2 if pool.world_size > 1 else 0), names
    for rank, cases in enumerate(got):
        assert [c["case"] for c in cases] == names
        for c in cases:
            assert c["message"].startswith(f"[rank {rank}] "), c


# ============================================================================ memory, async
def alloc_all_reduce(pool: Pool, seed: int, size: int, pattern: str) -> None:
    got = pool.run("bodies:alloc_all_reduce", {"seed": seed, "size": size, "pattern": pattern})
    assert got == [6 * size] * pool.world_size


def alloc_buckets_async(pool: Pool, seed: int, sizes: Sequence[int]) -> None:
    got = pool.run("bodies:alloc_buckets_async", {"seed": seed, "sizes": list(sizes)})
    assert got == [sum(sizes)] * pool.world_size


def async_in_flight(pool: Pool, seed: int) -> None:
    assert pool.run("bodies:async_in_flight", {"seed": seed}) == [5] * pool.world_size


def many_in_flight(pool: Pool, seed: int, count: int) -> None:
    got = pool.run("bodies:many_in_flight", {"seed": seed, "count": count})
    assert got == [count] * pool.world_size


def work_wait_timeout(pool: Pool, directory: str) -> None:
    got = pool.run("bodies:work_wait_timeout", {"directory": directory})
    msg = got[0]["message"]
    assert "Work.wait(timeout=0.2) expired" in msg and "all_reduce #" in msg, msg
    assert "still in flight" in msg
    assert got[0]["waited"] >= 0.2


def determinism(pool: Pool, seed: int, size: int) -> None:
    first = pool.run("bodies:determinism", {"seed": seed, "size": size})
    second = pool.run("bodies:determinism", {"seed": seed, "size": size})
    assert len(set(first)) == 1, "ranks disagree"
    assert first == second, "two runs of the same all_reduce differ"


def cupy_arrays(pool: Pool, seed: int) -> None:
    assert pool.run("bodies:cupy_arrays", {"seed": seed}) == [3 * (7 + 100_003)] * (pool.world_size)


# ============================================================================ failures
# bodies.mismatch's kinds: the two signature fragments every rank's message must show.
MISMATCHES = {
    "op": ("all_reduce #2(dtype=float32, shape=(16,), op=SUM)", "broadcast #2(dtype=float32"),
    "shape": ("shape=(16,)", "shape=(17,)"),
    "dtype": ("dtype=float32", "dtype=float64"),
    "root": ("root=0", "root=1"),
    "reduce_op": ("op=SUM", "op=MAX"),
    "large_shape": ("shape=(300000,)", "shape=(300001,)"),
}


def mismatched(got: list[Any], kind: str, fast: float) -> list[dict[str, Any]]:
    """Every rank's outcome of ``bodies:mismatch`` on 3 ranks: all_reduce #2 failed within
    ``fast`` seconds showing both sides, and the next call found the group aborted. Returns
    each rank's outcome of that next call, for what a backend promises about it."""
    ours, theirs = MISMATCHES[kind]
    for rank, res in enumerate(got):
        first = res["first"]
        assert first["type"] == "CollectiveMismatchError", first
        assert first["elapsed"] < fast, f"rank {rank} took {first['elapsed']:.1f} s"
        msg = first["message"]
        assert f"[rank {rank}]" in msg and "#2" in msg and first["seq"] == 2, msg
        assert "ranks [0, 1] called" in msg and "ranks [2] called" in msg, msg
        assert ours in msg and theirs in msg, msg
        # The group is unusable afterwards, and says why.
        after = res["after"]
        assert after["type"] == "GroupAbortedError", after
        assert "different collectives" in after["message"], after
    return [res["after"] for res in got]


def timed_out(res: dict[str, Any], timeout: float, fast: float, missing: str) -> str:
    """A waiting rank's outcome of ``bodies:skip_collective``: all_reduce #2 timed out after
    ``timeout`` seconds (not less, and not ``fast`` more), saying ``missing``. Returns the
    message, for what a backend adds to it."""
    assert res["type"] == "CollectiveTimeoutError", res
    assert "TimeoutError" in res["classes"], res
    msg = res["message"]
    assert "all_reduce #2" in msg and missing in msg, msg
    assert (res["op"], res["seq"]) == ("all_reduce", 2), res
    assert timeout - 0.1 <= res["elapsed"] < timeout + fast, res["elapsed"]
    return msg


def aborted_after_timeout(got: list[Any]) -> None:
    """``bodies:collective_after_peer_death`` on ranks that timed out: it fails at once."""
    for res in got:
        assert res["type"] == "GroupAbortedError", res
        assert "timed out" in res["message"] and res["elapsed"] < 1.0, res


def late_rank_failed(got: list[Any], late: int) -> None:
    """``bodies:late_rank``: every rank, the late one too, gets the timeout, data unchanged."""
    for rank, res in enumerate(got):
        assert res["type"] == "CollectiveTimeoutError", res
        assert f"ranks [{late}] never arrived" in res["message"], res["message"]
        assert res["value"] == rank + 1.0, "the failed all_reduce changed the data"


def left_the_group(got: list[Any], leaver: int, fast: float) -> None:
    """Rank ``leaver`` left the group instead of joining all_reduce #2: the others fail within
    ``fast`` seconds, naming it."""
    assert got[leaver] == {"type": None, "left": True}
    for rank, res in enumerate(got):
        if rank == leaver:
            continue
        assert res["type"] == "PeerFailureError", res
        assert f"rank {leaver} left the group" in res["message"], res
        assert (res["op"], res["seq"]) == ("all_reduce", 2)
        assert res["elapsed"] < fast, res["elapsed"]
