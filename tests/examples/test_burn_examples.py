"""Every example of Burn's distributed computing page (examples/burn/) runs as a script, ends
by itself and prints what the page's code computes.

Each script runs in a subprocess under a hard time limit, as a user would run it: on logical
CPU devices, with any remote server started by the script itself on loopback.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import run_to_end

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "burn"
TIMEOUT_S = 120


def _run(script: str, *args: str) -> str:
    """Run ``examples/burn/<script>`` to its end; its stdout, after checking it exited 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "TENSORLIB_CPU_DEVICES"):
        env.pop(var, None)  # neither launched nor pre-configured: the script decides
    proc = run_to_end([sys.executable, str(EXAMPLES / script), *args], env, TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def _epoch_lines(out: str) -> list[tuple[int, float]]:
    """(epoch, valid accuracy) of each of the learner's per-epoch lines."""
    found = re.finditer(r"^epoch (\d+)/\d+  train loss [\d.]+ acc [\d.]+%  valid loss [\d.]+ "
                        r"acc ([\d.]+)%", out, re.M)  # fmt: skip
    return [(int(m.group(1)), float(m.group(2)) / 100) for m in found]


@pytest.mark.timeout(TIMEOUT_S + 10)
@pytest.mark.parametrize("n", [1, 4])
def test_all_reduce_sums_and_averages_over_the_device_list(n: int) -> None:
    out = _run("all_reduce.py", "--devices", str(n))
    names = ["cpu"] + [f"cpu:{i}" for i in range(1, n)]
    assert f"devices: {', '.join(names)}" in out
    total, mean = n * (n + 1) // 2, (n + 1) / 2
    for name in names:  # every device holds the same result, on its own device
        assert re.search(rf"^{name}: sum {total}  mean {mean:g}  on {name}$", out, re.M), out
    assert "reduced values correct" in out


@pytest.mark.timeout(TIMEOUT_S + 10)
def test_ddp_training_trains_over_two_logical_devices(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the example's digits ship with scikit-learn")
    out = _run("ddp_training.py", "--epochs", "2", "--artifact-dir", str(tmp_path))
    assert "strategy: ExecutionStrategy.ddp([cpu, cpu:1], all_reduce_op=mean)" in out
    epochs = _epoch_lines(out)
    assert [e for e, _ in epochs] == [1, 2], out
    assert epochs[-1][1] >= 0.85, out
    assert "with DDP over 2 device(s)" in out
    assert "model on cpu," in out  # back on the main device
    assert (tmp_path / "checkpoint.npz").is_file()
