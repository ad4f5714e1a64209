"""The GPU check: versions, the `gpu` tests, and GPU timings, in one run of a few minutes.

    python3 -m benchmarks.gpu_check [--out DIR] [--quick]

Run it on a machine with an NVIDIA GPU and CuPy (the `cuda12`/`cuda13` extra) from the
repository root. It prints a Markdown block to paste into docs/gpu-results.md, and with
``--out`` also writes ``gpu-check.md`` and the JSON of each benchmark there. It exits non-zero
when a step fails, and exits 2 at once with the reason when no GPU is usable.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import tensorlib as tl

ROOT = Path(__file__).resolve().parents[1]


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
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = None
    return out


def run(cmd: list[str], timeout: int, log: list[str]) -> tuple[int, str, float]:
    """Run a command from the repo root; return (exit code, output tail, seconds)."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
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
    args = p.parse_args(argv)

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
    rc, text, took = run(
        [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"], 420, log
    )
    summary = [
        ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or "error" in ln
    ]
    steps.append(("pytest -m gpu", rc, summary[-1] if summary else text[-300:]))
    print(f"gpu tests: rc={rc} {steps[-1][2]} ({took:.0f} s)", flush=True)

    bench_json = (args.out or Path("/tmp")) / "mlp_step_cuda.json"
    rounds = ["--rounds", "3"] if args.quick else []
    rc, text, took = run(
        [py, "-m", "benchmarks.mlp_step", "--device", "cuda", "--json", str(bench_json), *rounds],
        240,
        log,
    )
    steps.append(("mlp_step --device cuda", rc, text.strip()[-1200:]))
    print(f"mlp_step cuda: rc={rc} ({took:.0f} s)\n{text.strip()}", flush=True)

    rc, text, took = run(
        [py, "examples/train_mlp.py", "--device", "cuda", "--no-progress", "--epochs", "20"],
        180,
        log,
    )
    final = [ln for ln in text.splitlines() if "final test accuracy" in ln]
    steps.append(("examples/train_mlp.py --device cuda", rc, final[-1] if final else text[-300:]))
    print(f"example cuda: rc={rc} {steps[-1][2]}", flush=True)

    today = dt.date.today().isoformat()
    md = [f"## {today}: {info['gpu']} ({info['gpu_memory_gib']} GiB)", ""]
    md.append(
        f"driver {info['driver']}, CUDA runtime {info['cuda_runtime']} / driver API "
        f"{info['cuda_driver']}, CuPy {info['cupy']}, NCCL (CuPy's) {info['nccl_cupy']}, "
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
        md.append(steps[1][2])
        md.append("```")
    text_md = "\n".join(md) + "\n"
    print("\n" + text_md)
    if args.out:
        (args.out / "gpu-check.md").write_text(text_md)
        (args.out / "gpu-check.log").write_text("\n\n".join(log))
    return 0 if all(code == 0 for _, code, _ in steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
