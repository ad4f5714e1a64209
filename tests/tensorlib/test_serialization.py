"""save/load: lossless round trips, a plain .npz without pickle, and atomic replacement."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import Tensor, nn

SUPPORTED: list[np.dtype[Any]] = [tl.float16, tl.float32, tl.float64, tl.int32, tl.int64, tl.bool_]


def _model(seed: int) -> nn.Module:
    tl.manual_seed(seed)
    m = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Embedding(4, 2))
    m.register_buffer("count", tl.tensor([7]))
    return m


def test_model_state_dict_round_trip(tmp_path: Path) -> None:
    src = _model(0)
    path = tmp_path / "model.npz"
    tl.save(src.state_dict(), path)
    loaded = tl.load(path)
    assert list(loaded) == list(src.state_dict())
    assert all(isinstance(v, Tensor) for v in loaded.values())
    dst = _model(1)
    dst.load_state_dict(loaded)
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert a.dtype == b.dtype, k
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=k)


def _nested() -> dict[str, Any]:
    arrays = {str(dt): (np.arange(6).reshape(2, 3) % 3).astype(dt) for dt in SUPPORTED}
    return {
        "int": 3,
        "big": 2**80,
        "neg": -1,
        "float": 0.1,
        "inf": math.inf,
        "ninf": -math.inf,
        "nan": math.nan,
        "np_scalar": np.float32(1.5),
        "str": 'héllo "quoted" {json}',
        "empty_str": "",
        "none": None,
        "flag": False,
        "list": [1, [2.5, None], "x", []],
        "tuple": (1, (2, 3), ()),
        "dict": {"inner": {"deeper": [{"k": 1}]}, "empty": {}},
        "int_keys": {0: "zero", 12: "twelve"},
        "arrays": arrays,
        "tensor": tl.tensor([1.0, 2.0], requires_grad=True),
        "zero_d": np.array(4.25),
        "empty": np.zeros((0, 3), np.float32),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "$array": "a user key that looks like the manifest's",
    }


def _assert_same(got: Any, want: Any, where: str = "root") -> None:
    if isinstance(want, Tensor | np.ndarray):
        assert isinstance(got, Tensor), where
        arr = want.numpy() if isinstance(want, Tensor) else want
        assert got.dtype == arr.dtype and got.shape == arr.shape, where
        np.testing.assert_array_equal(got.numpy(), arr, err_msg=where)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float | np.floating) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), where
    elif isinstance(want, np.generic):
        assert got == want.item() and type(got) is type(want.item()), where
    else:
        assert got == want and type(got) is type(want), where


def test_nested_round_trip_keeps_values_types_and_dtypes(tmp_path: Path) -> None:
    obj = _nested()
    path = tmp_path / "nested.npz"
    tl.save(obj, path)
    _assert_same(tl.load(path), obj)
    _assert_same(tl.load(str(path), device="cpu"), obj)


@pytest.mark.parametrize("top", [[1, tl.ones(2)], (None,), 5, "s", None, tl.zeros(3)], ids=str)
def test_non_dict_top_level_values(top: Any, tmp_path: Path) -> None:
    tl.save(top, tmp_path / "x.npz")
    _assert_same(tl.load(tmp_path / "x.npz"), top)


def test_loaded_tensors_are_independent_and_writable(tmp_path: Path) -> None:
    t = tl.tensor([1.0, 2.0])
    tl.save({"t": t, "again": t}, tmp_path / "x.npz")
    out = tl.load(tmp_path / "x.npz")
    assert not out["t"].requires_grad
    out["t"].numpy()[0] = 5.0
    assert t.tolist() == [1.0, 2.0]


def test_file_is_a_plain_npz_readable_without_pickle(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.bin"  # any name: nothing is appended to it
    tl.save({"w": tl.ones(2, 2), "meta": {"epoch": 3}}, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.bin"]
    with np.load(path, allow_pickle=False) as files:
        names = set(files.files)
        assert "__manifest__" in names and len(names) == 2
        manifest = json.loads(files["__manifest__"].tobytes().decode())
        arrays = [files[n] for n in names - {"__manifest__"}]
    assert manifest["format"] == "tensorlib.npz/1"
    np.testing.assert_array_equal(arrays[0], np.ones((2, 2), np.float32))


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"x": np.array([{}, 1], dtype=object)}, r"state\['x'\] is an object array"),
        ({"x": [np.zeros(2, np.uint8)]}, r"state\['x'\]\[0\] has dtype uint8"),
        ({"x": np.zeros(2, np.complex64)}, "complex64"),
        ({(1, 2): 3}, "keys must be str or int"),
        ({True: 3}, "keys must be str or int"),
        ({"s": {1, 2}}, r"cannot save set at state\['s'\]"),
        ({"f": lambda: 1}, "cannot save function"),
    ],
)
def test_unsaveable_values_raise_type_error_and_write_nothing(
    obj: Any, match: str, tmp_path: Path
) -> None:
    with pytest.raises(TypeError, match=match):
        tl.save(obj, tmp_path / "bad.npz")
    assert os.listdir(tmp_path) == []


def test_failed_save_keeps_the_previous_file_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.npz"
    tl.save({"epoch": 1, "w": tl.ones(3)}, path)
    before = path.read_bytes()

    def half_written(file: Any, *args: Any, **kwargs: Any) -> None:
        file.write(b"PK\x03\x04 partial zip data")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", half_written)
    with pytest.raises(OSError, match="disk full"):
        tl.save({"epoch": 2, "w": tl.zeros(3)}, path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz"]
    assert path.read_bytes() == before
    assert tl.load(path)["epoch"] == 1


def test_save_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.npz"
    tl.save({"epoch": 1}, path)
    tl.save({"epoch": 2}, path)
    assert tl.load(path) == {"epoch": 2}
    assert os.listdir(tmp_path) == ["ckpt.npz"]


def test_loading_a_foreign_npz_raises_value_error(tmp_path: Path) -> None:
    plain = tmp_path / "plain.npz"
    np.savez(plain, x=np.zeros(2))
    with pytest.raises(ValueError, match="not a tensorlib state file"):
        tl.load(plain)
    other = tmp_path / "other.npz"
    blob = np.frombuffer(json.dumps({"format": "other/9", "root": 1}).encode(), np.uint8)
    np.savez(other, __manifest__=blob)
    with pytest.raises(ValueError, match="other/9"):
        tl.load(other)


def test_loading_never_unpickles(tmp_path: Path) -> None:
    path = tmp_path / "evil.npz"
    manifest = {"format": "tensorlib.npz/1", "root": {"$array": "a0"}}
    blob = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    np.savez(path, __manifest__=blob, a0=np.array([{"payload": 1}], dtype=object))
    with pytest.raises(ValueError, match=r"state is an object array, which cannot be stored"):
        tl.load(path)


def test_a_manifest_naming_a_missing_array_raises_value_error(tmp_path: Path) -> None:
    path = tmp_path / "short.npz"
    manifest = {"format": "tensorlib.npz/1", "root": {"$dict": [["w", {"$array": "a7"}]]}}
    np.savez(path, __manifest__=np.frombuffer(json.dumps(manifest).encode(), np.uint8))
    with pytest.raises(ValueError, match=r"short\.npz: malformed manifest: state\['w'\] names"):
        tl.load(path)


# ---------------------------------------------------------------------- dtypes on load
def rewrite(path: Path, where: list[str | int], array: np.ndarray[Any, Any]) -> None:
    """Put ``array`` in place of the array at ``where`` (dict keys from the root) of a file
    :func:`tl.save` wrote, keeping its manifest: a damaged or crafted file in the format."""
    with np.load(path, allow_pickle=False) as files:
        arrays = {n: files[n] for n in files.files}
    node = json.loads(arrays["__manifest__"].tobytes().decode())["root"]
    for key in where:
        node = dict(node["$dict"])[key]
    arrays[node["$array"]] = array
    np.savez(path, **arrays)


def _linear_file(tmp_path: Path, weight: np.ndarray[Any, Any]) -> Path:
    path = tmp_path / "linear.npz"
    tl.save(nn.Linear(2, 2).state_dict(), path)
    rewrite(path, ["weight"], weight)
    return path


@pytest.mark.parametrize(
    ("weight", "match"),
    [
        # "0.123456789" kept 8 characters and loaded as 0.123456 before: silently other weights.
        (np.array([["0.123456789", "1"], ["2", "3"]], dtype="<U8"), "has dtype <U8"),
        (np.full((2, 2), 1 + 2j, np.complex64), "has dtype complex64"),  # NumPy only warned
        (np.array([[1.0, 2.0], [3.0, 4.0]], dtype=object), "is an object array"),
        (np.ones((2, 2), np.uint8), "has dtype uint8"),
    ],
)
def test_load_refuses_what_save_refuses_naming_the_key_and_dtype(
    weight: np.ndarray[Any, Any], match: str, tmp_path: Path
) -> None:
    path = _linear_file(tmp_path, weight)
    model = nn.Linear(2, 2)
    before = model.weight.numpy().copy()
    with pytest.raises(ValueError, match=rf"linear\.npz: state\['weight'\] {match}"):
        model.load_state_dict(tl.load(path))
    np.testing.assert_array_equal(model.weight.numpy(), before)
    # The same rule, one place: save refuses the same array with the same reason.
    with pytest.raises(TypeError, match=rf"state\['weight'\] {match}"):
        tl.save({"weight": weight}, tmp_path / "other.npz")


def test_float_checkpoints_load_into_other_float_dtypes_rounded(tmp_path: Path) -> None:
    tl.manual_seed(0)
    wide = nn.Linear(3, 4).to(tl.float64)
    wide.weight.data[0, 0] = 1 / 3 + 1e-12  # not a float32: the load rounds it
    path = tmp_path / "f64.npz"
    tl.save(wide.state_dict(), path)
    narrow = nn.Linear(3, 4)
    narrow.load_state_dict(tl.load(path))
    for name, t in narrow.state_dict().items():
        assert t.dtype == tl.float32, name  # the model keeps its dtype, as torch's does
        expected = wide.state_dict()[name].numpy().astype(np.float32)
        np.testing.assert_array_equal(t.numpy(), expected, err_msg=name)
    half = nn.Linear(3, 4).to(tl.float16)
    half.load_state_dict(tl.load(path))
    np.testing.assert_array_equal(half.weight.numpy(), wide.weight.numpy().astype(np.float16))


class _Counters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(tl.ones(2))
        self.register_buffer("count", tl.tensor([3, 4]))  # int64
        self.register_buffer("small", tl.tensor([1, 2], dtype=tl.int32))
        self.register_buffer("mask", tl.tensor([True, False]))


def _counters(**change: Any) -> dict[str, Any]:
    state = {k: v.numpy().copy() for k, v in _Counters().state_dict().items()}
    return {**state, **change}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # torch's copy_ casts all of these; here each is an error naming key and both dtypes.
        ({"weight": np.array([1, 2])}, r"weight: checkpoint int64 vs model float32 \(integer"),
        ({"weight": np.array([True, False])}, "weight: checkpoint bool vs model float32"),
        ({"count": np.array([1.5, 2.0])}, "count: checkpoint float64 vs model int64"),
        ({"mask": np.array([1.0, 0.0])}, "mask: checkpoint float64 vs model bool"),
        ({"mask": np.array([1, 0])}, "mask: checkpoint int64 vs model bool"),
        ({"count": np.array([True, True])}, "count: checkpoint bool vs model int64"),
        ({"small": np.array([2**31, 0])}, r"small: .*values 0\.\.2147483648 do not fit in int32"),
        ({"weight": np.ones(2, np.complex128)}, "weight: checkpoint complex128 vs model float32"),
    ],
)
def test_load_state_dict_refuses_casts_that_change_the_kind_of_number(
    change: dict[str, Any], match: str
) -> None:
    model = _Counters()
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"dtype mismatch for {match}"):
        model.load_state_dict(_counters(**change))
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


def test_load_state_dict_casts_integers_that_fit() -> None:
    model = _Counters()
    model.load_state_dict(_counters(count=np.array([7, 8], np.int32), small=np.array([5, -6])))
    assert model.count.dtype == tl.int64 and model.count.tolist() == [7, 8]
    assert model.small.dtype == tl.int32 and model.small.tolist() == [5, -6]


def test_optimizer_state_dtypes(tmp_path: Path) -> None:
    tl.manual_seed(0)
    wide = nn.Linear(2, 3).to(tl.float64)
    opt = tl.optim.Adam(wide.parameters(), lr=0.1)
    (wide(tl.ones(4, 2, dtype=tl.float64)) ** 2).sum().backward()
    opt.step()
    path = tmp_path / "opt.npz"
    tl.save(opt.state_dict(), path)
    narrow = nn.Linear(2, 3)
    narrow_opt = tl.optim.Adam(narrow.parameters(), lr=0.1)
    narrow_opt.load_state_dict(tl.load(path))
    moments = narrow_opt.state[narrow.weight]["exp_avg"]
    assert moments.dtype == np.float32
    np.testing.assert_array_equal(moments, opt.state[wide.weight]["exp_avg"].astype(np.float32))

    rewrite(path, ["state", 0, "exp_avg"], np.ones((3, 2), np.int64))
    fresh_opt = tl.optim.Adam(nn.Linear(2, 3).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0: dtype mismatch: checkpoint"):
        fresh_opt.load_state_dict(tl.load(path))
    assert fresh_opt.state == {}
