"""The GPU check: versions, the `gpu` tests, and GPU timings, in one run of a few minutes.

    python3 -m benchmarks.gpu_check [--out DIR] [--quick]

Run it on a machine with an NVIDIA GPU and CuPy (the `cuda12`/`cuda13` extra) from the
repository root. It prints a Markdown block to paste into docs/gpu-results.md, and with
``--out`` also writes ``gpu-check.md``, ``gpu-check.log`` and the JSON of each benchmark there.
It exits non-zero when a step fails, and exits 2 at once with the reason when no GPU is usable.

The whole run stays within ``BUDGET_S`` (under eight minutes): each step's timeout is cut to
what is left, keeping a minimum for the steps after it. Steps run most-needed first: the `gpu`
tests of the nccl backend, DDP and the benchmarks; benchmarks/nccl_bench.py (our nccl backend
against NCCL called directly, 8 B .. 1 GiB) at world size 1, and with several ranks on this
host when the GPUs or the NCCL version allow it (NCCL >= 2.30 lets ranks share a GPU with
NCCL_MULTI_RANK_GPU_ENABLE=1); the DDP example on NCCL at world size 1 and, where allowed, 2;
then the tensorlib `gpu` tests (in several processes where pytest-xdist is installed, so
that CuPy's first-use kernel compilations run in parallel), the MLP step timing and the
single-GPU example.

Nothing is lost when a run is cut short: every command's output streams into
``gpu-check.log`` as it runs, ``gpu-check.md`` is rewritten after each step, a step that runs
out of time is killed with every process it started (so no rank keeps the GPU), and a pytest
step that is cut short still reports what passed and which test was running.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

import tensorlib as tl

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 450.0  # the whole check, so that it fits an eight-minute device slot

# Each step: (most seconds it may take, seconds kept for it while earlier steps run).
CAP_RESERVE: dict[str, tuple[float, float]] = {
    "tests-nccl": (180.0, 60.0),
    "nccl-bench": (150.0, 60.0),
    "ddp": (90.0, 30.0),  # per world size, two of them
    "tests-tensorlib": (200.0, 60.0),
    "mlp-step": (120.0, 30.0),
    "example": (90.0, 30.0),
}
ORDER = ["tests-nccl", "nccl-bench", "ddp", "ddp", "tests-tensorlib", "mlp-step", "example"]

# The `gpu` tests in two runs: those of the nccl backend, DDP and the benchmarks first.
TESTS_NCCL = ["tests/collectives", "tests/ddp", "tests/benchmarks"]
TESTS_REST = ["tests"] + [f"--ignore={p}" for p in TESTS_NCCL]
PER_TEST_TIMEOUT_S = 120  # tests with their own timeout marker keep it

Step = tuple[str, int, str]  # (name, exit status, one line of detail)


class Budget:
    """Seconds left of the whole check, with a minimum kept for each step still to come."""

    def __init__(self, total: float, order: list[str]) -> None:
        self.end = time.monotonic() + total
        self.todo = list(order)

    def take(self, step: str) -> float:
        """The timeout for ``step`` (which must be next in the order): its cap, cut to what is
        left after keeping each later step's reserve."""
        if step in self.todo:
            self.todo.remove(step)
        kept = sum(CAP_RESERVE[s][1] for s in self.todo)
        return max(0.0, min(CAP_RESERVE[step][0], self.end - time.monotonic() - kept))

    def drop(self, step: str) -> None:
        """Keep nothing more for ``step``: it will not run (again)."""
        self.todo = [s for s in self.todo if s != step]


class Report:
    """The steps so far, written to ``out`` after each one, and the streamed log."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.steps: list[Step] = []
        self.info: dict[str, Any] = {}
        self.extra: list[str] = []  # Markdown blocks after the table
        self._tmp: IO[bytes] | None = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.log_path = out / "gpu-check.log"
            self.log_path.write_bytes(b"")
        else:
            self._tmp = tempfile.NamedTemporaryFile(prefix="gpu-check-", suffix=".log")  # noqa: SIM115
            self.log_path = Path(self._tmp.name)

    def note(self, text: str) -> None:
        """Append ``text`` to the log."""
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(text.rstrip("\n") + "\n\n")

    def add(self, steps: list[Step]) -> None:
        """Record finished steps and rewrite gpu-check.md."""
        self.steps += steps
        self.write()

    def markdown(self, done: bool) -> str:
        """The block for docs/gpu-results.md."""
        info = self.info
        today = dt.date.today().isoformat()
        md = [f"## {today}: {info.get('gpu')} ({info.get('gpu_memory_gib')} GiB)", ""]
        md.append(
            f"driver {info.get('driver')}, CUDA runtime {info.get('cuda_runtime')} / driver API "
            f"{info.get('cuda_driver')}, CuPy {info.get('cupy')}, NCCL (CuPy's) "
            f"{info.get('nccl_cupy')}, NCCL (ours) {info.get('nccl_ours')}, NumPy "
            f"{info.get('numpy')}, Python {info.get('python')}, torch {info.get('torch')}"
        )
        md += ["", "| check | result | detail |", "|---|---|---|"]
        for name, code, detail in self.steps:
            first = detail.strip().splitlines()[0] if detail.strip() else ""
            md.append(f"| {name} | {'ok' if code == 0 else f'FAILED (rc={code})'} | {first} |")
        if not done:
            md += ["", "(incomplete: the check is still running or was cut short)"]
        for block in self.extra:
            md += ["", block]
        return "\n".join(md) + "\n"

    def write(self, done: bool = False) -> None:
        """Rewrite gpu-check.md (when there is an output folder)."""
        if self.out is not None:
            (self.out / "gpu-check.md").write_text(self.markdown(done))


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
    out["gpus"] = int(cp.cuda.runtime.getDeviceCount())
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
        from collectives.backends.nccl import load_library

        lib = load_library()
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

    from collectives.backends.nccl import load_library, version_code

    gpus = int(cp.cuda.runtime.getDeviceCount())
    try:
        version = load_library().version
    except Exception as exc:
        return [], f"NCCL unavailable: {exc}"
    if gpus >= 2:
        return [1, min(gpus, 4)], f"{gpus} GPUs: one rank per GPU"
    if version >= version_code(2, 30, 0):
        # NCCL 2.30 supports up to 2 ranks per GPU (NVLS off there; NCCL_MAX_CTAS against
        # running out of resources): docs/nccl.md "Several ranks on one GPU".
        return [1, 2], (
            "one GPU, NCCL >= 2.30: 2 ranks share it (NCCL_MULTI_RANK_GPU_ENABLE=1; NCCL "
            "supports at most 2 ranks per GPU)"
        )
    return [1], (
        f"one GPU and NCCL {info.get('nccl_ours')} < 2.30, which refuses ranks sharing a GPU "
        "('Duplicate GPU detected'): world size 1 only"
    )


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    """Kill the process group ``p`` leads: pytest's or a launcher's ranks go with it."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(
    cmd: list[str], timeout: float, report: Report, env_extra: dict[str, str] | None = None
) -> tuple[int, str, float]:
    """Run a command from the repo root, its output streaming into the log; return (exit
    status, its output, seconds). Past ``timeout`` it is killed with everything it started
    and the status is 124."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env_extra or {}))
    report.note(f"$ {' '.join(cmd)}  (timeout {timeout:.0f} s)")
    t0 = time.perf_counter()
    with report.log_path.open("ab") as log:
        start = log.tell()
        p = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = 124
        _kill_group(p)  # also on success: nothing it started may keep the GPU
        p.wait()
    took = time.perf_counter() - t0
    with report.log_path.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    if rc == 124:
        text += f"\n[timed out after {timeout:.0f} s; killed with its process group]"
    report.note(f"(rc={rc}, {took:.1f} s)")
    return rc, text, took


# ``pytest -v`` lines: "<node id> PASSED   [ 10%]", or with pytest-xdist "<node id>" when
# scheduled and "[gw0] [ 10%] PASSED <node id>" when done; node ids may hold spaces.
_OUTCOMES = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
_OUTCOME = re.compile(rf"^(\S+\.py::.*?) ({_OUTCOMES})(?: |$)")
_OUTCOME_XDIST = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_OUTCOMES}) (\S+\.py::.*?)\s*$")
_STARTED = re.compile(r"^(\S+\.py::.*?)\s*$")
_FINAL = re.compile(r"^=+ (.*\b(?:passed|failed|skipped|errors?|deselected)\b.*) in [\d.]+s")


def pytest_summary(text: str, rc: int) -> str:
    """One line for a ``pytest -v`` run (with or without pytest-xdist): its final counts, or,
    when it was cut short, the counts so far and the tests that were running; then the failed
    tests' names."""
    counts: dict[str, int] = {}
    failed: list[str] = []
    running: dict[str, None] = {}  # started, not finished (ordered)
    for line in text.splitlines():
        m = _OUTCOME.match(line)
        done = (m[1], m[2]) if m else None
        if done is None and (x := _OUTCOME_XDIST.match(line)):
            done = (x[2], x[1])
        if done is not None:
            node, outcome = done
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome in ("FAILED", "ERROR"):
                failed.append(node)
            running.pop(node, None)
        elif started := _STARTED.match(line):
            running[started[1]] = None
    final = [m[1] for m in map(_FINAL.match, text.splitlines()) if m]
    if final and rc != 124:
        head = final[-1]
    else:
        so_far = ", ".join(f"{v} {k.lower()}" for k, v in counts.items()) or "no test finished"
        head = f"cut short ({so_far})"
        if running:
            names = list(running)
            head += "; running: " + ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    if failed:
        head += "; failed: " + ", ".join(failed[:8]) + (" ..." if len(failed) > 8 else "")
    return head


def xdist_workers() -> int:
    """Processes for the tensorlib gpu tests: several where pytest-xdist is installed (CuPy
    compiles each new kernel on a fresh machine; processes compile in parallel), else 0."""
    if importlib.util.find_spec("xdist") is None:
        return 0
    return max(0, min(8, (os.cpu_count() or 1) // 2))


def pytest_step(
    name: str, paths: list[str], timeout: float, report: Report, workers: int = 0
) -> list[Step]:
    """``pytest -m gpu -v`` over ``paths``, in ``workers`` processes when more than 1."""
    if timeout < 20:
        return [(name, 124, "skipped: the time budget ran out")]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider"]
    cmd += [f"--timeout={PER_TEST_TIMEOUT_S}", *(["-n", str(workers)] if workers > 1 else [])]
    cmd += paths
    rc, text, took = run(cmd, timeout, report)
    detail = pytest_summary(text, rc)
    print(f"{name}: rc={rc} ({took:.0f} s) {detail}", flush=True)
    return [(name, rc, detail)]


def nccl_step(info: dict[str, Any], report: Report, budget: float) -> list[Step]:
    """The all-reduce sweep through our backend and through NCCL directly."""
    from benchmarks import nccl_bench

    steps: list[Step] = []
    sizes, why = nccl_world_sizes(info)
    print(f"nccl: world sizes {sizes}: {why}", flush=True)
    if not sizes:
        return [("nccl all_reduce", 1, why)]
    report.extra.append(f"NCCL all_reduce (float32 SUM, in place), world sizes {sizes}: {why}.")
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
        report.note(f"$ nccl_bench --world {n} (rc={rc}, {took:.1f} s)\n{tail}")
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
        report.extra.append("\n".join([f"World size {n}:", "", *lines]))
        if report.out is not None:
            (report.out / f"nccl_allreduce_n{n}.json").write_text(json.dumps(data, indent=1))
    return steps


def ddp_nccl_steps(
    info: dict[str, Any], report: Report, take: Callable[[str], float]
) -> list[Step]:
    """The DDP example on NCCL: world size 1, and 2 ranks (one per GPU, or sharing one GPU
    where NCCL allows it)."""
    sizes, why = nccl_world_sizes(info)
    steps: list[Step] = []
    for n in [w for w in sizes if w <= 2][:2]:
        env: dict[str, str] = {"NCCL_SOCKET_IFNAME": "lo"}
        if "share" in why:
            env.update(DPT_ALLOW_SHARED_GPU="1", NCCL_MULTI_RANK_GPU_ENABLE="1")
        name = f"examples/train_ddp.py --device cuda --backend nccl --nproc {n}"
        budget = take("ddp")
        if budget < 20:
            steps.append((name, 124, "skipped: the time budget ran out"))
            continue
        with tempfile.TemporaryDirectory(prefix="gpu-check-ddp-") as tmp:
            rc, text, took = run(
                [sys.executable, "examples/train_ddp.py", "--device", "cuda", "--backend", "nccl"]
                + ["--nproc", str(n), "--epochs", "8", "--no-progress"]
                + ["--checkpoint", str(Path(tmp) / "ddp.npz")],
                budget,
                report,
                env,
            )
        final = [ln for ln in text.splitlines() if "final test accuracy" in ln]
        steps.append((name, rc, final[-1] if final else text.strip()[-300:]))
        print(f"ddp nccl x{n}: rc={rc} ({took:.0f} s) {steps[-1][2]}", flush=True)
    return steps


def main(argv: list[str] | None = None) -> int:
    """Run every GPU check and print the Markdown summary."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="directory for gpu-check.md, the log and JSON")
    p.add_argument("--quick", action="store_true", help="fewer benchmark rounds")
    p.add_argument("--skip-nccl", action="store_true", help="leave out the NCCL steps")
    args = p.parse_args(argv)

    reason = tl.cuda_unavailable_reason()
    if reason is not None:
        print(f"gpu_check: no usable GPU: {reason}", file=sys.stderr)
        return 2
    order = [s for s in ORDER if not (args.skip_nccl and s in ("nccl-bench", "ddp"))]
    budget = Budget(BUDGET_S, order)
    report = Report(args.out)
    report.info = info = versions()
    print("versions:", json.dumps(info), flush=True)
    report.note("versions: " + json.dumps(info))
    report.write()

    py = sys.executable
    name = "pytest -m gpu (nccl, ddp, benchmarks)"
    report.add(pytest_step(name, TESTS_NCCL, budget.take("tests-nccl"), report))
    if not args.skip_nccl:
        report.add(nccl_step(info, report, budget.take("nccl-bench")))
        report.add(ddp_nccl_steps(info, report, budget.take))
        budget.drop("ddp")  # where only world size 1 ran
    name = "pytest -m gpu (tensorlib and the rest)"
    timeout = budget.take("tests-tensorlib")
    report.add(pytest_step(name, TESTS_REST, timeout, report, xdist_workers()))

    bench_json = (args.out or Path(tempfile.gettempdir())) / "mlp_step_cuda.json"
    rounds = ["--rounds", "3"] if args.quick else []
    name, timeout = "mlp_step --device cuda", budget.take("mlp-step")
    if timeout < 20:
        report.add([(name, 124, "skipped: the time budget ran out")])
    else:
        cmd = [py, "-m", "benchmarks.mlp_step", "--device", "cuda", "--json", str(bench_json)]
        rc, text, took = run(cmd + rounds, timeout, report)
        report.add([(name, rc, text.strip()[-1200:])])
        print(f"mlp_step cuda: rc={rc} ({took:.0f} s)\n{text.strip()}", flush=True)
        if rc == 0:
            report.extra.insert(0, "```\n" + text.strip()[-1200:] + "\n```")

    name, timeout = "examples/train_mlp.py --device cuda", budget.take("example")
    if timeout < 20:
        report.add([(name, 124, "skipped: the time budget ran out")])
    else:
        cmd = [py, "examples/train_mlp.py", "--device", "cuda", "--no-progress", "--epochs", "20"]
        rc, text, took = run(cmd, timeout, report)
        final = [ln for ln in text.splitlines() if "final test accuracy" in ln]
        report.add([(name, rc, final[-1] if final else text.strip()[-300:])])
        print(f"example cuda: rc={rc} {report.steps[-1][2]}", flush=True)

    report.write(done=True)
    print("\n" + report.markdown(done=True))
    return 0 if all(code == 0 for _, code, _ in report.steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
