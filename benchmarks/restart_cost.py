"""What a restart costs: from the SIGKILL of a rank to the next attempt, ours against torchrun.

    python -m benchmarks.restart_cost                  # 2 ranks, 5 rounds, both launchers
    python -m benchmarks.restart_cost --nproc 3 --rounds 9 --json out.json
    python -m benchmarks.restart_cost --nodes 2 --nproc 1   # 2 simulated nodes, c10d

Each round runs one job with ``--max-restarts 1`` under ``python -m collectives.run`` (cpu
backend) and under ``python -m torch.distributed.run`` (gloo; skipped without PyTorch), in
alternating order so that a shared machine's noise hits both alike. Every rank of the job
(this file, with ``--worker``) prints when it starts, joins its group and finishes a first
all-reduce; on attempt 0 the last rank SIGKILLs itself once that all-reduce is done. Three
figures per launcher, medians over the rounds:

- ``to_start``: the kill to the first line of the next attempt's first rank (the launcher
  noticing, ending the other ranks, and starting new processes);
- ``to_ready``: the kill to the next attempt's first all-reduce done on every rank (plus the
  imports and the rendezvous again);
- ``job``: the whole job's wall time.

A round whose restarted job fails, or hangs (no end within 60 s: it is then killed), is
counted and its last error line printed, not timed.

With ``--nodes N`` each job is N launchers on this machine (simulated nodes) that meet in a
c10d rendezvous on 127.0.0.1 (``--nnodes N --rdzv-backend c10d --rdzv-endpoint``, the same
flags for both launchers); the rank that dies is on the last node to join, and ``to_ready`` is
the time from its death to every node's workers having done their next first all-reduce.

torchrun runs ``--standalone`` (one node) with ``--monitor-interval 0.05`` (how often it polls its
workers; ours polls every 0.05 s too) and ``GLOO_SOCKET_IFNAME=lo`` unless set.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 60.0  # a job not done by then counts as hung (a round takes a few seconds)


def worker(log: str, library: str) -> None:
    """One rank: note the times, join the group, all-reduce, and die on attempt 0's last rank."""
    started = time.time()
    # A start after the kill belongs to the next attempt. (Not TORCHELASTIC_RESTART_COUNT:
    # torchrun keeps it per node, and a node restarted because another node's rank died
    # gets 0 again.)
    attempt = 1 if '"kill"' in (Path(log).read_text() if Path(log).exists() else "") else 0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if library == "torch":
        import datetime

        import torch
        import torch.distributed as dist

        # Ours fails a rendezvous after its group timeout; give gloo a bound too (30 min else).
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        dist.all_reduce(torch.ones(4))
    else:
        import numpy as np

        import collectives

        collectives.init_process_group(backend="cpu", timeout=30)
        collectives.all_reduce(np.ones(4))
    ready = time.time()
    with open(log, "a") as f:  # one short line per write: appends do not interleave
        f.write(json.dumps({"a": attempt, "r": rank, "start": started, "ready": ready}) + "\n")
    if attempt == 0 and rank == world - 1:
        with open(log, "a") as f:
            f.write(json.dumps({"a": 0, "r": rank, "kill": time.time()}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 0:
        time.sleep(60)  # like a rank blocked in a collective: the launcher ends it
    if library == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
    else:
        import collectives

        collectives.destroy_process_group()


def _launch(library: str, nproc: int, log: Path, nodes: int = 1, port: int = 0) -> list[str]:
    """One node's launcher command; with ``nodes`` > 1, a c10d rendezvous at ``port``."""
    if library == "torch":
        launcher = ["-m", "torch.distributed.run", "--max-restarts", "1"]
        launcher += ["--monitor-interval", "0.05"]
    else:
        launcher = ["-m", "collectives.run", "--max-restarts", "1"]
    if nodes == 1:
        launcher += ["--standalone"] if library == "torch" else []
    else:
        launcher += ["--nnodes", str(nodes), "--rdzv-backend", "c10d"]
        launcher += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}"]
        if library == "collectives":
            # torchrun's keep-alive defaults (5 s x 3); our last call waits for nobody here.
            launcher += ["--rdzv-conf", "keep_alive_interval=5,keep_alive_max_attempt=3"]
    me = [str(Path(__file__).resolve()), "--worker", str(log), library]
    return [sys.executable, *launcher, "--nproc-per-node", str(nproc), *me]


def _end_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # workers may sit in other sessions
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def one_round(library: str, nproc: int, tmp: Path, nodes: int = 1) -> dict[str, float] | str:
    """Run one job that is killed once: the three figures of the module docstring, or, when
    the restarted job failed, its last error line. ``nodes`` launchers stand for as many
    nodes (c10d rendezvous on 127.0.0.1); the rank that dies is the last node's last."""
    from collectives.run import free_port

    log = tmp / f"{library}-{time.monotonic_ns()}.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # Gloo picks the interface the hostname resolves to, which a container may not route;
    # loopback is what both jobs use here.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    t0 = time.monotonic()
    procs, errs = [], []
    for node in range(nodes):
        errs.append(tmp / f"{log.stem}.node{node}.err")
        with open(errs[-1], "wb") as err:
            procs.append(
                subprocess.Popen(
                    _launch(library, nproc, log, nodes, port),
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,  # so a hung job is ended with all it started
                )
            )
    deadline = t0 + HANG_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _end_all(procs)
            return f"hung: no end within {HANG_S:g} s"
    job = time.monotonic() - t0
    for proc, err_path in zip(procs, errs, strict=True):
        if proc.returncode != 0:
            stderr = err_path.read_text(errors="replace")
            errors = [ln for ln in stderr.splitlines() if "Error" in ln]
            return f"exit {proc.returncode}: {(errors or ['no error line'])[-1].strip()[:300]}"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kill = next(r["kill"] for r in records if "kill" in r)
    again = [r for r in records if r["a"] == 1 and "start" in r]
    if len(again) != nproc * nodes:
        raise RuntimeError(f"{library}: {len(again)} of {nproc * nodes} ranks ran attempt 1")
    return {
        "to_start": min(r["start"] for r in again) - kill,
        "to_ready": max(r["ready"] for r in again) - kill,
        "job": job,
    }


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc), children before grandchildren."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # The ppid follows the command name, which may hold spaces: split after ")".
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [root]
    while frontier:
        kids = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += kids
        frontier = kids
    return found


def _have_torch() -> bool:
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="simulated nodes: launchers on this machine meeting in a c10d rendezvous",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--worker", nargs=2, metavar=("LOG", "LIBRARY"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return 0
    if a.nproc * a.nodes < 2 or a.rounds < 1 or a.nodes < 1:
        p.error("--nproc x --nodes must be >= 2, --nodes >= 1 and --rounds >= 1")
    libraries = ["collectives", *(["torch"] if _have_torch() else [])]
    runs: dict[str, list[dict[str, float]]] = {lib: [] for lib in libraries}
    failures: dict[str, list[str]] = {lib: [] for lib in libraries}
    with tempfile.TemporaryDirectory(prefix="restart-cost-") as tmp:
        for i in range(a.rounds):
            order = libraries if i % 2 == 0 else libraries[::-1]
            for lib in order:
                result = one_round(lib, a.nproc, Path(tmp), a.nodes)
                if isinstance(result, str):
                    failures[lib].append(result)
                else:
                    runs[lib].append(result)
    names = {"collectives": "collectives.run (cpu)", "torch": "torchrun (gloo)"}
    where = f"{a.nodes} simulated nodes x " if a.nodes > 1 else ""
    print(f"{where}{a.nproc} ranks, {a.rounds} rounds, medians (min-max), seconds:")
    print(f"{'launcher':<24}{'kill->start':>20}{'kill->ready':>20}{'job':>20}")
    summary: dict[str, Any] = {
        "nproc": a.nproc,
        "nodes": a.nodes,
        "rounds": a.rounds,
        "launchers": {},
    }
    for lib, rs in runs.items():
        cells, figs = [], {}
        if not rs:
            print(f"{names[lib]:<24}every round failed")
            continue
        for key in ("to_start", "to_ready", "job"):
            vals = [r[key] for r in rs]
            figs[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            cells.append(f"{figs[key]['median']:.2f} ({min(vals):.2f}-{max(vals):.2f})")
        summary["launchers"][lib] = figs
        print(f"{names[lib]:<24}" + "".join(f"{c:>20}" for c in cells))
    for lib, errs in failures.items():
        summary["launchers"].setdefault(lib, {})["failed_rounds"] = errs
        if errs:
            what = f"{len(errs)} of {a.rounds} restarted jobs failed"
            print(f"{names[lib]}: {what}; last: {errs[-1]}")
    if "torch" not in runs:
        print("torchrun: skipped (PyTorch is not installed; the `parity` extra brings it)")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
