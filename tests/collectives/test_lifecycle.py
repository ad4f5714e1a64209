"""The process group's life cycle under faults: leaving a frozen store host, init -> destroy ->
init in a loop on one port, and ``new_group`` member lists that differ across ranks.

Every rank is a real process (``tests/collectives/lifecycle_bodies.py``) started with the
environment a launcher gives; each has a hard time limit, and no /dev/shm segment of a test
may survive it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO, Any

import pytest

from collectives.run import free_port
from tests.collectives.harness import leaked_segments, session_run_id
from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(120)

_counter = 0


class Job:
    """``world_size`` ranks of one case, with their output in temporary files."""

    def __init__(self, world_size: int, case: list[str], env: dict[str, str] | None = None):
        global _counter
        _counter += 1
        self.run_id = f"{session_run_id()}L{_counter}"
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.out: list[IO[bytes]] = []
        self.err: list[IO[bytes]] = []
        self.ended: dict[int, float] = {}
        base = dict(os.environ)
        base.update(
            PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            PYTHONDONTWRITEBYTECODE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            DPT_RUN_ID=self.run_id,
            **(env or {}),
        )
        self.started = time.time()
        for rank in range(world_size):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            out = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the job
            err = tempfile.TemporaryFile()  # noqa: SIM115
            cmd = [sys.executable, "-m", "tests.collectives.lifecycle_bodies", *case]
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=out, stderr=err))
            self.out.append(out)
            self.err.append(err)

    def wait(self, ranks: list[int], deadline: float) -> None:
        """Wait until ``ranks`` ended (noting when), failing after ``deadline`` seconds."""
        end = time.monotonic() + deadline
        while True:
            for r in ranks:
                if r not in self.ended and self.procs[r].poll() is not None:
                    self.ended[r] = time.time()
            if all(r in self.ended for r in ranks):
                return
            if time.monotonic() > end:
                left = [r for r in ranks if r not in self.ended]
                pytest.fail(f"ranks {left} still running after {deadline:g} s:\n{self.report()}")
            time.sleep(0.02)

    def text(self, rank: int, which: str = "out") -> str:
        f = (self.out if which == "out" else self.err)[rank]
        f.seek(0)
        return f.read().decode(errors="replace")

    def events(self, rank: int) -> dict[str, float]:
        got = {}
        for line in self.text(rank).splitlines():
            if line.startswith("EVENT "):
                _, name, t = line.split()
                got[name] = float(t)
        return got

    def result(self, rank: int) -> dict[str, Any]:
        for line in self.text(rank).splitlines():
            if line.startswith("RESULT "):
                return dict(json.loads(line[len("RESULT ") :]))
        pytest.fail(f"rank {rank} printed no result:\n{self.report()}")

    def report(self) -> str:
        parts = []
        for r, p in enumerate(self.procs):
            parts.append(
                f"--- rank {r} (returncode {p.returncode}) stdout:\n{self.text(r)[-3000:]}\n"
                f"--- rank {r} stderr:\n{self.text(r, 'err')[-3000:]}"
            )
        return "\n".join(parts)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(10)
        for f in self.out + self.err:
            f.close()


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    made: list[Job] = []
    yield made
    for j in made:
        j.kill()
    time.sleep(0.05)
    leaked = [name for j in made for name in leaked_segments(j.run_id)]
    assert not leaked, f"shared-memory segments left behind: {leaked}"


def start(jobs: list[Job], world_size: int, *case: str, **kw: Any) -> Job:
    job = Job(world_size, list(case), **kw)
    jobs.append(job)
    return job


# ------------------------------------------------------------------ (1) a frozen store host
# Three ranks: two peers wait on the frozen host at once (two ranks added nothing but 8 s).
@pytest.mark.slow  # waits out the store timeout
@pytest.mark.parametrize("world_size", [3])
def test_peers_of_a_frozen_store_host_end_soon_after_their_timeout(
    jobs: list[Job], world_size: int
) -> None:
    timeout = 5.0  # T: the leave used to take another T (2T = 10 s > T + 4)
    job = start(jobs, world_size, "frozen_host", str(timeout))
    peers = list(range(1, world_size))
    job.wait(peers, deadline=timeout + 60)
    for r in peers:
        began = job.events(r).get("collective")
        assert began is not None, job.report()
        took = job.ended[r] - began
        err = job.text(r, "err")
        assert "CollectiveTimeoutError" in err and "timed out after 5 s" in err, job.report()
        # It raised at the timeout and leaving the (frozen) store took a short deadline of its
        # own, not another group timeout.
        assert timeout - 0.5 < took < timeout + 4, f"rank {r} ended {took:.1f} s after the call"
        print(f"rank {r} ended {took:.2f} s after its all_reduce began (T = {timeout:g} s)")
        assert job.procs[r].returncode == 1


@pytest.mark.slow  # waits out the store timeout
def test_destroy_with_a_frozen_store_host_is_bounded(jobs: list[Job]) -> None:
    timeout = 3.0
    job = start(jobs, 2, "frozen_host_destroy", str(timeout))
    job.wait([1], deadline=timeout + 60)
    ev = job.events(1)
    assert "destroyed" in ev, job.report()
    assert ev["destroyed"] - ev["raised"] < 3.0, job.report()
    assert job.ended[1] - ev["collective"] < timeout + 5, job.report()
    assert job.procs[1].returncode == 0, job.report()
    print(f"destroy took {ev['destroyed'] - ev['raised']:.2f} s after the timeout error")


# ------------------------------------------------------------------ (5) init -> destroy -> init
@pytest.mark.parametrize("world_size,rounds", [(2, 30), (3, 30), (4, 100)])
def test_reinit_on_the_same_port_in_a_loop(jobs: list[Job], world_size: int, rounds: int) -> None:
    job = start(jobs, world_size, "reinit", str(rounds))
    job.wait(list(range(world_size)), deadline=90)
    codes = [p.returncode for p in job.procs]
    assert codes == [0] * world_size, job.report()
    for r in range(world_size):
        assert f'"rounds": {rounds}' in job.text(r), job.report()
    print(job.text(0).strip())


# ------------------------------------------------------------------ (8) new_group member lists
def _new_group(
    jobs: list[Job], lists: dict[int, list[int]], timeout: float
) -> list[dict[str, Any]]:
    n = len(lists)
    job = start(jobs, n, "new_group", json.dumps(lists), str(timeout))
    job.wait(list(range(n)), deadline=timeout + 60)
    assert [p.returncode for p in job.procs] == [0] * n, job.report()
    return [job.result(r) for r in range(n)]


def test_new_group_lists_are_sets_ordered_by_rank(jobs: list[Job]) -> None:
    got = _new_group(jobs, {0: [0, 1], 1: [1, 0]}, timeout=20)
    for r, out in enumerate(got):
        assert out["member"] and out["ranks"] == [0, 1] and out["rank"] == r, got
        assert out["sum"] == 1.0 and out["after"] == 2.0, got
        assert out["seconds"] < 5, got


def test_new_group_in_any_order_with_a_non_member(jobs: list[Job]) -> None:
    got = _new_group(jobs, {0: [2, 0], 1: [0, 2], 2: [0, 2]}, timeout=20)
    assert got[1]["member"] is False and got[1]["after"] == 3.0, got
    for r in (0, 2):
        assert got[r]["ranks"] == [0, 2] and got[r]["rank"] == r // 2, got
        assert got[r]["sum"] == 2.0 and got[r]["after"] == 3.0, got


@pytest.mark.parametrize(
    "lists,shown",
    [
        (
            {0: [0, 1], 1: [0, 1, 2], 2: [2, 1, 0]},
            "rank 0 passed [0, 1] (backend 'cpu'); ranks [1, 2] passed [0, 1, 2] (backend 'cpu')",
        ),
        # rank 2 thinks it is a member; the others make a group without it
        (
            {0: [0, 1], 1: [1, 0], 2: [0, 2]},
            "ranks [0, 1] passed [0, 1] (backend 'cpu'); rank 2 passed [0, 2] (backend 'cpu')",
        ),
    ],
    ids=["a_subset", "a_non_member_thinks_it_is_one"],
)
def test_new_group_lists_that_differ_fail_every_rank_at_once(
    jobs: list[Job], lists: dict[int, list[int]], shown: str
) -> None:
    got = _new_group(jobs, lists, timeout=20)
    for r, out in enumerate(got):
        assert out.get("error") == "CollectiveMismatchError", got
        assert out["message"].startswith(f"[rank {r}] new_group #1: "), out
        assert shown in out["message"], out
        assert out["seconds"] < 5, got
