"""What each rank runs in ``test_lifecycle.py``: ``python -m tests.collectives.lifecycle_bodies
CASE [ARGS...]`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by the test.

Each case prints ``EVENT <name> <time.time()>`` lines on stdout for the test to time, and
ends the process the way a user's script would (an uncaught exception, or a normal exit).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

import collectives as C


def event(name: str) -> None:
    print(f"EVENT {name} {time.time():.6f}", flush=True)


def frozen_host(timeout: float) -> None:
    """Rank 0 (the store host) stops itself with SIGSTOP; the others' next all_reduce times
    out, the exception goes uncaught and the process ends (atexit destroys the group)."""
    C.init_process_group(backend="cpu", timeout=timeout)
    C.barrier()
    if C.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # until the test kills it
    time.sleep(0.2)  # rank 0 is stopped by now
    event("collective")
    C.all_reduce(np.ones(4, dtype=np.float32))


def frozen_host_destroy(timeout: float) -> None:
    """As ``frozen_host`` but the script catches the error and calls destroy_process_group()."""
    C.init_process_group(backend="cpu", timeout=timeout)
    C.barrier()
    if C.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    time.sleep(0.2)
    event("collective")
    try:
        C.all_reduce(np.ones(4, dtype=np.float32))
    except Exception as exc:
        event("raised")
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    C.destroy_process_group()
    event("destroyed")


def reinit(rounds: int) -> None:
    """``rounds`` x (init, all_reduce check, destroy) on the same MASTER_PORT."""
    n = int(os.environ["WORLD_SIZE"])
    want = n * (n - 1) / 2
    start = time.monotonic()
    for i in range(rounds):
        C.init_process_group(backend="cpu", timeout=10.0)
        x = np.full(3, float(C.get_rank()), dtype=np.float32)
        C.all_reduce(x)
        if not np.all(x == want):
            raise AssertionError(f"round {i}: all_reduce gave {x}, expected {want}")
        C.destroy_process_group()
    print(json.dumps({"rounds": rounds, "seconds": time.monotonic() - start}), flush=True)


def new_group(spec: str, timeout: float) -> None:
    """``new_group`` with this rank's member list from ``spec`` (JSON: rank -> list), then
    an all_reduce on it; prints what this rank saw."""
    lists = {int(k): v for k, v in json.loads(spec).items()}
    out: dict[str, Any]
    C.init_process_group(backend="cpu", timeout=timeout)
    me = C.get_rank()
    start = time.monotonic()
    try:
        g = C.new_group(lists[me])
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    else:
        out = {"member": g.is_member()}
        if g.is_member():
            x = np.full(2, float(me), dtype=np.float32)
            g.all_reduce(x)
            out.update(rank=g.rank, size=g.size, ranks=list(g.ranks), sum=float(x[0]))
        # The next group still works (the counters agree across ranks).
        h = C.new_group()
        y = np.ones(1, dtype=np.float32)
        h.all_reduce(y)
        out["after"] = float(y[0])
    out["seconds"] = time.monotonic() - start
    print("RESULT " + json.dumps(out), flush=True)
    C.destroy_process_group()


def main() -> None:
    case, *args = sys.argv[1:]
    if case == "frozen_host":
        frozen_host(float(args[0]))
    elif case == "frozen_host_destroy":
        frozen_host_destroy(float(args[0]))
    elif case == "reinit":
        reinit(int(args[0]))
    elif case == "new_group":
        new_group(args[0], float(args[1]))
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main()
