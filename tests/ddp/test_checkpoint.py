"""``save_checkpoint``/``load_checkpoint``: round trips, exact resume, wrappers, errors, a
multi-rank run in which only rank 0 writes and every rank loads the same state, the per-rank
random generator states and their world-size rule, and format 1 files."""

from __future__ import annotations

import json
import os
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collectives
import tensorlib as tl
from ddp._checkpoint import FORMAT, load_checkpoint, save_checkpoint
from ddp.handlers import Checkpoint
from tensorlib import nn, optim
from tests.ddp import resume_script as rs
from tests.helpers import DEVICES


class Net(nn.Module):
    """Two layers and a buffer (buffers are part of the checkpoint too)."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, hidden)
        self.fc2 = nn.Linear(hidden, 2)
        self.register_buffer("seen", tl.zeros(1))

    def forward(self, x: tl.Tensor) -> tl.Tensor:
        self.seen.data[...] += x.shape[0]
        return self.fc2(self.fc1(x).tanh())


def make(seed: int, hidden: int = 4, device: str = "cpu") -> tuple[Net, optim.Optimizer]:
    tl.manual_seed(seed)
    model = Net(hidden)
    model.to(device)
    return model, optim.Adam(model.parameters(), lr=0.05)


def train_step(model: nn.Module, opt: optim.Optimizer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    device = next(iter(model.parameters())).device
    x = tl.tensor(rng.standard_normal((5, 3)).astype(np.float32), device=device)
    opt.zero_grad()
    loss = (model(x) ** 2).mean()
    loss.backward()
    opt.step()


def params(model: nn.Module) -> dict[str, np.ndarray[Any, Any]]:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, np.ndarray[Any, Any]], b: dict[str, np.ndarray[Any, Any]]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


class Wrapper:
    """A DDP-like wrapper that is not an nn.Module: its ``.module`` is what gets saved."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


class Outer(nn.Module):
    """A plain model whose child happens to be called ``module``: never unwrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.scale = nn.Parameter(tl.ones(1))


# ---------------------------------------------------------------------- single process
@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_and_exact_resume(tmp_path: Path, device: str) -> None:
    model, opt = make(0, device=device)
    for s in range(2):
        train_step(model, opt, s)
    path = tmp_path / "ckpt.npz"
    extra = {"epoch": 2, "best": 0.25, "history": [1.0, 0.5], "arr": np.arange(3), "tag": None}
    save_checkpoint(path, model, opt, step=7, extra=extra)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz"]  # no temporary file left behind

    fresh, fresh_opt = make(1, device=device)
    out = load_checkpoint(path, fresh, fresh_opt)
    assert out["step"] == 7
    assert {k: v for k, v in out["extra"].items() if k != "arr"} == {
        "epoch": 2,
        "best": 0.25,
        "history": [1.0, 0.5],
        "tag": None,
    }
    assert out["extra"]["arr"].tolist() == [0, 1, 2]
    assert_same(params(fresh), params(model))
    assert all(p.device == tl.device(device) for p in fresh.parameters())
    assert all(b.device == tl.device(device) for b in fresh.buffers())
    # Adam's moments and step count came back too: the next step is bit-identical.
    train_step(model, opt, 9)
    train_step(fresh, fresh_opt, 9)
    assert_same(params(fresh), params(model))


def test_model_only_and_map_location(tmp_path: Path) -> None:
    model, _ = make(0)
    path = tmp_path / "sub" / "dir" / "m.npz"  # missing parent directories are created
    save_checkpoint(path, model)
    fresh, opt = make(3)
    out = load_checkpoint(str(path), fresh, map_location="cpu")
    assert out == {"step": 0, "epoch": 0, "extra": None, "rng_restored": False}
    assert_same(params(fresh), params(model))
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_checkpoint(path, fresh, opt)
    # A checkpoint with optimizer state loads into a model alone as well.
    save_checkpoint(path, model, opt, step=1)
    assert load_checkpoint(path, fresh)["step"] == 1


def test_wrappers_are_unwrapped_but_plain_modules_are_not(tmp_path: Path) -> None:
    model, opt = make(0)
    path = tmp_path / "w.npz"
    save_checkpoint(path, Wrapper(model), opt)
    assert set(tl.load(path)["model"]) == {
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
        "seen",
    }
    fresh, _ = make(2)
    load_checkpoint(path, Wrapper(fresh))
    assert_same(params(fresh), params(model))

    outer = Outer()
    save_checkpoint(path, outer)
    assert set(tl.load(path)["model"]) == {"module.weight", "module.bias", "scale"}


def test_load_errors(tmp_path: Path) -> None:
    model, _ = make(0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.npz", model)
    with pytest.raises(FileNotFoundError, match="is a directory"):
        load_checkpoint(tmp_path, model)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="not a checkpoint written by save_checkpoint"):
        load_checkpoint(junk, model)
    plain = tmp_path / "plain.npz"
    np.savez(plain, a=np.zeros(2))
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_checkpoint(plain, model)
    bare = tmp_path / "bare.npz"
    tl.save(model.state_dict(), bare)
    with pytest.raises(ValueError, match=r"no 'model' entry .* model\.load_state_dict"):
        load_checkpoint(bare, model)
    other = tmp_path / "other.npz"
    tl.save({"format": "something/2", "model": {}}, other)
    with pytest.raises(ValueError, match="has format 'something/2'"):
        load_checkpoint(other, model)
    with pytest.raises(TypeError, match=r"model must be a tensorlib nn\.Module"):
        load_checkpoint(bare, object())
    with pytest.raises(TypeError, match=r"optimizer must be a tensorlib\.optim\.Optimizer"):
        load_checkpoint(bare, model, optimizer=object())  # type: ignore[arg-type]


def test_mismatch_changes_nothing(tmp_path: Path) -> None:
    model, opt = make(0)
    train_step(model, opt, 0)
    path = tmp_path / "c.npz"
    save_checkpoint(path, model, opt, step=1)

    wider, wider_opt = make(1, hidden=5)
    before = params(wider)
    with pytest.raises(ValueError, match=r"shape mismatch: fc1.weight: checkpoint \(4, 3\)"):
        load_checkpoint(path, wider, wider_opt)
    assert_same(params(wider), before)
    assert wider_opt.state == {}

    renamed = Outer()
    with pytest.raises(
        ValueError,
        match=r"missing from the checkpoint: .*'module.weight'.*not in the model: .*'fc1.weight'",
    ):
        load_checkpoint(path, renamed)

    # The model matches but the optimizer does not: neither is changed.
    same, _ = make(2)
    before = params(same)
    other_opt = optim.Adam([same.fc1.weight], lr=0.1)
    with pytest.raises(ValueError, match="optimizer state does not match"):
        load_checkpoint(path, same, other_opt)
    assert_same(params(same), before)
    assert other_opt.state == {}


def test_save_errors(tmp_path: Path) -> None:
    model, _ = make(0)
    path = tmp_path / "s.npz"
    with pytest.raises(TypeError, match=r"model must be a tensorlib nn\.Module"):
        save_checkpoint(path, Wrapper(object()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer must be"):
        save_checkpoint(path, model, optimizer=model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an int"):
        save_checkpoint(path, model, step=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot save object"):
        save_checkpoint(path, model, extra={"bad": object()})
    assert os.listdir(tmp_path) == []  # a failed save leaves nothing, not even a temp file
    save_checkpoint(path, model, step=np.int64(4))  # type: ignore[arg-type]
    assert tl.load(path)["format"] == FORMAT and tl.load(path)["step"] == 4


# ---------------------------------------------------------------------- multi-process
@pytest.fixture
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPT_ALLOW_SHARED_GPU", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)


def _forbidden_save(obj: Any, path: Any) -> None:
    raise AssertionError(f"rank {collectives.get_rank()} called tensorlib.save({path})")


def checkpoint_rank(rank: int, directory: str) -> dict[str, Any]:
    root = Path(directory)
    real_save = tl.save
    if rank == 0:

        def slow_save(obj: Any, path: Any) -> None:
            time.sleep(0.4)  # a rank that did not wait would find no file yet
            real_save(obj, path)

        tl.save = slow_save
    else:
        tl.save = _forbidden_save
    out: dict[str, Any] = {}
    runs: list[tuple[str, Any]] = [("plain", None)]
    try:
        from ddp._ddp import DistributedDataParallel

        runs.append(("ddp", DistributedDataParallel))
    except ImportError:
        pass
    for name, wrap in runs:
        model, opt = make(rank)  # different weights on every rank (until DDP broadcasts)
        target: Any = wrap(model) if wrap is not None else model
        train_step(target, opt, seed=rank)
        saved = params(model)
        path = root / f"{name}.npz"
        save_checkpoint(path, target, opt, step=5, extra={"writer": rank})
        st = path.stat() if path.exists() else None
        fresh, fresh_opt = make(10 + rank)
        result = load_checkpoint(path, Wrapper(fresh) if wrap is not None else fresh, fresh_opt)
        out[name] = {
            "exists_on_return": st is not None,
            "stat": [st.st_ino, st.st_mtime_ns] if st is not None else None,
            "saved": {k: v.tolist() for k, v in saved.items()},
            "loaded": {k: v.tolist() for k, v in params(fresh).items()},
            "result": [result["step"], result["extra"]],
            "adam_steps": sorted(s["step"] for s in fresh_opt.state.values()),
        }
    try:
        save_checkpoint(root / "bad.npz", fresh, extra={"bad": object()})
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    collectives.barrier()
    out["files"] = sorted(os.listdir(root))
    tl.save = real_save
    return out


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_clean_env")
def test_rank0_writes_every_rank_loads(tmp_path: Path) -> None:
    results = collectives.spawn(checkpoint_rank, args=(str(tmp_path),), nprocs=2, backend="cpu")
    assert results is not None
    r0, r1 = results
    names = ["plain", "ddp"] if "ddp" in r0 else ["plain"]
    for name in names:
        a, b = r0[name], r1[name]
        assert a["exists_on_return"] and b["exists_on_return"]  # rank 1 waited for the write
        assert a["stat"] == b["stat"]  # one file, written once
        assert a["loaded"] == b["loaded"] == a["saved"]  # rank 0's state, on every rank
        if name == "plain":
            assert b["saved"] != a["saved"]  # (rank 1's own model was different)
        else:
            assert b["saved"] == a["saved"]  # DDP kept the ranks identical
        assert a["result"] == b["result"] == [5, {"writer": 0}]
        assert a["adam_steps"] == b["adam_steps"] == [1, 1, 1, 1]
    assert r0["error"].startswith("TypeError: save: cannot save object")
    assert r1["error"].startswith("RuntimeError: save_checkpoint: rank 0 failed to write")
    assert "cannot save object" in r1["error"]
    assert r0["files"] == r1["files"] == sorted(f"{n}.npz" for n in names)


# ---------------------------------------------------------------------- exact resume
def _draws(run: rs.Run) -> list[float]:
    """The next value of every generator a script draws from."""
    return [
        float(tl.rand(1).item()),
        float(np.random.random()),
        float(run.gen.random()),
        random.random(),
    ]


def _resume_body(rank: int, directory: str, dtype: str, save_at: int, steps: int) -> Any:
    """Train to ``steps`` saving at ``save_at``; then rebuild, scramble the generators, load and
    train again from the checkpoint. Both final states and the draws after each are returned."""
    world = collectives.get_world_size()
    path = str(Path(directory) / "resume.npz")

    def on_step(when: str, s: int) -> None:
        if when == "after" and s == save_at:
            rs.save(run, path, s)

    run = rs.build(dtype, world, rank)
    rs.train(run, 0, steps, 0, on_step)
    whole = {k: v.tolist() for k, v in rs.params(run).items()}
    after_whole = _draws(run)

    run = rs.build(dtype, world, rank)
    tl.manual_seed(12345)  # what the restarted script might draw before loading
    np.random.seed(6789)
    start = rs.load(run, path)
    rs.train(run, start, steps, 0)
    return {
        "start": start,
        "whole": whole,
        "resumed": {k: v.tolist() for k, v in rs.params(run).items()},
        "draws": [after_whole, _draws(run)],
        "loader": run.loader.state_dict(),
    }


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("save_at", [1, 5, 12, 13])  # 12 batches per epoch: 12 ends one
def test_everything_resumes_bitwise_in_one_process(
    tmp_path: Path, dtype: str, save_at: int
) -> None:
    out = _resume_body(0, str(tmp_path), dtype, save_at, 20)
    assert out["start"] == save_at
    assert out["resumed"] == out["whole"]  # parameters, bit for bit
    assert out["draws"][0] == out["draws"][1]  # every generator is where it would have been
    assert out["loader"] == {"epoch": 1, "batches_done": 8}


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_clean_env")
def test_every_rank_gets_its_own_random_streams_back(tmp_path: Path) -> None:
    """At the world size of the save each rank restores its own generators (they differ)."""
    results = collectives.spawn(
        _resume_body, args=(str(tmp_path), "float64", 7, 11), nprocs=2, backend="cpu"
    )
    assert results is not None
    for r in results:
        assert r["resumed"] == r["whole"] and r["draws"][0] == r["draws"][1]
    assert results[0]["draws"][0] != results[1]["draws"][0]  # the ranks' streams differ
    assert results[0]["resumed"] == results[1]["resumed"]  # DDP kept the weights equal

    # The same file at world size 1: everything but the random streams loads, and it says so.
    before = _draws(rs.build("float64", 1, 0))
    run = rs.build("float64", 1, 0)  # the same generators again
    with pytest.warns(RuntimeWarning, match="saved by 2 rank.*this job has 1.*not restored"):
        state = load_checkpoint(
            tmp_path / "resume.npz", run.model, run.opt, scheduler=run.sched,
            scaler=run.scaler, loader=run.loader, rng=True, generators=[run.gen],
        )  # fmt: skip
    assert state["rng_restored"] is False and state["step"] == 7
    assert _draws(run) == before  # the generators were left alone
    assert {k: v.tolist() for k, v in rs.params(run).items()} != results[0]["whole"]
    assert run.sched.last_epoch == 7 and run.scaler.get_scale() == 2.0**10
    assert run.loader.state_dict() == {"epoch": 1, "batches_done": 1}  # 6 batches an epoch


def test_format_1_files_still_load(tmp_path: Path) -> None:
    model, opt = make(0)
    train_step(model, opt, 0)
    old = tmp_path / "v1.npz"
    tl.save(
        {
            "format": "ddp.checkpoint/1",
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": 3,
            "extra": {"epoch": 1},
        },
        old,
    )
    fresh, fresh_opt = make(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = load_checkpoint(old, fresh, fresh_opt)
    assert out == {"step": 3, "epoch": 0, "extra": {"epoch": 1}, "rng_restored": False}
    assert_same(params(fresh), params(model))
    with pytest.warns(RuntimeWarning, match="holds no random generator states"):
        assert load_checkpoint(old, fresh, rng=True)["rng_restored"] is False
    sched = optim.lr_scheduler.StepLR(fresh_opt, step_size=2)
    with pytest.raises(ValueError, match="holds no scheduler state"):
        load_checkpoint(old, fresh, scheduler=sched)
    save_checkpoint(old, fresh)
    assert tl.load(old)["format"] == FORMAT == "ddp.checkpoint/2"


def test_mismatched_parts_change_nothing(tmp_path: Path) -> None:
    run = rs.build("float64", 1, 0)
    rs.train(run, 0, 4, 0)
    path = tmp_path / "p.npz"
    rs.save(run, str(path), 4)
    other = rs.build("float64", 1, 0)
    sched_before = other.sched.state_dict()
    with pytest.raises(ValueError, match=r"holds 1 scheduler state\(s\), scheduler= has 2"):
        load_checkpoint(path, other.model, scheduler=[other.sched, other.sched])
    off = tl.amp.GradScaler(enabled=True)
    tl.save({**tl.load(path), "scaler": {}}, path)  # as if saved from a disabled scaler
    with pytest.raises(ValueError, match="the scaler state does not match"):
        load_checkpoint(path, other.model, other.opt, scheduler=other.sched, scaler=off)
    assert other.sched.state_dict() == sched_before  # put back after the scaler failed
    assert other.opt.state == {}
    with pytest.raises(ValueError, match="generators= are restored with rng=True"):
        load_checkpoint(path, other.model, generators=[other.gen])
    draws = _draws(rs.build("float64", 1, 0))
    again = rs.build("float64", 1, 0)
    with pytest.raises(ValueError, match=r"1 numpy generator state.*generators= has 0"):
        load_checkpoint(path, again.model, rng=True)
    assert _draws(again) == draws
    with pytest.raises(TypeError, match="generators\\[0\\] is int"):
        save_checkpoint(path, again.model, generators=[3])
    with pytest.raises(TypeError, match=r"loader must be a ddp\.DataLoader"):
        save_checkpoint(path, again.model, loader=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scheduler\\[0\\] must have state_dict"):
        save_checkpoint(path, again.model, scheduler=object())


# ---------------------------------------------------------------------- dtypes
def rewrite(path: Path, where: list[str | int], array: np.ndarray[Any, Any]) -> None:
    """Put ``array`` in place of the array at ``where`` (dict keys from the root) of a file
    ``tensorlib.save`` wrote, keeping its manifest: a damaged or crafted checkpoint."""
    with np.load(path, allow_pickle=False) as files:
        arrays = {n: files[n] for n in files.files}
    node = json.loads(arrays["__manifest__"].tobytes().decode())["root"]
    for key in where:
        node = dict(node["$dict"])[key]
    arrays[node["$array"]] = array
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.full((4, 3), "0.123456789", dtype="<U8"), "has dtype <U8"),
        (np.ones((4, 3), np.complex64), "has dtype complex64"),
        (np.ones((4, 3), dtype=object), "is an object array"),
    ],
)
def test_a_checkpoint_holding_a_non_tensor_dtype_is_refused_by_name(
    bad: np.ndarray[Any, Any], match: str, tmp_path: Path
) -> None:
    model, opt = make(0)
    train_step(model, opt, 0)
    path = tmp_path / "c.npz"
    save_checkpoint(path, model, opt, step=1)
    rewrite(path, ["model", "fc1.weight"], bad)
    fresh, fresh_opt = make(1)
    before = params(fresh)
    key = re.escape("state['model']['fc1.weight'] ")
    with pytest.raises(
        ValueError, match=f"not a checkpoint written by save_checkpoint.*{key}{match}"
    ):
        load_checkpoint(path, fresh, fresh_opt)
    assert_same(params(fresh), before)
    assert fresh_opt.state == {}
    # The Checkpoint handler reads with tensorlib.load too: the same refusal.
    with pytest.raises(ValueError, match=f"{key}{match}"):
        Checkpoint.load_objects({"model": fresh}, path)
    assert_same(params(fresh), before)


def test_a_float64_checkpoint_loads_into_a_float32_run_cast(tmp_path: Path) -> None:
    wide, wide_opt = make(0)
    wide.to(tl.float64)
    train_step(wide, wide_opt, 0)
    path = tmp_path / "f64.npz"
    save_checkpoint(path, wide, wide_opt, step=1)
    narrow, narrow_opt = make(1)
    assert load_checkpoint(path, narrow, narrow_opt)["step"] == 1
    for name, t in narrow.state_dict().items():
        assert t.dtype == tl.float32, name
        want = wide.state_dict()[name].numpy().astype(np.float32)
        np.testing.assert_array_equal(t.numpy(), want, err_msg=name)
    for p_narrow, p_wide in zip(narrow.parameters(), wide.parameters(), strict=True):
        for moment in ("exp_avg", "exp_avg_sq"):
            got = narrow_opt.state[p_narrow][moment]
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, wide_opt.state[p_wide][moment].astype(np.float32))
    again = make(2)[0]
    Checkpoint.load_objects({"model": again}, path)  # the handler's path: the same cast
    assert_same(params(again), params(narrow))


@pytest.mark.parametrize(
    ("where", "bad", "match"),
    [
        # torch's copy_ would convert each of these; a checkpoint whose kind of number differs
        # from the model's belongs to another model or is damaged.
        (["model", "fc2.bias"], np.array([1, 2]), "fc2.bias: checkpoint int64 vs model float32"),
        (["model", "seen"], np.array([True]), "seen: checkpoint bool vs model float32"),
    ],
)
def test_a_checkpoint_of_another_kind_of_number_is_refused_and_changes_nothing(
    where: list[str | int], bad: np.ndarray[Any, Any], match: str, tmp_path: Path
) -> None:
    model, opt = make(0)
    train_step(model, opt, 0)
    path = tmp_path / "c.npz"
    save_checkpoint(path, model, opt, step=1)
    rewrite(path, where, bad)
    fresh, fresh_opt = make(1)
    sched = optim.lr_scheduler.StepLR(fresh_opt, step_size=2)
    before, sched_before = params(fresh), sched.state_dict()
    with pytest.raises(ValueError, match=f"does not match Net: dtype mismatch: {match}"):
        load_checkpoint(path, fresh, fresh_opt)
    assert_same(params(fresh), before)
    assert fresh_opt.state == {} and sched.state_dict() == sched_before
    with pytest.raises(ValueError, match=f"dtype mismatch for {match}"):
        Checkpoint.load_objects({"model": fresh}, path)
    assert_same(params(fresh), before)


def test_optimizer_state_of_another_kind_of_number_is_refused(tmp_path: Path) -> None:
    model, opt = make(0)
    train_step(model, opt, 0)
    path = tmp_path / "c.npz"
    save_checkpoint(path, model, opt, step=1)
    rewrite(path, ["optimizer", "state", 0, "exp_avg_sq"], np.ones((4, 3), np.int64))
    fresh, fresh_opt = make(1)
    before = params(fresh)
    with pytest.raises(
        ValueError,
        match=r"optimizer state does not match.*'exp_avg_sq' of parameter 0: dtype mismatch: "
        "checkpoint int64 vs model float32",
    ):
        load_checkpoint(path, fresh, fresh_opt)
    assert_same(params(fresh), before)
    assert fresh_opt.state == {}
