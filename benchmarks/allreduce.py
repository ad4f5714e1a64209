"""allreduce-bench: collective throughput in the nccl-tests format, with peers side by side.

    allreduce-bench --nproc 2 -b 4K -e 256M --compare gloo,mpi4py  # own ranks on this host
    allreduce-bench --nproc 2 --zero-copy --op all_gather --json out.json --plot out.png
    python -m collectives.run --nproc 4 -m benchmarks.allreduce -b 1M -e 1G   # inside ranks
    allreduce-bench --nproc 2 --backend mpi --compare cpu,mpi-nb,mpi4py        # via mpiexec
    mpirun -n 4 allreduce-bench --backend mpi                                  # inside ranks

Without ``--nproc`` inside ranks started by ``collectives.run``, torchrun, SLURM or mpirun
(RANK/WORLD_SIZE, SLURM_PROCID or OMPI_COMM_WORLD_RANK set) it runs in those ranks; otherwise
it starts ``--nproc`` (default 2) fresh ranks per engine. Per size: ``--warmup-iters`` untimed
calls, then ``--blocks`` timed blocks of ``--iters`` calls, each block after a barrier; a
block's time is the slowest rank's; the figure is the median block divided by its calls
(``--async``: a block issues every call, then waits). algbw = size / time; busbw = algbw *
factor (all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast and reduce 1):
what each rank's link carries, comparable across world sizes and with the hardware's
bandwidth. ``--check`` then runs each collective on data that differs per rank and per
iteration (never zeros) and counts wrong elements (#wrong, summed over ranks). The footer
states average and peak busbw and, on CPU, the peak as a share of a memory-copy bandwidth
measured in the same run (on GPU, of a device-to-device copy). Exit status: 0, 1 when any
element was wrong, 2 for impossible requests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
# Ours: cpu, cpu-zc (group.alloc buffers), nccl, mpi (blocking engine), mpi-nb (its
# non-blocking engine). Peers: gloo (torch.distributed), mpi4py (raw calls on COMM_WORLD).
ENGINES = ("cpu", "cpu-zc", "nccl", "mpi", "mpi-nb", "gloo", "mpi4py")
_MPIEXEC_ENGINES = ("mpi", "mpi-nb", "mpi4py")
SCHEMA = "allreduce-bench/1"
CORRUPT_ENV = "DPT_BENCH_CORRUPT"  # test hook: rank 0 spoils this many result elements
CHECK_ITERS = 2
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SHORT_TYPES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16"}


class UsageError(Exception):
    """An impossible request; main() prints it on one line and exits 2."""


# ---------------------------------------------------------------------------- arithmetic
def parse_size(text: str) -> int:
    """'4K' -> 4096, '256M' -> 268435456, '1.5G', '64KiB' (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = t[-1] if t[-1] in _UNITS else ""
    num = t[:-1] if unit else t
    try:
        value = int(float(num) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4K, 1M, 256M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def human(n: float) -> str:
    """Bytes as a short binary-unit string."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    """Geometric sweep lo, lo*f, ... <= hi (just lo when factor is 1 or lo >= hi)."""
    out = [lo]
    while factor > 1 and out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` at world size ``n``."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def element_count(op: str, nbytes: int, itemsize: int, n: int) -> int:
    """Elements of the full buffer for ``nbytes``: at least one per rank, and for all_gather
    and reduce_scatter a multiple of the world size (rounded down, as nccl-tests does)."""
    count = max(nbytes // itemsize, 1)
    if op in ("all_gather", "reduce_scatter"):
        count = max(count // n, 1) * n
    return count


def auto_iters(nbytes: int) -> int:
    """Calls per timed block: many for small messages so a block is long enough to time."""
    return int(max(2, min(200, 32e6 // max(nbytes, 1))))


def memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    """GB/s of one NumPy copy of ``nbytes`` (best of 5; bytes counted once, like algbw)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    return nbytes / min(ts) / 1e9


def _gpu_copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """GB/s of one device-to-device copy (CuPy, best of 5, GPU time)."""
    import cupy as cp

    a = cp.ones(nbytes // 4, dtype=cp.float32)
    b = cp.empty_like(a)
    best = float("inf")
    for _ in range(6):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        cp.copyto(b, a)
        e1.record()
        e1.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return nbytes / best / 1e9


# ---------------------------------------------------------------------------- engines
class Engine:
    """One rank's view of a communication library, on NumPy (or CuPy) arrays."""

    rank: int
    size: int
    xp: Any = np

    def buffer(self, count: int, dtype: np.dtype[Any]) -> Any:
        return self.xp.empty(count, dtype=dtype)

    def run(self, op: str, x: Any, out: Any, rop: str, async_op: bool) -> Any:
        """Issue ``op``; return a handle with ``wait()`` when ``async_op``."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def reduce_host(self, v: np.ndarray[Any, Any], rop: str) -> np.ndarray[Any, Any]:
        """All-reduce a small float64 host vector (``max`` or ``sum``), for statistics."""
        raise NotImplementedError

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class Ours(Engine):
    """This project's collectives (cpu, cpu with group.alloc buffers, nccl, mpi)."""

    def __init__(self, backend: str, zero_copy: bool, device: str) -> None:
        import collectives as C

        self.C = C
        self.group = C.init_process_group(backend, timeout=600)
        self.rank, self.size = self.group.rank, self.group.size
        self.zero_copy = zero_copy
        if device == "cuda":
            import cupy as cp

            self.xp = cp

    def buffer(self, count: int, dtype: np.dtype[Any]) -> Any:
        if self.zero_copy:
            return self.group.alloc(count, dtype)
        return self.xp.empty(count, dtype=dtype)

    def run(self, op: str, x: Any, out: Any, rop: str, async_op: bool) -> Any:
        g = self.group
        if op == "all_reduce":
            return g.all_reduce(x, rop, async_op=async_op)
        if op == "all_gather":
            return g.all_gather(x, out=out, async_op=async_op)
        if op == "reduce_scatter":
            return g.reduce_scatter(x, rop, out=out, async_op=async_op)
        if op == "broadcast":
            return g.broadcast(x, 0, async_op=async_op)
        return g.reduce(x, 0, rop, async_op=async_op)

    def barrier(self) -> None:
        self.group.barrier()

    def reduce_host(self, v: np.ndarray[Any, Any], rop: str) -> np.ndarray[Any, Any]:
        if self.xp is np:
            self.group.all_reduce(v, rop)
            return v
        d = self.xp.asarray(v)
        self.group.all_reduce(d, rop)
        return np.asarray(d.get())

    def synchronize(self) -> None:
        if self.xp is not np:
            self.xp.cuda.Device().synchronize()

    def close(self) -> None:
        self.C.destroy_process_group()


class Gloo(Engine):
    """torch.distributed over gloo."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        R = dist.ReduceOp
        self.ops = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}

    def _op(self, rop: str) -> Any:
        if rop not in self.ops:
            raise UsageError(f"gloo has no {rop} reduction")
        return self.ops[rop]

    def run(self, op: str, x: Any, out: Any, rop: str, async_op: bool) -> Any:
        d, t = self.dist, self.torch.from_numpy
        if op == "all_reduce":
            return d.all_reduce(t(x), op=self._op(rop), async_op=async_op)
        if op == "all_gather":
            return d.all_gather(list(t(out)), t(x), async_op=async_op)
        if op == "reduce_scatter":
            blocks = list(t(x).reshape(self.size, -1))
            return d.reduce_scatter(t(out), blocks, op=self._op(rop), async_op=async_op)
        if op == "broadcast":
            return d.broadcast(t(x), 0, async_op=async_op)
        return d.reduce(t(x), 0, op=self._op(rop), async_op=async_op)

    def barrier(self) -> None:
        self.dist.barrier()

    def reduce_host(self, v: np.ndarray[Any, Any], rop: str) -> np.ndarray[Any, Any]:
        self.dist.all_reduce(self.torch.from_numpy(v), op=self._op(rop))
        return v

    def close(self) -> None:
        self.dist.destroy_process_group()


class Mpi(Engine):
    """mpi4py on MPI.COMM_WORLD (ranks started by mpiexec)."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def _op(self, rop: str) -> Any:
        if rop not in self.ops:
            raise UsageError(f"MPI has no {rop} reduction")
        return self.ops[rop]

    def run(self, op: str, x: Any, out: Any, rop: str, async_op: bool) -> Any:
        c, M = self.comm, self.MPI
        if op == "all_reduce":
            f = c.Iallreduce if async_op else c.Allreduce
            return f(M.IN_PLACE, x, op=self._op(rop))
        if op == "all_gather":
            return (c.Iallgather if async_op else c.Allgather)(x, out)
        if op == "reduce_scatter":
            f = c.Ireduce_scatter_block if async_op else c.Reduce_scatter_block
            return f(x, out, op=self._op(rop))
        if op == "broadcast":
            return (c.Ibcast if async_op else c.Bcast)(x, root=0)
        send = M.IN_PLACE if self.rank == 0 else x
        recv = x if self.rank == 0 else None
        return (c.Ireduce if async_op else c.Reduce)(send, recv, op=self._op(rop), root=0)

    def barrier(self) -> None:
        self.comm.Barrier()

    def reduce_host(self, v: np.ndarray[Any, Any], rop: str) -> np.ndarray[Any, Any]:
        self.comm.Allreduce(self.MPI.IN_PLACE, v, op=self._op(rop))
        return v


def make_engine(engine: str, device: str) -> Engine:
    """Join the job's ranks through ``engine``."""
    if engine in ("cpu", "cpu-zc"):
        return Ours("cpu", zero_copy=engine == "cpu-zc", device=device)
    if engine == "nccl":
        return Ours("nccl", zero_copy=False, device="cuda")
    if engine in ("mpi", "mpi-nb"):
        return Ours("mpi", zero_copy=False, device=device)  # DPT_MPI_ENGINE set by launch()
    if engine == "gloo":
        return Gloo()
    return Mpi()


# ---------------------------------------------------------------------------- one rank
def _data(rank: int, it: int, start: int, count: int, dtype: np.dtype[Any]) -> Any:
    """Rank ``rank``'s input at iteration ``it`` for global elements start..start+count:
    small positive integers (exact in every dtype), different per rank and per iteration."""
    idx = np.arange(start, start + count, dtype=np.int64)
    return ((idx % 7) + 1 + rank + 2 * it).astype(dtype)


def _reduce_expect(rop: str, n: int, it: int, start: int, count: int) -> np.ndarray[Any, Any]:
    """Reduction over ranks of ``_data`` in float64."""
    parts = [_data(r, it, start, count, np.dtype(np.float64)) for r in range(n)]
    if rop in ("sum", "avg"):
        acc = np.sum(parts, axis=0)
        return acc / n if rop == "avg" else acc
    if rop == "prod":
        return np.prod(parts, axis=0)
    return np.min(parts, axis=0) if rop == "min" else np.max(parts, axis=0)


def _count_wrong(got: Any, expect: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> int:
    """Elements of ``got`` (cast to ``dtype`` for the expected value) that differ."""
    g = np.asarray(got, dtype=np.float64)
    e = expect.astype(dtype).astype(np.float64)  # the dtype's own rounding (wrap for ints)
    if dtype.kind == "f":
        tol = {2: 1e-2, 4: 1e-5}.get(dtype.itemsize, 1e-12)
        return int(np.count_nonzero(~np.isclose(g, e, rtol=tol, atol=0)))
    return int(np.count_nonzero(g != e))


def _to_host(a: Any) -> np.ndarray[Any, Any]:
    return np.asarray(a.get() if hasattr(a, "get") else a)


_CHUNK = 1 << 22


def _expect(
    op: str, rop: str, n: int, r: int, it: int, blk: int, lo: int, hi: int
) -> np.ndarray[Any, Any]:
    """Expected result elements lo..hi of ``op`` on rank ``r`` (float64)."""
    f64 = np.dtype(np.float64)
    if op in ("all_reduce", "reduce"):
        return _reduce_expect(rop, n, it, lo, hi - lo)
    if op == "broadcast":
        return _data(0, it, lo, hi - lo, f64)
    if op == "reduce_scatter":
        return _reduce_expect(rop, n, it, r * blk + lo, hi - lo)
    idx = np.arange(lo, hi, dtype=np.int64)  # all_gather: element i came from rank i // blk
    return ((idx % 7) + 1 + idx // blk + 2 * it).astype(f64)


def check(
    eng: Engine, op: str, x: Any, out: Any, count: int, dtype: np.dtype[Any], rop: str
) -> int:
    """Run ``op`` on fresh data CHECK_ITERS times; wrong elements on this rank."""
    n, r = eng.size, eng.rank
    corrupt = int(os.environ.get(CORRUPT_ENV, "0") or 0) if r == 0 else 0
    blk = count // n if op in ("all_gather", "reduce_scatter") else count
    wrong = 0
    for it in range(CHECK_ITERS):
        if op == "all_gather":
            x[...] = eng.xp.asarray(_data(r, it, r * blk, blk, dtype))
        else:
            x[...] = eng.xp.asarray(_data(r, it, 0, count, dtype))
        eng.run(op, x, out, rop, async_op=False)
        eng.synchronize()
        res = _to_host(out if op in ("all_gather", "reduce_scatter") else x).reshape(-1).copy()
        if corrupt:
            res[: min(corrupt, res.size)] += 1
        if op == "reduce" and r != 0:
            continue  # non-roots' buffers are unspecified after a reduce
        for lo in range(0, res.size, _CHUNK):  # in chunks: float64 copies of 256M would be big
            hi = min(lo + _CHUNK, res.size)
            wrong += _count_wrong(res[lo:hi], _expect(op, rop, n, r, it, blk, lo, hi), dtype)
    return wrong


def _buffers(eng: Engine, op: str, count: int, dtype: np.dtype[Any]) -> tuple[Any, Any]:
    """Input and output for ``op`` with ``count`` elements in the full buffer."""
    n = eng.size
    if op == "all_gather":
        x = eng.buffer(count // n, dtype)
        out = eng.buffer(count, dtype).reshape(n, count // n)
    elif op == "reduce_scatter":
        x, out = eng.buffer(count, dtype), eng.buffer(count // n, dtype)
    else:
        x, out = eng.buffer(count, dtype), None
    return x, out


def run_sweep(eng: Engine, args: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    """The sweep in this rank; every rank returns the same rows."""
    dtype = np.dtype(args.dtype)
    n = eng.size
    root = 0 if args.op in ("broadcast", "reduce") else -1
    rop = args.reduce_op if args.op in ("all_reduce", "reduce_scatter", "reduce") else "none"
    rows = []
    sweep = sizes(args.min_bytes, args.max_bytes, args.step_factor)
    for i, nbytes in enumerate(sweep):
        count = element_count(args.op, nbytes, dtype.itemsize, n)
        x, out = _buffers(eng, args.op, count, dtype)
        x[...] = eng.xp.asarray(_data(eng.rank, 0, 0, x.size, dtype))
        iters = args.iters or auto_iters(nbytes)
        for _ in range(args.warmup_iters):
            eng.run(args.op, x, out, args.reduce_op, async_op=False)
        eng.synchronize()
        blocks = np.zeros(args.blocks, dtype=np.float64)
        for b in range(args.blocks):
            eng.barrier()
            t0 = time.perf_counter()
            if args.async_op:
                works = [eng.run(args.op, x, out, args.reduce_op, True) for _ in range(iters)]
                for w in works:
                    w.wait()
            else:
                for _ in range(iters):
                    eng.run(args.op, x, out, args.reduce_op, False)
            eng.synchronize()
            blocks[b] = (time.perf_counter() - t0) / iters
        eng.reduce_host(blocks, "max")  # a block lasts as long as its slowest rank
        wrong = np.zeros(1, dtype=np.float64)
        if args.check:
            wrong[0] = check(eng, args.op, x, out, count, dtype, args.reduce_op)
        eng.reduce_host(wrong, "sum")
        t = float(np.median(blocks))
        size = count * dtype.itemsize
        algbw = size / t / 1e9
        rows.append(
            {
                "size": size,
                "count": count,
                "type": str(dtype),
                "redop": rop,
                "root": root,
                "time_us": t * 1e6,
                "algbw": algbw,
                "busbw": algbw * bus_factor(args.op, n),
                "wrong": int(wrong[0]) if args.check else None,
                "iters": iters,
            }
        )
        if eng.rank == 0:
            print(
                f"[{label}] {i + 1}/{len(sweep)} {human(size)}: {t * 1e6:.1f} us",
                file=sys.stderr,
                flush=True,
            )
        del x, out
    return rows


def worker(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the sweep through ``engine`` in the current ranks; rank 0 gets the result."""
    try:
        eng = make_engine(engine, args.device)
    except ImportError as e:
        raise UsageError(f"{engine}: {e}") from e
    try:
        rows = run_sweep(eng, args, engine)
        copy_bw = (
            _gpu_copy_bandwidth()
            if args.device == "cuda" or engine == "nccl"
            else memcpy_bandwidth(min(256 << 20, max(args.max_bytes, 16 << 20)))
        )
        return {
            "engine": engine,
            "world": eng.size,
            "rank": eng.rank,
            "copy_GBps": copy_bw,
            "rows": rows,
        }
    finally:
        eng.close()


# ---------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_argv(engine: str, args: argparse.Namespace, out: str) -> list[str]:
    argv = ["-m", "benchmarks.allreduce", "--worker", engine, "--out", out, "--op", args.op]
    argv += ["-b", str(args.min_bytes), "-e", str(args.max_bytes), "-f", str(args.step_factor)]
    argv += ["--dtype", args.dtype, "--reduce-op", args.reduce_op, "--device", args.device]
    argv += ["--iters", str(args.iters), "--warmup-iters", str(args.warmup_iters)]
    argv += ["--blocks", str(args.blocks), "--check" if args.check else "--no-check"]
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
    argv = _worker_argv(engine, args, out)
    if engine in _MPIEXEC_ENGINES:
        here = os.path.dirname(sys.executable)
        mpiexec = shutil.which("mpiexec", path=here) or shutil.which("mpiexec")
        if mpiexec is None:
            return "mpiexec not found (pip install 'dpt[mpi]')"
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        if engine in ("mpi", "mpi-nb"):
            env["DPT_MPI_ENGINE"] = "nonblocking" if engine == "mpi-nb" else "blocking"
        cmd = [mpiexec, "-n", str(args.nproc), *oversubscribe_args(mpiexec), sys.executable, *argv]
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
    port = _free_port()
    procs, logs = [], []
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
        # Rank 0's stderr stays live (progress); the others' goes to a file for error reports.
        log = None if r == 0 else open(os.path.join(tmp, f"{engine}.rank{r}.log"), "w+")  # noqa: SIM115
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv], env=e, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log
            )
        )
    codes = [p.wait(timeout=3600) for p in procs]
    why = None
    for r, (code, log) in enumerate(zip(codes, logs, strict=True)):
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


def availability(engine: str, device: str) -> str | None:
    """None when ``engine`` can run here, else the reason (one line)."""
    if engine == "nccl" or (engine in ("cpu", "cpu-zc") and device == "cuda"):
        import collectives  # noqa: F401  (registers the backends)
        from collectives._registry import get_backend_spec

        why = get_backend_spec("nccl").probe()
        if why is not None:
            return why
    if engine == "gloo":
        try:
            import torch.distributed as dist
        except ImportError:
            return "torch is not installed (pip install torch)"
        if not (dist.is_available() and dist.is_gloo_available()):
            return "this torch build has no gloo"
    if engine in _MPIEXEC_ENGINES:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py is not installed (pip install 'dpt[mpi]')"
        here = os.path.dirname(sys.executable)
        if (shutil.which("mpiexec", path=here) or shutil.which("mpiexec")) is None:
            return "mpiexec not found (pip install 'dpt[mpi]')"
    return None


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


# ---------------------------------------------------------------------------- report
def _env_info(results: dict[str, Any], args: argparse.Namespace, n: int) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "world_size": n,
        "device": args.device,
    }
    from importlib import metadata

    for pkg in ("dpt", "torch", "mpi4py", "cupy"):
        try:
            info[pkg] = metadata.version(pkg) if pkg != "cupy" else _cupy_version()
        except metadata.PackageNotFoundError:
            info[pkg] = None
    return info


def _cupy_version() -> str | None:
    from importlib import metadata

    for name in ("cupy-cuda12x", "cupy-cuda13x", "cupy"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(ours: str, results: dict[str, Any], args: argparse.Namespace, n: int) -> list[str]:
    """The nccl-tests table for ``ours`` with each peer's time, busbw, #wrong and ratio."""
    rows = results[ours]["rows"]
    peers = [e for e in results if e != ours]
    factor = bus_factor(args.op, n)
    mode = "async" if args.async_op else "blocking"
    lines = [
        f"# allreduce-bench: {args.op}, engine {ours}, {n} ranks, {args.dtype}, {mode}, "
        f"busbw = algbw * {factor:g}, time = slowest rank, median of {args.blocks} blocks",
        f"# {'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'root':>4} "
        f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        + "".join(f" | {p + ' us':>11} {'busbw':>7} {'#wrong':>6} {'ratio':>7}" for p in peers),
    ]
    for i, r in enumerate(rows):
        wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
        line = (
            f"  {r['size']:>10} {r['count']:>10} {_SHORT_TYPES.get(r['type'], r['type']):>8} "
            f"{r['redop']:>6} {r['root']:>4} {r['time_us']:>10.1f} {r['algbw']:>7.2f} "
            f"{r['busbw']:>7.2f} {wrong:>6}"
        )
        for p in peers:
            q = results[p]["rows"][i]
            qw = "N/A" if q["wrong"] is None else str(q["wrong"])
            ratio = q["time_us"] / r["time_us"]
            line += f" | {q['time_us']:>11.1f} {q['busbw']:>7.2f} {qw:>6} {ratio:>6.2f}x"
        lines.append(line)
    if peers:
        lines.append(f"# ratio = peer's time / {ours}'s time (above 1: {ours} is faster)")
    for e, res in results.items():
        bus = [r["busbw"] for r in res["rows"]]
        peak_i = int(np.argmax([r["algbw"] for r in res["rows"]]))
        peak_alg = res["rows"][peak_i]["algbw"]
        copy = res["copy_GBps"]
        where = "device copy" if args.device == "cuda" or e == "nccl" else "memory copy"
        lines.append(
            f"# {e:>7}: avg busbw {np.mean(bus):.2f} GB/s, peak busbw {max(bus):.2f} GB/s; "
            f"peak algbw {peak_alg:.2f} GB/s at {human(res['rows'][peak_i]['size'])} = "
            f"{peak_alg / copy:.0%} of {where} ({copy:.1f} GB/s, same run)"
        )
    return lines


def plot(path: str, results: dict[str, Any], args: argparse.Namespace, n: int) -> None:
    """busbw against size (log x), one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e, res in results.items():
        xs = [r["size"] for r in res["rows"]]
        ax.plot(xs, [r["busbw"] for r in res["rows"]], marker="o", label=e)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{args.op}, {n} ranks, {args.dtype}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(
    results: dict[str, Any],
    skipped: dict[str, str],
    ours: str,
    args: argparse.Namespace,
    n: int,
    notes: list[str],
) -> int:
    """Print the table (stdout), write JSON and plot; the exit status."""
    for line in table(ours, results, args, n):
        print(line)
    for note in notes:
        print(f"# note: {note}")
    for e, why in skipped.items():
        print(f"# {e}: not run ({why})")
    if args.json:
        env = _env_info(results, args, n)
        env["backend"] = ours
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "config": {
                k: getattr(args, k)
                for k in (
                    "op",
                    "dtype",
                    "reduce_op",
                    "min_bytes",
                    "max_bytes",
                    "step_factor",
                    "iters",
                    "warmup_iters",
                    "blocks",
                    "check",
                    "async_op",
                    "device",
                    "zero_copy",
                )
            },
            "engine": ours,
            "env": env,
            "results": results,
            "skipped": skipped,
            "notes": notes,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(args.plot, results, args, n)
        print(f"wrote {args.plot}", file=sys.stderr)
    bad = any(r["wrong"] for res in results.values() for r in res["rows"])
    return 1 if bad else 0


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
    p.add_argument("--backend", choices=("cpu", "nccl", "mpi", "auto"), default="auto")
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
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.add_argument(
        "--compare",
        default="",
        help="peers, comma separated: gloo,mpi4py (others'), cpu,cpu-zc,mpi,mpi-nb (ours)",
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
        if args.worker:  # one rank started by launch()
            res = worker(args.worker, args)
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
        return report({ours: res}, {}, ours, args, n, _notes(args, n, itemsize))
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
    return report(results, skipped, ours, args, n, _notes(args, n, itemsize))


def _notes(args: argparse.Namespace, n: int, itemsize: int) -> list[str]:
    if args.op not in ("all_gather", "reduce_scatter"):
        return []
    changed = [
        s
        for s in sizes(args.min_bytes, args.max_bytes, args.step_factor)
        if element_count(args.op, s, itemsize, n) * itemsize != s
    ]
    if not changed:
        return []
    return [
        f"{args.op} sizes rounded to a multiple of world size * itemsize ({n} * {itemsize} B): "
        + ", ".join(str(s) for s in changed[:6])
        + (" ..." if len(changed) > 6 else "")
    ]


if __name__ == "__main__":
    raise SystemExit(main())
