"""The rank body of the restart tests: a script for ``python -m collectives.run``, or for spawn.

    python -m collectives.run ... restart_worker.py OUTDIR MODE FAIL_RANK FAIL_ATTEMPTS
    spawn(spawned, args=(OUTDIR, MODE, FAIL_RANK, FAIL_ATTEMPTS), init=False, ...)

Every rank first writes one line ``start <attempt> <rank> <time.time()>`` to stdout (then
``ready ...`` after its first all-reduce, ``kill ...`` just before a SIGKILL), records
what is left of earlier attempts (their ranks' and grandchildren's pids still running, their
segments in /dev/shm, their error-file directories), joins a cpu group and all-reduces, so the
store and shared memory are really used. Then it writes ``a<attempt>-r<rank>.json`` to OUTDIR
and, on a failing attempt (FAIL_ATTEMPTS: a comma list of attempts, or ``all``), rank FAIL_RANK
fails as MODE says while the others wait to be ended:

- ``raise``: raises ``ValueError("planned failure on attempt <k>")``;
- ``exit``: exits with code ``10 + attempt``;
- ``sigkill``: leaves a named segment behind (as a rank killed while setting up does), then
  SIGKILLs itself;
- ``hang``: every rank waits (for a signal to the launcher).

On attempt 0 rank 0 also starts a grandchild that ignores SIGTERM, to be ended with its group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

_NAMES = (
    "DPT_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "DPT_RUN_ID",
    "MASTER_PORT",
    "DPT_ERROR_FILE",
)


def _running(pid: int) -> bool:
    """True when ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _earlier_leftovers(outdir: str, attempt: int) -> dict[str, list[str]]:
    """What this attempt finds of the earlier ones, before it creates anything itself."""
    from collectives.backends.cpu._shm import run_tag

    left: dict[str, list[str]] = {"pids": [], "segments": [], "error_dirs": []}
    shm = os.listdir("/dev/shm")
    for name in sorted(os.listdir(outdir)):
        if not (name.startswith("a") and name.endswith(".json")):
            continue
        with open(os.path.join(outdir, name)) as f:
            rec = json.load(f)
        if rec["attempt"] >= attempt:
            continue
        pids = [rec["pid"], rec["grandchild"]]
        left["pids"] += [str(p) for p in pids if p and _running(p)]
        stem = f"dpt-{run_tag(rec['env']['DPT_RUN_ID'])}-"
        left["segments"] += [n for n in shm if n.startswith(stem)]
        errdir = os.path.dirname(rec["env"]["DPT_ERROR_FILE"])
        if errdir and os.path.isdir(errdir):
            left["error_dirs"].append(errdir)
    return left


def _wait_for_records(outdir: str, attempt: int, world: int) -> None:
    deadline = time.monotonic() + 20
    while not all(
        os.path.exists(os.path.join(outdir, f"a{attempt}-r{r}.json")) for r in range(world)
    ):
        if time.monotonic() > deadline:
            sys.exit("timed out waiting for the other ranks' records")
        time.sleep(0.01)


def run(outdir: str, mode: str, fail_rank: int, fail_attempts: str) -> dict[str, Any]:
    """One rank's attempt, as the module docstring says; returns its record."""
    t0 = time.time()
    attempt = int(os.environ["DPT_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    os.write(1, f"start {attempt} {rank} {t0:.6f}\n".encode())
    import numpy as np

    import collectives
    from collectives.backends.cpu._shm import Segment

    failing = fail_attempts == "all" or str(attempt) in fail_attempts.split(",")
    leftovers = _earlier_leftovers(outdir, attempt)
    collectives.init_process_group(backend="cpu", timeout=20)
    x = np.full(3, rank + 1.0)
    collectives.all_reduce(x)
    os.write(1, f"ready {attempt} {rank} {time.time():.6f}\n".encode())
    with open("/proc/self/maps") as f:
        mapped = sorted({ln.split("/dev/shm/")[1].strip() for ln in f if "/dev/shm/dpt-" in ln})
    grandchild = None
    if attempt == 0 and rank == 0:
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
        grandchild = subprocess.Popen([sys.executable, "-c", code]).pid
    record = {
        "attempt": attempt,
        "rank": rank,
        "pid": os.getpid(),
        "grandchild": grandchild,
        "env": {k: os.environ.get(k, "") for k in _NAMES},
        "sum": x.tolist(),
        "mapped": mapped,
        "leftovers": leftovers,
    }
    tmp = os.path.join(outdir, f".a{attempt}-r{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.rename(tmp, os.path.join(outdir, f"a{attempt}-r{rank}.json"))

    if failing and mode == "hang":
        time.sleep(60)
    if failing and rank == fail_rank:
        # Fail only once every rank has written its record (the launcher ends them at once).
        _wait_for_records(outdir, attempt, collectives.get_world_size())
        if mode == "raise":
            raise ValueError(f"planned failure on attempt {attempt}")
        if mode == "exit":
            sys.exit(10 + attempt)
        if mode == "sigkill":
            seg = Segment.create(4096, "leftover")  # named in /dev/shm, never unlinked
            with open(os.path.join(outdir, f"leftover{attempt}"), "w") as f:
                f.write(seg.name)
            os.write(1, f"kill {attempt} {rank} {time.time():.6f}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)
    if failing:
        time.sleep(60)  # like a rank blocked in a collective: ended by the launcher
    collectives.destroy_process_group()
    return record


def spawned(rank: int, outdir: str, mode: str, fail_rank: int, fail_attempts: str) -> Any:
    """The same body under ``spawn(..., init=False)`` (it joins the group itself)."""
    return run(outdir, mode, fail_rank, fail_attempts)


def parallel_body(local_rank: int, fail_rank: int) -> dict[str, Any]:
    """Under ``Parallel(nproc_per_node=..., max_restarts=...)`` (the group already exists):
    ``fail_rank`` raises on attempt 0; every rank returns its attempt and an all-reduce."""
    import numpy as np

    import collectives

    attempt = int(os.environ["DPT_RESTART_COUNT"])
    x = np.full(2, local_rank + 1.0)
    collectives.all_reduce(x)
    if attempt == 0 and local_rank == fail_rank:
        raise ValueError(f"planned failure on attempt {attempt}")
    return {"attempt": attempt, "sum": x.tolist(), "backend": collectives.get_backend()}


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
