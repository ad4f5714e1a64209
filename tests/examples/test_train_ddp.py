"""The DDP examples run end to end on 2 CPU ranks: spawned, launched, resumed, and alone.

Each test runs the script in a subprocess (as a user would) under a hard time limit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_to_end

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/train_ddp.py"
STEPS_PER_EPOCH = 23  # 1,437 training digits over a global batch of 64 (2 ranks x 32)

pytest.importorskip("sklearn", reason="the example's digits ship with scikit-learn")
pytestmark = pytest.mark.slow  # end-to-end runs of the examples


# Imported at start-up by every Python process that has its folder on PYTHONPATH: with
# KILL_AFTER_CHECKPOINT=name:N the process SIGKILLs itself right after its N-th checkpoint
# named `name` is on disk (tensorlib.save renames the finished file with os.replace).
KILLER = """
import os, signal
_spec = os.environ.get("KILL_AFTER_CHECKPOINT")
if _spec and os.environ.get("DPT_RESTART_COUNT", "0") == "0":  # the first attempt only
    _name, _n = _spec.rsplit(":", 1)
    _real, _seen = os.replace, [0]

    def _replace(src, dst, *args, **kwargs):
        _real(src, dst, *args, **kwargs)
        if os.path.basename(os.fspath(dst)) == _name:
            _seen[0] += 1
            if _seen[0] == int(_n):
                os.kill(os.getpid(), signal.SIGKILL)

    os.replace = _replace
"""


def _run(
    args: list[str], timeout: float = 100, env_vars: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_vars or {})}
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
    assert state["epoch"] == 8


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


@pytest.fixture(scope="module")
def launched_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Two epochs on 2 ranks started by the launcher, never interrupted."""
    ckpt = tmp_path_factory.mktemp("launched") / "launched.npz"
    proc = _run(
        ["-m", "collectives.run", "--nproc-per-node", "2", SCRIPT, "--epochs", "2"]
        + ["--no-progress", "--checkpoint", str(ckpt)]
    )
    return ckpt, _ok(proc)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launcher_form(launched_run: tuple[Path, str]) -> None:
    ckpt, out = launched_run
    assert "world size 2 (cpu backend" in out
    assert _epoch_lines(out) == [1, 2]
    assert _final_accuracy(out) >= 0.9
    assert ckpt.is_file()


def _same_shards(a: Path, b: Path) -> None:
    """Two sharded checkpoints of the same world size: the same step and every rank's shard
    file bitwise equal (the save ids in the names differ)."""
    import numpy as np

    import tensorlib as tl

    assert tl.load(a / "index.npz")["step"] == tl.load(b / "index.npz")["step"]
    files_a, files_b = sorted(a.glob("shard-*.npz")), sorted(b.glob("shard-*.npz"))
    assert len(files_a) == len(files_b) >= 1, (files_a, files_b)
    for fa, fb in zip(files_a, files_b, strict=True):
        assert fa.name[-9:] == fb.name[-9:]  # the rank
        pa, pb = tl.load(fa), tl.load(fb)
        assert len(pa) == len(pb), (fa, fb)
        for va, vb in zip(pa, pb, strict=True):
            assert np.array_equal(np.asarray(va), np.asarray(vb)), f"{fa.name} differs"


def _same_state(a: Path, b: Path) -> None:
    """Model and optimizer state bitwise equal, and the same step."""
    import numpy as np

    import tensorlib as tl

    sa, sb = tl.load(a), tl.load(b)
    assert sa["step"] == sb["step"]
    for part in ("model", "optimizer"):
        flat_a = [(k, v) for k, v in _leaves(sa[part])]
        flat_b = [(k, v) for k, v in _leaves(sb[part])]
        assert [k for k, _ in flat_a] == [k for k, _ in flat_b], part
        for (k, va), (_, vb) in zip(flat_a, flat_b, strict=True):
            assert np.array_equal(np.asarray(va), np.asarray(vb)), f"{part} {k} differs"


def _leaves(obj: object, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, f"{prefix}/{k}")]
    if isinstance(obj, list | tuple):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, f"{prefix}/{i}")]
    return [(prefix, obj.numpy() if hasattr(obj, "numpy") else obj)]


@pytest.mark.timeout(120)
def test_a_restarted_run_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    """World size 1: killed right after its checkpoint at step 20 (epoch 1, batch 20 of 23),
    the next attempt (DPT_RESTART_COUNT=1) resumes there and ends where an uninterrupted run
    ends, bit for bit. A finished run's checkpoint at the same path is not resumed by the
    fresh attempt (it writes its own step-0 checkpoint first)."""
    common = [SCRIPT, "--epochs", "2", "--no-progress", "--checkpoint-every", "10"]
    whole = tmp_path / "whole.npz"
    _ok(_run([*common, "--checkpoint", str(whole)]))
    ckpt = tmp_path / "run.npz"
    shutil.copy(whole, ckpt)  # stale: a fresh attempt must not resume it
    (tmp_path / "sitecustomize.py").write_text(KILLER)
    hooked = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    # Checkpoints at steps 0, 10, 20: killed right after the third.
    killed = _run(
        [*common, "--checkpoint", str(ckpt)],
        env_vars={"KILL_AFTER_CHECKPOINT": "run.npz:3", **hooked},
    )
    assert killed.returncode == -9, (killed.returncode, killed.stdout, killed.stderr)
    assert "resumed" not in killed.stdout
    out = _ok(_run([*common, "--checkpoint", str(ckpt)], env_vars={"DPT_RESTART_COUNT": "1"}))
    assert f"resumed from {ckpt}: epoch 1 batch 20/23, step 20" in out
    assert _epoch_lines(out) == [1, 2]
    _same_state(ckpt, whole)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("form", ["launcher", "nproc"])
def test_two_ranks_killed_then_restarted_match_the_launched_run(
    launched_run: tuple[Path, str], tmp_path: Path, form: str
) -> None:
    """``collectives.run --nproc-per-node 2 --max-restarts 1`` (or the script's own ``--nproc 2
    --max-restarts 1``): rank 0 killed right after the step-30 checkpoint (epoch 2, batch 7 of
    23); the job is started again, resumes on its own and ends in the same state as the
    uninterrupted launched run."""
    whole, _ = launched_run
    ckpt = tmp_path / "two.npz"
    (tmp_path / "sitecustomize.py").write_text(KILLER)
    hooked = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    if form == "launcher":
        launch = ["-m", "collectives.run", "--nproc-per-node", "2", "--max-restarts", "1", SCRIPT]
        banner = "collectives.run: restarting (attempt 2 of 2, DPT_RESTART_COUNT=1)"
    else:
        launch = [SCRIPT, "--nproc", "2", "--max-restarts", "1"]
        banner = "spawn: restarting (attempt 2 of 2, DPT_RESTART_COUNT=1)"
    args = [*launch, "--epochs", "2", "--no-progress"]
    args += ["--checkpoint-every", "10", "--checkpoint", str(ckpt)]
    # Checkpoints at steps 0, 10, 20, 23 (end of epoch 1), 30: killed after the fifth.
    proc = _run(args, timeout=150, env_vars={"KILL_AFTER_CHECKPOINT": "two.npz:5", **hooked})
    out = _ok(proc)
    assert "job failed (attempt 1 of 2)" in proc.stderr and "SIGKILL" in proc.stderr
    assert banner in proc.stderr
    assert f"resumed from {ckpt}: epoch 2 batch 7/23, step 30" in out
    assert _epoch_lines(out)[-1] == 2
    _same_state(ckpt, whole)


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


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "zero", ["0", "1", "3", "3-sharded"], ids=["ddp", "zero1", "zero3", "zero3-sharded"]
)
def test_transformer_restart_resumes_exactly(tmp_path: Path, zero: str) -> None:
    """The GPT example with --amp (under --zero 3: float16 all-gathers, float32 master shards)
    and --grad-accum 2, checkpointing every 3 steps: killed right after the step-6 checkpoint,
    the restarted attempt ends at step 9 in the state an uninterrupted run reaches (model,
    AdamW, schedule and scaler resumed, the loader's micro-batch position too); under DDP,
    --zero 1 (the ZeroRedundancyOptimizer's state consolidated into the checkpoint and
    sharded again on resume) and --zero 3 (fully_shard: the full model and the optimizer's
    shards gathered into the checkpoint), and --zero 3 with --sharded-checkpoint (each rank
    writes its shard; killed right after the step-6 index)."""
    sharded = zero.endswith("-sharded")
    common = ["examples/train_transformer_ddp.py", "--steps", "9", "--log-every", "9"]
    common += ["--zero", zero.removesuffix("-sharded")]
    common += ["--sharded-checkpoint"] if sharded else []
    common += ["--no-progress", "--d-model", "32", "--block", "16", "--batch-size", "8"]
    common += ["--warmup", "2", "--grad-accum", "2", "--checkpoint-every", "3"]
    common += ["--amp"]
    whole = tmp_path / ("whole" if sharded else "whole.npz")
    _ok(_run([*common, "--checkpoint", str(whole)]))
    ckpt = tmp_path / ("gpt" if sharded else "gpt.npz")
    (tmp_path / "sitecustomize.py").write_text(KILLER)
    hooked = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    # Checkpoints at steps 0, 3, 6: killed right after the third.
    killed = _run(
        [*common, "--checkpoint", str(ckpt)],
        env_vars={"KILL_AFTER_CHECKPOINT": f"{'index' if sharded else 'gpt'}.npz:3", **hooked},
    )
    assert killed.returncode == -9, (killed.returncode, killed.stdout, killed.stderr)
    out = _ok(_run([*common, "--checkpoint", str(ckpt)], env_vars={"DPT_RESTART_COUNT": "1"}))
    assert f"resumed from {ckpt} at step 6" in out
    import tensorlib as tl

    if sharded:
        _same_shards(ckpt, whole)
        a, b = tl.load(ckpt / "index.npz"), tl.load(whole / "index.npz")
    else:
        _same_state(ckpt, whole)
        a, b = tl.load(ckpt), tl.load(whole)
    assert a["scheduler"] == b["scheduler"] and a["scaler"] == b["scaler"]
    assert a["loader"] == b["loader"] == {"epoch": 0, "batches_done": 18}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_transformer_zero_stages_reach_ddps_validation_loss() -> None:
    """--zero 1 (ZeroRedundancyOptimizer), 2 and 3 (fully_shard) train the GPT to plain DDP's
    validation loss (float32, to 1e-6 relative): same schedule, gradient accumulation over two
    micro-batches, and gradients clipped to a norm they exceed (under fully_shard the global
    norm over the shards: clipping each rank's shards by their own norm ends elsewhere)."""
    tiny = ["examples/train_transformer_ddp.py", "--nproc", "2", "--steps", "6"]
    tiny += ["--log-every", "6", "--no-progress", "--d-model", "32", "--block", "16"]
    tiny += ["--warmup", "2", "--clip", "0.1", "--batch-size", "8", "--grad-accum", "2"]
    ddp = _val_loss(_ok(_run(tiny)))
    for stage in ("1", "2", "3"):
        out = _ok(_run([*tiny, "--zero", stage]))
        assert f"ZeRO stage {stage} (" in out, out
        assert _val_loss(out) == pytest.approx(ddp, rel=1e-6), (stage, ddp, out)
    # Mixed precision under fully_shard (float16 parameters gathered, float32 master shards)
    # trains as DDP does. Its parameter gradients are float16 (under DDP's autocast they are
    # the float32 leaves' casts), so GradScaler's first scale of 65536 overflows: a step or
    # so is skipped (the scale backed off), which in 6 steps costs ~2% of the loss.
    out = _ok(_run([*tiny, "--zero", "3", "--amp"]))
    assert "float16 autocast + GradScaler" in out and "ZeRO stage 3 (" in out, out
    skipped = re.search(r"^GradScaler: (\d+) of 6 steps skipped", out, re.M)
    assert skipped is not None and int(skipped[1]) <= 2, out
    assert _val_loss(out) == pytest.approx(ddp, rel=0.04), (ddp, out)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--zero", "2", "--device", "cuda"], "--zero 2 with --device cuda: fully_shard shards"),
        (["--zero", "1", "--compare-buckets"], "--compare-buckets compares DDP's bucket"),
        (["--zero", "4"], "argument --zero: invalid choice: 4"),
    ],
)
def test_transformer_zero_refuses_what_it_cannot_do(flags: list[str], expected: str) -> None:
    proc = _run(["examples/train_transformer_ddp.py", "--nproc", "2", *flags], timeout=60)
    assert proc.returncode == 2 and expected in proc.stderr, (proc.returncode, proc.stderr)
