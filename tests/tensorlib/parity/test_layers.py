"""Layers and their functional forms against PyTorch.

Each layer case builds the torch module, copies its (seeded, perturbed) parameters into the
tensorlib module by name through ``load_state_dict``, runs forward and backward with the same
random upstream gradient, and compares the output, the input's gradient and every parameter's
gradient. Default initialization is compared by its distribution (bounds, moments), not by
its random values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F
from tensorlib import nn

from .compare import DTYPES, assert_close, check, pair, to_numpy, torch

TF: Any = torch.nn.functional if torch else None
TNN: Any = torch.nn if torch else None
_TORCH_DTYPE = {np.dtype(np.float64): "float64", np.dtype(np.float32): "float32"}


def _randn(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _compare_module(
    ours: nn.Module, theirs: Any, x: np.ndarray, dtype: Any, seed: int = 0, **call: Any
) -> None:
    """Copy theirs' parameters into ours, run both on x, compare output and every gradient."""
    theirs = theirs.to(getattr(torch, _TORCH_DTYPE[np.dtype(dtype)]))
    with torch.no_grad():  # perturb LayerNorm's ones/zeros so their gradients mean something
        for i, p in enumerate(theirs.parameters()):
            p.add_(torch.tensor(_randn(seed + 100 + i, *p.shape) * 0.1, dtype=p.dtype))
    state = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    ours.load_state_dict(state)  # strict: the parameter names must be torch's
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    floating = x.dtype.kind == "f"
    xi, xt = pair(x, dtype if floating else None, requires_grad=floating)
    out, ref = ours(xi, **call), theirs(xt, **call)
    assert_close(out, ref, f"{type(ours).__name__} output")
    r = np.random.default_rng(seed).standard_normal(tuple(ref.shape)).astype(dtype)
    out.backward(tl.tensor(r))
    ref.backward(torch.tensor(r))
    if xt.requires_grad:
        assert_close(xi.grad, xt.grad, "input grad", grad=True)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        tp = theirs_params[name]
        assert (p.grad is None) == (tp.grad is None), name
        if tp.grad is not None:
            assert_close(p.grad, tp.grad, f"{name} grad", grad=True)


# ============================================================================ functional
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xshape", [(4, 3), (2, 5, 3), (3,)], ids=str)
def test_f_linear(xshape: tuple[int, ...], bias: bool, dtype: Any) -> None:
    arrays = [_randn(1, *xshape), _randn(2, 6, 3)] + ([_randn(3, 6)] if bias else [])
    check(F.linear, TF.linear, arrays, dtype, what="linear")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_f_embedding(padding_idx: int | None, dtype: Any) -> None:
    idx = np.array([[1, 2, 1], [4, 0, 2]])  # repeats add up; padding rows get no gradient
    check(
        lambda w: F.embedding(idx, w, padding_idx=padding_idx),
        lambda w: TF.embedding(torch.tensor(idx), w, padding_idx=padding_idx),
        [_randn(4, 5, 3)],
        dtype,
        what="embedding",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
@pytest.mark.parametrize("shape", [(4,), (3, 4)], ids=str)
def test_f_layer_norm(shape: tuple[int, ...], affine: str, eps: float, dtype: Any) -> None:
    x = _randn(5, 2, 3, 4) * 3 + 1
    extra = {"both": [_randn(6, *shape), _randn(7, *shape)], "weight": [_randn(6, *shape)]}
    arrays = [x, *extra.get(affine, [])]

    def ours(t: tl.Tensor, *wb: tl.Tensor) -> tl.Tensor:
        return F.layer_norm(t, shape, *wb, eps=eps)  # type: ignore[misc, arg-type]

    def theirs(t: Any, *wb: Any) -> Any:
        return TF.layer_norm(t, shape, *wb, eps=eps)

    check(
        ours,
        theirs,
        arrays,
        dtype,
        what="layer_norm",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_f_dropout_identities(dtype: Any) -> None:
    x = _randn(8, 4, 5)
    check(
        lambda t: F.dropout(t, 0.5, training=False), lambda t: TF.dropout(t, 0.5, False), [x], dtype
    )
    check(lambda t: F.dropout(t, 0.0), lambda t: TF.dropout(t, 0.0), [x], dtype)
    check(lambda t: F.dropout(t, 1.0), lambda t: TF.dropout(t, 1.0), [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_f_dropout_scales_kept_values_and_their_gradient(p: float, dtype: Any) -> None:
    # No torch comparison for the random mask: check torch's rule on the mask that was drawn.
    x = np.abs(_randn(9, 50, 40)) + 0.1  # never 0, so a kept value is never mistaken
    t = tl.tensor(x.astype(dtype), requires_grad=True)
    out = F.dropout(t, p, generator=tl.Generator(3))
    kept = out.numpy() != 0
    assert 0 < kept.mean() < 1 and abs(kept.mean() - (1 - p)) < 0.05
    expect = np.where(kept, x.astype(dtype) / np.asarray(1 - p, dtype), 0)
    np.testing.assert_allclose(out.numpy(), expect, rtol=1e-6)
    r = _randn(10, 50, 40).astype(dtype)
    out.backward(tl.tensor(r))
    assert t.grad is not None and t.grad.dtype == dtype
    np.testing.assert_allclose(t.grad.numpy(), np.where(kept, r / (1 - p), 0), rtol=1e-6)


# ============================================================================ layers
LAYERS: list[tuple[str, Callable[[Any], nn.Module], Callable[[], Any], tuple[int, ...]]] = [
    ("Linear", lambda dt: nn.Linear(4, 3, dtype=dt), lambda: TNN.Linear(4, 3), (5, 4)),
    (
        "Linear_3d_no_bias",
        lambda dt: nn.Linear(4, 3, bias=False, dtype=dt),
        lambda: TNN.Linear(4, 3, bias=False),
        (2, 5, 4),
    ),
    ("LayerNorm", lambda dt: nn.LayerNorm(6, dtype=dt), lambda: TNN.LayerNorm(6), (3, 6)),
    (
        "LayerNorm_2d_eps",
        lambda dt: nn.LayerNorm((3, 4), eps=1e-3, dtype=dt),
        lambda: TNN.LayerNorm((3, 4), eps=1e-3),
        (2, 3, 4),
    ),
    (
        "LayerNorm_no_affine",
        lambda dt: nn.LayerNorm(5, elementwise_affine=False, dtype=dt),
        lambda: TNN.LayerNorm(5, elementwise_affine=False),
        (4, 5),
    ),
    (
        "LayerNorm_no_bias",
        lambda dt: nn.LayerNorm(5, bias=False, dtype=dt),
        lambda: TNN.LayerNorm(5, bias=False),
        (4, 5),
    ),
    ("ReLU", lambda dt: nn.ReLU(), lambda: TNN.ReLU(), (4, 5)),
    ("GELU", lambda dt: nn.GELU(), lambda: TNN.GELU(approximate="tanh"), (4, 5)),
    ("GELU_tanh", lambda dt: nn.GELU("tanh"), lambda: TNN.GELU("tanh"), (4, 5)),
    ("Tanh", lambda dt: nn.Tanh(), lambda: TNN.Tanh(), (4, 5)),
    ("Sigmoid", lambda dt: nn.Sigmoid(), lambda: TNN.Sigmoid(), (4, 5)),
    ("Identity", lambda dt: nn.Identity(), lambda: TNN.Identity(), (4, 5)),
    ("Flatten", lambda dt: nn.Flatten(), lambda: TNN.Flatten(), (2, 3, 4, 5)),
    ("Dropout_eval", lambda dt: nn.Dropout(0.3).eval(), lambda: TNN.Dropout(0.3).eval(), (4, 5)),
    ("Dropout_p0", lambda dt: nn.Dropout(0.0), lambda: TNN.Dropout(0.0), (4, 5)),
    ("Dropout_p1", lambda dt: nn.Dropout(1.0), lambda: TNN.Dropout(1.0), (4, 5)),
    (
        "Sequential_mlp",
        lambda dt: nn.Sequential(
            nn.Linear(6, 8, dtype=dt),
            nn.GELU(),
            nn.LayerNorm(8, dtype=dt),
            nn.Linear(8, 2, dtype=dt),
        ),
        lambda: TNN.Sequential(
            TNN.Linear(6, 8), TNN.GELU(approximate="tanh"), TNN.LayerNorm(8), TNN.Linear(8, 2)
        ),
        (5, 6),
    ),
    (
        "Sequential_flatten_tanh",
        lambda dt: nn.Sequential(nn.Flatten(), nn.Linear(12, 3, dtype=dt), nn.Tanh()),
        lambda: TNN.Sequential(TNN.Flatten(), TNN.Linear(12, 3), TNN.Tanh()),
        (2, 3, 4),
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "ours", "theirs", "xshape"), LAYERS, ids=[c[0] for c in LAYERS])
def test_layer(name: str, ours: Any, theirs: Any, xshape: tuple[int, ...], dtype: Any) -> None:
    torch.manual_seed(0)
    _compare_module(ours(dtype), theirs(), _randn(11, *xshape) * 2, dtype)


class _Blocks(nn.Module):
    def __init__(self, dt: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4, dtype=dt) for _ in range(3)])
        self.norm = nn.LayerNorm(4, dtype=dt)

    def forward(self, x: tl.Tensor) -> tl.Tensor:
        for layer in self.layers:
            x = x + F.relu(layer(x))
        return self.norm(x)


class _TorchBlocks(torch.nn.Module if torch else object):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return self.norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_module_list_model(dtype: Any) -> None:
    torch.manual_seed(1)
    _compare_module(_Blocks(dtype), _TorchBlocks(), _randn(12, 3, 4), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [None, 0, -2])
def test_embedding_layer(padding_idx: int | None, dtype: Any) -> None:
    torch.manual_seed(2)
    ours = nn.Embedding(6, 3, padding_idx=padding_idx, dtype=dtype)
    theirs = TNN.Embedding(6, 3, padding_idx=padding_idx)
    assert ours.padding_idx == theirs.padding_idx  # normalized the same way
    idx = np.array([[0, 4, 4], [1, 0, 5]])
    _compare_module(ours, theirs, idx, dtype)


# ============================================================================ initialization
def _stats(a: np.ndarray) -> tuple[float, float, float]:
    return float(np.abs(a).max()), float(a.mean()), float(a.std())


@pytest.mark.parametrize(("fan_in", "fan_out"), [(256, 512), (1000, 64)])
def test_linear_default_init_follows_torch(fan_in: int, fan_out: int) -> None:
    # Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias (torch's kaiming_uniform_
    # with a=sqrt(5)): the same bound, a mean of ~0 and a std of bound/sqrt(3) in both.
    torch.manual_seed(3)
    ours = nn.Linear(fan_in, fan_out, generator=tl.Generator(3))
    theirs = TNN.Linear(fan_in, fan_out)
    bound = 1 / np.sqrt(fan_in)
    for name in ("weight", "bias"):
        a, b = to_numpy(getattr(ours, name)), to_numpy(getattr(theirs, name))
        assert a.dtype == b.dtype == np.float32
        (amax, amean, astd), (bmax, bmean, bstd) = _stats(a), _stats(b)
        assert amax <= bound and bmax <= bound
        assert amax > 0.95 * bound and bmax > 0.95 * bound
        tol = 4 / np.sqrt(a.size)  # a few standard errors
        assert abs(amean) < tol * bound and abs(bmean) < tol * bound
        assert abs(astd - bound / np.sqrt(3)) < tol * bound
        assert abs(bstd - bound / np.sqrt(3)) < tol * bound


def test_embedding_and_layer_norm_default_init_follow_torch() -> None:
    torch.manual_seed(4)
    ours, theirs = nn.Embedding(500, 64, generator=tl.Generator(4)), TNN.Embedding(500, 64)
    (_, am, asd), (_, bm, bsd) = _stats(to_numpy(ours.weight)), _stats(to_numpy(theirs.weight))
    for m, s in ((am, asd), (bm, bsd)):  # N(0, 1)
        assert abs(m) < 0.02 and abs(s - 1) < 0.02
    padded = nn.Embedding(5, 3, padding_idx=1)
    np.testing.assert_array_equal(padded.weight.numpy()[1], 0)  # as torch: a zero row
    ln, tln = nn.LayerNorm((3, 4)), TNN.LayerNorm((3, 4))
    assert_close(ln.weight, tln.weight)
    assert_close(ln.bias, tln.bias)


def test_gelu_refuses_the_exact_form_it_does_not_implement() -> None:
    # torch's default GELU is the exact erf form; tensorlib has only the tanh approximation,
    # so asking for the exact one must not silently give the other.
    with pytest.raises(ValueError, match="approximate='tanh'"):
        nn.GELU("none")
    with pytest.raises(ValueError, match="tanh approximation only"):
        F.gelu(tl.ones(2), approximate="none")


@pytest.mark.parametrize("offset", [1e2, 1e3])
def test_f_layer_norm_far_from_zero(offset: float) -> None:
    """A large common offset (float32's rounding of the mean dominates).

    In float64 both agree at the suite's tolerance. In float32 torch itself is off the exact
    result (computed in float64 from the same float32 input) by more than 1e-5 there, so the
    float32 check is that tensorlib is at least as close to the exact result as torch is.
    """
    x = _randn(13, 3, 16) + offset
    check(lambda t: F.layer_norm(t, 16), lambda t: TF.layer_norm(t, (16,)), [x], np.float64)
    x32 = x.astype(np.float32)
    x64 = x32.astype(np.float64)
    exact = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    ours = F.layer_norm(tl.tensor(x32), 16).numpy()
    theirs = TF.layer_norm(torch.tensor(x32), (16,)).numpy()
    assert ours.dtype == np.float32
    assert np.abs(ours - exact).max() <= np.abs(theirs - exact).max()
