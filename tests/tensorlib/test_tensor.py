"""The Tensor API: creation, dtypes, conversions, DLPack, comparisons and Python protocols."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import Tensor
from tests.helpers import DEVICES

SUPPORTED: list[np.dtype[Any]] = [tl.float16, tl.float32, tl.float64, tl.int32, tl.int64, tl.bool_]


# ============================================================================ creation
@pytest.mark.parametrize(
    ("data", "dtype"),
    [
        (1.5, tl.float32),
        ([1.0, 2.0], tl.float32),
        ([1, 2.5], tl.float32),
        (3, tl.int64),
        ([[1, 2], [3, 4]], tl.int64),
        (True, tl.bool_),
        ([True, False], tl.bool_),
        (np.zeros(2, np.float64), tl.float64),
        (np.zeros(2, np.float16), tl.float16),
        (np.zeros(2, np.int32), tl.int32),
        (np.zeros(2, np.uint8), tl.int64),
        (np.zeros(2, np.bool_), tl.bool_),
    ],
)
def test_tensor_default_dtypes(data: Any, dtype: np.dtype[Any]) -> None:
    t = tl.tensor(data)
    assert t.dtype == dtype
    np.testing.assert_array_equal(t.numpy(), np.asarray(data).astype(dtype))


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("half", tl.float16),
        ("float", tl.float32),
        ("double", tl.float64),
        ("int", tl.int64),
        ("long", tl.int64),
        ("int32", tl.int32),
        ("bool", tl.bool_),
        (np.float64, tl.float64),
    ],
)
def test_dtype_names_and_aliases(name: Any, dtype: np.dtype[Any]) -> None:
    assert tl.tensor([1], dtype=name).dtype == dtype
    assert tl.zeros(2, dtype=name).dtype == dtype


def test_tensor_copies_its_data() -> None:
    arr = np.array([1.0, 2.0], dtype=np.float32)
    t = tl.tensor(arr)
    arr[0] = 99.0
    assert t.numpy()[0] == 1.0
    src = tl.tensor([1.0, 2.0], requires_grad=True)
    u = tl.tensor(src)
    u.numpy()[1] = -5.0
    assert src.numpy()[1] == 2.0
    assert not u.requires_grad and u.grad_fn is None
    v = Tensor([3.0, 4.0])
    assert v.dtype == tl.float32 and v.tolist() == [3.0, 4.0]


@pytest.mark.parametrize("device", DEVICES)
def test_constant_constructors_shapes_and_dtypes(device: str) -> None:
    z = tl.zeros(2, 3, device=device)
    assert z.shape == (2, 3) and z.dtype == tl.float32 and z.device == device
    assert tl.zeros((2, 3)).shape == (2, 3)
    assert tl.zeros(()).shape == () and tl.zeros(0).shape == (0,)
    o = tl.ones(4, dtype=tl.int32, device=device)
    assert o.dtype == tl.int32 and o.tolist() == [1, 1, 1, 1]
    assert tl.full((2,), 7).dtype == tl.int64
    assert tl.full((2,), 1.5).dtype == tl.float32
    assert tl.full((2,), True).tolist() == [True, True]
    f = tl.full((2, 2), 2.5, dtype=tl.float64, device=device)
    assert f.dtype == tl.float64 and f.numpy().tolist() == [[2.5, 2.5], [2.5, 2.5]]
    like = tl.ones_like(f)
    assert like.shape == (2, 2) and like.dtype == tl.float64 and like.device == f.device
    assert tl.zeros_like(o).dtype == tl.int32
    assert tl.full_like(o, 3).tolist() == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="negative"):
        tl.zeros(2, -1)


def test_arange() -> None:
    a = tl.arange(5)
    assert a.dtype == tl.int64 and a.tolist() == [0, 1, 2, 3, 4]
    assert tl.arange(1, 7, 2).tolist() == [1, 3, 5]
    b = tl.arange(0.0, 1.0, 0.25)
    assert b.dtype == tl.float32 and b.tolist() == [0.0, 0.25, 0.5, 0.75]
    assert tl.arange(3, dtype=tl.float64).dtype == tl.float64


@pytest.mark.parametrize("device", DEVICES)
def test_rand_and_randn_shapes_dtypes_and_distribution(device: str) -> None:
    tl.manual_seed(0)
    r = tl.rand(200, 50, device=device)
    assert r.shape == (200, 50) and r.dtype == tl.float32 and r.device == device
    rv = r.numpy()
    assert rv.min() >= 0.0 and rv.max() < 1.0 and abs(rv.mean() - 0.5) < 0.02
    n = tl.randn(200, 50, dtype=tl.float64).numpy()
    assert n.dtype == np.float64 and abs(n.mean()) < 0.05 and abs(n.std() - 1.0) < 0.05
    assert tl.rand(3, dtype=tl.float16).dtype == tl.float16
    assert tl.randn(2, requires_grad=True).requires_grad
    with pytest.raises(TypeError, match="floating"):
        tl.rand(2, dtype=tl.int64)


def test_manual_seed_reproduces_draws() -> None:
    tl.manual_seed(123)
    a = np.concatenate([tl.randn(4).numpy(), tl.rand(3).numpy()])
    tl.manual_seed(123)
    b = np.concatenate([tl.randn(4).numpy(), tl.rand(3).numpy()])
    np.testing.assert_array_equal(a, b)
    tl.manual_seed(124)
    assert not np.array_equal(tl.randn(4).numpy(), a[:4])


def test_generator_is_independent_of_the_default_one() -> None:
    first = tl.randn(5, generator=tl.Generator(7)).numpy()
    g = tl.Generator(7)
    tl.manual_seed(0)
    tl.randn(100)  # draws from the default generator must not disturb g
    np.testing.assert_array_equal(tl.randn(5, generator=g).numpy(), first)
    assert not np.array_equal(tl.randn(5, generator=g).numpy(), first)  # the stream moves on
    tl.manual_seed(5)
    d1 = tl.randn(3).numpy()
    tl.manual_seed(5)
    tl.randn(3, generator=tl.Generator(1))  # an explicit generator leaves the default alone
    np.testing.assert_array_equal(tl.randn(3).numpy(), d1)


def test_generator_state_round_trip() -> None:
    g = tl.Generator(3)
    state = g.get_state()
    a = tl.rand(4, generator=g).numpy()
    g.set_state(state)
    np.testing.assert_array_equal(tl.rand(4, generator=g).numpy(), a)


# ============================================================================ zero-copy
def test_from_numpy_shares_memory() -> None:
    arr = np.arange(6, dtype=np.float64).reshape(2, 3)
    t = tl.from_numpy(arr)
    assert t.dtype == tl.float64 and t.shape == (2, 3)
    arr[0, 0] = 42.0
    assert t.numpy()[0, 0] == 42.0
    t.numpy()[1, 2] = -1.0
    assert arr[1, 2] == -1.0
    with pytest.raises(TypeError, match=r"numpy\.ndarray"):
        tl.from_numpy([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="uint8"):
        tl.from_numpy(np.zeros(3, np.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_from_array_wraps_without_copying_on_the_arrays_device(device: str) -> None:
    arr = tl.zeros(2, 3, dtype=tl.float64, device=device).data
    t = tl.from_array(arr)
    assert t.data is arr and t.device == device and t.dtype == tl.float64
    assert not t.requires_grad and t.is_leaf
    arr[0, 0] = 42.0
    assert t.tolist()[0][0] == 42.0
    scalar = tl.from_array(np.float32(2.5))  # a NumPy scalar becomes a 0-d tensor
    assert scalar.shape == () and scalar.dtype == tl.float32 and scalar.item() == 2.5
    with pytest.raises(TypeError, match="NumPy or CuPy array, got list"):
        tl.from_array([1.0, 2.0])
    with pytest.raises(TypeError, match="uint8"):
        tl.from_array(np.zeros(3, np.uint8))


def test_from_dlpack_round_trip_with_numpy() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    t = tl.from_dlpack(arr)
    assert t.device == "cpu" and t.dtype == tl.float32 and t.shape == (3, 2)
    assert np.shares_memory(t.numpy(), arr)
    back = np.from_dlpack(t)  # through Tensor.__dlpack__
    assert np.shares_memory(back, arr)
    np.testing.assert_array_equal(back, arr)
    assert t.__dlpack_device__()[0] == 1  # kDLCPU
    back[0, 0] = 9.0
    assert t.numpy()[0, 0] == 9.0
    with pytest.raises(TypeError, match="uint8"):
        tl.from_dlpack(np.zeros(2, np.uint8))


@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_every_supported_dtype_round_trips_through_dlpack(dtype: np.dtype[Any]) -> None:
    arr = (np.arange(4) % 2).astype(dtype)
    t = tl.from_dlpack(arr)
    assert t.dtype == dtype
    np.testing.assert_array_equal(np.from_dlpack(t), arr)


# ============================================================================ dtypes
def test_unsupported_dtypes_are_refused_with_the_supported_list() -> None:
    with pytest.raises(TypeError, match="complex"):
        tl.tensor([1 + 2j])
    with pytest.raises(TypeError, match=r"complex64.*float16, float32, float64, int32, int64"):
        tl.zeros(2, dtype=np.complex64)
    with pytest.raises(TypeError, match="uint8"):
        tl.tensor([1.0]).astype(np.uint8)
    with pytest.raises(TypeError, match="unknown dtype"):
        tl.tensor([1.0], dtype="floaty")
    with pytest.raises(TypeError, match="cannot make a tensor from data of dtype <U1"):
        tl.tensor(["a", "b"])
    t = tl.tensor([1.0])
    with pytest.raises(TypeError, match="uint8"):
        t.data = np.zeros(1, np.uint8)


@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_casts_between_supported_dtypes(dtype: np.dtype[Any]) -> None:
    t = tl.tensor([0.0, 1.0, 2.0], dtype=tl.float64)
    for cast in (t.to(dtype), t.astype(dtype), t.to(dtype=dtype), t.to(str(dtype))):
        assert cast.dtype == dtype
        np.testing.assert_array_equal(cast.numpy(), np.array([0.0, 1.0, 2.0]).astype(dtype))


def test_cast_shortcuts_and_no_op_casts() -> None:
    t = tl.tensor([1.5, -2.5], dtype=tl.float64)
    assert t.float().dtype == tl.float32
    assert t.double() is t
    assert t.half().dtype == tl.float16
    assert t.long().tolist() == [1, -2]
    assert t.to("cpu") is t and t.cpu() is t and t.to(tl.float64) is t


# ============================================================================ conversions
def test_numpy_item_tolist_detach() -> None:
    x = tl.tensor([[1.0, 2.0]], requires_grad=True)
    assert np.shares_memory(x.numpy(), x.data)
    assert x.tolist() == [[1.0, 2.0]]
    s = tl.tensor([[3.5]])
    assert s.item() == 3.5 and isinstance(s.item(), float)
    assert isinstance(tl.tensor([7]).item(), int) and isinstance(tl.tensor(True).item(), bool)
    assert float(s) == 3.5 and int(tl.tensor(4)) == 4
    with pytest.raises(ValueError, match=r"\(1, 2\)"):
        x.item()
    d = (x * 2.0).detach()
    assert not d.requires_grad and d.grad_fn is None and d.is_leaf
    d2 = x.detach()
    d2.numpy()[0, 0] = 10.0  # detach shares the data
    assert x.numpy()[0, 0] == 10.0


def test_properties() -> None:
    x = tl.zeros(2, 3, 4, dtype=tl.float64)
    assert x.shape == (2, 3, 4) and x.ndim == 3 and x.size == 24 and x.numel() == 24
    assert x.nbytes == 24 * 8 and x.is_leaf and x.grad is None and x.grad_fn is None
    y = tl.ones(2, requires_grad=True) * 2.0
    assert not y.is_leaf and y.grad_fn is not None


def test_grad_setter_checks_shape_and_dtype() -> None:
    x = tl.zeros(2, 3, requires_grad=True)
    x.grad = tl.ones(2, 3)
    assert x.grad is not None and x.grad.shape == (2, 3)
    with pytest.raises(ValueError, match=r"\(3, 2\).*\(2, 3\)"):
        x.grad = tl.ones(3, 2)
    with pytest.raises(TypeError, match="float64"):
        x.grad = tl.ones(2, 3, dtype=tl.float64)
    x.grad = None
    assert x.grad is None


def test_requires_grad_false_on_non_leaf_raises() -> None:
    y = tl.ones(2, requires_grad=True) * 2.0
    with pytest.raises(RuntimeError, match="detach"):
        y.requires_grad_(False)


# ============================================================================ operators
def test_comparisons_give_bool_tensors() -> None:
    a = tl.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = tl.tensor([3.0, 2.0, 1.0])
    cases = {
        "<": (a < b, [True, False, False]),
        "<=": (a <= 2.0, [True, True, False]),
        ">": (a > b, [False, False, True]),
        ">=": (a >= b, [False, True, True]),
        "==": (a == b, [False, True, False]),
        "!=": (a != 2.0, [True, False, True]),
    }
    for op, (out, expected) in cases.items():
        assert out.dtype == tl.bool_, op
        assert not out.requires_grad, op
        assert out.tolist() == expected, op
    m = a > 1.5
    assert (~m).tolist() == [True, False, False]
    assert (m & (a < 2.5)).tolist() == [False, True, False]
    assert (m | (a < 1.5)).tolist() == [True, True, True]


def test_numpy_on_the_left_defers_to_tensor() -> None:
    x = tl.tensor([1.0, 2.0], requires_grad=True)
    y = np.array([10.0, 20.0], dtype=np.float32) + x
    assert isinstance(y, Tensor) and y.requires_grad
    assert y.tolist() == [11.0, 22.0]
    np.testing.assert_array_equal(np.asarray(x), [1.0, 2.0])


def test_repr_shows_values_and_non_default_attributes() -> None:
    assert repr(tl.tensor([1.5, 2.25])) == "tensor([1.5 , 2.25])"
    r = repr(tl.tensor([1.0, 2.0], dtype=tl.float64, requires_grad=True))
    assert "1." in r and "2." in r and "float64" in r and "requires_grad=True" in r
    y = tl.tensor([4.0], requires_grad=True) * 2.0
    assert "8." in repr(y) and "grad_fn=<Mul>" in repr(y)
    assert "7" in repr(tl.tensor([7])) and "dtype" not in repr(tl.tensor([7]))


def test_transpose_len_iter_bool() -> None:
    x = tl.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert x.T.shape == (3, 2) and x.T.tolist() == [[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]]
    assert len(x) == 2
    assert [row.tolist() for row in x] == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    with pytest.raises(TypeError, match="0-d"):
        len(tl.tensor(1.0))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x)
    assert bool(tl.tensor([1.0])) and not bool(tl.tensor(0))
    assert (x > 0).all().item() and not (x > 5).all().item() and (x > 5).any().item()


# ---------------------------------------------------------------------------- in place
@pytest.mark.parametrize("device", DEVICES)
def test_setitem_copy_fill_zero_write_in_place(device: str) -> None:
    t = tl.zeros(2, 3, device=device)
    t[0] = 5.0
    t[1, tl.tensor([0, 2])] = tl.tensor([1.0, 2.0], device=device)
    np.testing.assert_array_equal(t.numpy(), [[5, 5, 5], [1, 0, 2]])
    t.copy_(tl.tensor([7.0, 8.0, 9.0]))  # broadcast over rows, moved to t's device
    np.testing.assert_array_equal(t.numpy(), [[7, 8, 9], [7, 8, 9]])
    t.fill_(3.0)
    np.testing.assert_array_equal(t.numpy(), np.full((2, 3), 3.0))
    assert t.zero_() is t
    np.testing.assert_array_equal(t.numpy(), np.zeros((2, 3)))


def test_inplace_on_tensor_requiring_grad_is_refused_unless_no_grad() -> None:
    w = tl.ones(3, requires_grad=True)
    for op in (lambda: w.__setitem__(0, 2.0), lambda: w.fill_(2.0), lambda: w.copy_(tl.zeros(3))):
        with pytest.raises(RuntimeError, match="no_grad"):
            op()
    np.testing.assert_array_equal(w.numpy(), np.ones(3))  # untouched
    with tl.no_grad():
        w[0] = 2.0
    np.testing.assert_array_equal(w.numpy(), [2.0, 1.0, 1.0])


@pytest.mark.parametrize("device", DEVICES)
def test_setitem_and_copy_take_host_arrays_and_lists(device: str) -> None:
    # CuPy refuses a non-scalar NumPy value for a basic-index assignment: host values must be
    # copied to the tensor's GPU first, as they are for index arrays.
    t = tl.zeros(2, 3, device=device)
    t[0] = np.array([1.0, 2.0, 3.0])
    t[1] = [4.0, 5.0, 6.0]
    np.testing.assert_array_equal(t.numpy(), [[1, 2, 3], [4, 5, 6]])
    t[np.array([1, 0]), 0] = np.array([7.0, 8.0])
    np.testing.assert_array_equal(t.numpy()[:, 0], [8.0, 7.0])
    t.copy_(np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(t.numpy(), np.arange(6.0).reshape(2, 3))
    t.copy_([9.0, 8.0, 7.0])
    np.testing.assert_array_equal(t.numpy(), [[9, 8, 7], [9, 8, 7]])
    assert t.device == device and t.dtype == tl.float32
    with pytest.raises(ValueError, match=r"\(4,\).*\(2, 3\)"):
        t.copy_(np.ones(4))


def test_copy_shape_mismatch_names_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(4,\).*\(2, 3\)"):
        tl.zeros(2, 3).copy_(tl.ones(4))
