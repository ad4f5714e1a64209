"""ddp_scaling in each rank: the benchmark's parameters, one runner per library (tensorlib +
ddp, torch + gloo) and the protocol of phases the two ranks alternate between.

``benchmarks/ddp_scaling.py`` starts two ranks with ``tl_worker`` (then ``torch_worker``) and
prints what rank 0 returns.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import collectives
from benchmarks._bench_mlp import mlp

# One BLAS/OpenMP thread per rank. The ranks are fresh processes (spawn start method) that
# inherit the parent's environment, so ddp_scaling.main() sets these before starting them and
# each rank's NumPy/torch reads them when it loads.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_KEYS = ("fwd", "bwd", "wait", "opt", "step")


@dataclass
class Config:
    """The benchmark's parameters (they travel to the ranks)."""

    width: int = 1024
    depth: int = 8
    batch: int = 8
    classes: int = 10
    steps: int = 20
    rounds: int = 4
    warmup: int = 5
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    seed: int = 0
    switch_interval: float | None = None  # sys.setswitchinterval in each rank (GIL hand-off)

    def dims(self) -> list[int]:
        """Layer sizes: ``depth`` square hidden layers of ``width``, then the classes."""
        return [self.width] * (self.depth + 1) + [self.classes]


def thread_report() -> dict[str, Any]:
    """BLAS/OpenMP thread counts as threadpoolctl sees them, else the environment's word."""
    env = {v: os.environ.get(v) for v in THREAD_VARS}
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {"checked": False, "env": env}
    pools = [
        {"api": p.get("internal_api"), "threads": p.get("num_threads")} for p in threadpool_info()
    ]
    return {"checked": True, "env": env, "pools": pools}


def _median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------- runners
class _Runner:
    """One rank's models and the timing loops ``_protocol`` runs, written once for both
    libraries; a subclass builds the models and supplies the library's few calls below."""

    rank: int
    models: dict[str, tuple[Any, Any]]  # name -> (model, optimizer)
    x: Any
    y: Any
    buckets: list[int]  # DDP's bucket sizes in bytes

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}
        self._bufs: list[Any] | None = None

    # -- the library's calls
    def loss(self, logits: Any, target: Any) -> Any:
        raise NotImplementedError

    def zero_grad(self, opt: Any) -> None:
        raise NotImplementedError

    def wait_s(self, name: str, model: Any) -> float | None:
        """How long the last backward waited for communication; None: not exposed."""
        return None

    def note_ddp(self, name: str, model: Any, rec: dict[str, Any]) -> None:
        """Record what the library's DDP says about the recorded steps."""

    def barrier(self) -> None:
        raise NotImplementedError

    def max_over_ranks(self, v: np.ndarray[Any, Any]) -> None:
        raise NotImplementedError

    def bucket(self, nbytes: int) -> Any:
        """A float32 buffer of ``nbytes`` for the standalone all-reduce."""
        raise NotImplementedError

    def fill_ones(self, buf: Any) -> None:
        raise NotImplementedError

    def all_reduce_async(self, buf: Any) -> Any:
        raise NotImplementedError

    # -- the timing loops
    def steps(self, name: str, n: int, record: bool, key: str | None = None) -> None:
        """Train ``models[name]`` for ``n`` steps; with ``record``, keep each phase's seconds
        under ``key`` (default ``name``)."""
        model, opt = self.models[name]
        rec = self.stats.setdefault(key or name, {k: [] for k in _KEYS})
        for _ in range(n):
            t0 = time.perf_counter()
            loss = self.loss(model(self.x), self.y)
            t1 = time.perf_counter()
            self.zero_grad(opt)
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if record:
                rec["fwd"].append(t1 - t0)
                rec["bwd"].append(t2 - t1)
                wait = self.wait_s(name, model)
                if wait is not None:
                    rec["wait"].append(wait)
                rec["opt"].append(t3 - t2)
                rec["step"].append(t3 - t0)
        if record:
            self.note_ddp(name, model, rec)

    def allreduce_alone(self, reps: int) -> list[float]:
        """Seconds to all-reduce buckets of DDP's sizes, all launched at once, then waited."""
        if self._bufs is None:
            self._bufs = [self.bucket(nbytes) for nbytes in self.buckets]
        times = []
        for r in range(reps + 1):
            for b in self._bufs:
                self.fill_ones(b)  # touch them, as backward's writes would
            self.barrier()
            t0 = time.perf_counter()
            works = [self.all_reduce_async(b) for b in self._bufs]
            for w in works:
                w.wait()
            if r >= 1:
                times.append(time.perf_counter() - t0)
        return times


class _TlRunner(_Runner):
    """Plain, DDP-at-world-size-1 and DDP-at-2-ranks tensorlib models in one rank."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        import tensorlib as tl
        import tensorlib.functional as F
        from ddp import DistributedDataParallel
        from tensorlib import nn, optim

        self.F = F
        self.rank = collectives.get_rank()
        self.group = collectives.get_default_group()
        dims = cfg.dims()

        def model() -> Any:
            tl.manual_seed(cfg.seed)
            return mlp(nn, dims)

        def sgd(m: Any) -> Any:
            return optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)

        # Every rank must create the group; only rank 0 is in it (a serial, one-rank group).
        solo = collectives.new_group([0])
        self.models = {}
        plain = model()  # every rank: the 2-rank phase without communication needs it too
        self.models["plain"] = (plain, sgd(plain))
        if self.rank == 0:
            assert isinstance(solo, collectives.ProcessGroup)
            one = DistributedDataParallel(
                model(),
                process_group=solo,
                bucket_cap_mb=cfg.bucket_cap_mb,
                first_bucket_mb=cfg.first_bucket_mb,
            )
            self.models["ddp1"] = (one, sgd(one))
        two = DistributedDataParallel(
            model(), bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_mb=cfg.first_bucket_mb
        )
        self.models["ddp2"] = (two, sgd(two))
        rng = np.random.default_rng(cfg.seed + self.rank)
        self.x = tl.tensor(rng.standard_normal((cfg.batch, dims[0])).astype(np.float32))
        self.y = tl.tensor(rng.integers(0, cfg.classes, cfg.batch).astype(np.int64))
        self.buckets = two.bucket_sizes()

    def loss(self, logits: Any, target: Any) -> Any:
        return self.F.cross_entropy(logits, target)

    def zero_grad(self, opt: Any) -> None:
        opt.zero_grad()

    def wait_s(self, name: str, model: Any) -> float | None:
        return model.stats.wait_s if name != "plain" else 0.0

    def note_ddp(self, name: str, model: Any, rec: dict[str, Any]) -> None:
        if name != "plain":
            rec["in_backward"] = model.stats.launched_in_backward

    def barrier(self) -> None:
        collectives.barrier()

    def max_over_ranks(self, v: np.ndarray[Any, Any]) -> None:
        collectives.all_reduce(v, op="max")

    def bucket(self, nbytes: int) -> Any:
        # Shared-memory buffers from the group, like DDP's buckets (zero-copy all-reduce).
        return self.group.alloc(nbytes // 4, np.float32)

    def fill_ones(self, buf: Any) -> None:
        buf.fill(1.0)

    def all_reduce_async(self, buf: Any) -> Any:
        return self.group.all_reduce(buf, op="avg", async_op=True)


class _TorchRunner(_Runner):
    """The same protocol with torch eager (1 rank) and torch DDP over gloo (2 ranks)."""

    def __init__(self, cfg: Config, buckets: list[int]) -> None:
        super().__init__()
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.torch, self.dist = torch, dist
        self.rank = dist.get_rank()
        dims = cfg.dims()

        def model() -> Any:
            torch.manual_seed(cfg.seed)
            return mlp(torch.nn, dims)

        def sgd(m: Any) -> Any:
            return torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)

        ddp_cls = torch.nn.parallel.DistributedDataParallel
        self.models = {}
        plain = model()
        self.models["plain"] = (plain, sgd(plain))
        # Like ours: gradients are views into the buckets; torch's first bucket is also 1 MiB.
        two = ddp_cls(model(), bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True)
        self.models["ddp2"] = (two, sgd(two))
        g = torch.Generator().manual_seed(cfg.seed + self.rank)
        self.x = torch.randn(cfg.batch, dims[0], generator=g)
        self.y = torch.randint(0, cfg.classes, (cfg.batch,), generator=g)
        self.buckets = buckets

    def loss(self, logits: Any, target: Any) -> Any:
        return self.torch.nn.functional.cross_entropy(logits, target)

    def zero_grad(self, opt: Any) -> None:
        opt.zero_grad(set_to_none=False)

    # wait_s: torch exposes no wait time (shown as "-"); note_ddp: nothing to note.

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, v: np.ndarray[Any, Any]) -> None:
        self.dist.all_reduce(self.torch.from_numpy(v), op=self.dist.ReduceOp.MAX)

    def bucket(self, nbytes: int) -> Any:
        return self.torch.ones(nbytes // 4)

    def fill_ones(self, buf: Any) -> None:
        buf.fill_(1.0)

    def all_reduce_async(self, buf: Any) -> Any:
        return self.dist.all_reduce(buf, async_op=True)

    def close(self) -> None:
        self.dist.destroy_process_group()


# ---------------------------------------------------------------------------- protocol
def _protocol(runner: _Runner, cfg: Config, solo: list[str]) -> dict[str, Any]:
    """Warm up, then ``rounds`` rounds of every phase (order rotated each round); summarize.

    Phases: ``solo`` (rank 0 alone runs the 1-rank models while rank 1 waits at a barrier),
    ``indep2`` (both ranks train the plain model at once, without communicating: what two
    processes cost each other on this machine), ``ddp2`` (both train under DDP) and ``comm``
    (an all-reduce of buckets of DDP's sizes, nothing else running).
    """
    rank = runner.rank
    comm: list[float] = []

    def phase(name: str, record: bool, n: int) -> None:
        runner.barrier()
        if name == "solo":
            if rank == 0:
                for model in solo:
                    runner.steps(model, n, record)
        elif name == "comm":
            times = runner.allreduce_alone(reps=max(3, n // 4))
            if record:
                comm.extend(times)
        else:
            runner.steps("plain" if name == "indep2" else "ddp2", n, record, key=name)
        runner.barrier()  # the rank that sat out waits here (blocking, not spinning)

    phases = ["solo", "ddp2", "indep2", "comm"]
    for name in phases:
        phase(name, False, cfg.warmup)
    for r in range(cfg.rounds):
        for name in phases[r % 4 :] + phases[: r % 4]:
            phase(name, True, cfg.steps)

    rows: dict[str, dict[str, float]] = {}
    for name in [*solo, "indep2", "ddp2"]:
        rec = runner.stats.get(name, {})
        med = np.array([_median_ms(rec.get(k, [])) for k in _KEYS], dtype=np.float64)
        if name in ("indep2", "ddp2"):
            runner.max_over_ranks(med)  # the slower rank sets the pace
        rows[name] = dict(zip(_KEYS, (float(v) for v in med), strict=True))
        if "in_backward" in rec:
            rows[name]["launched_in_backward"] = rec["in_backward"]
    comm_ms = np.array([_median_ms(comm)], dtype=np.float64)
    runner.max_over_ranks(comm_ms)
    return {"rows": rows, "allreduce_alone_ms": float(comm_ms[0]), "threads": thread_report()}


def tl_worker(rank: int, cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of the tensorlib run (the group is initialized by ``spawn``)."""
    cfg = Config(**cfg_dict)
    if cfg.switch_interval:
        sys.setswitchinterval(cfg.switch_interval)
    runner = _TlRunner(cfg)
    out = _protocol(runner, cfg, ["plain", "ddp1"])
    out["buckets"] = runner.buckets
    return out if rank == 0 else None


def threads_job(rank: int, cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """In a fresh process (one BLAS thread, set before NumPy loaded): the tensorlib run with
    its two ranks as threads of that process (the threads backend); rank 0's result."""
    got = collectives.spawn(tl_worker, args=(cfg_dict,), nprocs=2, backend="threads")
    return got[0] if got else None


def torch_worker(rank: int, cfg_dict: dict[str, Any], buckets: list[int]) -> Any:
    """One rank of the torch run (spawned without our group; torch reads the same env)."""
    cfg = Config(**cfg_dict)
    if cfg.switch_interval:
        sys.setswitchinterval(cfg.switch_interval)
    runner = _TorchRunner(cfg, buckets)
    try:
        out = _protocol(runner, cfg, ["plain"])
    finally:
        runner.close()
    return out if rank == 0 else None
