"""DDP training step at 1 and 2 ranks on the cpu backend: scaling, waiting and bucket sizes.

    python -m benchmarks.ddp_scaling                       # wide MLP, per-rank batch 8
    python -m benchmarks.ddp_scaling --json ddp.json
    python -m benchmarks.ddp_scaling --width 2048 --depth 4 --batch 16 --bucket-cap-mb 8
    .venv-bench/bin/python -m benchmarks.ddp_scaling       # + torch DDP (gloo), same shapes
    python -m benchmarks.ddp_scaling --threads             # + the 2 ranks as threads

Weak scaling at equal per-rank batch: a step is forward, cross-entropy, backward (which, under
DDP, returns once every gradient is averaged) and SGD with momentum. Two ranks are started
once (``collectives.spawn``) with one BLAS/OpenMP thread each (set in their environment
before NumPy loads, checked with threadpoolctl when installed), and alternate in rounds
(in an order rotated every round, so that a noisy neighbour hits all alike) between:

- 1 rank: rank 0 alone trains the plain model, then the same model under DDP at world size 1
  (a one-rank group: no communication), while rank 1 waits at a barrier;
- 2 ranks, no comm: both train the plain model at once without communicating. This is the
  machine's own limit: what two processes cost each other in cores, caches and memory
  bandwidth (and what other tenants take), with no DDP at all;
- 2 ranks, DDP: both train the model under DDP over the cpu backend;
- comm: an all-reduce of buckets of exactly DDP's sizes with nothing else running (what
  communication costs when nothing overlaps it).

Reported per configuration (medians over the timed steps; at 2 ranks the slower rank's):
forward, backward (including DDP's wait), ``stats.wait_s`` (how long the end of backward
waited for communication), optimizer and whole-step times. Then the bucket sizes, the
standalone all-reduce as a share of the 1-rank backward, how much of it the 2-rank backward
still waited for, and the scaling efficiency (1-rank step / 2-rank step) against the target
2-rank step <= 1.10x the 1-rank step, split into the machine's part (no comm / 1 rank) and
DDP's part (DDP / no comm).

With torch importable (``.venv-bench``), the same protocol runs again with torch eager and
torch DDP over gloo on the same shapes, and the two are shown side by side. With
``--threads`` it runs once more with the two ranks as threads of one fresh process (the
threads backend, same model and protocol) and prints the two kinds of ranks side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import collectives
from benchmarks._bench_ddp import THREAD_VARS, Config, threads_job, tl_worker, torch_worker
from benchmarks._bench_math import human

TARGET = 1.10  # the 2-rank step may take at most this multiple of the 1-rank step


# ---------------------------------------------------------------------------- report
def _fmt_row(label: str, row: dict[str, float] | None) -> str:
    if row is None:
        return f"{label:<24}" + " " * 45
    wait = row["wait"]
    wait_s = f"{wait:8.2f}" if wait == wait else f"{'-':>8}"
    return (
        f"{label:<24}{row['fwd']:8.2f} {row['bwd']:8.2f} {wait_s} {row['opt']:8.2f} "
        f"{row['step']:8.2f}"
    )


def report(
    cfg: Config, ours: dict[str, Any], theirs: dict[str, Any] | None, why: str
) -> dict[str, Any]:
    """Print the tables and verdict; return the JSON summary."""
    _print_tables(cfg, ours, theirs)
    summary = _print_verdict(cfg, ours)
    if theirs:
        summary["torch"] = _print_torch(theirs, ours["rows"]["ddp2"]["step"])
    else:
        print(f"torch: not run ({why})")
        summary["torch"] = {"skipped": why}
    return summary


def _print_tables(cfg: Config, ours: dict[str, Any], theirs: dict[str, Any] | None) -> None:
    """The run's description, then a row per configuration (torch's beside ours)."""
    rows = ours["rows"]
    total = sum(ours["buckets"])
    head = f"{'':<24}{'fwd ms':>8} {'bwd ms':>8} {'wait ms':>8} {'opt ms':>8} {'step ms':>8}"
    threads = ours["threads"]
    if threads["checked"]:
        tdesc = ", ".join(f"{p['api']} {p['threads']}" for p in threads["pools"])
        tdesc = f"threadpoolctl: {tdesc} thread(s) per rank"
    else:
        tdesc = "threadpoolctl not installed; " + ", ".join(
            f"{k}={v}" for k, v in threads["env"].items()
        )
    print(
        f"DDP training step, MLP {'-'.join(map(str, cfg.dims()))} "
        f"({total / 2**20:.1f} MiB of float32 gradients), per-rank batch {cfg.batch}, "
        f"SGD momentum\ncpu backend, 2 ranks on {os.cpu_count()} cores, {tdesc}; "
        f"medians of {cfg.rounds} rounds x {cfg.steps} steps (phases rotated every round)\n"
    )
    print("tensorlib + ddp" + (" " * 9 + "| torch " + torch_version() if theirs else ""))
    print(head + ("  | " + head.strip() if theirs else ""))
    labels = [
        ("1 rank, no DDP", "plain"),
        ("1 rank, DDP (1-rank grp)", "ddp1"),
        ("2 ranks, no comm", "indep2"),
        ("2 ranks, DDP", "ddp2"),
    ]
    for label, key in labels:
        line = _fmt_row(label, rows.get(key))
        if theirs:
            trow = theirs["rows"].get(key)  # torch exposes no wait time: shown as "-"
            line += "  | " + (_fmt_row("", trow).strip() if trow else "")
        print(line)


def _print_verdict(cfg: Config, ours: dict[str, Any]) -> dict[str, Any]:
    """Buckets, the all-reduce's share, the wait, the scaling verdict and its two parts;
    the JSON summary of ours."""
    buckets = ours["buckets"]
    rows = ours["rows"]
    t1, t2 = rows["plain"]["step"], rows["ddp2"]["step"]
    bwd1 = rows["plain"]["bwd"]
    comm = ours["allreduce_alone_ms"]
    wait2 = rows["ddp2"]["wait"]
    ratio = t2 / t1
    sizes = ", ".join(human(b, whole_within=0.05) for b in buckets)
    print(
        f"\nbuckets: {len(buckets)} [{sizes}] (first {cfg.first_bucket_mb:g} MiB, cap "
        f"{cfg.bucket_cap_mb:g} MiB); started during backward: "
        f"{rows['ddp2'].get('launched_in_backward', '?')} of {len(buckets)}"
    )
    print(
        f"all-reduce of those buckets alone, 2 ranks: {comm:.2f} ms = {comm / bwd1:.0%} of the "
        f"1-rank backward ({bwd1:.2f} ms)  [model choice: >= 20% wanted]"
    )
    print(
        f"waiting after backward at 2 ranks (stats.wait_s): {wait2:.2f} ms = "
        f"{wait2 / comm:.0%} of that all-reduce ({1 - min(wait2 / comm, 1):.0%} hidden by overlap)"
    )
    met = ratio <= TARGET
    print(
        f"scaling efficiency (1-rank step / 2-rank step): {t1 / t2:.2f}; 2-rank step = "
        f"{ratio:.2f}x the 1-rank step: target <= {TARGET:.2f}x {'MET' if met else 'NOT met'}"
    )
    ddp1, indep = rows["ddp1"]["step"], rows["indep2"]["step"]
    print(
        f"of which: two processes at once, no communication (this machine's own limit): "
        f"{indep / t1:.2f}x; DDP on top of that: {t2 / indep:.2f}x"
    )
    # Without an idle core nothing hides the all-reduce's CPU time: the best a DDP step can
    # do here is the two-process step without communication plus the all-reduce alone.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    floor = (indep + comm) / t1
    if (cores or 1) <= 2:
        print(
            f"no idle core ({cores} cores, 2 ranks): best possible here = (no-comm step + "
            f"all-reduce alone) / 1-rank step = {floor:.2f}x; DDP reached {ratio:.2f}x"
        )
    i2, d2 = rows["indep2"], rows["ddp2"]
    print(
        f"DDP's extra time at 2 ranks over no comm: backward {d2['bwd'] - i2['bwd']:+.2f} ms "
        f"(of which waiting {d2['wait']:.2f} ms), optimizer {d2['opt'] - i2['opt']:+.2f} ms, "
        f"forward {d2['fwd'] - i2['fwd']:+.2f} ms"
    )
    print(f"DDP at world size 1 costs {ddp1 / t1 - 1:+.1%} over the plain step")
    summary: dict[str, Any] = {
        "config": asdict(cfg),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "threads": ours["threads"],
        "bucket_bytes": buckets,
        "rows_ms": rows,
        "allreduce_alone_ms": comm,
        "comm_share_of_backward": comm / bwd1,
        "wait_share_of_comm": wait2 / comm,
        "efficiency": t1 / t2,
        "step_ratio_2_over_1": ratio,
        "machine_ratio_indep2_over_1": indep / t1,
        "floor_without_idle_core": floor,
        "ddp_ratio_2_over_indep2": t2 / indep,
        "target_ratio": TARGET,
        "target_met": met,
    }
    return summary


def _print_torch(theirs: dict[str, Any], t2: float) -> dict[str, Any]:
    """torch DDP's efficiency and ours against it (``t2``: our 2-rank step); its summary."""
    tt1, tt2 = theirs["rows"]["plain"]["step"], theirs["rows"]["ddp2"]["step"]
    tcomm = theirs["allreduce_alone_ms"]
    print(
        f"torch DDP (gloo): efficiency {tt1 / tt2:.2f} (2-rank step = {tt2 / tt1:.2f}x "
        f"the 1-rank step); gloo all-reduce of the same bucket sizes alone {tcomm:.2f} ms "
        f"= {tcomm / theirs['rows']['plain']['bwd']:.0%} of torch's 1-rank backward"
    )
    print(f"2-rank step, tensorlib+ddp / torch DDP: {t2 / tt2:.2f}x")
    return {
        "version": torch_version(),
        "rows_ms": theirs["rows"],
        "allreduce_alone_ms": tcomm,
        "efficiency": tt1 / tt2,
    }


def print_threads(ours: dict[str, Any], threads: dict[str, Any]) -> dict[str, Any]:
    """The 2-rank rows of processes (cpu backend) and rank threads side by side."""
    print("\n2 ranks as processes (cpu backend) vs as threads of one process (threads backend)")
    head = f"{'':<24}{'fwd ms':>8} {'bwd ms':>8} {'wait ms':>8} {'opt ms':>8} {'step ms':>8}"
    print(head)
    for label, rows in (("processes", ours["rows"]), ("threads", threads["rows"])):
        print(_fmt_row(f"{label}, DDP", rows["ddp2"]))
        print(_fmt_row(f"{label}, no comm", rows["indep2"]))
    print(
        f"{'all-reduce alone':<24}processes {ours['allreduce_alone_ms']:.2f} ms, threads "
        f"{threads['allreduce_alone_ms']:.2f} ms"
    )
    tp, tt = ours["rows"]["ddp2"]["step"], threads["rows"]["ddp2"]["step"]
    print(f"2-rank DDP step, threads / processes: {tt / tp:.2f}x")
    return {"rows_ms": threads["rows"], "allreduce_alone_ms": threads["allreduce_alone_ms"]}


def torch_version() -> str:
    try:
        import torch
    except ImportError:
        return ""
    return str(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the ranks, print the tables."""
    d = Config()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--width", type=int, default=d.width, help="hidden layer width")
    p.add_argument("--depth", type=int, default=d.depth, help="hidden layers (width x width)")
    p.add_argument("--batch", type=int, default=d.batch, help="per-rank batch size")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per phase")
    p.add_argument("--rounds", type=int, default=d.rounds, help="1-rank/2-rank alternations")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument("--first-bucket-mb", type=float, default=d.first_bucket_mb)
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        metavar="S",
        help="sys.setswitchinterval(S) in each rank: how soon the communication thread gets\n"
        "the GIL back from the training thread (Python's default is 0.005)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the torch DDP comparison")
    p.add_argument(
        "--threads", action="store_true", help="also run the 2 ranks as threads (threads backend)"
    )
    p.add_argument("--json", metavar="PATH", help="write the results here")
    a = p.parse_args(argv)
    # The options named like Config's fields are its values; the rest keep their defaults.
    cfg = Config(**{f.name: getattr(a, f.name) for f in fields(Config) if hasattr(a, f.name)})
    for var in THREAD_VARS:
        # Assigned, not defaulted: a run of "one thread per rank" must not inherit 4.
        os.environ[var] = "1"
    print("running tensorlib + ddp (2 ranks) ...", file=sys.stderr, flush=True)
    results = collectives.spawn(tl_worker, args=(asdict(cfg),), nprocs=2, backend="cpu")
    assert results is not None
    ours = results[0]
    theirs, why = None, ""
    if a.no_torch:
        why = "--no-torch"
    elif not torch_version():
        why = "torch is not importable here; run with .venv-bench/bin/python to compare"
    else:
        print("running torch DDP over gloo (2 ranks) ...", file=sys.stderr, flush=True)
        out = collectives.spawn(
            torch_worker, args=(asdict(cfg), ours["buckets"]), nprocs=2, init=False
        )
        theirs = out[0] if out else None
    summary = report(cfg, ours, theirs, why)
    if a.threads:
        print("running tensorlib + ddp (2 rank threads) ...", file=sys.stderr, flush=True)
        # One fresh process (one BLAS thread, like the ranks above) whose threads are the ranks.
        got = collectives.spawn(threads_job, args=(asdict(cfg),), nprocs=1, backend="serial")
        assert got is not None and got[0] is not None
        summary["threads"] = print_threads(ours, got[0])
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
