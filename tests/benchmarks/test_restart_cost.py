"""The restart-cost benchmark runs: one killed-and-restarted job under collectives.run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.restart_cost import _descendants, one_round

# A child that starts a grandchild, both sleeping: what a hung launcher leaves.
_TREE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
)


@pytest.mark.timeout(90)
def test_one_round_of_our_launcher_measures_a_restart(tmp_path: Path) -> None:
    got = one_round("collectives", 2, tmp_path)
    assert isinstance(got, dict), got  # a failed or hung round comes back as its error line
    # The next attempt starts after the kill, is ready after it starts, within the job's time.
    assert 0 < got["to_start"] < got["to_ready"] < got["job"], got


@pytest.mark.timeout(30)
def test_descendants_finds_the_grandchild_a_hung_job_leaves() -> None:
    child = subprocess.Popen([sys.executable, "-c", _TREE])
    try:
        deadline = time.monotonic() + 10
        while not _descendants(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_descendants(child.pid)) == 1
    finally:
        for pid in _descendants(child.pid):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()
