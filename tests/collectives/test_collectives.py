"""Every collective, on real processes, against a NumPy reference.

One test body per collective (in ``bodies.py``) runs on every pool: backend ``serial`` (world
size 1), ``cpu`` at world sizes 1-4, ``cpu`` pools with 4 KiB chunks that force the chunked
and multi-chunk point-to-point paths at small sizes, ``cpu`` pools on the pure-Python path
(``DPT_CPU_NATIVE=0``; the others run the compiled helper when it is built), ``mpi`` at world
sizes 1-4 under ``mpiexec`` (plus its non-blocking engine, no signature check, and the
all-gather check), and ``threads`` at world sizes 1-4 (rank threads of this process, through
``spawn``: ``threads_pool.py``).
Bodies check their own result on every rank and raise with the details; a failing rank fails
the test with every rank's traceback (see ``harness``). Every test has a hard time limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.collectives import expect
from tests.collectives.expect import BLOCKS, DTYPE_OPS, NUMERIC
from tests.collectives.harness import PoolCache, PoolSpec, RankPool
from tests.collectives.harness.mpipool import mpi_unavailable_reason
from tests.collectives.threads_pool import ThreadsPool

pytestmark = pytest.mark.timeout(120)

SMALL_CHUNKS = (("DPT_CPU_CHUNK_BYTES", "4096"), ("DPT_CPU_P2P_CHUNK_BYTES", "4096"))
SERIAL = PoolSpec("serial", 1)
CPU = [PoolSpec("cpu", n) for n in (1, 2, 3, 4)]
CHUNKED = [PoolSpec("cpu", n, SMALL_CHUNKS, tag="4k") for n in (2, 3)]
CPU_PYTHON = [PoolSpec("cpu", n, (("DPT_CPU_NATIVE", "0"),), tag="py") for n in (2, 3)]
MPI = [PoolSpec("mpi", n) for n in (1, 2, 3, 4)]  # started by mpiexec (harness/mpipool.py)
NONBLOCKING = (("DPT_MPI_ENGINE", "nonblocking"),)
MPI_VARIANTS = [
    *(PoolSpec("mpi", n, NONBLOCKING, tag="nb") for n in (2, 3)),  # Iallreduce... + Test()
    PoolSpec("mpi", 3, (("DPT_MPI_CHECK", "0"),), tag="nocheck"),
    PoolSpec("mpi", 4, (("DPT_MPI_P2P_CHECK_MAX", "2"),), tag="gathercheck"),  # Iallgather
]
THREADS = [PoolSpec("threads", n) for n in (1, 2, 3, 4)]  # threads_pool.py: spawn per call
ALL = [SERIAL, *CPU, *CHUNKED, *CPU_PYTHON, *MPI, *MPI_VARIANTS, *THREADS]
DEFAULT_CHUNKS = [SERIAL, *CPU, *MPI, *THREADS]
PROCESSES = [s for s in ALL if s.backend != "threads"]
MULTI = [s for s in ALL if s.world_size > 1]


def sizes_for(pool: RankPool | ThreadsPool) -> list[int]:
    """Odd sizes: empty, one, fewer than the ranks... and over the 64 KiB small-message limit
    (several 4 KiB chunks on the chunked pools, with a 1-element last chunk at 4097)."""
    return [0, 1, 7, 4097, 20_011 if pool.tag == "4k" else 70_001]


def params(specs: list[PoolSpec]) -> Any:
    return pytest.mark.parametrize("pool", [pytest.param(s, id=s.id) for s in specs], indirect=True)


@pytest.fixture
def pool(request: pytest.FixtureRequest, pool_cache: PoolCache) -> Any:
    spec: PoolSpec = request.param
    if spec.backend == "threads":
        return ThreadsPool(spec.world_size, timeout=spec.timeout, tag=spec.tag)
    if spec.backend == "mpi" and (reason := mpi_unavailable_reason()) is not None:
        pytest.skip(f"backend mpi: {reason}")
    return pool_cache.get(spec)


# ---------------------------------------------------------------------------- identity
@params(PROCESSES)  # threads: test_threads_backend.py (one process, so one pid)
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
    expect.all_reduce(pool, seed, dtype, op, sizes_for(pool))


@params(DEFAULT_CHUNKS)
def test_all_reduce_large(pool: RankPool, seed: int) -> None:
    expect.all_reduce(pool, seed, "float32", "SUM", [1_000_003], iters=1)


@params(ALL)
def test_all_reduce_tensor_and_nd(pool: RankPool, seed: int) -> None:
    expect.all_reduce_tensor_2d(pool, seed)


# ---------------------------------------------------------------------------- broadcast, reduce
@params(ALL)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_broadcast_every_src(pool: RankPool, seed: int, dtype: str) -> None:
    expect.broadcast(pool, seed, dtype, sizes_for(pool))


@params(DEFAULT_CHUNKS)
def test_broadcast_large(pool: RankPool, seed: int) -> None:
    expect.broadcast(pool, seed, "float32", [1_000_003])


@params(ALL)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reduce_every_dst(pool: RankPool, seed: int, dtype: str, op: str) -> None:
    expect.reduce(pool, seed, dtype, op, sizes_for(pool))


# ---------------------------------------------------------------------------- gathers & scatters
@params(ALL)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_all_gather(pool: RankPool, seed: int, dtype: str) -> None:
    expect.all_gather(pool, seed, dtype, sizes_for(pool))


@params(DEFAULT_CHUNKS)
def test_all_gather_large(pool: RankPool, seed: int) -> None:
    expect.all_gather(pool, seed, "float32", [1_000_003])


@params(ALL)
def test_all_gather_tensor(pool: RankPool, seed: int) -> None:
    expect.all_gather_tensor(pool, seed)


@params(ALL)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reduce_scatter(pool: RankPool, seed: int, dtype: str, op: str) -> None:
    expect.reduce_scatter(pool, seed, dtype, op, BLOCKS)


@params(DEFAULT_CHUNKS)
def test_reduce_scatter_large(pool: RankPool, seed: int) -> None:
    expect.reduce_scatter(pool, seed, "float32", "SUM", [1_000_003 // pool.world_size])


@params(ALL)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_all_to_all(pool: RankPool, seed: int, dtype: str) -> None:
    expect.all_to_all(pool, seed, dtype, BLOCKS)


# ---------------------------------------------------------------------------- barrier
@params(ALL)
def test_barrier(pool: RankPool, tmp_path: Path) -> None:
    expect.barrier(pool, str(tmp_path))


# ---------------------------------------------------------------------------- point to point
P2P_SIZES = [0, 1, 7, 4097, 300_007]  # 300_007 float64 = 2.3 MiB: three 1 MiB chunks


@params(MULTI)
@pytest.mark.parametrize("dtype", ["float64", "float16", "int32", "uint8", "bool"])
@pytest.mark.parametrize("senders_first", ["even", "odd"])
def test_send_recv_ring(pool: RankPool, seed: int, dtype: str, senders_first: str) -> None:
    sizes = P2P_SIZES if pool.tag != "4k" else [0, 1, 7, 4097, 20_011]
    expect.send_recv_ring(pool, seed, dtype, sizes, senders_first)


@params(MULTI)
def test_send_several_before_recv(pool: RankPool, seed: int) -> None:
    """Sends complete before the receiver posts (eagerly buffered); none overwrites another."""
    expect.send_many_then_recv(pool, seed, count=6, delay=0.2)


@params(MULTI)
def test_send_recv_async(pool: RankPool, seed: int) -> None:
    expect.send_recv_async(pool, seed, 501)


# ---------------------------------------------------------------------------- objects
@params(ALL)
def test_object_collectives(pool: RankPool, seed: int) -> None:
    expect.objects(pool, seed)


@params(ALL)
def test_object_not_json_raises_type_error(pool: RankPool) -> None:
    expect.objects_not_json(pool)


@params([SERIAL, *CPU, *THREADS])
def test_broadcast_object_not_json_fails_every_rank(pool: RankPool) -> None:
    expect.broadcast_object_not_json(pool, pool.world_size - 1, deadline=30)


# ---------------------------------------------------------------------------- subgroups
@pytest.mark.parametrize(
    "members,src",
    [([0, 2], 2), ([2, 0], 0), ([1], 1), ([3, 1, 2], 1), ([0, 1, 2, 3], 3)],
    ids=["0-2", "2-0", "1", "3-1-2", "all"],
)
@params([PoolSpec("cpu", 4), PoolSpec("mpi", 4), PoolSpec("threads", 4)])
def test_subgroup(pool: RankPool, seed: int, members: list[int], src: int) -> None:
    expect.subgroups(pool, seed, members, src)


@params([PoolSpec("cpu", 3), PoolSpec("mpi", 3), PoolSpec("threads", 3)])
def test_subgroup_root_outside_group(pool: RankPool) -> None:
    got = pool.run("bodies:subgroup_bad_root", {"members": [0, 1], "outsider": 2})
    for rank in (0, 1):
        assert "src=2 is not a member" in got[rank] and "[0, 1]" in got[rank], got[rank]


# ---------------------------------------------------------------------------- zero copy
@params(ALL)
@pytest.mark.parametrize("pattern", ["all", "mixed", "slice"])
@pytest.mark.parametrize("size", [7, 100_003])
def test_alloc_all_reduce(pool: RankPool, seed: int, pattern: str, size: int) -> None:
    expect.alloc_all_reduce(pool, seed, size, pattern)


@params(ALL)
@pytest.mark.parametrize("size", [5, 30_001])
def test_alloc_views_that_move_between_calls(pool: RankPool, seed: int, size: int) -> None:
    got = pool.run("bodies:alloc_views_cycle", {"seed": seed, "size": size, "rounds": 80})
    assert got == [80] * pool.world_size


@params(ALL)
def test_alloc_buckets_async(pool: RankPool, seed: int) -> None:
    expect.alloc_buckets_async(pool, seed, [20_000, 70_001, 3, 40_000])


# ---------------------------------------------------------------------------- async
@params(
    [
        PoolSpec("cpu", 2),
        PoolSpec("cpu", 4),
        PoolSpec("mpi", 2),
        *MPI_VARIANTS[:1],
        PoolSpec("threads", 2),
        PoolSpec("threads", 4),
    ]
)
def test_work_wait_timeout_leaves_collective_running(pool: RankPool, tmp_path: Path) -> None:
    expect.work_wait_timeout(pool, str(tmp_path))


@params(ALL)
def test_async_several_in_flight(pool: RankPool, seed: int) -> None:
    expect.async_in_flight(pool, seed)


@params(ALL)
def test_async_overlaps_computation(pool: RankPool, seed: int) -> None:
    got = pool.run("bodies:async_overlap", {"seed": seed, "size": 1_000_003})
    for res in got:
        assert res["threads"] and all(t.startswith("collectives-") for t in res["threads"])


@params(ALL)
def test_many_in_flight(pool: RankPool, seed: int) -> None:
    expect.many_in_flight(pool, seed, 200)


# ---------------------------------------------------------------------------- determinism
@params(MULTI)
@pytest.mark.parametrize("size", [1_001, 300_007])
def test_all_reduce_bitwise_deterministic(pool: RankPool, seed: int, size: int) -> None:
    expect.determinism(pool, seed, size)


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
    expect.cupy_arrays(pool, seed)


# ---------------------------------------------------------------------------- validation
@params(ALL)
def test_argument_validation(pool: RankPool) -> None:
    """The body checks each error's type and text (rank, op, the sequence number the call
    would have had, what is wrong) and that nothing moved; here: every case ran everywhere."""
    expect.validation(pool)
