"""``tl.save`` under crashes: writers SIGKILLed mid-save, a concurrent live writer, and fsync.

A killed writer leaves its temporary file; the next save to the same path removes it (its
name says which process on which host wrote it), never a live writer's. Power loss cannot be
tested, so the fsync order is checked by recording the calls.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import _serialization
from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(120)

_MIB = 2**20
# Saves a 32 MiB array to argv[1] over and over (so a kill lands mid-save soon).
_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorlib as tl
    big = np.random.default_rng(0).standard_normal(8 << 20).astype(np.float32)
    while True:
        tl.save({"w": big}, sys.argv[1])
    """
)
# A writer that stays alive between writing its temporary file and renaming it.
_SLOW_WRITER = textwrap.dedent(
    """
    import os, sys, time
    import tensorlib as tl
    def stall(src, dst):
        open(sys.argv[2], "w").close()
        time.sleep(120)
    os.replace = stall
    tl.save({"w": tl.ones(4)}, sys.argv[1])
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _temps(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith(".tmp-"))


def _start(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _kill_mid_save(path: Path, deadline_s: float = 30.0) -> None:
    """Start a writer and SIGKILL it while its temporary file is being written."""
    proc = _start(_WRITER, str(path))
    try:
        end = time.monotonic() + deadline_s
        before = set(_temps(path.parent))
        while time.monotonic() < end:
            fresh = [p for p in _temps(path.parent) if p not in before]
            if any(p.exists() and p.stat().st_size > _MIB for p in fresh):
                proc.send_signal(signal.SIGKILL)
                return
            time.sleep(0.002)
        raise AssertionError(f"the writer wrote no temporary file within {deadline_s} s")
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_killed_writers_temp_files_are_removed_by_the_next_save(tmp_path: Path) -> None:
    """8 writers SIGKILLed mid-save: the next save to the path removes their temporary files
    and writes a checkpoint that loads."""
    path = tmp_path / "ckpt.npz"
    for _ in range(8):
        _kill_mid_save(path)
    leaked = _temps(tmp_path)
    leaked_bytes = sum(p.stat().st_size for p in leaked)
    assert leaked, "no kill landed mid-save: the test is broken"

    t0 = time.monotonic()
    tl.save({"w": tl.ones(3), "step": 9}, path)
    took = time.monotonic() - t0
    left = _temps(tmp_path)
    assert not left, (
        f"{len(left)} temporary files ({sum(p.stat().st_size for p in left) / _MIB:.0f} MiB) "
        f"left after the next save, of {len(leaked)} ({leaked_bytes / _MIB:.0f} MiB) leaked: "
        f"{[p.name for p in left]}"
    )
    got = tl.load(path)
    assert got["step"] == 9 and np.array_equal(got["w"].numpy(), np.ones(3, np.float32))
    assert took < 5, took


def test_a_live_writers_temp_file_survives_a_concurrent_save(tmp_path: Path) -> None:
    """Another process is saving to the same path right now: its temporary file stays; once
    it is dead, the next save removes it."""
    path, ready = tmp_path / "ckpt.npz", tmp_path / "ready"
    proc = _start(_SLOW_WRITER, str(path), str(ready))
    try:
        end = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < end, "the slow writer never got to its rename"
            assert proc.poll() is None, "the slow writer died"
            time.sleep(0.01)
        theirs = _temps(tmp_path)
        assert len(theirs) == 1, theirs
        tl.save({"step": 1}, path)
        assert theirs[0].exists(), "a save removed a live writer's temporary file"
        assert tl.load(path) == {"step": 1}
    finally:
        proc.kill()
        proc.wait(timeout=10)
    tl.save({"step": 2}, path)
    assert _temps(tmp_path) == []


def test_temp_files_of_other_paths_hosts_and_unknown_writers_are_kept(tmp_path: Path) -> None:
    """Only this path's temporary files by a dead writer on this host go."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=10)
    path = tmp_path / "a.npz"
    own = _serialization._temp_name(path.name, dead.pid)
    assert own.startswith(".tmp-") and str(dead.pid) in own
    other_path = _serialization._temp_name("b.npz", dead.pid)
    other_host = own.replace(_serialization._origin(), "ffffffff")
    legacy = ".tmp-abc123_x.npz"  # the old mkstemp name: its writer is unknown
    for name in (own, other_path, other_host, legacy):
        (tmp_path / name).write_bytes(b"partial")
    tl.save({"step": 1}, path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert own not in names
    assert sorted(names) == sorted(["a.npz", other_path, other_host, legacy])


def test_save_fsyncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.npz"
    events: list[tuple[str, Any]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else st.st_size))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tl.save({"w": tl.ones(1000)}, path)
    kinds = [
        e[0] if e[0] == "replace" else f"fsync {'dir' if e[1] == 'dir' else 'file'}" for e in events
    ]
    assert kinds == ["fsync file", "replace", "fsync dir"], events
    assert events[0][1] == path.stat().st_size  # the file was complete when it was synced
