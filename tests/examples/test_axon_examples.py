"""Every code example of axonml-distributed's README (examples/axon/) runs as a script, ends by
itself and prints what the README's code computes.

Each script runs in a subprocess under a hard time limit, as a user would run it: as the
README writes it (a mock world of one; four backends for "Multi-Backend Setup"), and with
``--world N``, where N rank threads of one mock world really combine their values. The scripts
check their own values and exit 1 when one is wrong; the tests read what they print.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import run_to_end

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "axon"
TIMEOUT_S = 60
pytestmark = pytest.mark.slow  # end-to-end runs of the scripts


def _run(script: str, *args: str) -> str:
    """Run ``examples/axon/<script>`` to its end; its stdout, after checking it exited 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # not launched: the scripts make their own (mock) worlds
    proc = run_to_end([sys.executable, str(EXAMPLES / script), *args], env, TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def _ranks(out: str, n: int, pattern: str) -> None:
    """Every rank printed a line matching ``pattern`` (after ``rank R: ``), once."""
    for r in range(n):
        found = re.findall(rf"^rank {r}: {pattern}$", out, re.M)
        assert len(found) == 1, f"rank {r}: no single line matching {pattern!r} in\n{out}"


def test_every_readme_example_has_a_script() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "axon_common.py")
    assert scripts == [
        "communication.py",
        "data_parallel_training.py",
        "gradient_bucketing.py",
        "gradient_sync.py",
        "multi_backend.py",
        "subgroups.py",
        "sync_strategy.py",
    ]


@pytest.mark.timeout(2 * TIMEOUT_S + 10)
@pytest.mark.parametrize("n", [1, 3])
def test_communication_primitives(n: int) -> None:
    out = _run("communication.py", "--world", str(n))
    s = n * (n + 1) // 2
    _ranks(out, n, rf"sum \[{s}, {2 * s}, {3 * s}\]  after mean and broadcast \[{s}, {2 * s}, "
                   rf"{3 * s}\]")  # fmt: skip
    for r in range(n):
        assert f"rank {r}: gathered shape [{n}, 3]  rank {r} of {n}  main {r == 0}" in out
    assert out.rstrip().endswith("all values correct")


@pytest.mark.timeout(2 * TIMEOUT_S + 10)
@pytest.mark.parametrize(("n", "mean"), [(1, "1"), (4, "2.5")])
def test_gradient_synchronization(n: int, mean: str) -> None:
    out = _run("gradient_sync.py", "--world", str(n))
    m = float(mean)
    issued = 0 if n == 1 else 1  # both gradients of the list in one bucket
    _ranks(out, n, rf"gradients \[{0.1 * m:.4g}, {0.2 * m:.4g}\], \[{0.3 * m:.4g}, "
                   rf"{0.4 * m:.4g}, {0.5 * m:.4g}\]  grad \[{m:.4g}, {2 * m:.4g}\]  "
                   rf"all-reduces {issued}")  # fmt: skip
    assert out.rstrip().endswith("all values correct")


@pytest.mark.timeout(2 * TIMEOUT_S + 10)
@pytest.mark.parametrize(("n", "mean"), [(1, 1.0), (3, 2.0)])
def test_gradient_bucketing(n: int, mean: float) -> None:
    out = _run("gradient_bucketing.py", "--world", str(n))
    _ranks(out, n, rf"bucket of 5 elements  synced \[{0.1 * mean:.4g}, {0.2 * mean:.4g}\], "
                   rf"\[{0.3 * mean:.4g}, {0.4 * mean:.4g}, {0.5 * mean:.4g}\]  "
                   r"shapes \[\[2\], \[3\]\]")  # fmt: skip
    assert out.rstrip().endswith("all values correct")


@pytest.mark.timeout(2 * TIMEOUT_S + 10)
@pytest.mark.parametrize(("n", "grad", "issued"), [(1, "[1, 2]", 0), (3, "[2, 4]", 1)])
def test_custom_synchronization_strategy(n: int, grad: str, issued: int) -> None:
    out = _run("sync_strategy.py", "--world", str(n))
    _ranks(out, n, rf"grad after sync_all {re.escape(grad)}  all-reduces {issued}")
    assert out.rstrip().endswith("all values correct")


@pytest.mark.timeout(2 * TIMEOUT_S + 10)
@pytest.mark.parametrize("n", [4, 2])
def test_multi_backend_setup(n: int) -> None:
    out = _run("multi_backend.py", "--world", str(n))
    lines = out.splitlines()
    assert lines[:n] == [f"Rank {r} of {n}" for r in range(n)]  # the README's loop
    _ranks(out, n, f"sum of the ranks {n * (n - 1) // 2}")
    assert out.rstrip().endswith("all values correct")


@pytest.mark.timeout(2 * TIMEOUT_S + 10)
def test_process_subgroups() -> None:
    out = _run("subgroups.py")
    assert "subgroup ranks [0, 1]  size 2  contains(0) True  in a world of 1" in out
    assert "its collectives need rank 1: the group with ranks [0, 1] names rank(s) [1]" in out
    out = _run("subgroups.py", "--world", "3")
    _ranks(out, 2, r"in the subgroup \[0, 1\]: sum of its ranks 1")
    assert "rank 2: not in the subgroup [0, 1]" in out
    assert out.rstrip().endswith("all values correct")


@pytest.mark.timeout(2 * TIMEOUT_S + 10)
def test_basic_ddp_training_gives_the_same_loss_at_every_world_size() -> None:
    finals = []
    for n in (1, 4):
        out = _run("data_parallel_training.py", "--world", str(n))
        losses = [float(v) for v in re.findall(r"^rank 0: epoch \d/5  loss ([\d.]+)$", out, re.M)]
        assert len(losses) == 5 and losses == sorted(losses, reverse=True), out
        assert losses[-1] < losses[0] / 5, out  # it learns
        assert f"rank 0: weights identical on all {n} rank(s): True" in out
        finals.append(float(re.findall(r"^final loss ([\d.]+)$", out, re.M)[0]))
    # Four ranks of 16 rows each train as one process on the 64-row batch.
    assert finals[1] == pytest.approx(finals[0], rel=1e-4)
