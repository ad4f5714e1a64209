"""Per-rank memory, traffic and step time by ZeRO stage, and the largest model under a cap.

    python -m benchmarks.zero_memory                      # N = 2 and 4, cap 8 MB
    python -m benchmarks.zero_memory --worlds 2 --cap-mb 4 --json zero.json
    python -m benchmarks.zero_memory --mp                 # mixed precision, the issue's formulas

One float32 model (``blocks`` residual blocks Linear(W, 4W) -> ReLU -> Linear(4W, W), then a
Linear(W, 5) head) trained with AdamW on the cpu backend (``collectives.spawn``), under:

- ``ddp``: DistributedDataParallel with the plain AdamW;
- ``zero1``: DistributedDataParallel with ZeroRedundancyOptimizer(AdamW);
- ``zero2``: fully_shard per block and at the root, ``reshard_after_forward=False``;
- ``zero3``: the same with ``reshard_after_forward=True``.

Reported per world size: the bytes ``ddp.memory_stats`` counts after a step against the
float32 formulas (:func:`formulas`), the full parameters still gathered at the end of forward
(ZeRO-2 keeps them until backward), the bytes each rank sends in one step (counted from the
collectives issued, with ring factors: :class:`TrafficCounter`), the median step time over
alternating rounds (the slower rank's), and the largest model (by width) whose one AdamW step
fits ``--cap-mb`` per rank, counted as memory_stats after the step plus, under
``fully_shard``, the step's peak beyond the shards (``model.stats.peak_bytes``: gathered units,
collective buffers).

The float32 formulas without mixed precision (P parameters, N ranks): DDP 4P parameters + 4P
gradients + 8P Adam moments = 16P; ZeRO-1 4P + 4P + 8P/N; ZeRO-2 and ZeRO-3 after the step
4P/N + 4P/N + 8P/N = 16P/N (``fully_shard`` frees the full parameters once backward is done
with them, so between steps ZeRO-2 holds what ZeRO-3 does; its 4P + 4P/N + 8P/N is the peak
from forward to backward, when every unit's full parameters are gathered).

With ``--mp`` every stage trains in mixed precision: DDP and ZeRO-1 under float16 autocast
(float32 parameters), ZeRO-2/3 with ``MixedPrecisionPolicy(param_dtype=float16,
reduce_dtype=float32)`` (float16 all-gathers and compute over float32 master shards) and
autocast; the formulas are then the ZeRO paper's for float16 parameters and gradients with
float32 master weights and moments: DDP 2P + 2P + 12P = 16P, ZeRO-1 2P + 2P + 12P/N, ZeRO-2
2P + 2P/N + 12P/N, ZeRO-3 16P/N (see :func:`formulas` for where this code's accounting
differs). For ``fully_shard`` the table also gives ``model.stats``: the step's peak bytes
beyond the shards (gathered units and collective buffers) and the seconds it waited for
communication (what prefetching and overlap did not hide).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

import collectives
import collectives as C
import tensorlib as tl
from ddp import (
    DistributedDataParallel,
    MixedPrecisionPolicy,
    ZeroRedundancyOptimizer,
    fully_shard,
    memory_stats,
)
from tensorlib import Tensor, nn, optim

STAGES = ("ddp", "zero1", "zero2", "zero3")
OUT = 5
LR = 1e-3


class Block(nn.Module):
    """Residual Linear(W, 4W) -> ReLU -> Linear(4W, W)."""

    def __init__(self, width: int, gen: tl.Generator) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width, dtype="float32", generator=gen)
        self.act = nn.ReLU()
        self.down = nn.Linear(4 * width, width, dtype="float32", generator=gen)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(self.act(self.up(x)))


class Model(nn.Module):
    """``blocks`` Blocks and a Linear(W, 5) head, float32."""

    def __init__(self, width: int, blocks: int, seed: int = 0) -> None:
        super().__init__()
        gen = tl.Generator(seed)
        self.blocks = nn.ModuleList([Block(width, gen) for _ in range(blocks)])
        self.head = nn.Linear(width, OUT, dtype="float32", generator=gen)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def num_params(width: int, blocks: int) -> int:
    """P of :class:`Model`."""
    return blocks * (8 * width * width + 5 * width) + OUT * width + OUT


def build(stage: str, width: int, blocks: int, seed: int = 0, mp: bool = False) -> tuple[Any, Any]:
    """The model under ``stage`` and its AdamW (every rank calls it alike); with ``mp``
    ``fully_shard`` gathers in float16 and reduces in float32."""
    model: Any = Model(width, blocks, seed)
    kw: dict[str, Any] = {"lr": LR, "weight_decay": 0.01}
    if stage in ("ddp", "zero1"):
        model = DistributedDataParallel(model)
        if stage == "zero1":
            return model, ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, **kw)
        return model, optim.AdamW(model.parameters(), **kw)
    if stage not in ("zero2", "zero3"):
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    reshard = stage == "zero3"
    policy = MixedPrecisionPolicy(param_dtype=tl.float16, reduce_dtype=tl.float32) if mp else None
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    return model, optim.AdamW(model.parameters(), **kw)


def batch(width: int, rows: int, step: int) -> tuple[Tensor, Tensor]:
    """This rank's batch for ``step`` (different on every rank)."""
    rng = np.random.default_rng([step, C.get_rank()])
    x = rng.standard_normal((rows, width)).astype(np.float32)
    y = rng.standard_normal((rows, OUT)).astype(np.float32)
    return tl.tensor(x), tl.tensor(y)


def gathered_bytes(model: Any) -> int:
    """Bytes of the ``fully_shard`` units' full parameters gathered right now."""
    total = 0
    for m in model.modules():
        unit = m.__dict__.get("_fsdp_unit")
        if unit is not None and unit.buffer.gathered:
            total += int(unit.buffer.array.nbytes)
    return total


def train_step(model: Any, opt: Any, width: int, rows: int, step: int, mp: bool = False) -> int:
    """One AdamW step (under float16 autocast with ``mp``); returns the full parameters still
    gathered at the end of forward."""
    x, y = batch(width, rows, step)
    opt.zero_grad()
    with tl.autocast(dtype=tl.float16, enabled=mp):
        out = model(x)
    held = gathered_bytes(model)
    loss = ((out.astype(tl.float32) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return held


def formulas(stage: str, p: int, n: int, mp: bool = False) -> dict[str, float]:
    """Bytes per rank after a step, float32 without mixed precision (see the module doc), or
    with ``mp`` the issue's mixed-precision formulas (float16 parameters and gradients,
    float32 master weights and Adam moments, counted under "optimizer"). This code's
    accounting differs from them: DDP and ZeRO-1 keep float32 parameters and gradients under
    autocast (4P + 4P instead of 2P + 2P + the 4P master weights, the same 16P for DDP, but
    ZeRO-1 holds 8P + 8P/N, not 4P + 12P/N: its master weights are the replicated float32
    parameters), and ``fully_shard`` keeps no float16 copy between steps and reduces into
    float32 gradient shards (ZeRO-2 and ZeRO-3 both hold 16P/N after the step, under ZeRO-2's
    2P + 14P/N)."""
    if mp:
        half, master = 2.0 * p, 12.0 * p
        table_mp = {
            "ddp": (half, half, master),
            "zero1": (half, half, master / n),
            "zero2": (half, half / n, master / n),
            "zero3": (half / n, half / n, master / n),
        }
        a, b, c = table_mp[stage]
        return {"parameters": a, "gradients": b, "optimizer": c}
    full, shard = 4.0 * p, 4.0 * p / n
    table = {
        "ddp": (full, full, 2 * full),
        "zero1": (full, full, 2 * shard),
        "zero2": (shard, shard, 2 * shard),
        "zero3": (shard, shard, 2 * shard),
    }
    a, b, c = table[stage]
    return {"parameters": a, "gradients": b, "optimizer": c}


def padding_bound(width: int, blocks: int, n: int) -> int:
    """Most bytes sharding can add per rank: under fully_shard one padding row per parameter
    (its row's elements) in each of parameters, gradients and the two Adam moments (16 bytes
    an element); ZeRO-1's flat partition is even within a few elements, far under this."""
    rows = blocks * (width + 1 + 4 * width + 1) + width + 1
    return 16 * rows if n > 1 else 0


class TrafficCounter:
    """Bytes this rank sends, counted from the collectives issued on a group (its methods
    wrapped), with the ring algorithms' factors (N ranks, B the input's bytes):
    all-reduce 2(N-1)/N B, all-gather (N-1) B (B is one rank's part), reduce-scatter
    (N-1)/N B (B the full input), broadcast (N-1)/N B."""

    FACTORS: ClassVar[dict[str, Callable[[int], float]]] = {
        "all_reduce": lambda n: 2 * (n - 1) / n,
        "all_gather": lambda n: float(n - 1),
        "reduce_scatter": lambda n: (n - 1) / n,
        "broadcast": lambda n: (n - 1) / n,
    }

    def __init__(self) -> None:
        self.sent: dict[str, float] = {k: 0.0 for k in self.FACTORS}
        self.calls: dict[str, int] = {k: 0 for k in self.FACTORS}

    @property
    def total(self) -> float:
        return sum(self.sent.values())

    @contextmanager
    def counting(self, group: Any = None) -> Iterator[TrafficCounter]:
        """Count what ``group`` (the default group when None) is asked to send meanwhile."""
        group = group if group is not None else C.get_default_group()
        n = group.size
        for name, factor in self.FACTORS.items():
            setattr(group, name, self._wrap(name, getattr(group, name), factor(n)))
        try:
            yield self
        finally:
            for name in self.FACTORS:
                delattr(group, name)  # back to the class's method

    def _wrap(self, name: str, fn: Callable[..., Any], factor: float) -> Callable[..., Any]:
        def counted(x: Any, *args: Any, **kwargs: Any) -> Any:
            self.sent[name] += factor * int(x.nbytes)
            self.calls[name] += 1
            return fn(x, *args, **kwargs)

        return counted


# ---------------------------------------------------------------------- rank worker
@dataclass
class Config:
    width: int = 96
    blocks: int = 8
    rows: int = 16
    steps: int = 9
    cap_mb: float = 8.0
    max_width: int = 1024
    worlds: list[int] = field(default_factory=lambda: [2, 4])
    mp: bool = False


def _slowest(value: float) -> float:
    """The largest of every rank's ``value`` (a collective)."""
    return float(max(C.get_default_group().all_gather_object(value)))


def measure(stage: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Memory after one step, gathered bytes at the end of forward, traffic of the second."""
    w, b, rows, mp = cfg["width"], cfg["blocks"], cfg["rows"], cfg["mp"]
    model, opt = build(stage, w, b, mp=mp)
    held = train_step(model, opt, w, rows, 0, mp)
    mem = memory_stats(model, opt)
    counter = TrafficCounter()
    with counter.counting():
        train_step(model, opt, w, rows, 1, mp)
    stats = getattr(model, "stats", None)
    peak = getattr(stats, "peak_bytes", None)
    return {"memory": mem, "held_at_forward_end": held, "sent": counter.total, "peak": peak}


def _fits(stage: str, width: int, cfg: dict[str, Any]) -> bool:
    model, opt = build(stage, width, cfg["blocks"], mp=cfg["mp"])
    held = train_step(model, opt, width, cfg["rows"], 0, cfg["mp"])
    # fully_shard: its peak beyond the shards during the step (gathered units and collective
    # buffers, which include what is still gathered at the end of forward); DDP's and ZeRO-1's
    # transient collective buffers are not counted (their gradients are DDP's buckets).
    peak = getattr(getattr(model, "stats", None), "peak_bytes", None)
    mine = sum(memory_stats(model, opt).values()) + (held if peak is None else max(held, peak))
    return _slowest(float(mine)) <= cfg["cap_mb"] * 1e6


def largest(stage: str, cfg: dict[str, Any]) -> int:
    """The widest model (a multiple of 4) whose step fits the cap on every rank, or 0."""
    lo, hi = 0, 4
    while hi <= cfg["max_width"] and _fits(stage, hi, cfg):
        lo, hi = hi, hi * 2
    hi = min(hi, cfg["max_width"] + 4)
    while hi - lo > 4:
        mid = (lo + hi) // 8 * 4
        if _fits(stage, mid, cfg):
            lo = mid
        else:
            hi = mid
    return lo


def worker(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every measurement at this world size (rank 0's return value is the report's)."""
    w, b, rows = cfg["width"], cfg["blocks"], cfg["rows"]
    out: dict[str, Any] = {"world": C.get_world_size(), "P": num_params(w, b), "stages": {}}
    for stage in STAGES:
        out["stages"][stage] = measure(stage, cfg)
    # Step time: the four stages alternate step by step, in an order rotated every round.
    mp = cfg["mp"]
    built = {s: build(s, w, b, mp=mp) for s in STAGES}
    for m, o in built.values():
        train_step(m, o, w, rows, 0, mp)  # warm-up
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    waits: dict[str, list[float]] = {s: [] for s in STAGES}
    for r in range(cfg["steps"]):
        order = STAGES[r % 4 :] + STAGES[: r % 4]
        for s in order:
            m, o = built[s]
            C.get_default_group().barrier()
            t0 = time.perf_counter()
            train_step(m, o, w, rows, r + 1, mp)
            times[s].append(_slowest(time.perf_counter() - t0))
            waits[s].append(_slowest(m.stats.wait_s))  # DDP's and fully_shard's stats
    for s in STAGES:
        out["stages"][s]["step_s"] = statistics.median(times[s])
        out["stages"][s]["wait_s"] = statistics.median(waits[s])
    del built
    for s in STAGES:
        width = largest(s, cfg)
        out["stages"][s]["cap_width"] = width
        out["stages"][s]["cap_params"] = num_params(width, b) if width else 0
    return out


# ---------------------------------------------------------------------- report
def report(cfg: Config, runs: list[dict[str, Any]]) -> str:
    """The Markdown tables of :func:`worker`'s results, one block per world size."""
    lines: list[str] = []
    for run in runs:
        n, p = run["world"], run["P"]
        st = run["stages"]
        lines += [
            f"N = {n}, P = {p:,} (width {cfg.width}, {cfg.blocks} blocks, "
            f"{'mixed precision' if cfg.mp else 'float32'}, AdamW), "
            f"cap {cfg.cap_mb:g} MB per rank",
            "",
            "| stage | params MB | grads MB | optim MB | total MB | formula MB | ratio "
            "| gathered at fwd end MB | peak extra MB | sent MB/step | x DDP | step ms | x DDP "
            "| wait ms | largest P under cap | x DDP |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = st["ddp"]
        for s in STAGES:
            r = st[s]
            mem = r["memory"]
            total = sum(mem.values())
            want = sum(formulas(s, p, n, cfg.mp).values())
            peak = "-" if r.get("peak") is None else f"{r['peak'] / 1e6:.3f}"
            lines.append(
                f"| {s} | {mem['parameters'] / 1e6:.3f} | {mem['gradients'] / 1e6:.3f} "
                f"| {mem['optimizer'] / 1e6:.3f} | {total / 1e6:.3f} | {want / 1e6:.3f} "
                f"| {total / want:.3f} | {r['held_at_forward_end'] / 1e6:.3f} | {peak} "
                f"| {r['sent'] / 1e6:.3f} | {r['sent'] / base['sent']:.2f} "
                f"| {r['step_s'] * 1e3:.1f} | {r['step_s'] / base['step_s']:.2f} "
                f"| {r['wait_s'] * 1e3:.2f} | {r['cap_params']:,} | "
                f"{r['cap_params'] / base['cap_params'] if base['cap_params'] else 0:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run each world size, print the tables."""
    d = Config()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--width", type=int, default=d.width, help="model width (memory, time)")
    p.add_argument("--blocks", type=int, default=d.blocks)
    p.add_argument("--rows", type=int, default=d.rows, help="per-rank batch rows")
    p.add_argument("--steps", type=int, default=d.steps, help="timed rounds")
    p.add_argument("--cap-mb", type=float, default=d.cap_mb, help="per-rank memory cap")
    p.add_argument("--max-width", type=int, default=d.max_width, help="largest width tried")
    p.add_argument("--worlds", type=int, nargs="+", default=d.worlds)
    p.add_argument("--mp", action="store_true", help="mixed precision (see above)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    a = p.parse_args(argv)
    cfg = Config(a.width, a.blocks, a.rows, a.steps, a.cap_mb, a.max_width, a.worlds, a.mp)
    runs = []
    for n in cfg.worlds:
        print(f"running N = {n} (cpu backend) ...", file=sys.stderr, flush=True)
        got = collectives.spawn(worker, args=(asdict(cfg),), nprocs=n, backend="cpu")
        assert got is not None
        runs.append(got[0])
    print(report(cfg, runs))
    if a.json:
        Path(a.json).write_text(json.dumps({"config": asdict(cfg), "runs": runs}, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
