"""``save_checkpoint``/``load_checkpoint``: round trips, exact resume, wrappers, errors, and a
multi-rank run in which only rank 0 writes and every rank loads the same state."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collectives
import tensorlib as tl
from ddp._checkpoint import FORMAT, load_checkpoint, save_checkpoint
from tensorlib import nn, optim
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
    assert out == {"step": 0, "extra": None}
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
