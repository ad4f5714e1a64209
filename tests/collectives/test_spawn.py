"""``spawn`` and ``Parallel``: real processes, results and tracebacks carried home as JSON.

The functions the ranks run are module-level so the ``spawn`` start method can import them.
Every test has a hard time limit; few processes, since each start costs a Python + NumPy import.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collectives
from collectives import Parallel, SpawnError, spawn

needs_cpu = pytest.mark.skipif(
    "cpu" not in collectives.available_backends(),
    reason="the cpu backend is not available yet",
)


@pytest.fixture(autouse=True)
def _share_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a machine with fewer GPUs than ranks, ranks share them instead of refusing to start.
    monkeypatch.setenv("DPT_ALLOW_SHARED_GPU", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def _write_pid(directory: str, rank: int) -> None:
    tmp = Path(directory) / f"tmp{rank}"
    tmp.write_text(str(os.getpid()))
    tmp.rename(Path(directory) / f"rank{rank}.pid")


def _wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


# ---------------------------------------------------------------------- rank functions
def report_env(rank: int, extra: Any) -> dict[str, Any]:
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    return {"rank": rank, "extra": extra, "env": {k: os.environ[k] for k in keys}}


def not_json(rank: int) -> Any:
    return object() if rank == 0 else rank


def fail_on_rank1(rank: int, directory: str) -> None:
    if rank == 1:
        _wait_for(Path(directory) / "rank0.pid")

        def read_shard() -> None:
            raise ValueError("shard 12 is corrupt")

        read_shard()
    _write_pid(directory, rank)
    time.sleep(60)
    (Path(directory) / f"finished{rank}").touch()


def sigkill_rank1(rank: int, directory: str) -> None:
    if rank == 1:
        _wait_for(Path(directory) / "rank0.pid")
        os.kill(os.getpid(), signal.SIGKILL)
    _write_pid(directory, rank)
    time.sleep(60)


def group_info(rank: int) -> list[Any]:
    return [rank, collectives.get_rank(), collectives.get_world_size(), collectives.get_backend()]


def all_reduce_sum(rank: int, n: int) -> list[float]:
    x = np.arange(n, dtype=np.float64) * (rank + 1)
    collectives.all_reduce(x)
    return x.tolist()


def with_kwargs(local_rank: int, a: int, *, b: int = 0) -> list[int]:
    return [local_rank, a, b, collectives.get_world_size()]


def raise_in_parallel(local_rank: int) -> None:
    raise KeyError(f"no such column on rank {local_rank}")


# ---------------------------------------------------------------------- spawn
@pytest.mark.timeout(60)
def test_spawn_env_and_return_values() -> None:
    results = spawn(report_env, args=((1, "two"),), nprocs=2, init=False)
    assert results is not None and [r["rank"] for r in results] == [0, 1]
    ports = set()
    for rank, res in enumerate(results):
        env = res["env"]
        assert res["extra"] == [1, "two"]  # JSON: tuples come back as lists
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1
    assert "RANK" not in os.environ  # the parent's environment is restored


@pytest.mark.timeout(60)
def test_spawn_non_json_results_give_none() -> None:
    assert spawn(not_json, nprocs=1, init=False) is None


@pytest.mark.timeout(60)
def test_spawn_failure_names_rank_and_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(fail_on_rank1, args=(str(tmp_path),), nprocs=2, init=False, grace_period=2)
    assert time.monotonic() - start < 20
    err = info.value
    text = str(err)
    assert err.rank == 1 and err.exit_code == 1 and err.signal_name is None
    assert err.exc_type == "ValueError"
    assert "rank 1 (of 2) failed first" in text
    assert "ValueError: shard 12 is corrupt" in text
    assert "Traceback (most recent call last)" in text and "in read_shard" in text
    assert "rank 0 terminated by SIGTERM" in text
    assert err.traceback_text is not None and "read_shard()" in err.traceback_text
    assert not list(tmp_path.glob("finished*"))
    assert _gone(int((tmp_path / "rank0.pid").read_text()))


@pytest.mark.timeout(60)
def test_spawn_rank_killed_by_signal(tmp_path: Path) -> None:
    with pytest.raises(SpawnError) as info:
        spawn(sigkill_rank1, args=(str(tmp_path),), nprocs=2, init=False, grace_period=2)
    err = info.value
    assert err.rank == 1 and err.signal_name == "SIGKILL" and err.exit_code == -9
    assert "rank 1 (of 2) failed first: killed by SIGKILL" in str(err)
    assert _gone(int((tmp_path / "rank0.pid").read_text()))


@pytest.mark.timeout(60)
def test_spawn_init_serial() -> None:
    assert spawn(group_info, nprocs=1, backend="serial") == [[0, 0, 1, "serial"]]


@pytest.mark.timeout(60)
@needs_cpu
def test_spawn_all_reduce_cpu() -> None:
    results = spawn(all_reduce_sum, args=(5,), nprocs=2, backend="cpu", timeout=30)
    expected = (np.arange(5) * 3.0).tolist()
    assert results == [expected, expected]


@pytest.mark.timeout(60)
def test_spawn_join_false() -> None:
    ctx = spawn(group_info, nprocs=1, join=False)
    with pytest.raises(RuntimeError, match="after join"):
        _ = ctx.results
    assert len(ctx.pids()) == 1
    deadline = time.monotonic() + 30
    while not ctx.join(timeout=0.2):
        assert time.monotonic() < deadline
    assert ctx.results == [[0, 0, 1, "serial"]]
    assert ctx.join() is True


@pytest.mark.timeout(10)
def test_spawn_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        spawn(group_info, nprocs=0)
    with pytest.raises(ValueError, match="start_method"):
        spawn(group_info, start_method="teleport")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (
            {"grace_period": -1},
            ValueError,
            "spawn: grace_period must be a number of seconds >= 0, got -1",
        ),
        (
            {"grace_period": "x"},
            TypeError,
            "spawn: grace_period must be a number of seconds >= 0, got 'x'",
        ),
        (
            {"args": 5},
            TypeError,
            "spawn: args must be a tuple (or list) of fn's arguments after the rank, got 5",
        ),
        (
            {"timeout": -1},
            ValueError,
            "spawn: timeout must be a positive number of seconds, got -1",
        ),
        ({"timeout": 0}, ValueError, "spawn: timeout must be a positive number of seconds, got 0"),
        (
            {"timeout": "x"},
            TypeError,
            "spawn: timeout must be a positive number of seconds, got 'x'",
        ),
        (
            {"timeout": "x", "backend": "threads"},
            TypeError,
            "spawn: timeout must be a positive number",
        ),
        ({"backend": "nope"}, ValueError, "spawn: unknown backend 'nope'; registered: ["),
        ({"backend": 3}, TypeError, "spawn: backend must be a backend name (str) or None, got 3"),
        ({"master_port": 0}, ValueError, "spawn: master_port must be in 1-65535, got 0"),
        ({"master_port": "x"}, TypeError, "spawn: master_port must be None or an int, got 'x'"),
        ({"join": "no"}, TypeError, "spawn: join must be a bool, got 'no'"),
        ({"init": "yes"}, TypeError, "spawn: init must be a bool, got 'yes'"),
    ],
)
def test_spawn_checks_its_arguments_before_any_rank_starts(
    kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    # A TypeError/ValueError up front naming the argument, not a SpawnError carrying a rank's
    # traceback (or, for some, no error at all).
    with pytest.raises(error) as info:
        spawn(group_info, **kwargs)
    assert fragment in str(info.value)
    assert not isinstance(info.value, SpawnError)


# ---------------------------------------------------------------------- Parallel
@pytest.mark.timeout(30)
def test_parallel_in_process_world_of_one() -> None:
    with Parallel() as p:
        assert p.mode == "serial"
        assert p.run(with_kwargs, 4, b=5) == [0, 4, 5, 1]
        assert collectives.get_backend() == "serial"
    assert not collectives.is_initialized()


@pytest.mark.timeout(30)
def test_parallel_inside_a_launched_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # What `python -m collectives.run --nproc-per-node 1` gives a worker.
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with Parallel(backend="serial") as p:
        assert p.mode == "launched"
        assert p.run(with_kwargs, 1) == [0, 1, 0, 1]
    assert not collectives.is_initialized()


@pytest.mark.timeout(60)
def test_parallel_spawned_one_rank() -> None:
    with Parallel(nproc_per_node=1) as p:
        assert p.mode == "spawn"
        assert p.run(with_kwargs, 2, b=3) == [[0, 2, 3, 1]]


@pytest.mark.timeout(60)
def test_parallel_failure_is_reported() -> None:
    with (
        pytest.raises(SpawnError, match="no such column on rank 0") as info,
        Parallel(nproc_per_node=1) as p,
    ):
        p.run(raise_in_parallel)
    assert info.value.rank == 0 and "raise_in_parallel" in str(info.value)


@pytest.mark.timeout(60)
@needs_cpu
def test_parallel_two_ranks_cpu() -> None:
    with Parallel(backend="cpu", nproc_per_node=2, timeout=30) as p:
        results = p.run(all_reduce_sum, 3)
    assert results == [[0.0, 3.0, 6.0]] * 2


@pytest.mark.timeout(10)
def test_parallel_rejects_bad_use() -> None:
    with pytest.raises(ValueError, match="nproc_per_node"):
        Parallel(nproc_per_node=0)
    with pytest.raises(RuntimeError, match="inside `with Parallel"):
        Parallel().run(with_kwargs, 1)
