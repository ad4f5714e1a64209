"""``ddp.axon``: axonml-distributed's API, on real ranks and on its mock world.

Each body (tests/ddp/axon_bodies.py) runs on every rank of a live pool (serial x1, cpu x2 and
x3, threads x2 and x4: ``World.init()`` over the default group) and on every rank of a mock
world (``MockBackend.create_world(n)``, one thread of this process a rank, as axonml's README
simulates processes), so each name is checked where a user would meet it. The mock world's
own promises (connected backends, one thread a rank, failures reaching the peers) and the
argument checks follow.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collectives
import ddp
import ddp.axon as axon
import tensorlib as tl
from ddp.axon import (
    GradientBucket,
    GradientSynchronizer,
    GradSyncStrategy,
    MockBackend,
    ProcessGroup,
    ReduceOp,
    World,
)
from tests.collectives.threads_pool import ThreadsPool

from . import axon_bodies as B
from .conftest import Pools

pytestmark = pytest.mark.timeout(120)

BODIES = "tests.ddp.axon_bodies"
POOLS = [("serial", 1), ("cpu", 2), ("cpu", 3), ("threads", 2), ("threads", 4)]
MOCKS = [1, 3]

Run = Callable[..., list[Any]]


def run_mock(n: int, body: Callable[..., Any], timeout: float = 20.0, **kwargs: Any) -> list[Any]:
    """``body(world=World.init(backend), **kwargs)`` on every rank of a fresh mock world of
    ``n``, one thread each; results in rank order (a failure shows every rank's traceback)."""
    results: list[Any] = [None] * n
    errors: dict[int, str] = {}

    def rank_main(backend: MockBackend) -> None:
        try:
            with backend:
                results[backend.rank()] = body(world=World.init(backend), **kwargs)
        except BaseException:
            errors[backend.rank()] = traceback.format_exc()

    threads = [
        threading.Thread(target=rank_main, args=(b,), daemon=True)
        for b in MockBackend.create_world(n, timeout=timeout)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads), "a mock rank did not finish in 60 s"
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items()))
    return results


@pytest.fixture(
    params=[*POOLS, *(("mock", n) for n in MOCKS)], ids=lambda w: f"{w[0]}{w[1]}"
)  # fmt: skip
def world(request: pytest.FixtureRequest, pools: Pools) -> tuple[int, Run]:
    """(world size, ``run(body_name, **kwargs)``) on a pool, rank threads or a mock world."""
    kind, size = request.param
    if kind == "mock":
        return size, lambda body, **kw: run_mock(size, getattr(B, body), **kw)
    pool: Any = ThreadsPool(size, timeout=20.0, tag="axon") if kind == "threads" else None
    pool = pool or pools(kind, size)
    return size, lambda body, **kw: pool.run(f"{BODIES}:{body}", kw, deadline=60.0)


def _close(got: Any, want: Any) -> None:
    """Equal shapes and values, to float32 rounding."""
    np.testing.assert_allclose(np.asarray(got, dtype=float), np.asarray(want), rtol=1e-6)


# ---------------------------------------------------------------------- on every world
def test_communication_functions_combine_every_rank(world: tuple[int, Run]) -> None:
    n, run = world
    got = run("comm_case")
    base = np.array([1.0, 2.0, 3.0])
    factors = np.arange(1, n + 1)
    total = base * factors.sum()
    for r, g in enumerate(got):
        assert (g["rank"], g["world_size"], g["is_main"]) == (r, n, r == 0)
        _close(g["sum"], total.tolist())
        _close(g["mean"], (total / n).tolist())
        _close(g["min"], base.tolist())
        _close(g["max"], (base * n).tolist())
        _close(g["product"], (base**n * np.prod(factors)).tolist())
        _close(g["broadcast"], base.tolist())  # rank 0's, with no src given
        _close(g["broadcast_from_last"], (base * n).tolist())
        want_t = np.arange(6).reshape(2, 3).T * factors.sum()
        _close(g["transposed_sum"], want_t.tolist())
        _close(g["gathered"], [(base * f).tolist() for f in factors])


def test_sync_gradients_reduces_plain_gradient_tensors(world: tuple[int, Run]) -> None:
    # Wrong result 1: given gradient tensors (axonml's usage), ddp.sync_gradients returned 0
    # and left them as they were, silently, on every world size.
    n, run = world
    got = run("plain_gradients_case")
    mean = (n + 1) / 2
    total = n * (n + 1) / 2
    for g in got:
        assert g["issued"] == (0 if n == 1 else 1), g  # both gradients in one bucket
        _close(g["g1"], [0.1 * mean, 0.2 * mean])
        _close(g["g2"], [[0.3 * mean, 0.4 * mean, 0.5 * mean]])
        # A parameter's gradient is reduced (not its values), a frozen one is left alone,
        # and a gradient tensor beside them is reduced too, in the same bucket.
        assert g["mixed_issued"] == (0 if n == 1 else 1)
        _close(g["param_grad"], [total, 2 * total, 3 * total])
        assert g["param"] == [0.0, 0.0, 0.0]
        assert g["frozen_grad"] is None and g["frozen"] == [1.0, 1.0]
        _close(g["grad"], [4 * total])
        assert g["axon_issued"] == (0 if n == 1 else 1)
        for got, want in zip(g["axon"], ([1, 2], [3], [5, 6]), strict=True):
            _close(got, np.array(want) * mean)


def test_gradient_bucket_is_reduced_in_place_and_extracted_in_shape(
    world: tuple[int, Run],
) -> None:
    n, run = world
    mean = (n + 1) / 2
    for g in run("bucket_case"):
        assert (g["full"], g["refused"], g["size"]) == (True, False, 5)
        assert g["shapes"] == [[2], [3, 1]]
        _close(g["synced"][0], [0.1 * mean, 0.2 * mean])
        _close(g["synced"][1], [[0.3 * mean], [0.4 * mean], [0.5 * mean]])


@pytest.mark.parametrize(("bucket_size", "buckets"), [(25_000_000, 1), (3, 3), (5, 2)])
def test_gradient_synchronizer_averages_what_was_added_in_buckets(
    world: tuple[int, Run], bucket_size: int, buckets: int
) -> None:
    n, run = world
    mean = (n + 1) / 2
    for g in run("synchronizer_case", bucket_size=bucket_size):
        # Sizes 2, 3, 4: one bucket; or 3 when 3 elements fit; or [2, 3] and [4] with 5.
        want = 0 if n == 1 else buckets
        assert (g["issued"], g["ran"]) == (want, want), g
        for got, size in zip(g["grads"], (2, 3, 4), strict=True):
            _close(got, [mean] * size)
        assert g["kept"] == [True, True]  # the tensors added are the ones averaged
        assert g["cleared"] == [None] * 4
        assert g["no_sync"][0] == 0 and g["no_sync"][1] == [float(g["no_sync"][1][0])]


def test_ddp_sync_gradients_checks_backward_did_it_and_reduces_nothing_twice(
    world: tuple[int, Run],
) -> None:
    n, run = world
    got = run("ddp_case")
    mean = (n + 1) / 2
    for g in got:
        # Every rank holds rank 0's start (DDP copied it; sync_parameters copies it again).
        assert g["param0"] == got[0]["param0"]
        assert g["copied"] == (0 if n == 1 else 2)
        # d(sum of outputs)/dW = the batch's column sums: 2 rows of (r + 1), averaged.
        _close(g["grad"], [[2 * mean] * 3] * 2)
        assert g["extra_collectives"] == 0  # sync_gradients after backward issues nothing
        assert g["launched"] == 1
        assert "no synchronized backward has run" in g["errors"]["before_backward"]
        assert "no_sync()" in g["errors"]["after_no_sync"]
        # The next synchronized backward averaged the no_sync sum: three backwards' worth.
        _close(g["after_sync"], [[6 * mean] * 3] * 2)


def test_new_group_runs_collectives_on_its_members_only(world: tuple[int, Run]) -> None:
    n, run = world
    members = [0, n - 1] if n > 1 else [0]
    for r, g in enumerate(run("subgroup_case")):
        assert (g["size"], g["ranks"], g["clone_size"]) == (len(members), members, len(members))
        assert g["contains"] == [i in members for i in range(n)]
        if r in members:
            assert g["sum"] == [float(sum(members))]
        else:
            assert f"[rank {r}] barrier: this rank is not a member of the group with ranks " \
                   f"{members}" in g["refused"]  # fmt: skip
        size, message = g["beyond"]
        assert size == 2 and f"names rank(s) [{n}]" in message
        assert g["world_seq_step"] == 1


@pytest.mark.parametrize("kind", ["serial1", "cpu2", "threads2"])
def test_world_init_is_this_processs_default_group(pools: Pools, kind: str) -> None:
    size = int(kind[-1])
    if kind.startswith("threads"):
        got = ThreadsPool(size, timeout=20.0).run(f"{BODIES}:default_world_case")
    else:
        got = pools(kind[:-1], size).run(f"{BODIES}:default_world_case")
    for r, g in enumerate(got):
        assert (g["rank"], g["world_size"], g["is_main"], g["same_group"]) == (
            r,
            size,
            r == 0,
            True,
        )
        assert g["backend"] == kind[:-1]


# ---------------------------------------------------------------------- the mock world
def test_every_name_of_the_readme_comes_from_one_import() -> None:
    readme = [
        "World", "DistributedDataParallel", "ProcessGroup", "Tensor", "all_reduce_sum",
        "all_reduce_mean", "broadcast", "all_gather", "barrier", "rank", "world_size",
        "is_main_process", "sync_gradients", "sync_gradient", "GradientBucket", "ReduceOp",
        "GradientSynchronizer", "GradSyncStrategy", "MockBackend",
    ]  # fmt: skip
    namespace: dict[str, Any] = {}
    exec("from ddp.axon import *", namespace)
    assert [name for name in readme if name not in namespace] == []
    assert ddp.axon is axon
    assert ReduceOp.AVERAGE is ReduceOp.Average and ReduceOp.Sum is ReduceOp.SUM
    assert GradSyncStrategy.Synchronous is GradSyncStrategy.SYNCHRONOUS


def test_mock_world_and_group_are_a_world_of_one() -> None:
    world = World.mock()
    assert (world.rank(), world.world_size(), world.is_main()) == (0, 1, True)
    pg = ProcessGroup.mock()
    assert (pg.rank(), pg.size(), pg.world_size(), pg.ranks()) == (0, 1, 1, [0])
    assert pg.contains(0) and not pg.contains(1)
    assert pg.backend().name() == "mock"
    t = tl.tensor([1.0, 2.0])
    axon.all_reduce_sum(t, pg)
    assert t.numpy().tolist() == [1.0, 2.0]
    sub = world.new_group([0, 1])  # the README's subgroup: rank 1 is not in this world
    assert sub.contains(0) and sub.size() == 2
    with pytest.raises(ValueError, match=r"names rank\(s\) \[1\].*create_world\(2\)"):
        axon.all_reduce_sum(t, sub)


def test_created_backends_are_connected_and_each_serves_its_own_thread() -> None:
    backends = MockBackend.create_world(4, timeout=20.0)
    assert [(b.rank(), b.world_size(), b.name()) for b in backends] == [
        (r, 4, "mock") for r in range(4)
    ]
    # As in the README: the groups are made here, then each is used from a thread of its own.
    groups = [ProcessGroup(b) for b in backends]
    sums: list[Any] = [None] * 4

    def worker(pg: ProcessGroup, backend: MockBackend) -> None:
        with backend:
            t = tl.tensor([float(pg.rank())])
            axon.all_reduce_sum(t, pg)
            sums[pg.rank()] = float(t.numpy()[0])

    threads = [
        threading.Thread(target=worker, args=(g, b), daemon=True)
        for g, b in zip(groups, backends, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert sums == [6.0] * 4


def test_one_thread_cannot_be_two_ranks_of_a_mock_world() -> None:
    a, b = MockBackend.create_world(2, timeout=20.0)
    assert a.group.rank == 0  # this thread now issues rank 0's collectives
    with pytest.raises(RuntimeError, match="already issues the collectives of rank 0"):
        _ = b.group  # rank 1's too would wait for rank 0 for ever
    a.close()
    b.close()


@pytest.mark.timeout(30)  # far below the world's 120 s: the failure must arrive at once
def test_a_rank_that_raises_makes_its_peers_fail_at_once_naming_it() -> None:
    zero, one = MockBackend.create_world(2, timeout=120.0)
    caught: list[BaseException] = []

    def rank0() -> None:
        try:
            with zero:
                ProcessGroup(zero).barrier()  # waits for rank 1, which never comes
        except BaseException as e:
            caught.append(e)

    def rank1() -> None:
        try:
            with one:
                raise KeyError("boom")
        except KeyError:
            pass

    t0 = threading.Thread(target=rank0, daemon=True)
    t0.start()
    threading.Thread(target=rank1, daemon=True).start()
    t0.join(25.0)
    assert len(caught) == 1 and isinstance(caught[0], collectives.CollectiveError)
    assert "rank 1" in str(caught[0]) and "boom" in str(caught[0])


def test_bad_arguments_are_refused_with_what_was_expected() -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        MockBackend.create_world(0)
    with pytest.raises(TypeError, match="expected a Backend"):
        ProcessGroup("not a backend")  # type: ignore[arg-type]
    world = World.mock()
    with pytest.raises(ValueError, match="unique"):
        world.new_group([0, 0])
    with pytest.raises(TypeError, match="ranks must be ints"):
        world.new_group(["0"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"expected a ddp\.axon\.ProcessGroup"):
        axon.all_reduce_sum(tl.tensor([1.0]), collectives.get_default_group())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="op must be a ReduceOp"):
        ProcessGroup.mock().backend().all_reduce(np.ones(2, np.float32), "median")
    sync = GradientSynchronizer(GradSyncStrategy.Synchronous, 10)
    with pytest.raises(IndexError, match=r"call prepare\(n\) first"):
        sync.add_gradient(0, tl.tensor([1.0]))
    sync.prepare(2)
    with pytest.raises(IndexError, match=r"prepare\(2\) made room for gradients 0..1"):
        sync.add_gradient(2, tl.tensor([1.0]))
    with pytest.raises(ValueError, match="bucket_size must be an int >= 1"):
        GradientSynchronizer(GradSyncStrategy.Synchronous, 0)
    bucket = GradientBucket(10)
    bucket.add(tl.tensor([1.0]))
    with pytest.raises(TypeError, match="holds float32 on cpu, got float64"):
        bucket.add(tl.tensor(np.ones(2)))


def test_gradient_bucket_copies_in_grows_and_extracts_copies() -> None:
    bucket = GradientBucket(5000)
    g = tl.tensor(np.arange(3000, dtype=np.float32))
    assert bucket.add(g) and bucket.add(tl.tensor(np.ones((10, 100), np.float32)))
    g.data[...] = -1  # the bucket holds a copy of what was added
    assert bucket.size() == 4000 and bucket.data()[:3].tolist() == [0.0, 1.0, 2.0]
    bucket.data_mut()[...] *= 2  # the flat buffer itself: extract reads what was written
    first, second = bucket.extract()
    assert first.numpy()[:3].tolist() == [0.0, 2.0, 4.0] and second.shape == (10, 100)
    first.data[...] = 7  # extracted tensors are copies
    assert bucket.data()[1] == 2.0
    assert not bucket.add(tl.tensor(np.ones(1001, np.float32)))  # over the capacity
    bucket.clear()
    assert bucket.is_empty() and bucket.extract() == []
    assert bucket.add(tl.tensor(np.ones(2)))  # an empty bucket takes any dtype again
