"""Every usage example of Ignite's distributed page (examples/ignite/) runs as a script: alone,
on 2 ranks spawned by the script (``--nproc 2``), on 2 ranks started by ``python -m
collectives.run``, and on 2 rank threads (``--backend threads``).

Rank 0 alone prints the final accuracy, which is high, and the same at every world size: the
scripts train on the same global batches from the same initial weights (no dropout; the
2-rank gradient is the mean of two half-batch means, equal to the full batch's up to float
rounding, so one test sample's prediction is allowed to differ). The four runs of a script go
at once, each a subprocess as a user starts it, in its own session under a hard time limit.
A backend this machine lacks (horovod, xla-tpu, nccl) ends the script with one line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import ddp.idist as idist

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "ignite"
TIMEOUT_S = 90
N_TEST = 359  # the digits' test split (20% of 1,797)

pytest.importorskip("sklearn", reason="the examples' digits ship with scikit-learn")

# Each mode's command line for a script: alone, spawned by the script, launched, threads.
MODES = {
    "alone": lambda s, a: [sys.executable, str(s), *a],
    "spawned": lambda s, a: [sys.executable, str(s), "--nproc", "2", *a],
    "launched": lambda s, a: [
        sys.executable, "-m", "collectives.run", "--nproc-per-node", "2", str(s), *a
    ],
    "threads": lambda s, a: [sys.executable, str(s), "--backend", "threads", "--nproc", "2", *a],
}  # fmt: skip


@dataclass
class Run:
    mode: str
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str

    def ok(self) -> str:
        assert self.returncode == 0, (
            f"{self.mode}: {' '.join(self.cmd)} exited {self.returncode}\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        )
        return self.stdout


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TENSORLIB_CPU_DEVICES"):  # fmt: skip
        env.pop(var, None)  # never look launched to the script
    return env


def _run_all(cmds: dict[str, list[str]], cwd: Path) -> dict[str, Run]:
    """Run the commands at once, each to its end within TIMEOUT_S; a hang kills its whole
    session (the launcher and its ranks) and fails the test."""
    procs = {
        mode: subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        for mode, cmd in cmds.items()
    }  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    runs: dict[str, Run] = {}
    try:
        for mode, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{mode}: {' '.join(cmds[mode])} still running after {TIMEOUT_S} s")
            runs[mode] = Run(mode, cmds[mode], proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return runs


def _run_modes(script: str, *args: str, cwd: Path = ROOT, **per_mode: list[str]) -> dict[str, Run]:
    """The script in every mode (``per_mode[mode]``: that mode's extra arguments)."""
    path = EXAMPLES / script
    return _run_all(
        {mode: make(path, [*args, *per_mode.get(mode, [])]) for mode, make in MODES.items()}, cwd
    )


def _final(run: Run) -> tuple[float, float]:
    """(accuracy, loss) of the one final line (printed by rank 0 only)."""
    found = re.findall(r"^final test accuracy: ([\d.]+)%  loss: ([\d.]+)$", run.ok(), re.M)
    assert len(found) == 1, f"{run.mode}: expected one final line\n{run.stdout}"
    return float(found[0][0]) / 100, float(found[0][1])


def _same_accuracy(runs: dict[str, Run], world: dict[str, str] | None = None) -> None:
    """Alone and every 2-rank run: high accuracy, equal up to one test sample's prediction;
    ``world``: the line each mode's rank 0 prints about its world."""
    acc, loss = _final(runs["alone"])
    assert acc > 0.9, runs["alone"].stdout
    for mode, run in runs.items():
        if world is not None:
            assert world[mode] in run.stdout, f"{mode}: no {world[mode]!r}\n{run.stdout}"
        got_acc, got_loss = _final(run)
        assert abs(got_acc - acc) <= 1 / N_TEST + 1e-4, (mode, got_acc, acc)
        assert abs(got_loss - loss) <= 1e-3, (mode, got_loss, loss)


WORLDS = {
    "alone": "world size 1 (serial backend)",
    "spawned": "world size 2 (cpu backend)",
    "launched": "world size 2 (cpu backend)",
    "threads": "world size 2 (threads backend)",
}
pytestmark = [pytest.mark.timeout(TIMEOUT_S + 30), pytest.mark.slow]


def test_basic_setup_trains_alike_alone_spawned_launched_and_on_threads() -> None:
    runs = _run_modes("basic_training.py")
    _same_accuracy(runs, WORLDS)
    for run in runs.values():  # rank 0 logs each epoch, once
        assert re.findall(r"^epoch (\d)  ", run.stdout, re.M) == ["1", "2", "3"], run.stdout


@pytest.mark.parametrize("script", ["horovod_training.py", "xla_tpu_training.py"])
def test_horovod_and_xla_scripts_train_on_the_backend_given(script: str) -> None:
    runs = _run_modes(
        script, alone=["--backend", "cpu"], spawned=["--backend", "gloo"],
        launched=["--backend", "cpu"],
    )  # fmt: skip
    _same_accuracy(runs, WORLDS)


def test_multi_gpu_ddp_logs_on_rank_0_every_n_iterations() -> None:
    runs = _run_modes(
        "multi_gpu_ddp.py", "--log-every", "10", alone=["--backend", "cpu"],
        spawned=["--backend", "cpu"], launched=["--backend", "cpu"],
    )  # fmt: skip
    _same_accuracy(runs, WORLDS)
    for run in runs.values():  # 3 epochs of 22 steps; rank 0 only
        logged = re.findall(r"^Rank (\d): Iteration (\d+), Loss: [\d.]+$", run.stdout, re.M)
        assert logged == [("0", str(i)) for i in range(10, 61, 10)], run.stdout


def test_custom_communication_keeps_the_replicas_identical() -> None:
    runs = _run_modes("custom_communication.py")
    _same_accuracy(runs, WORLDS)
    # The gathered loss is the global batch's: the epoch lines match alone's too.
    alone = re.findall(r"^epoch \d .*$", runs["alone"].stdout, re.M)
    assert len(alone) == 3, runs["alone"].stdout
    for run in runs.values():
        assert run.stdout.count("replicas identical: True") == 1, run.stdout
        epochs = re.findall(r"^epoch \d .*$", run.stdout, re.M)
        for got, want in zip(epochs, alone, strict=True):
            g, w = (float(s.rsplit(" ", 1)[1]) for s in (got, want))
            assert abs(g - w) <= 2e-4, (run.mode, got, want)


def test_spawn_starts_every_worker_and_trains() -> None:
    runs = _run_modes("spawn_processes.py")
    _same_accuracy(runs)
    for mode, run in runs.items():
        n = 1 if mode == "alone" else 2
        started = sorted(re.findall(r"Worker (\d) of (\d) started", run.stdout))
        assert started == [(str(r), str(n)) for r in range(n)], run.stdout


def test_conditional_execution_runs_on_rank_0_only(tmp_path: Path) -> None:
    runs = _run_modes(
        "conditional_execution.py", cwd=tmp_path, spawned=["--checkpoint", "spawned.pth"],
        launched=["--checkpoint", "launched.pth"], threads=["--checkpoint", "threads.pth"],
    )  # fmt: skip
    _same_accuracy(runs)
    import tensorlib as tl

    for mode, run in runs.items():
        out = run.stdout
        assert out.count("This runs only on the master process") == 1, out
        epochs = re.findall(r"^Epoch completed, metrics: \{'acc': ([\d.]+), .*'epoch': (\d)\}$",
                            out, re.M)  # fmt: skip
        assert [e for _, e in epochs] == ["1", "2", "3"], out
        name = "checkpoint.pth" if mode == "alone" else f"{mode}.pth"
        assert out.count(f"saved checkpoint to {name}") == 1, out
        state = tl.load(tmp_path / name)
        assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert state["0.weight"].shape == (64, 64)


@pytest.mark.parametrize(
    ("script", "backend", "missing"),
    [
        ("horovod_training.py", "horovod", "this project has no Horovod backend"),
        ("xla_tpu_training.py", "xla-tpu", "this project has no XLA/TPU backend"),
        ("multi_gpu_ddp.py", "nccl", "it needs CUDA GPUs with CuPy and NCCL"),
        ("basic_training.py", "horovod", "this project has no Horovod backend"),
    ],
)
def test_a_backend_missing_here_ends_the_script_with_one_line(
    script: str, backend: str, missing: str
) -> None:
    if backend == "nccl" and idist.has_nccl_support:
        pytest.skip("nccl is usable here: multi_gpu_ddp.py would train on the GPUs")
    args = [] if script != "basic_training.py" else ["--backend", backend]
    runs = _run_all(
        {
            "default": [sys.executable, str(EXAMPLES / script), *args],
            "spawned": [sys.executable, str(EXAMPLES / script), *args, "--nproc", "2"],
        },
        ROOT,
    )
    for run in runs.values():
        assert run.returncode == 1, (run.mode, run.stdout, run.stderr)
        assert run.stdout == ""
        assert run.stderr.count("\n") == 1, run.stderr  # one line, no traceback
        assert run.stderr.startswith(f"{script}: backend {backend!r} is not available here: ")
        assert missing in run.stderr and "(try --backend cpu)" in run.stderr, run.stderr
