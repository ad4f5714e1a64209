"""``ddp.idist``: Ignite's ``ignite.distributed`` helpers at world sizes 1, 2 and 4.

One body per helper (tests/ddp/idist_bodies.py) runs on every rank of a live pool (serial x1,
cpu x2, cpu x4; and as rank threads of this process, threads x2 and x4), and in this process
with nothing initialized (the serial model), so each case is checked with real processes (and
threads) at every world size. The cases follow Ignite's own tests
of these helpers (tests/ignite/distributed/utils in pytorch/ignite).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import collectives
import ddp.idist as idist
import tensorlib as tl
from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool

from . import idist_bodies as B
from .conftest import Pools

Pool = RankPool | ThreadsPool

pytestmark = pytest.mark.timeout(120)

WORLDS = [("serial", 1), ("cpu", 2), ("cpu", 4), ("threads", 2), ("threads", 4)]
BODIES = "tests.ddp.idist_bodies"


@pytest.fixture(params=WORLDS, ids=lambda w: f"{w[0]}{w[1]}")
def world(request: pytest.FixtureRequest, pools: Pools) -> Pool:
    backend, size = request.param
    if backend == "threads":  # rank threads of this process, one spawn per call
        return ThreadsPool(size, timeout=20.0, tag="idist")
    return pools(backend, size)


@pytest.fixture
def alone() -> Iterator[None]:
    """This process, outside any group (the serial model); left as found."""
    if collectives.is_initialized():
        pytest.skip("another test left a process group in this process")
    yield
    idist.finalize()


def _run(world: Pool, body: str, **kwargs: Any) -> list[Any]:
    return world.run(f"{BODIES}:{body}", kwargs, deadline=60.0)


def test_configuration_queries(world: Pool) -> None:
    got = _run(world, "config")
    ws = world.world_size
    assert [g["rank"] for g in got] == list(range(ws))
    assert [g["local_rank"] for g in got] == list(range(ws))
    for g in got:
        assert (g["world"], g["nproc"], g["nnodes"], g["node_rank"]) == (ws, ws, 1, 0)
        assert g["device"] == "cpu"
        backend = "threads" if isinstance(world, ThreadsPool) else world.backend
        assert g["backend"] == (None if ws == 1 else backend)
        assert g["model"] == ("serial" if ws == 1 else "native-dist")
        assert f"ddp.idist: world size: {ws}\n" in g["shown"]
        assert f"ddp.idist: rank: {g['rank']}\n" in g["shown"]


def test_outside_any_group_every_query_is_world_size_one(alone: None) -> None:
    got = B.config()
    assert (got["rank"], got["world"], got["local_rank"], got["backend"]) == (0, 1, 0, None)
    assert got["model"] == "serial" and got["device"] == "cpu"
    assert "ddp.idist: distributed configuration: serial" in got["shown"]
    # Every collective answered for a world of one, and none initialized anything.
    B.all_reduce_cases()
    B.all_gather_cases()
    B.broadcast_cases()
    assert B.barrier_case() == 10.0
    assert B.group_cases() == {}
    assert B.one_rank_only_case(True) == [100]
    assert not collectives.is_initialized()


def test_all_reduce(world: Pool) -> None:
    ws = world.world_size
    got = _run(world, "all_reduce_cases")
    assert got == [{"sum": ws * ws / 2, "max": ws - 1}] * ws


def test_all_gather(world: Pool) -> None:
    ws = world.world_size
    got = _run(world, "all_gather_cases")
    assert got == [{"strings": [f"r{r}" for r in range(ws)]}] * ws


def test_broadcast_from_every_rank_with_and_without_safe_mode(world: Pool) -> None:
    ws = world.world_size
    assert _run(world, "broadcast_cases") == [{"from_last": f"r{ws - 1}"}] * ws


def test_barrier_orders_a_change_before_the_all_reduce(world: Pool) -> None:
    ws = world.world_size
    assert _run(world, "barrier_case") == [10.0 + sum(range(ws))] * ws


def test_groups_by_object_and_by_rank_list(world: Pool) -> None:
    ws = world.world_size
    got = _run(world, "group_cases")
    if ws == 1:
        assert got == [{}]
        return
    members = list(range(1, ws))
    for rank, g in enumerate(got):
        if rank == 0:  # not a member: its input comes back
            assert g["by_group"] == [0] and g["by_list"] == [0] and g["sum_by_list"] == 0
            assert g["objects"] == {"r": 0}
        else:
            assert g["by_group"] == members and g["by_list"] == members
            assert g["sum_by_list"] == sum(members)
            assert g["objects"] == [{"r": r} for r in members]


@pytest.mark.parametrize("with_barrier", [False, True])
def test_one_rank_only_runs_on_the_given_rank(world: Pool, with_barrier: bool) -> None:
    ws = world.world_size
    got = _run(world, "one_rank_only_case", with_barrier=with_barrier)
    assert got == [[0] * (ws - 1) + [100]] * ws


@pytest.mark.parametrize(("op", "cap_mb"), [("avg", 25.0), ("sum", 1e-6)])
def test_sync_gradients_buckets_and_reduces(world: Pool, op: str, cap_mb: float) -> None:
    ws = world.world_size
    got = _run(world, "sync_gradients_case", op=op, cap_mb=cap_mb)
    # 5 trainable parameters in two dtypes: one bucket per dtype, or one each when tiny.
    buckets = 0 if ws == 1 else (2 if cap_mb > 1 else 5)
    rank_sum = ws * (ws + 1) / 2
    for g in got:
        assert g["count"] == buckets and g["issued"] == buckets, g
        for name, grad in g["grads"].items():
            if name == "frozen":
                assert grad is None
                continue
            if name == "b.bias":  # no gradient on any rank: zeros when synced
                assert grad is None if ws == 1 else set(_flat(grad)) == {0.0}
                continue
            want = g["factor"][name] * (
                1.0 if ws == 1 else (rank_sum / ws if op == "avg" else rank_sum)
            )
            flat = _flat(grad)
            assert flat == pytest.approx([want] * len(flat)), (name, grad, want)
    assert all(g["grads"] == got[0]["grads"] for g in got)


def _flat(x: Any) -> list[float]:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def test_sync_parameters_copies_the_source_ranks_values(world: Pool) -> None:
    ws = world.world_size
    got = _run(world, "sync_parameters_case", src=ws - 1)
    assert got == [{"count": 0 if ws == 1 else 6}] * ws


def test_argument_errors_outside_any_group(alone: None) -> None:
    with pytest.raises(ValueError, match="backend 'nope' is not usable here"):
        idist.initialize("nope")
    with pytest.raises(TypeError, match="unexpected arguments"):
        idist.initialize("cpu", nproc_per_node=2)
    with pytest.raises(ValueError, match="backend None, nproc_per_node must be None"):
        idist.Parallel(nproc_per_node=2)
    with pytest.raises(ValueError, match="nnodes=2"):
        idist.Parallel(backend="gloo", nproc_per_node=2, nnodes=2, node_rank=0)
    with pytest.raises(ValueError, match="src=1 does not exist"):
        import ddp

        ddp.sync_parameters(B._Mixed(0), src=1)
    with pytest.raises(ValueError, match="sync_bn"):
        idist.auto_model(B._Mixed(0), sync_bn=True)
    with pytest.raises(ValueError, match="rank 1 does not exist at world size 1"):
        idist.one_rank_only(rank=1)(lambda: None)()
    assert idist.available_backends() == tuple(
        b for b in collectives.available_backends() if b != "serial"
    )
    assert bool(idist.has_native_dist_support) and idist.has_native_dist_support()
    assert not idist.has_xla_support and not idist.has_hvd_support()
    assert bool(idist.has_mpi_support) == ("mpi" in collectives.available_backends())


@pytest.mark.parametrize("joined", [False, True], ids=["alone", "serial1"])
@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (
            lambda: idist.new_group([5]),
            ValueError,
            "idist.new_group: ranks [5] are out of range for world size 1",
        ),
        (
            lambda: idist.new_group([0, 0]),
            ValueError,
            "idist.new_group: ranks must be unique and non-empty, got [0, 0]",
        ),
        (
            lambda: idist.new_group([]),
            ValueError,
            "idist.new_group: ranks must be unique and non-empty, got []",
        ),
        (
            lambda: idist.all_reduce(1.0, group=[3]),
            ValueError,
            "idist.all_reduce: ranks [3] are out of range",
        ),
        (
            lambda: idist.barrier(group=[0, 1]),
            ValueError,
            "idist.barrier: ranks [1] are out of range",
        ),
        (
            lambda: idist.all_gather({"a": tl.tensor([1.0])}),
            TypeError,
            "idist.all_gather: the value must be JSON-serializable",
        ),
        (
            lambda: idist.all_gather(object()),
            TypeError,
            "idist.all_gather: the value must be JSON-serializable",
        ),
    ],
    ids=[
        "new_group([5])",
        "duplicates",
        "empty",
        "all_reduce",
        "barrier",
        "dict of tensor",
        "object",
    ],
)
def test_argument_errors_at_world_size_one_are_those_of_world_size_n(
    alone: None, joined: bool, call: Any, error: type[Exception], fragment: str
) -> None:
    # What collectives.new_group and the object collectives refuse among ranks is refused
    # alone too (docs/idist.md), outside any group and in a serial group of one.
    if joined:
        idist.initialize("gloo")
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)
    assert idist.new_group([0]) == [0]  # a valid group of one still works


def test_initialize_alone_is_a_world_of_one_and_finalize_ends_it(alone: None) -> None:
    idist.initialize("gloo")
    assert collectives.is_initialized() and collectives.get_backend() == "serial"
    assert idist.backend() is None and idist.get_world_size() == 1
    with pytest.raises(RuntimeError, match="already exists"):
        idist.initialize("cpu")
    idist.finalize()
    assert not collectives.is_initialized()


def _spawned(local_rank: int, tag: str, scale: int = 1) -> dict[str, Any]:
    """A spawned rank: Ignite's calling convention and the group it finds."""
    return {
        "local_rank": local_rank,
        "tag": tag,
        "sum": idist.all_reduce(local_rank * scale),
        "backend": idist.backend(),
        "world": idist.get_world_size(),
    }


def test_spawn_and_parallel_call_fn_with_the_local_rank(alone: None) -> None:
    got = idist.spawn(
        "gloo", _spawned, ("a",), kwargs_dict={"scale": 10}, nproc_per_node=2, timeout=30
    )
    assert got == [
        {"local_rank": r, "tag": "a", "sum": 10, "backend": "cpu", "world": 2} for r in range(2)
    ]
    with idist.Parallel(backend="cpu", nproc_per_node=2, timeout=30) as parallel:
        got = parallel.run(_spawned, "b", scale=3)
    assert [g["sum"] for g in got] == [3, 3] and [g["tag"] for g in got] == ["b", "b"]
    with idist.Parallel() as parallel:  # alone: a world of one in this process
        assert parallel.run(_spawned, "c") == {
            "local_rank": 0,
            "tag": "c",
            "sum": 0,
            "backend": None,
            "world": 1,
        }
    assert not collectives.is_initialized()
