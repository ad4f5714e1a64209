"""``ddp.idist`` as the seed's page writes it (../shared/seeds/003_*.txt), beside Ignite's own
signatures: ``rank()``/``world_size()``, ``spawn(fn, args, nprocs, join, daemon,
start_method)`` whose workers call ``idist.initialize()`` themselves, ``Parallel(backend,
nprocs)``, ``sync``/``barrier``/``broadcast``/``all_reduce`` in the seed's argument order,
``auto_dataloader`` of an existing loader, and ``one_rank_only()`` waiting by default.

The collectives run as one body (tests/ddp/idist_bodies.py) on every rank of a live pool:
serial x1, cpu x2 and x4 processes, threads x2 and x4.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collectives
import ddp
import ddp.idist as idist
from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool

from . import idist_bodies as B
from .conftest import Pools

Pool = RankPool | ThreadsPool

pytestmark = pytest.mark.timeout(120)

WORLDS = [("serial", 1), ("cpu", 2), ("cpu", 4), ("threads", 2), ("threads", 4)]
BODIES = "tests.ddp.idist_bodies"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=WORLDS, ids=lambda w: f"{w[0]}{w[1]}")
def world(request: pytest.FixtureRequest, pools: Pools) -> Pool:
    backend, size = request.param
    if backend == "threads":
        return ThreadsPool(size, timeout=20.0, tag="idist-seed")
    return pools(backend, size)


@pytest.fixture
def alone() -> Iterator[None]:
    """This process, outside any group; left as found."""
    if collectives.is_initialized():
        pytest.skip("another test left a process group in this process")
    yield
    idist.finalize()


def _run(world: Pool, body: str, **kwargs: Any) -> list[Any]:
    return world.run(f"{BODIES}:{body}", kwargs, deadline=60.0)


# ---------------------------------------------------------------------- collectives
def test_seed_names_and_argument_orders(world: Pool) -> None:
    ws = world.world_size
    got = _run(world, "seed_order_cases")
    if ws == 1:
        assert got == [{}]
        return
    members = range(1, ws)
    for rank, g in enumerate(got):
        if rank == 0:  # outside the subgroup: its input comes back
            assert g == {"max_by_group": 0, "sum_by_list": 0, "from_1": [0.0], "safe_from_1": None}
        else:
            assert g == {
                "max_by_group": ws - 1,
                "sum_by_list": sum(members),
                "from_1": [1.0],
                "safe_from_1": "hello",
            }


@pytest.mark.parametrize("call", ["sync", "sync_group", "barrier_group"])
def test_sync_and_barrier_wait_for_every_rank_of_the_group(
    world: Pool, call: str, tmp_path: Path
) -> None:
    assert _run(world, "sync_waits_case", tmp=str(tmp_path), call=call) == [True] * world.world_size


def test_ignites_sync_temporary_waits_for_nobody(world: Pool) -> None:
    ws = world.world_size
    assert _run(world, "ignite_sync_is_local_case") == [ws] * ws


def test_one_rank_only_waits_for_the_rank_by_default(world: Pool, tmp_path: Path) -> None:
    assert _run(world, "one_rank_only_waits_case", tmp=str(tmp_path)) == [True] * world.world_size


@pytest.mark.parametrize(("shuffle", "drop_last"), [(True, True), (False, False)])
def test_auto_dataloader_of_a_loader_reads_this_ranks_share(
    world: Pool, shuffle: bool, drop_last: bool
) -> None:
    ws, n, batch = world.world_size, 26, 4
    got = _run(world, "loader_share_case", n=n, batch=batch, shuffle=shuffle, drop_last=drop_last)
    x = np.arange(n, dtype=np.int64)
    single = ddp.DataLoader((x,), batch_size=batch, shuffle=shuffle, drop_last=drop_last)
    single.set_epoch(2)
    want = [sorted(xb.numpy().tolist()) for (xb,) in single]
    # Global batch k (every rank's batch k together) is the one-process loader's batch k.
    steps = max(len(g["batches"]) for g in got)
    assert steps == len(want)
    for k in range(steps):
        union = sorted(i for g in got if k < len(g["batches"]) for i in g["batches"][k])
        assert union == want[k], (k, union, want[k])
    if ws > 1:
        for g in got:
            assert f"use {ws} or {2 * ws} (any multiple of {ws})" in g["error"], g["error"]
            assert f"each of the {ws} ranks reads batch_size / {ws}" in g["error"], g["error"]


def test_seed_names_outside_any_group(alone: None) -> None:
    assert (idist.rank(), idist.world_size()) == (0, 1)
    assert B.seed_order_cases() == {}
    idist.sync()
    idist.sync(True)
    idist.barrier([0])
    x = np.arange(5)
    loader = ddp.DataLoader((x,), batch_size=3)
    assert idist.auto_dataloader(loader) is loader
    assert idist.auto_dataloader(loader, batch_size=2).batch_size == 2
    with pytest.raises(TypeError, match="sampler= is for a dataset"):
        idist.auto_dataloader(loader, sampler=ddp.DistributedSampler(5, 1, 0))
    assert not collectives.is_initialized()


# ---------------------------------------------------------------------- spawn and Parallel
def _train_worker(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """The seed's worker: it joins the group itself, and leaves it (unless told not to)."""
    idist.initialize(config.get("backend"))
    out = {
        "rank": rank,
        "of": world_size,
        "seen": [idist.rank(), idist.world_size()],
        "backend": idist.backend(),
        "sum": idist.all_reduce(rank + 1),
    }
    if config.get("finalize", True):
        idist.finalize()
    return out


def _never_joins(rank: int) -> int:
    return idist.world_size()


def _in_group(local_rank: int, asked: str | None) -> list[Any]:
    """A worker of Ignite's spawn or of Parallel that calls initialize() all the same."""
    idist.initialize(asked)
    return [local_rank, idist.world_size(), idist.backend()]


def test_seed_spawn_workers_initialize_themselves(alone: None) -> None:
    got = idist.spawn(_train_worker, args=(2, {"backend": "gloo"}), nprocs=2, join=True)
    assert got == [
        {"rank": r, "of": 2, "seen": [r, 2], "backend": "cpu", "sum": 3} for r in range(2)
    ]
    # Rank threads; no backend named, and one worker leaves the group to spawn.
    got = idist.spawn(_train_worker, (3, {"finalize": False}), 3, backend="threads")
    assert got == [
        {"rank": r, "of": 3, "seen": [r, 3], "backend": "threads", "sum": 6} for r in range(3)
    ]
    assert not collectives.is_initialized()


def test_seed_spawn_with_join_false_returns_a_context_to_join(alone: None) -> None:
    ctx = idist.spawn(_train_worker, args=(2, {}), nprocs=2, join=False)
    assert isinstance(ctx, collectives.SpawnContext) and len(ctx.pids()) == 2
    assert ctx.join(timeout=60)
    assert [r["sum"] for r in ctx.results or []] == [3, 3]


def test_a_seed_worker_that_never_joins_fails_the_job(alone: None) -> None:
    # Both ranks skip initialize(); whichever is reported first is named.
    with pytest.raises(Exception, match=r"rank [01] of 2 returned without joining the group"):
        idist.spawn(_never_joins, nprocs=2, backend="threads")
    assert idist.spawn(_never_joins, nprocs=1, backend="threads") == [1]  # alone is fine


def test_workers_already_in_a_group_may_call_initialize(alone: None) -> None:
    got = idist.spawn("threads", _in_group, (None,), nproc_per_node=2)
    assert got == [[0, 2, "threads"], [1, 2, "threads"]]
    with idist.Parallel("threads", nprocs=2) as parallel:  # the seed's nprocs
        assert parallel.run(_in_group, "threads") == [[0, 2, "threads"], [1, 2, "threads"]]
    with pytest.raises(Exception, match="already in the group its spawner made on backend"):
        idist.spawn("threads", _in_group, ("gloo",), nproc_per_node=2)
    with idist.Parallel(nprocs=2, timeout=30) as parallel:  # no backend: chosen (cpu here)
        assert parallel.run(_in_group, None) == [[0, 2, "cpu"], [1, 2, "cpu"]]


def test_spawn_and_parallel_argument_errors(alone: None) -> None:
    with pytest.raises(TypeError, match="the first argument is the backend"):
        idist.spawn(123, args=(), nprocs=2)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        idist.spawn(_never_joins, nprocs=0)
    with pytest.raises(ValueError, match="join must be True or False"):
        idist.spawn(_never_joins, (), 1, "yes")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="needs join=True"):
        idist.spawn(_never_joins, nprocs=2, join=False, backend="threads")
    with pytest.raises(ValueError, match="two names for the number of ranks"):
        idist.Parallel("gloo", 3, nprocs=2)
    with pytest.raises(ValueError, match=r"Parallel\.run waits for its ranks"):
        idist.Parallel("gloo", nprocs=2, join=False)
    with pytest.raises(ValueError, match="backend None, nproc_per_node must be None"):
        idist.Parallel(nproc_per_node=2)  # Ignite's name keeps Ignite's rule


def _exit_after_spawn(tmp: Path, daemon: bool) -> tuple[list[int], Path]:
    """A script that spawns a sleeping rank with join=False and exits at once."""
    out = tmp / f"daemon-{daemon}.txt"
    code = (
        "import ddp.idist as idist\n"
        "from tests.ddp.idist_bodies import sleeper\n"
        f"ctx = idist.spawn(sleeper, args=({str(out)!r}, 1.5), nprocs=1, join=False, "
        f"daemon={daemon})\n"
        "print(ctx.pids()[0], flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [int(proc.stdout.split()[0])], out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_spawn_daemon_decides_whether_the_ranks_outlive_the_caller(tmp_path: Path) -> None:
    # daemon=False: the caller waits for its ranks at exit, so the rank's file is there.
    _, out = _exit_after_spawn(tmp_path, daemon=False)
    assert out.read_text() == "done"
    # daemon=True: the ranks end with the caller, so the file never comes.
    (pid,), out = _exit_after_spawn(tmp_path, daemon=True)
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"rank {pid} outlived its daemon=True spawner"
    assert not out.exists()
