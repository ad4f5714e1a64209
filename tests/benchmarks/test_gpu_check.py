"""benchmarks/gpu_check.py's plan, checked without a GPU (the run itself needs one).

A lent GPU comes for a few minutes, so the check must run right the first time: its steps'
order and time budget, its reporting of a cut-short pytest run, its killing of what a timed-out
step started, and its report written after every step are all checked here.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_check, nccl_bench


def test_no_gpu_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    import tensorlib as tl

    if tl.cuda_unavailable_reason() is None:
        pytest.skip("a GPU is usable here")
    assert gpu_check.main([]) == 2
    assert "no usable GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sizes,why,expect_share",
    [
        ([1, 2, 4], "one GPU, NCCL >= 2.30: ranks share it (NCCL_MULTI_RANK_GPU_ENABLE=1)", True),
        ([1, 4], "4 GPUs: one rank per GPU", False),
        ([1], "one GPU and NCCL 2.21 < 2.30 ...: world size 1 only", False),
    ],
)
def test_ddp_on_nccl_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sizes: list[int], why: str, expect_share: bool
) -> None:
    """DDP on NCCL runs at world size 1 and, where NCCL allows it, 2 (sharing the GPU only
    when there is one GPU)."""
    calls: list[tuple[list[str], dict[str, str]]] = []

    def fake_run(cmd: list[str], timeout: float, report: Any, env: Any = None) -> Any:
        calls.append((cmd, dict(env or {})))
        return 0, "final test accuracy: 97.00% (359 images, 1 rank(s), 1.0 s, cuda)", 1.0

    monkeypatch.setattr(gpu_check, "nccl_world_sizes", lambda info: (sizes, why))
    monkeypatch.setattr(gpu_check, "run", fake_run)
    steps = gpu_check.ddp_nccl_steps({}, gpu_check.Report(tmp_path), lambda step: 400.0)
    worlds = [w for w in sizes if w <= 2]
    assert [c[0][c[0].index("--nproc") + 1] for c in calls] == [str(w) for w in worlds]
    for cmd, env in calls:
        assert cmd[1] == "examples/train_ddp.py"
        assert cmd[cmd.index("--backend") + 1] == "nccl" and "cuda" in cmd
        assert env.get("NCCL_MULTI_RANK_GPU_ENABLE") == ("1" if expect_share else None)
    assert [code for _, code, _ in steps] == [0] * len(worlds)
    assert all("final test accuracy" in detail for _, _, detail in steps)


# ---------------------------------------------------------------------------- pytest output
FINISHED = """\
collecting ... collected 30 items / 6 deselected / 24 selected

tests/collectives/test_nccl.py::test_gpu_all_reduce[float32-SUM-n1] PASSED [  4%]
tests/collectives/test_nccl.py::test_gpu_all_reduce[float32-SUM-n2] SKIPPED [  8%]
tests/benchmarks/test_x.py::test_y[one GPU, NCCL >= 2.30-True] FAILED    [ 12%]
tests/ddp/test_ddp_gpu.py::test_ddp PASSED                               [100%]

=================================== FAILURES ===================================
___________________________ test_y[one GPU, NCCL >= 2.30-True] ___________________________
tests/benchmarks/test_x.py::test_y failed because
=========================== short test summary info ============================
FAILED tests/benchmarks/test_x.py::test_y[one GPU, NCCL >= 2.30-True] - AssertionError
============ 1 failed, 2 passed, 1 skipped, 6 deselected in 83.20s (0:01:23) ============
"""


def test_pytest_summary_of_a_finished_run() -> None:
    got = gpu_check.pytest_summary(FINISHED, 1)
    assert got.startswith("1 failed, 2 passed, 1 skipped, 6 deselected"), got
    assert got.endswith("failed: tests/benchmarks/test_x.py::test_y[one GPU, NCCL >= 2.30-True]")


def test_pytest_summary_of_a_cut_short_run_names_the_running_test() -> None:
    text = "\n".join(FINISHED.splitlines()[:5]) + "\ntests/ddp/test_ddp_gpu.py::test_ddp \n"
    text += "\n[timed out after 180 s; killed with its process group]\n"
    got = gpu_check.pytest_summary(text, 124)
    assert got.startswith("cut short (1 passed, 1 skipped, 1 failed)"), got
    assert "running: tests/ddp/test_ddp_gpu.py::test_ddp;" in got
    assert "failed: tests/benchmarks/test_x.py::test_y[one GPU, NCCL >= 2.30-True]" in got


def test_pytest_summary_when_nothing_ran() -> None:
    got = gpu_check.pytest_summary("ImportError while loading conftest\n", 4)
    assert got == "cut short (no test finished)"


XDIST = """\
4 workers [5 items]

scheduling tests via LoadScheduling

tests/tensorlib/test_device.py::test_a[cuda]
tests/tensorlib/test_device.py::test_b[float16 x, 2 dims]
tests/tensorlib/test_ops.py::test_c
[gw2] [ 20%] PASSED tests/tensorlib/test_device.py::test_a[cuda]
tests/tensorlib/test_ops.py::test_d
[gw1] [ 40%] FAILED tests/tensorlib/test_ops.py::test_c
[gw0] [ 60%] SKIPPED tests/tensorlib/test_device.py::test_b[float16 x, 2 dims]
"""


def test_pytest_summary_of_an_xdist_run() -> None:
    """With pytest-xdist (the tensorlib step uses it where installed) results come as
    "[gwN] [ pp%] OUTCOME node id" lines, tests scheduled earlier; several run at once."""
    done = XDIST + "[gw3] [ 80%] PASSED tests/tensorlib/test_ops.py::test_d\n"
    done += "===== 1 failed, 2 passed, 1 skipped in 12.00s =====\n"
    got = gpu_check.pytest_summary(done, 1)
    assert got == "1 failed, 2 passed, 1 skipped; failed: tests/tensorlib/test_ops.py::test_c"
    got = gpu_check.pytest_summary(XDIST + "\n[timed out after 200 s]\n", 124)
    assert got == (
        "cut short (1 passed, 1 failed, 1 skipped); running: tests/tensorlib/test_ops.py::test_d"
        "; failed: tests/tensorlib/test_ops.py::test_c"
    )


def test_xdist_only_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "xdist" else real(name, *a)
    )
    assert gpu_check.xdist_workers() == 0
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert gpu_check.xdist_workers() == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert gpu_check.xdist_workers() == 1  # one process: pytest_step then runs without -n


# ---------------------------------------------------------------------------- run, budget
def _state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return "gone"
    return next(ln.split()[1] for ln in status.splitlines() if ln.startswith("State:"))


def test_run_streams_to_the_log_and_kills_what_a_timed_out_step_started(
    tmp_path: Path,
) -> None:
    report = gpu_check.Report(tmp_path / "out")
    pidfile = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(g.pid))\n"
        "print('started the rank', flush=True)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    rc, text, _ = gpu_check.run([sys.executable, "-c", code], 3.0, report)
    assert rc == 124 and time.monotonic() - t0 < 30
    assert "started the rank" in text and "timed out after 3 s" in text
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "started the rank" in log and "(rc=124" in log
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _state(grandchild) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(grandchild) in ("gone", "Z"), "the timed-out step's child outlived it"


def test_run_returns_the_status_and_output_of_a_step(tmp_path: Path) -> None:
    report = gpu_check.Report(None)
    rc, text, _ = gpu_check.run(
        [sys.executable, "-c", "import os, sys; print(os.environ['X']); sys.exit(3)"],
        30.0,
        report,
        {"X": "hello from the step"},
    )
    assert (rc, text.strip()) == (3, "hello from the step")


def test_budget_keeps_a_minimum_for_the_steps_after() -> None:
    reserve = {s: gpu_check.CAP_RESERVE[s][1] for s in gpu_check.CAP_RESERVE}
    budget = gpu_check.Budget(300.0, gpu_check.ORDER)
    later = sum(reserve[s] for s in gpu_check.ORDER[1:])
    cap = gpu_check.CAP_RESERVE["tests-nccl"][0]
    assert budget.take("tests-nccl") == pytest.approx(min(cap, 300.0 - later), abs=1)
    # Most of the budget spent: the next step gets what is left over the later reserves.
    later = sum(reserve[s] for s in gpu_check.ORDER[2:])
    budget.end = time.monotonic() + later + 40
    assert budget.take("nccl-bench") == pytest.approx(40, abs=1)
    budget.end = time.monotonic() + 10  # nothing left: 0, and the step is skipped
    assert budget.take("ddp") == 0.0
    budget.drop("ddp")
    assert "ddp" not in budget.todo
    # The caps add up to more than the budget: a step that finishes early leaves time to later.
    assert sum(gpu_check.CAP_RESERVE[s][0] for s in gpu_check.ORDER) > gpu_check.BUDGET_S
    assert sum(reserve[s] for s in gpu_check.ORDER) < gpu_check.BUDGET_S


# ---------------------------------------------------------------------------- a rehearsal
def _rehearse(
    monkeypatch: pytest.MonkeyPatch, out: Path, fail: str = ""
) -> tuple[int, list[list[str]]]:
    """main() with every command faked: returns its status and the commands in order."""
    import tensorlib as tl

    info = {"gpu": "NVIDIA H200", "gpu_memory_gib": 139.8, "driver": "580", "cupy": "14.2.0"}
    monkeypatch.setattr(tl, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(gpu_check, "versions", lambda: dict(info))
    monkeypatch.setattr(
        gpu_check, "nccl_world_sizes", lambda info: ([1, 2], "one GPU ... ranks share it")
    )
    commands: list[list[str]] = []

    def fake_run(cmd: list[str], timeout: float, report: Any, env: Any = None) -> Any:
        assert timeout >= 20, (cmd, timeout)
        # The report of the steps before is on disk before the next one starts.
        md = (out / "gpu-check.md").read_text()
        assert md.count("| ok |") + md.count("| FAILED") == len(report.steps)
        commands.append(cmd)
        joined = " ".join(cmd)
        rc = 1 if fail and fail in joined else 0
        if "pytest" in joined:
            word = "failed" if rc else "passed"
            return rc, f"=========== 3 {word} in 1.00s ===========\n", 1.0
        if "mlp_step" in joined:
            return rc, "tensorlib step 1.0 ms, torch 1.1 ms", 1.0
        return rc, "final test accuracy: 97.50% (359 images, 1 rank(s), 2.0 s, cuda)", 1.0

    def fake_world(n: int, out_dir: Path, max_bytes: int, impls: list[str], timeout: float) -> Any:
        rows = [
            {"bytes": b, "iters": 5, "s": 1e-5 + b / 4e11, "host_s": 5e-6} for b in (8, 1 << 26)
        ]
        data = {"world": n, "impls": {"ours": {"rows": rows}, "raw": {"rows": rows}}}
        return 0, data, "ok"

    monkeypatch.setattr(gpu_check, "run", fake_run)
    monkeypatch.setattr(nccl_bench, "run_world", fake_world)
    code = gpu_check.main(["--out", str(out)])
    return code, commands


def test_rehearsal_runs_every_step_in_order_and_reports_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code, commands = _rehearse(monkeypatch, tmp_path)
    assert code == 0
    kinds = [" ".join(c[1:4]) for c in commands]
    assert kinds == [
        "-m pytest -m",
        "examples/train_ddp.py --device cuda",
        "examples/train_ddp.py --device cuda",
        "-m pytest -m",
        "-m benchmarks.mlp_step --device",
        "examples/train_mlp.py --device cuda",
    ]
    assert all(p in commands[0] for p in gpu_check.TESTS_NCCL)
    assert all(f"--ignore={p}" in commands[3] for p in gpu_check.TESTS_NCCL)
    md = (tmp_path / "gpu-check.md").read_text()
    assert md.startswith("## ") and "NVIDIA H200" in md and "incomplete" not in md
    assert md.count("| ok |") == 8, md  # 2 pytest, 2 nccl, 2 ddp, mlp, example
    assert "target busbw >= 95% of raw NCCL at >= 64 MiB: met" in md
    assert (tmp_path / "nccl_allreduce_n2.json").exists()


def test_rehearsal_with_a_failing_step_exits_1_and_says_which(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code, commands = _rehearse(monkeypatch, tmp_path, fail="--nproc 2")
    assert code == 1 and len(commands) == 6  # the steps after a failure still run
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| examples/train_ddp.py --device cuda --backend nccl --nproc 2 | FAILED (rc=1) |" in md
