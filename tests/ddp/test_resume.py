"""Exact resume, with real processes: a rank SIGKILLed at a random step, the job started again, and
the final parameters bitwise equal to an uninterrupted run of the same seed.

The job is ``python -m collectives.run --nproc-per-node W tests/ddp/resume_script.py`` (W = 2
and 3, float64 and float32) with ``--max-restarts 1``: the launcher ends the job when the rank
dies and starts it again with ``DPT_RESTART_COUNT=1``, and the script resumes; each case draws
its kill step from a generator seeded by the case, and the test id says which. One case per
world size kills rank 0 in the middle of writing a checkpoint: the previous checkpoint must
still be there and the resume still exact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import ROOT, run_to_end

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]  # killed and resumed jobs

SCRIPT = "tests/ddp/resume_script.py"
STEPS, EVERY = 30, 4
LAUNCH_TIMEOUT = 60.0  # per attempt; a hang fails the test


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        env.pop(key, None)
    return env


def _command(
    world: int, dtype: str, ckpt: Path, out: Path, *extra: str, restarts: int = 0
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "collectives.run",
        "--nproc-per-node",
        str(world),
        "--max-restarts",
        str(restarts),
        SCRIPT,
        "--dtype",
        dtype,
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
        *extra,
    ]


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-1500:]}\nstderr:\n{proc.stderr[-4000:]}"


_REFERENCES: dict[tuple[int, str], tuple[dict[str, Any], Path]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted run's final parameters (and final checkpoint) per (world, dtype)."""

    def get(world: int, dtype: str) -> tuple[dict[str, Any], Path]:
        key = (world, dtype)
        if key not in _REFERENCES:
            d = tmp_path_factory.mktemp(f"ref-w{world}-{dtype}")
            cmd = _command(world, dtype, d / "ckpt.npz", d / "final.npz")
            proc = run_to_end(cmd, _env(), LAUNCH_TIMEOUT)
            assert proc.returncode == 0, _report(proc)
            with np.load(d / "final.npz") as f:
                _REFERENCES[key] = ({k: f[k] for k in f.files}, d / "ckpt.npz")
        return _REFERENCES[key]

    return get


def _case(world: int, dtype: str, in_save: bool) -> Any:
    """One case with its kill step (and rank) drawn from a generator seeded by the case."""
    rng = random.Random(f"resume-{world}-{dtype}-{in_save}")
    if in_save:  # rank 0, inside a checkpoint that has a predecessor
        step, rank = rng.randrange(2 * EVERY, STEPS, EVERY), 0
        name = f"w{world}-{dtype}-kill-rank0-in-save-at-step{step}"
    else:
        step, rank = rng.randrange(2, STEPS), rng.randrange(1, world)  # not the store's host
        name = f"w{world}-{dtype}-kill-rank{rank}-at-step{step}"
    return pytest.param(world, dtype, in_save, step, rank, id=name)


CASES = [
    _case(2, "float64", False),
    _case(2, "float32", True),
    _case(3, "float32", False),
    _case(3, "float64", True),
]


@pytest.mark.parametrize(("world", "dtype", "in_save", "kill_step", "kill_rank"), CASES)
def test_killed_and_restarted_run_equals_the_uninterrupted_one(
    reference: Any,
    tmp_path: Path,
    world: int,
    dtype: str,
    in_save: bool,
    kill_step: int,
    kill_rank: int,
) -> None:
    expected, stale = reference(world, dtype)
    ckpt, out, times = tmp_path / "ckpt.npz", tmp_path / "final.npz", tmp_path / "times.jsonl"
    # A finished run's checkpoint at the same path: a fresh attempt must not resume it.
    shutil.copy(stale, ckpt)
    kill = ["--kill-step", str(kill_step), "--kill-rank", str(kill_rank), "--times", str(times)]
    extra = [*kill, *(["--kill-in-save"] if in_save else [])]
    cmd = _command(world, dtype, ckpt, out, *extra, restarts=1)
    what = f"world {world}, {dtype}, rank {kill_rank} killed at step {kill_step}"

    proc = run_to_end(cmd, _env(), 2 * LAUNCH_TIMEOUT)
    err = proc.stderr
    assert proc.returncode == 0, f"{what}: the restarted job failed\n{_report(proc)}"
    # Attempt 0 was killed, reported and restarted once.
    assert "job failed (attempt 1 of 2)" in err, f"{what}: no kill\n{_report(proc)}"
    assert f"rank {kill_rank} (of {world}" in err and "SIGKILL" in err, _report(proc)
    assert "restarting (attempt 2 of 2, DPT_RESTART_COUNT=1)" in err, _report(proc)
    assert "job failed (attempt 2 of 2)" not in err, _report(proc)
    notes = [json.loads(line) for line in times.read_text().splitlines()]
    killed = next(n for n in notes if n["what"] == "kill")
    resumed = next(n for n in notes if n["what"] == "first_step")
    # What the killed attempt left on disk: the last completed checkpoint (a kill inside a
    # write leaves the one before); the restarted attempt's first step is the one after it.
    last_saved = kill_step - EVERY if in_save else (kill_step - 1) // EVERY * EVERY
    assert resumed["step"] == last_saved + 1, f"{what}: resumed at {resumed}, not {last_saved}"
    with np.load(out) as f:
        got = {k: f[k] for k in f.files}
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        assert np.array_equal(got[name], value), (
            f"{what}: {name} differs from the uninterrupted run after resuming at step "
            f"{last_saved}: max |diff| {np.abs(got[name] - value).max()}"
        )
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")]

    recomputed = killed["step"] - last_saved
    print(
        f"\n{what}: {recomputed} step(s) recomputed (done {killed['step']}, resumed from step "
        f"{last_saved}); kill -> first step of the next attempt "
        f"{resumed['t'] - killed['t']:.2f} s"
    )
