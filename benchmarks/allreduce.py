"""allreduce-bench: collective throughput in the nccl-tests format, with peers side by side.

    allreduce-bench --nproc 2 -b 4K -e 256M --compare gloo,mpi4py  # own ranks on this host
    allreduce-bench --nproc 2 --zero-copy --op all_gather --json out.json --plot out.png
    python -m collectives.run --nproc 4 -m benchmarks.allreduce -b 1M -e 1G   # inside ranks
    allreduce-bench --nproc 2 --backend mpi --compare cpu,mpi-nb,mpi4py        # via mpiexec
    allreduce-bench --nproc 2 --backend threads --compare cpu -b 64K -e 64M    # rank threads
    mpirun -n 4 allreduce-bench --backend mpi                                  # inside ranks

Without ``--nproc`` inside ranks started by ``collectives.run``, torchrun, SLURM or mpirun
(RANK/WORLD_SIZE, SLURM_PROCID or OMPI_COMM_WORLD_RANK set) it runs in those ranks; otherwise
it starts ``--nproc`` (default 2) fresh ranks per engine. Per size: ``--warmup-iters``
untimed calls, then ``--blocks`` timed blocks of ``--iters`` calls, each block after a
barrier; a block's time is the slowest rank's; the figure is the median block divided by its
calls (``--async``: a block issues every call, then waits; ``--busy-main``: each call async
while rank 0's main thread runs pure Python until it completed, beside the same calls with
rank 0 idle). algbw = size / time; busbw = algbw * factor (all_reduce 2(n-1)/n, all_gather
and reduce_scatter (n-1)/n, broadcast and reduce 1): what each rank's link carries,
comparable across world sizes and with the hardware's bandwidth. ``--check`` then runs each
collective on data that differs per rank and per iteration (never zeros) and counts wrong
elements (#wrong, summed over ranks). Each row gives its share of the limit at that size:
one in-place pass over the buffer per rank (read and write every byte), all ranks at once,
warm as the collective touches it (on GPU a device-to-device copy), timed in the same ranks
right after it. Exit status: 0, 1 when any element was wrong, 2 for impossible requests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._bench_engines import (
    ENGINES,
    MPIEXEC_ENGINES,
    UsageError,
    availability,
    find_mpiexec,
)
from benchmarks._bench_math import OPS, parse_size
from benchmarks._bench_report import report, rounding_notes
from benchmarks._bench_sweep import worker

ROOT = Path(__file__).resolve().parents[1]
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")


# ---------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="allreduce-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc",
        type=int,
        help="start this many ranks here (default 2, or the launcher's ranks when started by one)",
    )
    p.add_argument("--backend", choices=("cpu", "nccl", "mpi", "threads", "auto"), default="auto")
    p.add_argument("--op", choices=OPS, default="all_reduce")
    p.add_argument("-b", "--min-bytes", type=parse_size, default=4 << 10)
    p.add_argument("-e", "--max-bytes", type=parse_size, default=256 << 20)
    p.add_argument("-f", "--step-factor", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reduce-op", choices=REDUCE_OPS, default="sum")
    p.add_argument("--iters", type=int, default=0, help="calls per timed block (0: by size)")
    p.add_argument("--warmup-iters", type=int, default=5)
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per size (median)")
    p.add_argument(
        "--async",
        dest="async_op",
        action="store_true",
        help="issue every call of a block, then wait",
    )
    p.add_argument(
        "--busy-main",
        action="store_true",
        help="each call async while rank 0's main thread runs Python until it completed, "
        "beside the same calls with rank 0 waiting idly (busy/idle column)",
    )
    p.add_argument(
        "--bind-cores",
        action="store_true",
        help="bind each rank of every engine to a core of its own once joined (local rank r "
        "to the r-th allowed core, as mpiexec binds its ranks by default)",
    )
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.add_argument(
        "--compare",
        default="",
        help="peers, comma separated: gloo,mpi4py (others'), cpu,cpu-zc,cpu-py,mpi,mpi-nb (ours)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--zero-copy", action="store_true", help="cpu: buffers from group.alloc")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def validate(args: argparse.Namespace) -> None:
    """Raise UsageError for requests that cannot be served."""
    try:
        dt = np.dtype(args.dtype)
    except TypeError:
        raise UsageError(f"unknown --dtype {args.dtype!r}") from None
    args.dtype = str(dt)
    if args.min_bytes > args.max_bytes:
        raise UsageError(f"-b {args.min_bytes} is larger than -e {args.max_bytes}")
    if args.step_factor < 1 or args.blocks < 1 or args.warmup_iters < 0 or args.iters < 0:
        raise UsageError("-f and --blocks must be >= 1, --iters and --warmup-iters >= 0")
    if args.reduce_op == "avg" and dt.kind != "f":
        raise UsageError("--reduce-op avg needs a floating --dtype")
    if args.nproc is not None and args.nproc < 1:
        raise UsageError("--nproc must be >= 1")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib, which is not installed: pip install 'dpt[plot]'"
            ) from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``allreduce-bench``."""
    args = parser().parse_args(argv)
    try:
        validate(args)
        if args.worker:  # one rank started by launch() (threads: one process, N rank threads)
            res = threads_worker(args) if args.worker == "threads" else worker(args.worker, args)
            if res["rank"] == 0 and args.out:
                Path(args.out).write_text(json.dumps(res))
            return 0
        return coordinate(args)
    except UsageError as e:
        print(f"allreduce-bench: {e}", file=sys.stderr)
        return 2


def coordinate(args: argparse.Namespace) -> int:
    """Pick the engines, run them (here or in fresh ranks), print the report."""
    ours = choose_engine(args)
    why = availability(ours, args.device)
    if why is not None:
        # One line, even when the probe lists every path it tried on lines of its own.
        reason = " ".join(part.strip() for part in why.splitlines() if part.strip())
        raise UsageError(f"--backend {args.backend} ({ours}) cannot run here: {reason}")
    peers = [p.strip() for p in args.compare.split(",") if p.strip() and p.strip() != ours]
    for p in peers:
        if p not in ENGINES:
            raise UsageError(f"--compare: unknown peer {p!r} (choose from {', '.join(ENGINES)})")
    itemsize = np.dtype(args.dtype).itemsize
    if in_ranks() and args.nproc is None:
        if peers:
            raise UsageError("--compare needs --nproc (each peer runs in its own fresh ranks)")
        res = worker(ours, args)
        n = res["world"]
        if res["rank"] != 0:
            return 0
        return report({ours: res}, {}, ours, args, n, rounding_notes(args, n, itemsize))
    n = args.nproc or 2
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for eng in [ours, *peers]:
            why = availability(eng, args.device)
            if why is None:
                print(f"running {eng} at {n} ranks ...", file=sys.stderr, flush=True)
                out = os.path.join(tmp, f"{eng}.json")
                why = launch(eng, args.__class__(**{**vars(args), "nproc": n}), out, tmp)
                if why is None:
                    results[eng] = json.loads(Path(out).read_text())
            if why is not None:
                if eng == ours:
                    raise UsageError(f"{eng} failed: {why}")
                skipped[eng] = why.strip().splitlines()[-1] if why.strip() else why
    return report(results, skipped, ours, args, n, rounding_notes(args, n, itemsize))


def threads_worker(args: argparse.Namespace) -> dict[str, Any]:
    """``--nproc`` rank threads of this process (the threads backend) run the sweep; rank 0's
    result."""
    import collectives as C

    got = C.spawn(
        lambda rank: worker("threads", args),
        nprocs=args.nproc or 2,
        backend="threads",
        init=False,  # the engine joins, as the process engines do
        timeout=600,
    )
    assert got is not None
    return dict(got[0])


def in_ranks() -> bool:
    """Whether a launcher started this process as one rank of a job."""
    e = os.environ
    return ("RANK" in e and "WORLD_SIZE" in e) or "OMPI_COMM_WORLD_RANK" in e or "PMI_RANK" in e


def choose_engine(args: argparse.Namespace) -> str:
    """The engine for ``--backend`` (and ``--zero-copy``, ``--device``)."""
    backend = args.backend
    if backend == "auto":
        gpu = args.device == "cuda" or availability("nccl", "cuda") is None
        backend = "nccl" if gpu else "cpu"
    if backend == "nccl" and args.zero_copy:
        raise UsageError("--zero-copy applies to the cpu backend only")
    if backend == "cpu":
        return "cpu-zc" if args.zero_copy else "cpu"
    return backend


# ---------------------------------------------------------------------------- launching
def _worker_argv(engine: str, args: argparse.Namespace, out: str) -> list[str]:
    argv = ["-m", "benchmarks.allreduce", "--worker", engine, "--out", out, "--op", args.op]
    argv += ["-b", str(args.min_bytes), "-e", str(args.max_bytes), "-f", str(args.step_factor)]
    argv += ["--dtype", args.dtype, "--reduce-op", args.reduce_op, "--device", args.device]
    argv += ["--iters", str(args.iters), "--warmup-iters", str(args.warmup_iters)]
    argv += ["--blocks", str(args.blocks), "--check" if args.check else "--no-check"]
    argv += ["--busy-main"] if args.busy_main else []
    argv += ["--bind-cores"] if args.bind_cores else []
    return argv + (["--async"] if args.async_op else [])


def oversubscribe_args(mpiexec: str) -> list[str]:
    """Open MPI needs ``--oversubscribe`` for more ranks than cores; MPICH's Hydra has no such
    option (and needs none)."""
    try:
        text = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    return [] if "HYDRA" in text.upper() else ["--oversubscribe"]


def launch(engine: str, args: argparse.Namespace, out: str, tmp: str) -> str | None:
    """Run one engine's ranks; None on success, else why it could not run."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        env.pop(var, None)
    if engine == "cpu-py":
        env["DPT_CPU_NATIVE"] = "0"  # the cpu backend without its compiled helper
    argv = _worker_argv(engine, args, out)
    if engine in MPIEXEC_ENGINES:
        return _launch_mpiexec(engine, args.nproc, argv, env, tmp)
    if engine == "threads":  # one process, its threads the ranks
        return _launch_local(engine, 1, [*argv, "--nproc", str(args.nproc)], env, tmp)
    return _launch_local(engine, args.nproc, argv, env, tmp)


def _launch_mpiexec(
    engine: str, nproc: int, argv: list[str], env: dict[str, str], tmp: str
) -> str | None:
    """``nproc`` ranks of ``argv`` under mpiexec; None on success, else why not."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        return "mpiexec not found (pip install 'dpt[mpi]')"
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # Open MPI names its session directory for mpiexec's pid and leaves it behind when killed;
    # a later mpiexec given the same pid then fails ("PMIx server's listener thread failed to
    # start"). A directory of this run's own keeps every launch clear of stale ones.
    env["TMPDIR"] = tempfile.mkdtemp(prefix=f"mpiexec-{engine}-", dir=tmp)
    if engine in ("mpi", "mpi-nb"):
        env["DPT_MPI_ENGINE"] = "nonblocking" if engine == "mpi-nb" else "blocking"
    cmd = [mpiexec, "-n", str(nproc), *oversubscribe_args(mpiexec), sys.executable, *argv]
    p = subprocess.run(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=3600,
        check=False,
    )
    return None if p.returncode == 0 else f"mpiexec exited {p.returncode}: {p.stderr[-800:]}"


def _launch_local(
    engine: str, nproc: int, argv: list[str], env: dict[str, str], tmp: str
) -> str | None:
    """``nproc`` ranks of ``argv`` as processes here, joined through the launcher's
    environment variables; None on success, else the first failed rank and its log's tail."""
    from collectives.run import free_port

    port = free_port()
    procs, logs = [], []
    for r in range(nproc):
        e = dict(
            env,
            RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        # Rank 0's stderr stays live (progress); the others' goes to a file for error reports.
        log = None if r == 0 else open(os.path.join(tmp, f"{engine}.rank{r}.log"), "w+")  # noqa: SIM115
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv], env=e, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log
            )
        )
    codes = _wait_all_or_first_failure(procs)
    why = None
    # Ranks killed above (-SIGKILL) come after the rank that failed by itself.
    order = sorted(range(nproc), key=lambda r: codes[r] == -signal.SIGKILL)
    for r in order:
        code, log = codes[r], logs[r]
        if code != 0 and why is None:
            tail = ""
            if log is not None:
                log.seek(0)
                tail = log.read()[-800:]
            why = f"rank {r} exited {code}" + (f": {tail}" if tail else " (see above)")
    for log in logs:
        if log is not None:
            log.close()
    return why


def _wait_all_or_first_failure(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Every rank's exit code. When one fails, the rest are killed rather than waited on:
    they would block on the failed rank (its store, its collectives) until their timeouts."""
    deadline = time.monotonic() + 3600
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


if __name__ == "__main__":
    raise SystemExit(main())
