"""Every collective, on real processes, against a NumPy reference.

One test body per collective (in ``bodies.py``) runs on every pool: backend ``serial`` (world
size 1), ``cpu`` at world sizes 1-4, ``cpu`` pools with 4 KiB chunks that force the chunked
and multi-chunk point-to-point paths at small sizes, and ``mpi`` at world sizes 1-4 under
``mpiexec`` (plus its non-blocking engine, no signature check, and the all-gather check).
Bodies check their own result on every rank and raise with the details; a failing rank fails
the test with every rank's traceback (see ``harness``). Every test has a hard time limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.collectives.harness import PoolCache, PoolSpec, RankPool
from tests.collectives.harness.mpipool import mpi_unavailable_reason

pytestmark = pytest.mark.timeout(120)

SMALL_CHUNKS = (("DPT_CPU_CHUNK_BYTES", "4096"), ("DPT_CPU_P2P_CHUNK_BYTES", "4096"))
SERIAL = PoolSpec("serial", 1)
CPU = [PoolSpec("cpu", n) for n in (1, 2, 3, 4)]
CHUNKED = [PoolSpec("cpu", n, SMALL_CHUNKS, tag="4k") for n in (2, 3)]
MPI = [PoolSpec("mpi", n) for n in (1, 2, 3, 4)]  # started by mpiexec (harness/mpipool.py)
NONBLOCKING = (("DPT_MPI_ENGINE", "nonblocking"),)
MPI_VARIANTS = [
    *(PoolSpec("mpi", n, NONBLOCKING, tag="nb") for n in (2, 3)),  # Iallreduce... + Test()
    PoolSpec("mpi", 3, (("DPT_MPI_CHECK", "0"),), tag="nocheck"),
    PoolSpec("mpi", 4, (("DPT_MPI_P2P_CHECK_MAX", "2"),), tag="gathercheck"),  # Iallgather
]
ALL = [SERIAL, *CPU, *CHUNKED, *MPI, *MPI_VARIANTS]
DEFAULT_CHUNKS = [SERIAL, *CPU, *MPI]
MULTI = [s for s in ALL if s.world_size > 1]

FLOATS = ["float16", "float32", "float64"]
INTS = ["int8", "uint8", "int32", "int64"]
NUMERIC = FLOATS + INTS
OPS = ["SUM", "PROD", "MIN", "MAX", "AVG"]
DTYPE_OPS = [(d, op) for d in NUMERIC for op in OPS if op != "AVG" or d in FLOATS]


def sizes_for(pool: RankPool) -> list[int]:
    """Odd sizes: empty, one, fewer than the ranks... and over the 64 KiB small-message limit
    (several 4 KiB chunks on the chunked pools, with a 1-element last chunk at 4097)."""
    return [0, 1, 7, 4097, 20_011 if pool.tag == "4k" else 70_001]


def params(specs: list[PoolSpec]) -> Any:
    return pytest.mark.parametrize("pool", [pytest.param(s, id=s.id) for s in specs], indirect=True)


@pytest.fixture
def pool(request: pytest.FixtureRequest, pool_cache: PoolCache) -> RankPool:
    spec: PoolSpec = request.param
    if spec.backend == "mpi" and (reason := mpi_unavailable_reason()) is not None:
        pytest.skip(f"backend mpi: {reason}")
    return pool_cache.get(spec)


def total(results: list[Any]) -> int:
    return sum(int(r) for r in results)


# ---------------------------------------------------------------------------- identity
@params(ALL)
def test_ranks_and_backend(pool: RankPool) -> None:
    got = pool.run("bodies:whoami")
    assert [g["rank"] for g in got] == list(range(pool.world_size))
    assert {g["size"] for g in got} == {pool.world_size}
    assert {g["backend"] for g in got} == {pool.backend}
    assert [g["local_rank"] for g in got] == list(range(pool.world_size))
    assert len({g["pid"] for g in got}) == pool.world_size


# ---------------------------------------------------------------------------- all_reduce
@params(ALL)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_all_reduce(pool: RankPool, seed: int, dtype: str, op: str) -> None:
    sizes = sizes_for(pool)
    got = pool.run("bodies:all_reduce", {"seed": seed, "dtype": dtype, "op": op, "sizes": sizes})
    assert got == [sum(sizes) + sum(s for s in sizes if s >= 7)] * pool.world_size


@params(DEFAULT_CHUNKS)
def test_all_reduce_large(pool: RankPool, seed: int) -> None:
    got = pool.run(
        "bodies:all_reduce",
        {"seed": seed, "dtype": "float32", "op": "SUM", "sizes": [1_000_003], "iters": 1},
    )
    assert got == [1_000_003] * pool.world_size


@params(ALL)
def test_all_reduce_tensor_and_nd(pool: RankPool, seed: int) -> None:
    got = pool.run("bodies:all_reduce_tensor_2d", {"seed": seed})
    assert total(got) == pool.world_size * 2 * (15 + 24 + 21_000)


# ---------------------------------------------------------------------------- broadcast, reduce
@params(ALL)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_broadcast_every_src(pool: RankPool, seed: int, dtype: str) -> None:
    sizes = sizes_for(pool)
    got = pool.run("bodies:broadcast", {"seed": seed, "dtype": dtype, "sizes": sizes})
    assert got == [pool.world_size * sum(sizes)] * pool.world_size


@params(DEFAULT_CHUNKS)
def test_broadcast_large(pool: RankPool, seed: int) -> None:
    got = pool.run("bodies:broadcast", {"seed": seed, "dtype": "float32", "sizes": [1_000_003]})
    assert got == [pool.world_size * 1_000_003] * pool.world_size


@params(ALL)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reduce_every_dst(pool: RankPool, seed: int, dtype: str, op: str) -> None:
    sizes = sizes_for(pool)
    got = pool.run("bodies:reduce", {"seed": seed, "dtype": dtype, "op": op, "sizes": sizes})
    n = pool.world_size
    assert got == [sum(sizes) + (n - 1) * sum(s for s in sizes if s >= 7)] * n


# ---------------------------------------------------------------------------- gathers & scatters
@params(ALL)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_all_gather(pool: RankPool, seed: int, dtype: str) -> None:
    sizes = sizes_for(pool)
    got = pool.run("bodies:all_gather", {"seed": seed, "dtype": dtype, "sizes": sizes})
    n = pool.world_size
    assert got == [2 * n * sum(3 * s for s in sizes)] * n


@params(DEFAULT_CHUNKS)
def test_all_gather_large(pool: RankPool, seed: int) -> None:
    got = pool.run("bodies:all_gather", {"seed": seed, "dtype": "float32", "sizes": [1_000_003]})
    assert got == [2 * pool.world_size * 1_000_003] * pool.world_size


@params(ALL)
def test_all_gather_tensor(pool: RankPool, seed: int) -> None:
    assert pool.run("bodies:all_gather_tensor", {"seed": seed}) == [12 * pool.world_size] * (
        pool.world_size
    )


BLOCKS = [0, 1, 7, 1025]


@params(ALL)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reduce_scatter(pool: RankPool, seed: int, dtype: str, op: str) -> None:
    got = pool.run(
        "bodies:reduce_scatter", {"seed": seed, "dtype": dtype, "op": op, "blocks": BLOCKS}
    )
    assert got == [sum(4 * k for k in BLOCKS)] * pool.world_size


@params(DEFAULT_CHUNKS)
def test_reduce_scatter_large(pool: RankPool, seed: int) -> None:
    k = 1_000_003 // pool.world_size
    got = pool.run(
        "bodies:reduce_scatter", {"seed": seed, "dtype": "float32", "op": "SUM", "blocks": [k]}
    )
    assert got == [4 * k] * pool.world_size


@params(ALL)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_all_to_all(pool: RankPool, seed: int, dtype: str) -> None:
    got = pool.run("bodies:all_to_all", {"seed": seed, "dtype": dtype, "blocks": BLOCKS})
    n = pool.world_size
    assert got == [2 * n * sum(3 * k for k in BLOCKS)] * n


# ---------------------------------------------------------------------------- barrier
@params(ALL)
def test_barrier(pool: RankPool, tmp_path: Path) -> None:
    assert pool.run("bodies:barrier", {"directory": str(tmp_path)}) == [3] * pool.world_size


# ---------------------------------------------------------------------------- point to point
P2P_SIZES = [0, 1, 7, 4097, 300_007]  # 300_007 float64 = 2.3 MiB: three 1 MiB chunks


@params(MULTI)
@pytest.mark.parametrize("dtype", ["float64", "float16", "int32", "uint8", "bool"])
@pytest.mark.parametrize("senders_first", ["even", "odd"])
def test_send_recv_ring(pool: RankPool, seed: int, dtype: str, senders_first: str) -> None:
    sizes = P2P_SIZES if pool.tag != "4k" else [0, 1, 7, 4097, 20_011]
    got = pool.run(
        "bodies:send_recv_ring",
        {"seed": seed, "dtype": dtype, "sizes": sizes, "senders_first": senders_first},
    )
    assert got == [sum(sizes)] * pool.world_size


@params(MULTI)
def test_send_several_before_recv(pool: RankPool, seed: int) -> None:
    """Sends complete before the receiver posts (eagerly buffered); none overwrites another."""
    got = pool.run("bodies:send_many_then_recv", {"seed": seed, "count": 6, "delay": 0.2})
    assert got[:2] == [6, 6]


@params(MULTI)
def test_send_recv_async(pool: RankPool, seed: int) -> None:
    assert pool.run("bodies:send_recv_async", {"seed": seed, "size": 501}) == [501] * (
        pool.world_size
    )


# ---------------------------------------------------------------------------- objects
@params(ALL)
def test_object_collectives(pool: RankPool, seed: int) -> None:
    got = pool.run("bodies:objects", {"seed": seed})
    assert got == [{"sources": pool.world_size, "gathered": pool.world_size}] * pool.world_size


@params(ALL)
def test_object_not_json_raises_type_error(pool: RankPool) -> None:
    for errors in pool.run("bodies:objects_not_json"):
        assert len(errors) == 3
        assert all("JSON" in e for e in errors), errors


@params([SERIAL, *CPU])
def test_broadcast_object_not_json_fails_every_rank(pool: RankPool) -> None:
    src = pool.world_size - 1
    got = pool.run("bodies:broadcast_object_not_json", {"src": src}, deadline=30)
    for rank, res in enumerate(got):
        if rank == src:
            assert res["type"] == "TypeError" and "JSON" in res["message"], res
        else:
            assert f"source rank {src}" in res["message"], res


# ---------------------------------------------------------------------------- subgroups
@pytest.mark.parametrize(
    "members,src",
    [([0, 2], 2), ([2, 0], 0), ([1], 1), ([3, 1, 2], 1), ([0, 1, 2, 3], 3)],
    ids=["0-2", "2-0", "1", "3-1-2", "all"],
)
@params([PoolSpec("cpu", 4), PoolSpec("mpi", 4)])
def test_subgroup(pool: RankPool, seed: int, members: list[int], src: int) -> None:
    got = pool.run("bodies:subgroups", {"seed": seed, "members": members, "src": src})
    for rank, res in enumerate(got):
        if rank in members:
            assert res == {
                "member": True,
                "group_rank": members.index(rank),
                "group_size": len(members),
            }
        else:
            assert res["member"] is False
            assert len(res["errors"]) == 3
            assert all(f"rank {rank}" in e and "not a member" in e for e in res["errors"])


@params([PoolSpec("cpu", 3), PoolSpec("mpi", 3)])
def test_subgroup_root_outside_group(pool: RankPool) -> None:
    got = pool.run("bodies:subgroup_bad_root", {"members": [0, 1], "outsider": 2})
    for rank in (0, 1):
        assert "src=2 is not a member" in got[rank] and "[0, 1]" in got[rank], got[rank]


# ---------------------------------------------------------------------------- zero copy
@params(ALL)
@pytest.mark.parametrize("pattern", ["all", "mixed", "slice"])
@pytest.mark.parametrize("size", [7, 100_003])
def test_alloc_all_reduce(pool: RankPool, seed: int, pattern: str, size: int) -> None:
    got = pool.run("bodies:alloc_all_reduce", {"seed": seed, "size": size, "pattern": pattern})
    assert got == [6 * size] * pool.world_size


@params(ALL)
def test_alloc_buckets_async(pool: RankPool, seed: int) -> None:
    sizes = [20_000, 70_001, 3, 40_000]
    got = pool.run("bodies:alloc_buckets_async", {"seed": seed, "sizes": sizes})
    assert got == [sum(sizes)] * pool.world_size


# ---------------------------------------------------------------------------- async
@params([PoolSpec("cpu", 2), PoolSpec("cpu", 4), PoolSpec("mpi", 2), *MPI_VARIANTS[:1]])
def test_work_wait_timeout_leaves_collective_running(pool: RankPool, tmp_path: Path) -> None:
    got = pool.run("bodies:work_wait_timeout", {"directory": str(tmp_path)})
    msg = got[0]["message"]
    assert "Work.wait(timeout=0.2) expired" in msg and "all_reduce #" in msg, msg
    assert "still in flight" in msg
    assert got[0]["waited"] >= 0.2


@params(ALL)
def test_async_several_in_flight(pool: RankPool, seed: int) -> None:
    assert pool.run("bodies:async_in_flight", {"seed": seed}) == [5] * pool.world_size


@params(ALL)
def test_async_overlaps_computation(pool: RankPool, seed: int) -> None:
    got = pool.run("bodies:async_overlap", {"seed": seed, "size": 1_000_003})
    for res in got:
        assert res["threads"] and all(t.startswith("collectives-") for t in res["threads"])


@params(ALL)
def test_many_in_flight(pool: RankPool, seed: int) -> None:
    assert pool.run("bodies:many_in_flight", {"seed": seed, "count": 200}) == [200] * (
        pool.world_size
    )


# ---------------------------------------------------------------------------- determinism
@params(MULTI)
@pytest.mark.parametrize("size", [1_001, 300_007])
def test_all_reduce_bitwise_deterministic(pool: RankPool, seed: int, size: int) -> None:
    first = pool.run("bodies:determinism", {"seed": seed, "size": size})
    second = pool.run("bodies:determinism", {"seed": seed, "size": size})
    assert len(set(first)) == 1, "ranks disagree"
    assert first == second, "two runs of the same all_reduce differ"


@pytest.mark.slow
def test_all_reduce_deterministic_across_processes(pool_cache: PoolCache, seed: int) -> None:
    """A fresh set of processes gets the same bytes as the cached pool."""
    kwargs = {"seed": seed, "size": 300_007}
    cached = pool_cache.get(PoolSpec("cpu", 3)).run("bodies:determinism", kwargs)
    with RankPool.launch("cpu", 3, timeout=20) as fresh:
        again = fresh.run("bodies:determinism", kwargs)
    assert cached == again


# ---------------------------------------------------------------------------- CuPy arrays
FAKE_CUPY = (("DPT_TEST_FAKE_CUPY", "1"),)


@params(
    [
        PoolSpec("serial", 1, FAKE_CUPY, tag="fakecupy"),
        PoolSpec("cpu", 3, FAKE_CUPY, tag="fakecupy"),
        PoolSpec("mpi", 3, FAKE_CUPY, tag="fakecupy"),
    ]
)
def test_cupy_arrays_staged_through_host(pool: RankPool, seed: int) -> None:
    """On tests/fakes' CuPy (host memory that refuses implicit NumPy conversion)."""
    got = pool.run("bodies:cupy_arrays", {"seed": seed})
    assert got == [3 * (7 + 100_003)] * pool.world_size


# ---------------------------------------------------------------------------- validation
@params(ALL)
def test_argument_validation(pool: RankPool) -> None:
    """The body checks each error's type and text (rank, op, the sequence number the call
    would have had, what is wrong) and that nothing moved; here: every case ran everywhere."""
    got = pool.run("bodies:validation")
    names = [c["case"] for c in got[0]]
    assert len(names) == 29 + (2 if pool.world_size > 1 else 0), names
    for rank, cases in enumerate(got):
        assert [c["case"] for c in cases] == names
        for c in cases:
            assert c["message"].startswith(f"[rank {rank}] "), c
