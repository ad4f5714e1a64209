"""Restarts: ``python -m collectives.run --max-restarts N`` and ``spawn(max_restarts=N)``.

Real processes on the cpu backend (a group and an all-reduce in every attempt, so the store
and shared memory are used), the rank body in ``restart_worker.py``. Every launcher run has a
hard deadline (``run_to_end``), every test a time limit.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import collectives
from collectives import Parallel, SpawnError, spawn
from collectives.run import free_port, parse_args
from tests.collectives.harness import leaked_segments, session_run_id
from tests.collectives.restart_worker import parallel_body, spawned
from tests.helpers import run_to_end

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("restart_worker.py")
_ids = itertools.count()

pytestmark = [
    pytest.mark.skipif(
        "cpu" not in collectives.available_backends(), reason="the cpu backend is not available"
    ),
    pytest.mark.slow,  # killed and restarted jobs, end to end
]


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp_path)  # the launcher's error-file directories land here
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _job_id() -> str:
    # The session's prefix: the end-of-session leak check looks at these segments too.
    return f"{session_run_id()}R{next(_ids)}"


def _cmd(out: Path, job: str, *launcher_args: str, worker: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "collectives.run",
        "--run-id",
        job,
        "--grace-period",
        "2",
        *launcher_args,
        str(WORKER),
        str(out),
        *worker,
    ]


def _records(out: Path) -> dict[tuple[int, int], dict[str, Any]]:
    recs = {}
    for p in out.glob("a*-r*.json"):
        rec = json.loads(p.read_text())
        recs[rec["attempt"], rec["rank"]] = rec
    return recs


def _reports(err: str) -> list[str]:
    """The launcher's per-attempt failure reports, in order."""
    head = "collectives.run: job failed"
    parts = err.split("=" * 80)
    return [p for p in parts if head in p]


def _check_attempt(rec: dict[str, Any], world: int, max_restarts: int, job: str) -> None:
    """The attempt's variables, its all-reduce, and its segments' tag."""
    from collectives.backends.cpu._shm import run_tag

    env, attempt = rec["env"], rec["attempt"]
    assert env["DPT_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == str(attempt), env
    assert env["TORCHELASTIC_MAX_RESTARTS"] == str(max_restarts), env
    run_id = job if attempt == 0 else f"{job}.r{attempt}"
    assert env["DPT_RUN_ID"] == run_id
    assert rec["sum"] == [world * (world + 1) / 2] * 3
    # Shared memory was used, and only under this attempt's own tag.
    assert rec["mapped"], rec
    assert all(name.startswith(f"dpt-{run_tag(run_id)}-") for name in rec["mapped"]), rec


# ---------------------------------------------------------------------- the launcher
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("mode", "nproc", "fixed_port"),
    [("raise", 2, False), ("sigkill", 3, True)],
    ids=["raise-2ranks-auto-port", "sigkill-3ranks-given-port"],
)
def test_failed_attempt_is_reported_and_restarted(
    tmp_path: Path, mode: str, nproc: int, fixed_port: bool
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = _job_id()
    fail_rank = nproc - 1
    port_args = ["--master-port", str(free_port())] if fixed_port else []
    cmd = _cmd(
        out,
        job,
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        *port_args,
        worker=(mode, str(fail_rank), "0"),
    )
    res = run_to_end(cmd, _env(tmp_path), timeout=60, cwd=tmp_path)
    err = res.stderr
    assert res.returncode == 0, err
    recs = _records(out)
    assert sorted(recs) == [(a, r) for a in range(2) for r in range(nproc)], sorted(recs)
    for rec in recs.values():
        _check_attempt(rec, nproc, 1, job)
    ports = {recs[a, r]["env"]["MASTER_PORT"] for a in range(2) for r in range(nproc)}
    if fixed_port:
        assert ports == {port_args[1]}  # attempt 1's store rebound the given port
    # Attempt 1 found nothing of attempt 0: processes (the grandchild too), segments (the one
    # the killed rank left named as well), error files.
    for r in range(nproc):
        assert recs[1, r]["leftovers"] == {"pids": [], "segments": [], "error_dirs": []}
    if mode == "sigkill":
        assert (out / "leftover0").exists()
    # One report, for attempt 0, naming the rank and how it failed.
    reports = _reports(err)
    assert len(reports) == 1, err
    report = reports[0]
    assert "job failed (attempt 1 of 2)" in report
    assert f"rank {fail_rank} (of {nproc}; local rank {fail_rank}" in report
    if mode == "raise":
        assert "failed first: exited with code 1" in report
        assert "ValueError: planned failure on attempt 0" in report
        assert f"traceback of rank {fail_rank}" in report and "in run" in report
    else:
        assert "failed first: killed by SIGKILL" in report
    assert "collectives.run: restarting (attempt 2 of 2, DPT_RESTART_COUNT=1)" in report
    assert "start 1 0 " in res.stdout  # attempt 1 ran
    for attempt in range(2):
        assert leaked_segments(job if attempt == 0 else f"{job}.r{attempt}") == []


@pytest.mark.timeout(90)
def test_restarts_exhausted_exit_with_the_last_attempts_code(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = _job_id()
    cmd = _cmd(
        out, job, "--nproc-per-node", "2", "--max-restarts", "2", worker=("exit", "1", "all")
    )
    res = run_to_end(cmd, _env(tmp_path), timeout=60, cwd=tmp_path)
    err = res.stderr
    assert res.returncode == 12, err  # attempt 2's rank 1 exits with 10 + 2
    assert sorted(_records(out)) == [(a, r) for a in range(3) for r in range(2)]
    reports = _reports(err)
    assert len(reports) == 3, err
    for attempt, report in enumerate(reports):
        assert f"job failed (attempt {attempt + 1} of 3)" in report
        assert "rank 1 (of 2; local rank 1" in report
        assert f"failed first: exited with code {10 + attempt}" in report
        assert "rank 0 terminated by SIGTERM" in report
    assert "restarting (attempt 2 of 3, DPT_RESTART_COUNT=1)" in reports[0]
    assert "restarting (attempt 3 of 3, DPT_RESTART_COUNT=2)" in reports[1]
    assert "restarts exhausted (3 attempts ran); collectives.run exits with code 12" in reports[2]
    for attempt in range(3):
        assert leaked_segments(job if attempt == 0 else f"{job}.r{attempt}") == []


@pytest.mark.timeout(90)
def test_sigterm_to_the_launcher_ends_the_job_without_a_restart(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = _job_id()
    cmd = _cmd(out, job, "--nproc-per-node", "2", "--max-restarts", "2", worker=("hang", "1", "0"))
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        end = time.monotonic() + 40
        while len(_records(out)) < 2 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.02)
        assert len(_records(out)) == 2, "attempt 0 did not start"
        proc.send_signal(signal.SIGTERM)
        _, err_bytes = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err_bytes.decode()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "job interrupted (attempt 1 of 3)" in err and "no restart" in err
    assert "restarting" not in err
    assert sorted(_records(out)) == [(0, 0), (0, 1)]
    assert leaked_segments(job) == [] and leaked_segments(f"{job}.r1") == []


# ---------------------------------------------------------------------- arguments
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-restarts", "-1", "t.py"], "expected a number of restarts (an integer >= 0)"),
        (["--max-restarts", "two", "t.py"], "expected a number of restarts (an integer >= 0)"),
        (["--max-restarts", "1.5", "t.py"], "got '1.5'"),
        (
            [
                *("--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29500"),
                *("--max-restarts", "1", "t.py"),
            ],
            "--max-restarts > 0 needs --nnodes 1",
        ),
    ],
)
def test_bad_max_restarts_is_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_max_restarts_parsed() -> None:
    cfg = parse_args(["--max-restarts", "3", "t.py"])
    assert cfg.max_restarts == 3 and not cfg.fixed_port
    cfg = parse_args(["--max_restarts", "0", "--master-port", "29500", "t.py"])
    assert cfg.max_restarts == 0 and cfg.fixed_port and cfg.master_port == 29500


# ---------------------------------------------------------------------- spawn
@pytest.fixture
def _spawn_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("_spawn_env")
@pytest.mark.parametrize(("mode", "fixed_port"), [("raise", False), ("sigkill", True)])
def test_spawn_restarts_a_failed_attempt(
    tmp_path: Path, mode: str, fixed_port: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    port = free_port() if fixed_port else None
    results = spawn(
        spawned,
        args=(str(tmp_path), mode, 1, "0"),
        nprocs=2,
        init=False,
        timeout=20,
        grace_period=2,
        master_port=port,
        max_restarts=1,
    )
    err = capfd.readouterr().err
    assert results is not None and [r["attempt"] for r in results] == [1, 1], err
    job = results[0]["env"]["DPT_RUN_ID"].removesuffix(".r1")
    recs = _records(tmp_path)
    assert sorted(recs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rec in recs.values():
        _check_attempt(rec, 2, 1, job)
    if port is not None:
        assert {rec["env"]["MASTER_PORT"] for rec in recs.values()} == {str(port)}
    for r in range(2):
        assert results[r]["leftovers"] == {"pids": [], "segments": [], "error_dirs": []}
    assert "spawn: job failed (attempt 1 of 2)" in err
    assert "rank 1 (of 2) failed first" in err
    if mode == "raise":
        assert "ValueError: planned failure on attempt 0" in err
    else:
        assert "killed by SIGKILL" in err and (tmp_path / "leftover0").exists()
    assert "spawn: restarting (attempt 2 of 2, DPT_RESTART_COUNT=1)" in err
    assert leaked_segments(job) == [] and leaked_segments(f"{job}.r1") == []


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("_spawn_env")
def test_parallel_passes_max_restarts_to_spawn(capfd: pytest.CaptureFixture[str]) -> None:
    with Parallel(backend="cpu", nproc_per_node=2, timeout=20, max_restarts=1) as p:
        results = p.run(parallel_body, 1)
    err = capfd.readouterr().err
    assert results == [{"attempt": 1, "sum": [3.0, 3.0], "backend": "cpu"}] * 2, err
    assert "ValueError: planned failure on attempt 0" in err
    assert "spawn: restarting (attempt 2 of 2, DPT_RESTART_COUNT=1)" in err


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("_spawn_env")
def test_spawn_restarts_exhausted_raise_the_last_attempts_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SpawnError) as info:
        spawn(
            spawned,
            args=(str(tmp_path), "exit", 1, "all"),
            nprocs=2,
            init=False,
            timeout=20,
            grace_period=2,
            max_restarts=1,
        )
    err = capfd.readouterr().err
    e = info.value
    assert e.attempts == 2 and e.rank == 1 and e.exit_code == 11, str(e)
    assert "restarts exhausted (2 attempts ran)" in str(e)
    assert "rank 1 (of 2) failed first: exited with code 11" in str(e)
    assert "spawn: job failed (attempt 1 of 2)" in err and "exited with code 10" in err
    assert "job failed (attempt 2 of 2)" not in err  # the last attempt's failure is the exception
    assert sorted(_records(tmp_path)) == [(a, r) for a in range(2) for r in range(2)]


@pytest.mark.timeout(10)
def test_spawn_rejects_bad_max_restarts() -> None:
    bad_values: tuple[Any, ...] = (-1, 1.5, True, "2")
    for bad in bad_values:
        with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
            spawn(spawned, nprocs=1, max_restarts=bad)
    with pytest.raises(ValueError, match="max_restarts > 0 needs join=True"):
        spawn(spawned, nprocs=1, join=False, max_restarts=1)  # type: ignore[call-overload]
