"""The Ignite-style example (examples/train_ignite_style.py, on ``ddp.idist``) trains to the
same accuracy alone, on ranks ``idist.Parallel`` spawns, under ``collectives.run`` and under
``mpiexec``: every world size sees the same global batches, so the epoch lines match too.

Each run is the script in a subprocess, as a user starts it, under a hard time limit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_to_end

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/train_ignite_style.py"

pytest.importorskip("sklearn", reason="the example's digits ship with scikit-learn")
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # never look launched to the script
    return env


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def _epochs(out: str) -> list[str]:
    lines = re.findall(r"^epoch \d+ .*$", out, re.M)
    assert len(lines) == 2, out  # rank 0 alone logs (one_rank_only)
    return lines


def _accuracy(out: str) -> float:
    found = re.findall(r"final test accuracy: ([\d.]+)%", out)
    assert len(found) == 1, out
    return float(found[0]) / 100


@pytest.fixture(scope="module")
def alone() -> str:
    out = _ok(run_to_end([sys.executable, SCRIPT, "--epochs", "2"], _env(), 100))
    assert "world size 1 (serial backend)" in out
    assert _accuracy(out) >= 0.9, out
    return out


def _same_run(out: str, alone: str, world: str) -> None:
    assert world in out, out
    # Same global batches and initial weights: the same losses and accuracy, up to the
    # rounding of a sum over two ranks instead of one batch (4 digits printed).
    assert abs(_accuracy(out) - _accuracy(alone)) <= 0.005, (out, alone)
    for got, want in zip(_epochs(out), _epochs(alone), strict=True):
        g, w = (float(re.search(r"train loss ([\d.]+)", s).group(1)) for s in (got, want))  # type: ignore[union-attr]
        assert abs(g - w) <= 2e-4, (got, want)


def test_spawned_by_parallel(alone: str) -> None:
    out = _ok(run_to_end([sys.executable, SCRIPT, "--nproc", "2", "--epochs", "2"], _env(), 100))
    _same_run(out, alone, "world size 2 (cpu backend)")


def test_under_the_launcher(alone: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "collectives.run",
        "--nproc-per-node",
        "2",
        SCRIPT,
        "--epochs",
        "2",
    ]
    _same_run(_ok(run_to_end(cmd, _env(), 100)), alone, "world size 2 (cpu backend)")


def test_under_mpiexec(alone: str) -> None:
    from tests.collectives.harness.mpipool import mpi_env, mpi_unavailable_reason, mpiexec_command

    if (reason := mpi_unavailable_reason()) is not None:
        pytest.skip(f"backend mpi: {reason}")
    env = mpi_env()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [*mpiexec_command(2), sys.executable, SCRIPT, "--backend", "mpi", "--epochs", "2"]
    _same_run(_ok(run_to_end(cmd, env, 100)), alone, "world size 2 (mpi backend)")
