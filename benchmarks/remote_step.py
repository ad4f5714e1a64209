"""Time the digits MLP step locally and on a remote device over loopback, in the same run.

    python -m benchmarks.remote_step                  # a `python -m remote serve` subprocess
    python -m benchmarks.remote_step --steps 300 --json out.json

The model is the one tests/remote trains (64-128-128-10, ReLU, cross-entropy, AdamW,
float64, batch 64). Local and remote steps alternate in rounds (ABAB...) so that noise from
a shared machine hits both; read the ratio of medians. Also printed: round trips per step
(``remote.stats``), records sent per step, and the client's cost per op (issuing 20,000
``a + b`` on remote arrays, which never waits, against the same on NumPy arrays), and where
the time goes: CPU seconds a step in this process (local steps, remote steps) and in the
server process (Linux ``/proc``), so a ratio measured on a busy machine can be read against
the work each side does. Set ``OPENBLAS_NUM_THREADS`` (both processes inherit it) to compare
BLAS thread settings.

Peak memory of a step (``--memory-steps``, after the timing): a local step against a remote
step on a server in this process (``remote.serve``), so that ``tracemalloc`` sees the
server's arrays (NumPy reports its buffers to it) as well as the client's; each figure is the
most a step allocated above what was held when it began (the model, its gradients and the
optimizer's state), the largest of the steps measured. Also the server's own count of the
session's arrays (``Server.stats()["peak_bytes"]``) above what it holds between steps: the
figure ``--max-session-bytes`` is checked against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np

import remote
import tensorlib as tl
import tensorlib.functional as F
from tensorlib import nn, optim

TOKEN = "benchmark-token"


def _data() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
    except ImportError:  # the same shapes without scikit-learn
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((1797, 64)), rng.integers(0, 10, 1797)
    x = (x - x.mean(0)) / (x.std(0) + 1.0)
    return x.astype(np.float64), y.astype(np.int64)


class _Trainer:
    """One model and optimizer on one device; ``step()`` runs and times one step."""

    def __init__(self, device: Any, x: np.ndarray, y: np.ndarray) -> None:
        tl.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        ).to(tl.float64)
        self.model.to(device)
        self.opt = optim.AdamW(self.model.parameters(), lr=1e-3)
        self.device, self.x, self.y = device, x, y
        self.rng = np.random.default_rng(1)

    def step(self) -> tuple[float, float]:
        """One step: (wall seconds, this thread's CPU seconds)."""
        c0, t0 = time.thread_time(), time.perf_counter()
        idx = self.rng.integers(0, len(self.x), 64)
        xb = tl.tensor(self.x[idx], device=self.device)
        yb = tl.tensor(self.y[idx], device=self.device)
        loss = F.cross_entropy(self.model(xb), yb)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        loss.item()  # the step's one wait
        return time.perf_counter() - t0, time.thread_time() - c0


def _start_server(own_session: bool = True) -> tuple[subprocess.Popen[str], str]:
    fd, token_file = tempfile.mkstemp(prefix="remote-token-")
    with os.fdopen(fd, "w") as f:
        f.write(TOKEN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote", "serve", "--device", "cpu", "--token-file", token_file],
        stdout=subprocess.PIPE,
        text=True,
        # Its own session, as a service started on its own is: Linux's autogroup scheduling
        # then gives it its own CPU share instead of splitting this process's with it.
        start_new_session=own_session,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    os.unlink(token_file)
    if not line.startswith("serving"):
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split()[-1]


def _cpu_of(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` used so far, or None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _per_op(dev: tl.Device, n: int = 20_000) -> tuple[float, float]:
    """Microseconds to issue one ``a + b`` (64x128 float64) remotely, and locally."""
    xp = dev.xp
    a, b = xp.asarray(np.ones((64, 128))), xp.asarray(np.ones((64, 128)))
    na, nb = np.ones((64, 128)), np.ones((64, 128))
    dev.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        a + b
    t1 = time.perf_counter()
    dev.synchronize()
    t2 = time.perf_counter()
    for _ in range(n):
        na + nb
    t3 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t3 - t2) / n * 1e6


def _step_peak(trainer: _Trainer, steps: int, sync: Any) -> int:
    """The most bytes one of ``steps`` steps allocated above what was held when it began
    (``tracemalloc``, which must be tracing); ``sync`` waits for the device's work."""
    most = 0
    for _ in range(steps):
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        trainer.step()
        sync()  # a remote step's update runs after its read's reply: include it
        most = max(most, tracemalloc.get_traced_memory()[1] - base)
    return most


def step_memory(x: np.ndarray, y: np.ndarray, steps: int) -> dict[str, int]:
    """Peak bytes a step allocates, locally and on an in-process server (see the doc)."""
    with remote.serve(["cpu"], token=TOKEN) as server:
        dev = remote.devices(server.address, token=TOKEN)[0]
        local, far = _Trainer("cpu", x, y), _Trainer(dev, x, y)
        local.step(), far.step()  # the optimizer's state exists from the first step on
        dev.synchronize()
        held = server.stats()["bytes"]
        tracemalloc.start()
        try:
            local_peak = _step_peak(local, steps, lambda: None)
            remote_peak = _step_peak(far, steps, dev.synchronize)
        finally:
            tracemalloc.stop()
        stats = server.stats()
        remote.close(dev)
    return {
        "local_step_peak_bytes": local_peak,
        "remote_step_peak_bytes": remote_peak,
        "server_held_bytes": held,
        "server_step_peak_bytes": stats["peak_bytes"] - held,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, and return the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200, help="timed steps of each (default 200)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ops", type=int, default=20_000, help="additions timed for the per-op cost")
    p.add_argument(
        "--memory-steps",
        type=int,
        default=5,
        help="steps of each whose peak memory is measured after the timing (0: skip)",
    )
    p.add_argument("--json", help="also write the figures here")
    p.add_argument(
        "--same-session",
        action="store_true",
        help="run the server in this process's session (its CPU share, with autogroup "
        "scheduling, is then shared with this process's)",
    )
    args = p.parse_args(argv)
    proc, address = _start_server(own_session=not args.same_session)
    try:
        dev = remote.devices(address, token=TOKEN)[0]
        x, y = _data()
        local, far = _Trainer("cpu", x, y), _Trainer(dev, x, y)
        for _ in range(args.warmup):
            local.step(), far.step()
        before = remote.stats(dev)
        t_local, t_remote, c_local, c_remote = [], [], 0.0, 0.0
        s0 = _cpu_of(proc.pid)
        for _ in range(args.steps):
            wall, cpu = local.step()
            t_local.append(wall)
            c_local += cpu
            wall, cpu = far.step()
            t_remote.append(wall)
            c_remote += cpu
        s1 = _cpu_of(proc.pid)
        after = remote.stats(dev)
        issue, numpy_op = _per_op(dev, args.ops)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    memory = step_memory(x, y, args.memory_steps) if args.memory_steps > 0 else {}
    ml, mr = statistics.median(t_local) * 1e3, statistics.median(t_remote) * 1e3
    out = {
        "local_ms": ml,
        "remote_ms": mr,
        "ratio": mr / ml,
        "round_trips_per_step": (after["round_trips"] - before["round_trips"]) / args.steps,
        "records_per_step": (after["ops"] - before["ops"]) / args.steps,
        "bytes_sent_per_step": (after["bytes_sent"] - before["bytes_sent"]) / args.steps,
        "client_us_per_op": issue,
        "numpy_us_per_op": numpy_op,
        "local_cpu_ms": c_local / args.steps * 1e3,
        "client_cpu_ms": c_remote / args.steps * 1e3,
        # the server process's CPU over the timed loop, all of it spent on the remote steps
        "server_cpu_ms": None if s0 is None or s1 is None else (s1 - s0) / args.steps * 1e3,
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "server_session": "same" if args.same_session else "own",
        **memory,
    }
    rt, ops, sent = out["round_trips_per_step"], out["records_per_step"], out["bytes_sent_per_step"]
    print(
        f"digits MLP step, median of {args.steps}: local {ml:.2f} ms, remote {mr:.2f} ms, "
        f"ratio {mr / ml:.2f}x (target <= 1.5x)"
    )
    print(f"round trips per step {rt:.2f}, ops per step {ops:.0f}, bytes sent per step {sent:.0f}")
    print(
        f"client cost per op (a + b, 64x128 float64): remote {issue:.2f} us, "
        f"NumPy computing it {numpy_op:.2f} us"
    )
    server = "?" if out["server_cpu_ms"] is None else f"{out['server_cpu_ms']:.2f}"
    print(
        f"CPU ms per step: local {out['local_cpu_ms']:.2f}; remote: client "
        f"{out['client_cpu_ms']:.2f} + server {server} "
        f"(OPENBLAS_NUM_THREADS={out['openblas_threads']})"
    )
    if memory:
        lp, rp = memory["local_step_peak_bytes"], memory["remote_step_peak_bytes"]
        print(
            f"peak memory a step allocates (tracemalloc, max of {args.memory_steps}): local "
            f"{lp / 1e3:.0f} KB, remote (client + in-process server) {rp / 1e3:.0f} KB "
            f"({rp / lp:.2f}x); the server's session arrays: "
            f"{memory['server_step_peak_bytes'] / 1e3:.0f} KB over the "
            f"{memory['server_held_bytes'] / 1e3:.0f} KB held between steps"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
