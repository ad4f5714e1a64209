"""The GPU check: versions, the `gpu` tests, and GPU timings, in one run of a few minutes.

    python3 -m benchmarks.gpu_check [--out DIR] [--quick]

Run it on a machine with an NVIDIA GPU and CuPy (the `cuda12`/`cuda13` extra) from the
repository root. It prints a Markdown block to paste into docs/gpu-results.md, and with
``--out`` also writes ``gpu-check.md`` and the JSON of each benchmark there. It exits non-zero
when a step fails, and exits 2 at once with the reason when no GPU is usable.

The whole run stays within ``BUDGET_S`` (under eight minutes): each step's timeout is cut to
what is left, keeping time for the steps after it. The NCCL step runs benchmarks/nccl_bench.py
(our nccl backend against NCCL called directly, 8 B .. 1 GiB) at world size 1, and with
several ranks on this host when the GPUs or the NCCL version allow it (NCCL >= 2.30 lets ranks
share a GPU with NCCL_MULTI_RANK_GPU_ENABLE=1). Last, the DDP example trains on NCCL at world
size 1 and, where allowed, 2 (the gpu tests include DDP over NCCL against a CPU reference).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import tensorlib as tl

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 450.0  # the whole check, so that it fits an eight-minute device slot
NCCL_STEP_S = 150.0  # time kept for the NCCL step while earlier steps run


def versions() -> dict[str, Any]:
    """Driver, CUDA runtime, CuPy, NCCL (when its wheel is present), GPU name and memory."""
    import cupy as cp

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cp.cuda.runtime.driverGetVersion(),
    }
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    out["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    out["gpu_memory_gib"] = round(props["totalGlobalMem"] / 2**30, 1)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        out["driver"] = smi.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["driver"] = None
    try:
        from cupy.cuda import nccl

        out["nccl_cupy"] = nccl.get_version()
    except Exception as exc:  # CuPy built without NCCL
        out["nccl_cupy"] = f"unavailable ({type(exc).__name__})"
    try:
        from collectives.backends import _nccl_lib

        lib = _nccl_lib.load()
        out["nccl_ours"] = lib.version_string
        out["nccl_ours_path"] = lib.path
    except Exception as exc:  # no NCCL wheel: the nccl step reports it
        out["nccl_ours"] = f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = None
    return out


def nccl_world_sizes(info: dict[str, Any]) -> tuple[list[int], str]:
    """World sizes for the NCCL step, and why several ranks do or do not run."""
    import cupy as cp

    from collectives.backends._nccl_lib import load, version_code

    gpus = int(cp.cuda.runtime.getDeviceCount())
    try:
        version = load().version
    except Exception as exc:
        return [], f"NCCL unavailable: {exc}"
    if gpus >= 2:
        return [1, min(gpus, 4)], f"{gpus} GPUs: one rank per GPU"
    if version >= version_code(2, 30, 0):
        return [1, 2, 4], "one GPU, NCCL >= 2.30: ranks share it (NCCL_MULTI_RANK_GPU_ENABLE=1)"
    return [1], (
        f"one GPU and NCCL {info.get('nccl_ours')} < 2.30, which refuses ranks sharing a GPU "
        "('Duplicate GPU detected'): world size 1 only"
    )


def nccl_step(
    info: dict[str, Any], out: Path | None, budget: float, log: list[str]
) -> tuple[list[tuple[str, int, str]], list[str]]:
    """The all-reduce sweep through our backend and through NCCL directly."""
    from benchmarks import nccl_bench

    steps: list[tuple[str, int, str]] = []
    md: list[str] = []
    sizes, why = nccl_world_sizes(info)
    print(f"nccl: world sizes {sizes}: {why}", flush=True)
    if not sizes:
        return [("nccl all_reduce", 1, why)], md
    md.append(f"NCCL all_reduce (float32 SUM, in place), world sizes {sizes}: {why}.")
    end = time.monotonic() + budget
    for n in sizes:
        left = end - time.monotonic()
        if left < 20:
            steps.append((f"nccl all_reduce x{n}", 124, "skipped: the time budget ran out"))
            continue
        with tempfile.TemporaryDirectory(prefix="gpu-check-nccl-") as tmp:
            t0 = time.perf_counter()
            rc, data, tail = nccl_bench.run_world(n, Path(tmp), 1 << 30, nccl_bench.IMPLS, left)
            took = time.perf_counter() - t0
        log.append(f"$ nccl_bench --world {n} (rc={rc}, {took:.1f} s)\n{tail}")
        if data is None:
            steps.append((f"nccl all_reduce x{n}", rc or 1, tail.strip()[-300:]))
            print(f"nccl x{n}: FAILED rc={rc}\n{tail[-2000:]}", flush=True)
            continue
        lines = nccl_bench.table(data) + [""] + nccl_bench.summary(data)
        bad = data.get("failures", [])
        code = rc or (1 if bad else 0)
        first = nccl_bench.summary(data)[0] if not bad else "; ".join(bad)[:300]
        steps.append((f"nccl all_reduce x{n}", code, first))
        print(f"nccl x{n}: rc={rc} ({took:.0f} s)\n" + "\n".join(lines), flush=True)
        md += ["", f"World size {n}:", "", *lines]
        if out is not None:
            (out / f"nccl_allreduce_n{n}.json").write_text(json.dumps(data, indent=1))
    return steps, md


def ddp_nccl_steps(
    info: dict[str, Any], py: str, left: Any, log: list[str]
) -> list[tuple[str, int, str]]:
    """The DDP example on NCCL: world size 1, and 2 ranks (one per GPU, or sharing one GPU
    where NCCL allows it)."""
    sizes, why = nccl_world_sizes(info)
    steps: list[tuple[str, int, str]] = []
    for n in [w for w in sizes if w <= 2]:
        env: dict[str, str] = {"NCCL_SOCKET_IFNAME": "lo"}
        if "share" in why:
            env.update(DPT_ALLOW_SHARED_GPU="1", NCCL_MULTI_RANK_GPU_ENABLE="1")
        name = f"examples/train_ddp.py --device cuda --backend nccl --nproc {n}"
        budget = min(150, left())
        if budget < 30:
            steps.append((name, 124, "skipped: the time budget ran out"))
            continue
        with tempfile.TemporaryDirectory(prefix="gpu-check-ddp-") as tmp:
            rc, text, took = run(
                [py, "examples/train_ddp.py", "--device", "cuda", "--backend", "nccl"]
                + ["--nproc", str(n), "--epochs", "8", "--no-progress"]
                + ["--checkpoint", str(Path(tmp) / "ddp.npz")],
                budget,
                log,
                env,
            )
        final = [ln for ln in text.splitlines() if "final test accuracy" in ln]
        steps.append((name, rc, final[-1] if final else text.strip()[-300:]))
        print(f"ddp nccl x{n}: rc={rc} ({took:.0f} s) {steps[-1][2]}", flush=True)
    return steps


def run(
    cmd: list[str], timeout: int, log: list[str], env_extra: dict[str, str] | None = None
) -> tuple[int, str, float]:
    """Run a command from the repo root; return (exit code, output tail, seconds)."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env_extra or {}))
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text += f"\n[timed out after {timeout} s]"
    took = time.perf_counter() - t0
    log.append(f"$ {' '.join(cmd)}  (rc={rc}, {took:.1f} s)\n{text}")
    return rc, text, took


def main(argv: list[str] | None = None) -> int:
    """Run every GPU check and print the Markdown summary."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="directory for gpu-check.md, logs and JSON")
    p.add_argument("--quick", action="store_true", help="fewer benchmark rounds")
    p.add_argument("--skip-nccl", action="store_true", help="leave out the NCCL step")
    args = p.parse_args(argv)
    started = time.monotonic()

    def left(keep: float = 0.0) -> int:
        """Seconds a step may take: what is left of the budget, less ``keep`` for later."""
        return int(max(10.0, BUDGET_S - (time.monotonic() - started) - keep))

    reason = tl.cuda_unavailable_reason()
    if reason is not None:
        print(f"gpu_check: no usable GPU: {reason}", file=sys.stderr)
        return 2
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    info = versions()
    print("versions:", json.dumps(info), flush=True)

    steps: list[tuple[str, int, str]] = []
    py = sys.executable
    nccl_keep = 0.0 if args.skip_nccl else NCCL_STEP_S
    rc, text, took = run(
        [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
        min(420, left(nccl_keep + 120)),
        log,
    )
    summary = [
        ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or "error" in ln
    ]
    steps.append(("pytest -m gpu", rc, summary[-1] if summary else text[-300:]))
    print(f"gpu tests: rc={rc} {steps[-1][2]} ({took:.0f} s)", flush=True)

    nccl_md: list[str] = []
    if not args.skip_nccl:
        nccl_steps, nccl_md = nccl_step(info, args.out, min(NCCL_STEP_S, left(120)), log)
        steps += nccl_steps

    bench_json = (args.out or Path("/tmp")) / "mlp_step_cuda.json"
    rounds = ["--rounds", "3"] if args.quick else []
    rc, text, took = run(
        [py, "-m", "benchmarks.mlp_step", "--device", "cuda", "--json", str(bench_json), *rounds],
        min(240, left(60)),
        log,
    )
    steps.append(("mlp_step --device cuda", rc, text.strip()[-1200:]))
    print(f"mlp_step cuda: rc={rc} ({took:.0f} s)\n{text.strip()}", flush=True)

    rc, text, took = run(
        [py, "examples/train_mlp.py", "--device", "cuda", "--no-progress", "--epochs", "20"],
        min(180, left()),
        log,
    )
    final = [ln for ln in text.splitlines() if "final test accuracy" in ln]
    steps.append(("examples/train_mlp.py --device cuda", rc, final[-1] if final else text[-300:]))
    print(f"example cuda: rc={rc} {steps[-1][2]}", flush=True)

    if not args.skip_nccl:
        steps += ddp_nccl_steps(info, py, left, log)

    today = dt.date.today().isoformat()
    md = [f"## {today}: {info['gpu']} ({info['gpu_memory_gib']} GiB)", ""]
    md.append(
        f"driver {info['driver']}, CUDA runtime {info['cuda_runtime']} / driver API "
        f"{info['cuda_driver']}, CuPy {info['cupy']}, NCCL (CuPy's) {info['nccl_cupy']}, "
        f"NCCL (ours) {info.get('nccl_ours')}, "
        f"NumPy {info['numpy']}, Python {info['python']}, torch {info['torch']}"
    )
    md.append("")
    md.append("| check | result | detail |")
    md.append("|---|---|---|")
    for name, code, detail in steps:
        first = detail.strip().splitlines()[0] if detail.strip() else ""
        md.append(f"| {name} | {'ok' if code == 0 else f'FAILED (rc={code})'} | {first} |")
    if bench_json.exists():
        md.append("")
        md.append("```")
        md.append(next(d for name, _, d in steps if name.startswith("mlp_step")))
        md.append("```")
    if nccl_md:
        md += ["", *nccl_md]
    text_md = "\n".join(md) + "\n"
    print("\n" + text_md)
    if args.out:
        (args.out / "gpu-check.md").write_text(text_md)
        (args.out / "gpu-check.log").write_text("\n\n".join(log))
    return 0 if all(code == 0 for _, code, _ in steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
