"""The DDP examples run end to end on 2 CPU ranks: spawned, launched, resumed, and alone.

Each test runs the script in a subprocess (as a user would) under a hard time limit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_to_end

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/train_ddp.py"
STEPS_PER_EPOCH = 23  # 1,437 training digits over a global batch of 64 (2 ranks x 32)

pytest.importorskip("sklearn", reason="the example's digits ship with scikit-learn")


def _run(args: list[str], timeout: float = 100) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RANK", None)  # never look launched to the script
    env.pop("WORLD_SIZE", None)
    return run_to_end([sys.executable, *args], env, timeout)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def _final_accuracy(out: str) -> float:
    m = re.search(r"final test accuracy: ([\d.]+)%", out)
    assert m, f"no final accuracy line in:\n{out}"
    return float(m.group(1)) / 100


def _epoch_lines(out: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^epoch +(\d+)  train loss", out, re.M)]


def _load(path: Path) -> dict[str, object]:
    """Load the checkpoint into a fresh model and optimizer, as a user resuming would."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_mlp import make_model
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from ddp import load_checkpoint
    from tensorlib import optim

    model = make_model(128, "cpu")
    before = [p.numpy().copy() for p in model.parameters()]
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    state = load_checkpoint(path, model, opt)
    changed = any((a != p.numpy()).any() for a, p in zip(before, model.parameters(), strict=True))
    assert changed, "loading the checkpoint left the fresh model's weights as they were"
    return state


@pytest.fixture(scope="module")
def spawned_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One 2-rank run started by the script itself (shared by the tests that read it)."""
    ckpt = tmp_path_factory.mktemp("ddp") / "digits.npz"
    proc = _run([SCRIPT, "--nproc", "2", "--epochs", "8", "--checkpoint", str(ckpt)])
    return ckpt, _ok(proc), proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawned_two_ranks_train_to_95_percent(spawned_run: tuple[Path, str, str]) -> None:
    _, out, err = spawned_run
    assert "world size 2 (cpu backend" in out
    assert _epoch_lines(out) == list(range(1, 9)), out
    acc = _final_accuracy(out)
    assert acc >= 0.95, f"test accuracy {acc:.2%} below 95%:\n{out}"
    assert "epoch 1/8" in err, f"no progress bar on stderr:\n{err[-2000:]}"
    # Rank 0 alone prints: every line once.
    assert out.count("final test accuracy") == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_checkpoint_exists_and_loads(spawned_run: tuple[Path, str, str]) -> None:
    ckpt, _, _ = spawned_run
    assert ckpt.is_file()
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".tmp")], "temp file left"
    state = _load(ckpt)
    assert state["step"] == 8 * STEPS_PER_EPOCH
    assert state["extra"] == {"epoch": 8}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_continues_from_the_checkpoint(
    spawned_run: tuple[Path, str, str], tmp_path: Path
) -> None:
    ckpt, _, _ = spawned_run
    out_ckpt = tmp_path / "resumed.npz"
    proc = _run(
        [
            SCRIPT,
            "--nproc",
            "2",
            "--epochs",
            "9",
            "--resume",
            str(ckpt),
            "--checkpoint",
            str(out_ckpt),
        ]
    )
    out = _ok(proc)
    assert f"resumed from {ckpt}: epoch 8, step {8 * STEPS_PER_EPOCH}" in out
    assert _epoch_lines(out) == [9], out  # only the epochs left
    assert _final_accuracy(out) >= 0.95
    assert _load(out_ckpt)["step"] == 9 * STEPS_PER_EPOCH


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launcher_form(tmp_path: Path) -> None:
    ckpt = tmp_path / "launched.npz"
    proc = _run(
        ["-m", "collectives.run", "--nproc-per-node", "2", SCRIPT, "--epochs", "2"]
        + ["--checkpoint", str(ckpt)]
    )
    out = _ok(proc)
    assert "world size 2 (cpu backend" in out
    assert _epoch_lines(out) == [1, 2]
    assert _final_accuracy(out) >= 0.9
    assert ckpt.is_file()


@pytest.mark.timeout(120)
def test_mpiexec_form_on_the_mpi_backend(tmp_path: Path) -> None:
    """``mpiexec -n 2 python examples/train_ddp.py --backend mpi``: Parallel sees the ranks
    mpiexec started, and DDP trains on the mpi backend."""
    from tests.collectives.harness.mpipool import mpi_env, mpi_unavailable_reason, mpiexec_command

    if (reason := mpi_unavailable_reason()) is not None:
        pytest.skip(f"backend mpi: {reason}")
    ckpt = tmp_path / "mpi.npz"
    env = mpi_env()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [*mpiexec_command(2), sys.executable, SCRIPT, "--backend", "mpi", "--epochs", "2"]
    proc = run_to_end([*cmd, "--no-progress", "--checkpoint", str(ckpt)], env, 110)
    out = _ok(proc)
    assert "world size 2 (mpi backend" in out
    assert _epoch_lines(out) == [1, 2]
    assert _final_accuracy(out) >= 0.9
    assert _load(ckpt)["step"] == 2 * STEPS_PER_EPOCH


@pytest.mark.timeout(60)
def test_one_process_is_world_size_one(tmp_path: Path) -> None:
    proc = _run([SCRIPT, "--epochs", "1", "--no-progress", "--checkpoint", str(tmp_path / "c.npz")])
    out = _ok(proc)
    assert "world size 1 (serial backend" in out
    assert _epoch_lines(out) == [1]
    assert proc.stderr.strip() == "", proc.stderr  # --no-progress: nothing on stderr


@pytest.mark.timeout(60)
def test_cuda_without_a_gpu_fails_clearly() -> None:
    import tensorlib as tl

    if tl.cuda_is_available():
        pytest.skip("a GPU is usable here")
    proc = _run([SCRIPT, "--nproc", "2", "--device", "cuda"], timeout=50)
    assert proc.returncode != 0
    assert "--device cuda: no usable CUDA GPU here" in proc.stderr
    assert "Traceback" not in proc.stderr  # one clear line, before any rank starts


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_transformer_bucket_layouts_train_identically() -> None:
    """Smoke test of the heavier example: bucketing changes timing, never the numbers."""
    proc = _run(
        ["examples/train_transformer_ddp.py", "--nproc", "2", "--steps", "3", "--log-every", "3"]
        + ["--compare-buckets", "--no-progress", "--d-model", "32", "--block", "16"]
    )
    out = _ok(proc)
    assert re.search(r"^step +3  train loss [\d.]+", out, re.M), out
    assert "parameters identical across bucket layouts: yes" in out
    for layout in ("one bucket", "default", "small"):
        assert re.search(rf"^{layout} +\d+", out, re.M), out


def _val_loss(out: str) -> float:
    m = re.search(r"^validation loss ([\d.]+)", out, re.M)
    assert m, f"no validation loss line in:\n{out}"
    return float(m.group(1))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_transformer_grad_accum_is_the_larger_batch_and_amp_trains() -> None:
    """Two micro-batches of 4 per rank under no_sync give the step one batch of 8 gives (same
    windows, same schedule and clipping); --amp runs the same steps in float16 under autocast."""
    tiny = ["--nproc", "2", "--steps", "4", "--log-every", "4", "--no-progress"]
    tiny += ["--d-model", "32", "--block", "16", "--warmup", "2", "--clip", "0.5"]
    whole = _ok(_run(["examples/train_transformer_ddp.py", *tiny, "--batch-size", "16"]))
    accum = _ok(
        _run(["examples/train_transformer_ddp.py", *tiny, "--batch-size", "8", "--grad-accum", "2"])
    )
    assert "2 micro-batches per step" in accum
    assert _val_loss(accum) == pytest.approx(_val_loss(whole), abs=2e-4), (whole, accum)
    amp = _ok(_run(["examples/train_transformer_ddp.py", *tiny, "--batch-size", "16", "--amp"]))
    assert "float16 autocast + GradScaler" in amp
    assert re.search(r"^GradScaler: \d+ of 4 steps skipped", amp, re.M), amp
    # float16 matmuls change the numbers a little, not the training.
    assert _val_loss(amp) == pytest.approx(_val_loss(whole), rel=0.02), (whole, amp)
