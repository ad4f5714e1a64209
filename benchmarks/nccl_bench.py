"""All-reduce over NCCL: this project's nccl backend against NCCL called directly, side by side.

    python -m benchmarks.nccl_bench --world 4 [--json out.json] [--max-bytes 1073741824]

Starts ``--world`` ranks as processes on this host (several ranks share a GPU when there are
fewer GPUs: that needs NCCL >= 2.30, and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` is set for them).
Every rank runs the same float32 SUM all-reduce sweep, 8 B .. ``--max-bytes`` by factors of
4, in place, through:

* ``ours``: ``collectives.all_reduce`` on a CuPy array (the nccl backend, signature check on);
* ``ours-nocheck``: the same with the signature check off (``DPT_NCCL_CHECK=0`` behaviour);
* ``raw``: ``ncclAllReduce`` through this project's ctypes binding, on the backend's own
  communicator, with nothing around it (same library as ``ours``);
* ``cupy``: ``cupy.cuda.nccl.NcclCommunicator.allReduce`` (CuPy's own NCCL binding);
* ``torch``: ``torch.distributed.all_reduce`` over NCCL, when torch is installed.

For each it prints the time per call (GPU time between events on the caller's stream), algbw,
busbw (algbw * 2(n-1)/n) and the host time to issue one call (200 back-to-back calls of the
smallest size, before any synchronization), checks every size's result once (ours), and
states the targets: busbw >= 95% of raw NCCL at >= 64 MiB, host overhead no worse than torch's.
It exits non-zero when a rank fails or a result is wrong (missed targets are reported, not
failed: these machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from collectives.run import free_port

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ["ours", "ours-nocheck", "raw", "cupy", "torch"]
HOST_CALLS = 200


def sizes_up_to(max_bytes: int) -> list[int]:
    """8 B, 32 B, ... (x4) up to ``max_bytes``."""
    out, b = [], 8
    while b <= max_bytes:
        out.append(b)
        b *= 4
    return out


def iters_for(nbytes: int) -> int:
    """Timed calls per size: many for small messages, at least 5 for the largest."""
    return max(5, min(HOST_CALLS, (256 << 20) // max(nbytes, 1)))


# ---------------------------------------------------------------------------- one rank
def worker(out_dir: Path, max_bytes: int, impls: list[str]) -> int:
    """One rank (RANK/WORLD_SIZE/... from the environment): the sweep, results to JSON."""
    import collectives as C

    C.init_process_group("nccl", timeout=120)
    try:
        return measure(out_dir, max_bytes, impls)
    finally:
        C.destroy_process_group()


def measure(out_dir: Path, max_bytes: int, impls: list[str]) -> int:
    """The sweep on the default group (already initialized on the nccl backend); writes
    ``rank{r}.json`` to ``out_dir`` and returns 1 when a result was wrong."""
    import cupy as cp
    import numpy as np

    import collectives as C
    from collectives import ReduceOp
    from collectives.backends.nccl import binding

    group = C.get_default_group()
    rank, n = group.rank, group.size
    backend: Any = group.backend
    lib = backend.lib
    stream = cp.cuda.get_current_stream()
    sizes = sizes_up_to(max_bytes)
    buf = cp.zeros(max(sizes) // 4, dtype=cp.float32)
    result: dict[str, Any] = {"world": n, "rank": rank, "device": backend.device, "impls": {}}
    result["nccl_ours"] = lib.version_string

    def sync_all() -> None:
        stream.synchronize()
        C.barrier()

    def sweep(name: str, issue: Any) -> dict[str, Any]:
        rows = []
        for nbytes in sizes:
            count = nbytes // 4
            x = buf[:count]
            for _ in range(2 if nbytes > (1 << 20) else 5):
                issue(x)
            iters = iters_for(nbytes)
            sync_all()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            t0 = time.perf_counter()
            for _ in range(iters):
                issue(x)
            host = time.perf_counter() - t0
            end.record(stream)
            end.synchronize()
            gpu_s = cp.cuda.get_elapsed_time(start, end) / 1e3 / iters
            rows.append({"bytes": nbytes, "iters": iters, "s": gpu_s, "host_s": host / iters})
        # Every rank's slowest: the collective takes as long as its slowest rank.
        times = np.array([r["s"] for r in rows] + [r["host_s"] for r in rows], dtype=np.float64)
        C.all_reduce(times, "MAX")
        for i, r in enumerate(rows):
            r["s"], r["host_s"] = float(times[i]), float(times[len(rows) + i])
        return {"rows": rows}

    failures: list[str] = []

    def ours(x: Any) -> None:
        C.all_reduce(x)

    if "ours" in impls:
        # Correctness of every size once (through the backend), then the timed sweep.
        for nbytes in sizes:
            x = buf[: nbytes // 4]
            x.fill(1.0)
            C.all_reduce(x)
            got = (float(x[0]), float(x[-1]))
            if got != (float(n), float(n)):
                failures.append(f"ours: all_reduce of {nbytes} B of ones gave {got}, not {n}")
        result["impls"]["ours"] = sweep("ours", ours)
    if "ours-nocheck" in impls:
        backend.check = False
        result["impls"]["ours-nocheck"] = sweep("ours-nocheck", ours)
        backend.check = True
    if "raw" in impls:
        f32, add = binding.FLOAT32, binding.nccl_op(ReduceOp.SUM)

        def raw(x: Any) -> None:
            p = int(x.data.ptr)
            rc = lib.all_reduce(p, p, x.size, f32, add, backend.comm, stream.ptr)
            if rc == binding.IN_PROGRESS:
                while lib.comm_get_async_error(backend.comm) == binding.IN_PROGRESS:
                    time.sleep(0.0001)

        result["impls"]["raw"] = sweep("raw", raw)
    result["failures"] = failures
    save = out_dir / f"rank{rank}.json"
    save.write_text(json.dumps(result))  # what is known so far survives a later hang
    gpus = int(cp.cuda.runtime.getDeviceCount())
    if "cupy" in impls:
        result["impls"]["cupy"] = _cupy_sweep(group, sweep, result, gpus)
        save.write_text(json.dumps(result))
    if "torch" in impls:
        result["impls"]["torch"] = _torch_sweep(group, sizes, result, gpus)
        save.write_text(json.dumps(result))
    return 1 if failures else 0


def _shares_gpu_ok(version: tuple[int, ...], world: int, gpus: int) -> str | None:
    """None when ``world`` ranks may run on ``gpus`` GPUs with an NCCL of ``version``."""
    if world <= gpus or tuple(version[:2]) >= (2, 30):
        return None
    return (
        f"NCCL {'.'.join(map(str, version))} refuses {world} ranks on {gpus} GPU(s) "
        "('Duplicate GPU detected'; 2.30+ allows it)"
    )


def cupy_communicator(cn: Any, size: int, uid: Any, rank: int) -> Any:
    """``cn.NcclCommunicator`` from a unique id as rank 0 made it or as bytes from the store.

    CuPy 14 takes the id as ``bytes``; CuPy 13 as a tuple of 128 signed chars. The form is
    tried in that order: a wrong one is refused (TypeError) before NCCL is called.
    """
    raw = bytes(v & 0xFF for v in uid)
    try:
        return cn.NcclCommunicator(size, raw, rank)
    except TypeError:
        return cn.NcclCommunicator(size, tuple(b - 256 if b > 127 else b for b in raw), rank)


def _cupy_sweep(group: Any, sweep: Any, result: dict[str, Any], gpus: int) -> dict[str, Any]:
    """CuPy's NCCL binding on its own communicator (its NCCL may be another version)."""
    try:
        from cupy.cuda import nccl as cn

        from collectives.backends.nccl import version_tuple

        code = int(cn.get_version())
        result["nccl_cupy"] = ".".join(map(str, version_tuple(code)))
        refused = _shares_gpu_ok(version_tuple(code), group.size, gpus)
        if refused:
            return {"error": refused}
        store = group.info.store
        if group.rank == 0:
            uid = cn.get_unique_id()
            if store is not None:
                store.set("bench/cupy-uid", bytes(v & 0xFF for v in uid))
        else:
            uid = store.get("bench/cupy-uid", timeout=60)
        comm = cupy_communicator(cn, group.size, uid, group.rank)
    except Exception as exc:  # CuPy without NCCL, or an NCCL that refuses ranks sharing a GPU
        return {"error": f"{type(exc).__name__}: {exc}"}
    import cupy as cp

    stream = cp.cuda.get_current_stream()

    def issue(x: Any) -> None:
        p = int(x.data.ptr)
        comm.allReduce(p, p, x.size, cn.NCCL_FLOAT32, cn.NCCL_SUM, stream.ptr)

    try:
        return dict(sweep("cupy", issue))
    finally:
        comm.destroy()


def _torch_sweep(group: Any, sizes: list[int], result: dict[str, Any], gpus: int) -> dict[str, Any]:
    """torch.distributed over NCCL on the same sizes (its own process group and NCCL)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return {"error": "torch is not installed"}
    try:
        dev = group.backend.device
        torch.cuda.set_device(dev)
        version = tuple(torch.cuda.nccl.version())
        result["nccl_torch"] = ".".join(map(str, version))
        refused = _shares_gpu_ok(version, group.size, gpus)
        if refused:
            return {"error": refused}
        port = int(os.environ["MASTER_PORT"]) + 1
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=group.rank,
            world_size=group.size,
        )
        t = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=f"cuda:{dev}")
        stream = torch.cuda.current_stream()
        rows = []
        for nbytes in sizes:
            x = t[: nbytes // 4]
            for _ in range(2 if nbytes > (1 << 20) else 5):
                dist.all_reduce(x)
            iters = iters_for(nbytes)
            torch.cuda.synchronize()
            dist.barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            host = time.perf_counter() - t0
            end.record(stream)
            end.synchronize()
            rows.append(
                {
                    "bytes": nbytes,
                    "iters": iters,
                    "s": start.elapsed_time(end) / 1e3 / iters,
                    "host_s": host / iters,
                }
            )
        dist.destroy_process_group()
        return {"rows": rows}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------------- the parent
def run_world(
    world: int, out_dir: Path, max_bytes: int, impls: list[str], timeout: float
) -> tuple[int, dict[str, Any] | None, str]:
    """Start ``world`` ranks; return (exit status, rank 0's results, output tail)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(ROOT),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NCCL_MULTI_RANK_GPU_ENABLE="1",
        )
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.nccl_bench",
            "--worker",
            str(out_dir),
            "--max-bytes",
            str(max_bytes),
            "--impls",
            ",".join(impls),
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    deadline = time.monotonic() + timeout
    tails, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            codes.append(124)
        tails.append(out.decode(errors="replace")[-2000:])
    rc = next((c for c in codes if c != 0), 0)
    path = out_dir / "rank0.json"
    data = json.loads(path.read_text()) if path.exists() else None
    return rc, data, "\n".join(f"--- rank {i}\n{t}" for i, t in enumerate(tails) if t.strip())


def _fmt_bytes(b: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << k:
            return f"{b / (1 << k):g} {unit}"
    return f"{b} B"


def table(data: dict[str, Any]) -> list[str]:
    """Markdown: per size, each implementation's time and busbw (algbw at one rank)."""
    n = int(data["world"])
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    bw_name = "busbw" if n > 1 else "algbw"
    impls = [k for k in IMPLS if "rows" in data["impls"].get(k, {})]
    head = "| size | " + " | ".join(f"{k} us | {k} {bw_name} GB/s" for k in impls) + " |"
    lines = [head, "|---|" + "---|---|" * len(impls)]
    rows = {k: {r["bytes"]: r for r in data["impls"][k]["rows"]} for k in impls}
    for nbytes in sorted(rows[impls[0]]) if impls else []:
        cells = []
        for k in impls:
            r = rows[k].get(nbytes)
            if r is None:
                cells.append("| - | -")
                continue
            bw = nbytes / r["s"] / 1e9 * factor
            cells.append(f"| {r['s'] * 1e6:.1f} | {bw:.1f}")
        lines.append(f"| {_fmt_bytes(nbytes)} " + " ".join(cells) + " |")
    return lines


def summary(data: dict[str, Any]) -> list[str]:
    """Host overhead per call and the targets, as text lines."""
    impls = data["impls"]
    out = []
    host = {
        k: v["rows"][0]["host_s"] * 1e6
        for k, v in impls.items()
        if "rows" in v and v["rows"] and v["rows"][0]["bytes"] == 8
    }
    out.append(
        "host time to issue one 8 B all_reduce: "
        + ", ".join(f"{k} {v:.1f} us" for k, v in host.items())
    )
    for k, v in impls.items():
        if "error" in v:
            out.append(f"{k}: not measured: {v['error']}")
    ref_name = "raw" if "rows" in impls.get("raw", {}) else "cupy"
    if "rows" in impls.get("ours", {}) and "rows" in impls.get(ref_name, {}):
        ref = {r["bytes"]: r["s"] for r in impls[ref_name]["rows"]}
        ratios = [
            ref[r["bytes"]] / r["s"]
            for r in impls["ours"]["rows"]
            if r["bytes"] >= (64 << 20) and r["bytes"] in ref
        ]
        if ratios:
            worst = min(ratios)
            verdict = "met" if worst >= 0.95 else "MISSED"
            out.append(
                f"target busbw >= 95% of {ref_name} NCCL at >= 64 MiB: {verdict} "
                f"(worst {worst:.1%})"
            )
    if "torch" in host and "ours" in host:
        verdict = "met" if host["ours"] <= host["torch"] else "MISSED"
        out.append(
            f"target host overhead <= torch's: {verdict} "
            f"(ours {host['ours']:.1f} us, torch {host['torch']:.1f} us)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the sweep at one world size (or be one of its ranks)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=1, help="ranks (processes) on this host")
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument(
        "--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS)
    )
    p.add_argument("--json", type=Path, help="write rank 0's results here")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    impls = [s for s in args.impls.split(",") if s]
    if args.worker is not None:
        return worker(args.worker, args.max_bytes, impls)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nccl-bench-") as tmp:
        rc, data, tail = run_world(args.world, Path(tmp), args.max_bytes, impls, args.timeout)
    if data is None:
        print(f"nccl_bench: world {args.world} failed (rc={rc}):\n{tail}", file=sys.stderr)
        return rc or 1
    print(f"NCCL all_reduce, float32 SUM, world size {args.world}")
    print("\n".join(table(data)))
    print("\n".join(summary(data)))
    for f in data.get("failures", []):
        print("FAILED:", f)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    if rc:
        print(tail, file=sys.stderr)
    return rc or (1 if data.get("failures") else 0)


if __name__ == "__main__":
    raise SystemExit(main())
