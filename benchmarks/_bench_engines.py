"""allreduce-bench's engines: one rank's view of each communication library it can time.

Ours: cpu, cpu-zc (group.alloc buffers), cpu-py (the cpu backend's pure-Python path,
``DPT_CPU_NATIVE=0``), nccl, mpi (blocking engine), mpi-nb (its
non-blocking engine), threads (rank threads of one process, the threads backend). Peers:
gloo (torch.distributed), mpi4py (raw calls on COMM_WORLD).
Each engine maps the five collectives onto its own library's calls; ``availability`` says
whether one can run on this machine at all.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import numpy as np

ENGINES = ("cpu", "cpu-zc", "cpu-py", "nccl", "mpi", "mpi-nb", "threads", "gloo", "mpi4py")
MPIEXEC_ENGINES = ("mpi", "mpi-nb", "mpi4py")  # their ranks are started by mpiexec


class UsageError(Exception):
    """An impossible request; main() prints it on one line and exits 2."""


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
        """All-reduce a small float64 host vector (``max`` or ``sum``), for statistics.

        Returns the result, which need not be ``v`` itself (the GPU engine reduces a device
        copy): callers must use the return value."""
        self.run("all_reduce", v, None, rop, async_op=False)  # in place on the host
        return v

    def synchronize(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        """What the JSON result records about how this engine ran, beside its rows."""
        return {}

    def close(self) -> None:
        pass


class Ours(Engine):
    """This project's collectives (cpu, cpu with group.alloc buffers, nccl, mpi, threads)."""

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
            return super().reduce_host(v, rop)
        d = self.xp.asarray(v)
        self.group.all_reduce(d, rop)
        return np.asarray(d.get())

    def synchronize(self) -> None:
        if self.xp is not np:
            self.xp.cuda.Device().synchronize()

    def describe(self) -> dict[str, Any]:
        # The cpu backend: whether its compiled helper ran (cpu-py: DPT_CPU_NATIVE=0).
        sync = getattr(self.group.backend, "sync", None)
        return {} if sync is None else {"native": getattr(sync, "native", None) is not None}

    def close(self) -> None:
        self.C.destroy_process_group()


class PeerEngine(Engine):
    """Another project's library: its table of reduction ops, one error for what it lacks."""

    library: str
    reduce_ops: dict[str, Any]

    def _op(self, rop: str) -> Any:
        if rop not in self.reduce_ops:
            raise UsageError(f"{self.library} has no {rop} reduction")
        return self.reduce_ops[rop]


class Gloo(PeerEngine):
    """torch.distributed over gloo."""

    library = "gloo"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        R = dist.ReduceOp
        self.reduce_ops = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}

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

    def close(self) -> None:
        self.dist.destroy_process_group()


class Mpi(PeerEngine):
    """mpi4py on MPI.COMM_WORLD (ranks started by mpiexec)."""

    library = "MPI"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.reduce_ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

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


def make_engine(engine: str, device: str) -> Engine:
    """Join the job's ranks through ``engine``."""
    if engine in ("cpu", "cpu-zc", "cpu-py"):  # cpu-py: launch() sets DPT_CPU_NATIVE=0
        return Ours("cpu", zero_copy=engine == "cpu-zc", device=device)
    if engine == "nccl":
        return Ours("nccl", zero_copy=False, device="cuda")
    if engine in ("mpi", "mpi-nb"):
        return Ours("mpi", zero_copy=False, device=device)  # DPT_MPI_ENGINE set by launch()
    if engine == "threads":
        return Ours("threads", zero_copy=False, device=device)  # in a rank thread
    if engine == "gloo":
        return Gloo()
    return Mpi()


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (a venv's mpi extra), else the one on PATH, else None."""
    here = os.path.dirname(sys.executable)
    return shutil.which("mpiexec", path=here) or shutil.which("mpiexec")


def availability(engine: str, device: str) -> str | None:
    """None when ``engine`` can run here, else the reason (one line)."""
    if engine == "nccl" or (engine in ("cpu", "cpu-zc", "cpu-py") and device == "cuda"):
        import collectives

        why = collectives.backend_unavailable_reason("nccl")
        if why is not None:
            return why
    if engine == "gloo":
        try:
            import torch.distributed as dist
        except ImportError:
            return "torch is not installed (pip install torch)"
        if not (dist.is_available() and dist.is_gloo_available()):
            return "this torch build has no gloo"
    if engine in MPIEXEC_ENGINES:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py is not installed (pip install 'dpt[mpi]')"
        if find_mpiexec() is None:
            return "mpiexec not found (pip install 'dpt[mpi]')"
    return None
