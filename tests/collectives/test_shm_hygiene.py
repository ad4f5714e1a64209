"""/dev/shm hygiene of the cpu backend, with real processes.

* Ranks SIGKILLed while setting up, outside our launchers (plain env://, as under torchrun or
  SLURM), leave their segments named; the next init on the host removes every segment whose
  creator is dead, and never one whose creator is alive or lives in another pid namespace.
* Two jobs whose run ids share a long prefix: the launcher's cleanup of one leaves the other's
  segments alone.

Every process has a hard deadline, and every test removes what its own processes left.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectives.backends.cpu import _shm
from collectives.run import free_port
from tests.helpers import ROOT, run_to_end

pytestmark = pytest.mark.timeout(60)

SHM = Path(_shm.shm_dir())
_SCRUB = ("DPT_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_")

# A rank of a cpu job started the plain env:// way (no launcher, so no launcher cleanup),
# held at the moment a kill leaks: it created and published its segment and is mapping the
# peers' (every rank unlinks its own once all mapped theirs).
_RANK = textwrap.dedent(
    """
    import time
    import collectives
    from collectives.backends.cpu import _shm
    _shm.Segment.attach = lambda *args, **kwargs: time.sleep(600)
    collectives.init_process_group(backend='cpu', timeout=30)
    """
)
# The next job on the host: a one-rank cpu group, set up and torn down.
_NEXT = textwrap.dedent(
    """
    import collectives
    collectives.init_process_group(backend='cpu', timeout=10)
    collectives.destroy_process_group()
    """
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB)}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        CUDA_VISIBLE_DEVICES="",
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


def _segments_of(pid: int) -> list[Path]:
    """/dev/shm segments whose name says process ``pid`` created them."""
    return [p for p in SHM.iterdir() if p.name.startswith(_shm.PREFIX) and f"-{pid}-" in p.name]


def _bytes(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        try:
            total += p.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    return total


class _Procs:
    """Processes a test started: killed, and their segments removed, at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pids: list[int] = []

    def start(self, code: str, env: dict[str, str], prefix: tuple[str, ...] = ()) -> int:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.procs.append(proc)
        self.pids.append(proc.pid)
        return proc.pid

    def kill(self, pid: int) -> None:
        for p in self.procs:
            if p.pid == pid:
                p.kill()
                p.wait(timeout=10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            if p.stderr is not None:
                p.stderr.close()
        for pid in self.pids:
            for seg in _segments_of(pid):
                seg.unlink(missing_ok=True)


@pytest.fixture
def procs() -> Iterator[_Procs]:
    made = _Procs()
    yield made
    made.close()


def _wait_segment(pid: int, deadline_s: float = 15.0) -> list[Path]:
    """Wait until ``pid`` created its segment and reserved its space (it then waits for peers)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        segs = _segments_of(pid)
        if segs and all(s.stat().st_size > 0 for s in segs):
            time.sleep(0.2)  # it publishes the name and sits in the store wait
            return _segments_of(pid)
        time.sleep(0.02)
    raise AssertionError(f"process {pid} made no shared-memory segment within {deadline_s} s")


def _job(procs: _Procs, **env: str) -> list[int]:
    """Start a two-rank plain env:// job and wait until both ranks hold a named segment."""
    port = str(free_port("127.0.0.1"))
    pids = [
        procs.start(_RANK, _env(RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port, **env))
        for r in (0, 1)
    ]
    for pid in pids:
        _wait_segment(pid)
    return pids


def _next_init(prefix: tuple[str, ...] = ()) -> float:
    """Run the next job on the host (one cpu rank); the seconds it took."""
    t0 = time.monotonic()
    done = run_to_end(
        [*prefix, sys.executable, "-c", _NEXT],
        _env(RANK="0", WORLD_SIZE="1", MASTER_PORT=str(free_port("127.0.0.1"))),
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return time.monotonic() - t0


# ------------------------------------------------------------------ dead creators (item 3)
def test_segments_of_ranks_killed_in_setup_are_swept_by_the_next_init(procs: _Procs) -> None:
    """Every rank of a plain env:// job SIGKILLed while setting up: the next init on the host
    removes their segments; a live job's segment in setup survives it."""
    # Both ranks created and published their segments and are mapping the peer's when the
    # scheduler SIGKILLs the job.
    dead = _job(procs)
    # A live job of the same shape, also still setting up.
    live = _job(procs)
    live_segs = [s for pid in live for s in _segments_of(pid)]
    for pid in dead:
        procs.kill(pid)
    leaked = [s for pid in dead for s in _segments_of(pid)]
    leaked_bytes = _bytes(leaked)
    assert leaked_bytes > 0, "the killed ranks left nothing to sweep: the test is broken"

    took = _next_init()
    left = [s for pid in dead for s in _segments_of(pid)]
    assert not left, (
        f"{_bytes(left) / 2**20:.1f} MiB of /dev/shm left by killed ranks after the next init "
        f"(of {leaked_bytes / 2**20:.1f} MiB leaked): {[s.name for s in left]}"
    )
    assert all(s.exists() for s in live_segs), "the sweep removed a live job's segment"
    assert took < 15, took

    # Once the live job dies too, the next init removes its segment as well.
    for pid in live:
        procs.kill(pid)
    _next_init()
    assert [s for pid in live for s in _segments_of(pid)] == []


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_sweep_in_another_pid_namespace_leaves_live_segments_alone(procs: _Procs) -> None:
    """A container with its own pids but our /dev/shm: our live rank's pid means nothing (or
    another process) there, so its sweep must not remove our segment."""
    unshare = ("unshare", "--pid", "--fork", "--mount-proc")
    if subprocess.run([*unshare, "true"], capture_output=True, timeout=10).returncode != 0:
        pytest.skip("cannot create a pid namespace here (needs root or user namespaces)")
    live_segs = [s for pid in _job(procs) for s in _segments_of(pid)]
    _next_init(unshare)
    assert all(s.exists() for s in live_segs), "a sweep in another pid namespace removed ours"


def _fake(name: str) -> Path:
    path = SHM / name
    path.write_bytes(b"\0" * 4096)
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)
    return proc.pid


def test_sweep_removes_only_dead_creators_of_this_namespace() -> None:
    """The sweep's rules, on names made here: dead creator of our namespace: removed; live
    creator, another namespace or host, a name it cannot read: kept."""
    dead, me, origin = _dead_pid(), os.getpid(), _shm.origin_id()
    assert origin is not None
    run = _shm.run_tag("hygiene_unit")
    made = {
        "dead": _fake(f"{_shm.PREFIX}{run}-g-r0-{dead}-{origin}-0123abcd"),
        "live": _fake(f"{_shm.PREFIX}{run}-g-r1-{me}-{origin}-0123abcd"),
        "other ns": _fake(f"{_shm.PREFIX}{run}-g-r2-{dead}-ffffffff-0123abcd"),
        "old format": _fake(f"{_shm.PREFIX}{run}-g-r3-{dead}-0123abcd"),
        "not ours": _fake(f"{_shm.PREFIX}somebody-else-{dead}-{origin}"),
    }
    try:
        removed = _shm.sweep_dead_segments()
        assert made["dead"].name in removed
        assert not made["dead"].exists()
        for what in ("live", "other ns", "old format", "not ours"):
            assert made[what].exists(), f"the sweep removed a segment it must keep ({what})"
    finally:
        for p in made.values():
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------ run tags (item 4)
def test_run_tags_are_unique_per_job_not_per_prefix() -> None:
    a, b = _shm.run_tag("sweep_lr_0.001_bs64"), _shm.run_tag("sweep_lr_0.001_bs32")
    assert a != b
    assert not a.startswith(b) and not b.startswith(a)
    assert a.startswith("sweep_lr_0_001_b")  # still readable: ls /dev/shm says whose it is
    assert _shm.run_tag("a/b") != _shm.run_tag("a_b")  # sanitizing does not merge ids either


_LEAVE_SEGMENT = textwrap.dedent(
    """
    import os, signal
    from collectives.backends.cpu._shm import Segment
    Segment.create(4096, "g-r0")  # this job's rank dies holding a named segment
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_launcher_cleanup_of_one_job_leaves_a_job_with_a_shared_prefix_alone(
    procs: _Procs, tmp_path: Path
) -> None:
    """Jobs ``sweep_lr_0.001_bs64`` (through ``collectives.run``) and ``sweep_lr_0.001_bs32``
    (a live rank in setup): the launcher's cleanup after the first removes its own rank's
    segment and not the other job's."""
    other = _job(procs, DPT_RUN_ID="sweep_lr_0.001_bs32")
    other_segs = [s for pid in other for s in _segments_of(pid)]
    script = tmp_path / "worker.py"
    script.write_text(_LEAVE_SEGMENT)
    done = run_to_end(
        [sys.executable, "-m", "collectives.run", "--nproc-per-node", "1"]
        + ["--run-id", "sweep_lr_0.001_bs64", str(script)],
        _env(TMPDIR=str(tmp_path)),
        timeout=30,
    )
    assert done.returncode != 0, done.stderr  # its rank was killed
    mine = _shm.run_tag("sweep_lr_0.001_bs64")
    assert [p.name for p in SHM.iterdir() if p.name.startswith(f"{_shm.PREFIX}{mine}-")] == []
    gone = [s.name for s in other_segs if not s.exists()]
    assert not gone, f"cleaning up job sweep_lr_0.001_bs64 removed job ..._bs32's {gone}"
    for pid in other:
        procs.kill(pid)


def test_attaching_a_swept_segment_names_its_dead_creator() -> None:
    """A peer that maps a dead rank's segment after a sweep removed it is told why."""
    dead = _dead_pid()
    name = f"{_shm.PREFIX}{_shm.run_tag('hygiene_unit')}-g-r0-{dead}-{_shm.origin_id()}-0123abcd"
    with pytest.raises(FileNotFoundError, match=f"its creator, pid {dead}, exited or was killed"):
        _shm.Segment.attach(name)
