"""All-reduce throughput of the cpu backend against torch.distributed gloo and mpi4py, one run.

    python -m benchmarks.cpu_allreduce                      # 2 ranks, 4 KiB .. 256 MiB, float32
    python -m benchmarks.cpu_allreduce --nproc 4 -e 64M --peers gloo
    python -m benchmarks.cpu_allreduce --json results.json

Each engine runs in its own set of freshly started ranks on this host: ``cpu`` (staging
through shared memory), ``cpu-zc`` (arrays from ``group.alloc``: already in shared memory, no
copies in or out), and, when installed, ``gloo`` (torch.distributed) and ``mpi`` (mpi4py,
started with mpiexec). For every size the ranks run ``--reps`` timed blocks, each after a
barrier; a block's time is the slowest rank's; the figure is the median block divided by its
iterations. algbw = bytes / time; busbw = algbw * 2(n-1)/n (what each link moves). The footer
compares with a memory-copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4K' -> 4096, '256M' -> 268435456 (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = t[-1] if t[-1] in _UNITS else ""
    num = t[:-1] if unit else t
    try:
        return int(float(num) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4K, 1M, 256M") from None


def human(n: float) -> str:
    """Bytes as a short binary-unit string."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    """Geometric sweep lo, lo*f, ... <= hi."""
    out = []
    s = lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def iters_for(nbytes: int) -> int:
    """More iterations for small messages so each block is long enough to time."""
    return int(max(2, min(500, 64e6 // max(nbytes, 1))))


def memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    """GB/s of one NumPy copy of ``nbytes`` (read + write counted once, like algbw)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    return nbytes / min(ts) / 1e9


# ---------------------------------------------------------------------------- workers
class _Engine:
    rank: int
    size: int

    def all_reduce(self, x: np.ndarray[Any, Any]) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def max_over_ranks(self, v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        raise NotImplementedError

    def buffer(self, count: int, dtype: Any) -> np.ndarray[Any, Any]:
        return np.empty(count, dtype=dtype)

    def close(self) -> None:
        pass


class _Ours(_Engine):
    def __init__(self, zero_copy: bool) -> None:
        import collectives as C

        self.C = C
        self.group = C.init_process_group("cpu", timeout=600)
        self.rank, self.size = self.group.rank, self.group.size
        self.zero_copy = zero_copy

    def all_reduce(self, x: np.ndarray[Any, Any]) -> None:
        self.group.all_reduce(x)

    def barrier(self) -> None:
        self.group.barrier()

    def max_over_ranks(self, v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        self.group.all_reduce(v, "max")
        return v

    def buffer(self, count: int, dtype: Any) -> np.ndarray[Any, Any]:
        if self.zero_copy:
            return self.group.alloc(count, dtype)
        return np.empty(count, dtype=dtype)

    def close(self) -> None:
        self.C.destroy_process_group()


class _Gloo(_Engine):
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def all_reduce(self, x: np.ndarray[Any, Any]) -> None:
        self.dist.all_reduce(self.torch.from_numpy(x))

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        self.dist.all_reduce(self.torch.from_numpy(v), op=self.dist.ReduceOp.MAX)
        return v

    def close(self) -> None:
        self.dist.destroy_process_group()


class _Mpi(_Engine):
    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def all_reduce(self, x: np.ndarray[Any, Any]) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, x)

    def barrier(self) -> None:
        self.comm.Barrier()

    def max_over_ranks(self, v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        self.comm.Allreduce(self.MPI.IN_PLACE, v, op=self.MPI.MAX)
        return v


def run_worker(engine: str, sweep: list[int], dtype: str, reps: int, out: str | None) -> None:
    """Run the sweep inside one rank and (rank 0) write the results as JSON."""
    eng: _Engine
    if engine in ("cpu", "cpu-zc"):
        eng = _Ours(zero_copy=engine == "cpu-zc")
    elif engine == "gloo":
        eng = _Gloo()
    else:
        eng = _Mpi()
    dt = np.dtype(dtype)
    rows = []
    for nbytes in sweep:
        count = max(nbytes // dt.itemsize, 1)
        x = eng.buffer(count, dt)
        iters = iters_for(nbytes)
        x.fill(1)
        for _ in range(min(iters, 5)):
            eng.all_reduce(x)
        blocks = np.zeros(reps, dtype=np.float64)
        for r in range(reps):
            eng.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                eng.all_reduce(x)
            blocks[r] = (time.perf_counter() - t0) / iters
        eng.max_over_ranks(blocks)
        # Correctness on data that differs per rank.
        pattern = (np.arange(count, dtype=np.int64) % 7).astype(dt)  # exact in every dtype
        x[:] = pattern + eng.rank
        eng.all_reduce(x)
        n = eng.size
        expect = pattern.astype(np.float64) * n + n * (n - 1) / 2
        wrong = int(np.count_nonzero(x.astype(np.float64) != expect))
        rows.append(
            {
                "bytes": count * dt.itemsize,
                "count": count,
                "time_s": float(np.median(blocks)),
                "wrong": wrong,
            }
        )
        del x
    if eng.rank == 0 and out:
        Path(out).write_text(json.dumps({"engine": engine, "world": eng.size, "rows": rows}))
    eng.close()


# ---------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(engine: str, args: argparse.Namespace, out: str) -> str | None:
    """Run one engine's ranks; return None on success, else why it could not run."""
    common = [
        "-m",
        "benchmarks.cpu_allreduce",
        "--worker",
        engine,
        "--out",
        out,
        "-b",
        str(args.min_bytes),
        "-e",
        str(args.max_bytes),
        "-f",
        str(args.step_factor),
        "--dtype",
        args.dtype,
        "--reps",
        str(args.reps),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if engine == "mpi":
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which(
            "mpiexec"
        )
        if mpiexec is None:
            return "mpiexec not found (pip install .[mpi])"
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [mpiexec, "-n", str(args.nproc), "--oversubscribe", sys.executable, *common]
        p = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False
        )
        return None if p.returncode == 0 else f"mpiexec failed: {p.stderr[-600:]}"
    port = _free_port()
    procs = []
    for r in range(args.nproc):
        e = dict(
            env,
            RANK=str(r),
            WORLD_SIZE=str(args.nproc),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(args.nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *common], env=e, cwd=ROOT, stderr=subprocess.PIPE, text=True
            )
        )
    errs = [p.communicate(timeout=1800)[1] for p in procs]
    bad = [
        (r, p.returncode, e)
        for r, (p, e) in enumerate(zip(procs, errs, strict=True))
        if p.returncode != 0
    ]
    if bad:
        r, code, err = bad[0]
        return f"rank {r} exited {code}: {err[-600:]}"
    return None


def _available(engine: str) -> str | None:
    if engine == "gloo":
        try:
            import torch.distributed as dist

            return None if dist.is_available() and dist.is_gloo_available() else "no gloo"
        except ImportError:
            return "torch not installed"
    if engine == "mpi":
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py not installed (pip install .[mpi])"
    return None


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; run as the coordinator or as one worker rank."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("-b", "--min-bytes", type=parse_size, default=4 << 10)
    p.add_argument("-e", "--max-bytes", type=parse_size, default=256 << 20)
    p.add_argument("-f", "--step-factor", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=5, help="timed blocks per size")
    p.add_argument("--peers", default="gloo,mpi", help="comma list of gloo,mpi; '' for none")
    p.add_argument("--no-zero-copy", action="store_true", help="skip the cpu-zc engine")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sweep = sizes(args.min_bytes, args.max_bytes, args.step_factor)
    if args.worker:
        run_worker(args.worker, sweep, args.dtype, args.reps, args.out)
        return 0

    engines = ["cpu"] + ([] if args.no_zero_copy else ["cpu-zc"])
    engines += [e for e in args.peers.split(",") if e]
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for eng in engines:
            why = _available(eng)
            if why is None:
                print(f"running {eng} at {args.nproc} ranks ...", file=sys.stderr, flush=True)
                out = os.path.join(tmp, f"{eng}.json")
                why = _launch(eng, args, out)
                if why is None:
                    results[eng] = json.loads(Path(out).read_text())["rows"]
            if why is not None:
                skipped[eng] = why
    copy_bw = memcpy_bandwidth()
    n = args.nproc
    factor = 2 * (n - 1) / n
    names = list(results)
    head = f"{'size':>7} {'count':>10}"
    for e in names:
        head += f" | {e + ' us':>12} {'busbw':>6} {'#wrong':>6}"
    for e in names[1:]:
        head += f" | {'vs ' + e:>9}"
    print(
        f"all_reduce, {n} ranks, {args.dtype}, busbw in GB/s (algbw * {factor:g}); "
        "'vs X' = X's time / cpu's time (above 1: cpu is faster)"
    )
    print(head)
    table = []
    for i, nbytes in enumerate(sweep):
        line = f"{human(nbytes):>7} {results[names[0]][i]['count'] if names else 0:>10}"
        row: dict[str, Any] = {"bytes": nbytes}
        for e in names:
            r = results[e][i]
            t = r["time_s"]
            bus = r["bytes"] / t / 1e9 * factor
            row[e] = {
                "time_us": t * 1e6,
                "algbw": r["bytes"] / t / 1e9,
                "busbw": bus,
                "wrong": r["wrong"],
            }
            line += f" | {t * 1e6:12.1f} {bus:6.2f} {r['wrong']:6d}"
        for e in names[1:]:
            ratio = results[e][i]["time_s"] / results["cpu"][i]["time_s"]
            line += f" | {ratio:8.2f}x"
        print(line)
        table.append(row)
    print(f"memory copy (np.copyto, 256M): {copy_bw:.1f} GB/s")
    for e in names:
        big = [r for r in results[e] if r["bytes"] >= 1 << 20]
        if big:
            peak = max(r["bytes"] / r["time_s"] / 1e9 for r in big)
            print(f"  {e:7s} peak algbw from 1M: {peak:6.2f} GB/s = {peak / copy_bw:.0%} of copy")
    for e, why in skipped.items():
        print(f"  {e}: not run ({why})")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "world": n,
                    "dtype": args.dtype,
                    "memcpy_GBps": copy_bw,
                    "rows": table,
                    "skipped": skipped,
                },
                indent=2,
            )
        )
    return 0 if all(r["wrong"] == 0 for e in names for r in results[e]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
