"""The worker of the cluster tests: a few exact "training" steps with checkpoint and resume.

    python -m collectives.run ... cluster_worker.py OUTDIR STEPS [options]

The job's state is a float64 vector ``w`` of 4 values. Step ``s`` averages a global batch of
4 samples (sample ``i``'s gradient is a small integer vector of ``s`` and ``i``), split across
the ranks (rank r takes samples r, r + W, ...), with one all-reduce, then ``w = w / 2 +
mean / 4``. Every value stays a dyadic rational with few bits, so sums are exact in any order:
the result is bitwise the same at every world size and every split, and equal to
:func:`reference`. Rank 0 saves ``w`` and the step after every step (written under another
name, then renamed), and every rank resumes from that file.

Each rank appends one JSON line per start to ``OUTDIR/starts.jsonl`` (its RANK, WORLD_SIZE,
GROUP_RANK, DPT_RESTART_COUNT, pid) and rank 0 writes ``OUTDIR/final.json`` at the end.

Options (for the failure scenarios):
    --kill NODE:STEP   on round 0, local rank 0 of node NODE SIGKILLs itself at step STEP
    --step-sleep S     sleep S seconds per step (so a test can act while the job runs)
    --hold-below W     at the last step, wait while the world size is below W (to be
                       restarted into a bigger round)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np

SAMPLES = 4


def grad(step: int, sample: int) -> np.ndarray:
    """Sample ``sample``'s gradient at ``step``: small integers."""
    return np.array([((step * 7 + sample * 3 + k * 5) % 11) - 5 for k in range(4)], np.float64)


def update(w: np.ndarray, total: np.ndarray) -> np.ndarray:
    """One step from the summed gradient of the global batch."""
    return w / 2 + (total / SAMPLES) / 4


def reference(steps: int) -> list[float]:
    """What the job ends with, computed in one process."""
    w = np.ones(4)
    for s in range(steps):
        w = update(w, sum((grad(s, i) for i in range(SAMPLES)), np.zeros(4)))
    return w.tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("steps", type=int)
    p.add_argument("--kill", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hold-below", type=int, default=0)
    a = p.parse_args()
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    node, restart = int(env["GROUP_RANK"]), int(env["DPT_RESTART_COUNT"])
    info = {"rank": rank, "world": world, "node": node, "restart": restart, "pid": os.getpid()}
    with open(os.path.join(a.outdir, "starts.jsonl"), "a") as f:
        f.write(json.dumps(info) + "\n")

    import collectives

    collectives.init_process_group(backend="cpu", timeout=20)
    ckpt = os.path.join(a.outdir, "ckpt.json")
    w, start = np.ones(4), 0
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            saved = json.load(f)
        w, start = np.array([float.fromhex(v) for v in saved["w"]]), saved["step"]
    kill_node, kill_step = (int(v) for v in a.kill.split(":")) if a.kill else (-1, -1)
    for s in range(start, a.steps):
        if restart == 0 and node == kill_node and int(env["LOCAL_RANK"]) == 0 and s == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if s == a.steps - 1:
            while world < a.hold_below:
                time.sleep(0.05)  # the launcher ends this round when a node joins
        local = sum((grad(s, i) for i in range(rank, SAMPLES, world)), np.zeros(4))
        collectives.all_reduce(local)  # in place: the sum over the ranks
        w = update(w, local)
        if rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                json.dump({"w": [v.hex() for v in w.tolist()], "step": s + 1}, f)
            os.replace(ckpt + ".tmp", ckpt)
        time.sleep(a.step_sleep)
    if rank == 0:
        with open(os.path.join(a.outdir, "final.json"), "w") as f:
            json.dump({"w": w.tolist(), "world": world, "restart": restart}, f)
    collectives.destroy_process_group()


if __name__ == "__main__":
    main()
