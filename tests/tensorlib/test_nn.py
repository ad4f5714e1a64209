"""nn: Module bookkeeping, state dicts, seeded init, layers, and a whole-model gradient check."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F
from tensorlib import Tensor, nn
from tests.helpers import DEVICES


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("steps", tl.tensor([0]))
        self.register_buffer("scale", tl.ones(4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.norm(self.fc(x))) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(tl.ones(1))
        self.body = Block()
        self.head = nn.Linear(4, 2, bias=False)
        self.note = "not registered"

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x)) * self.alpha


# ============================================================================ registration
def test_parameters_buffers_and_modules_are_registered_in_order() -> None:
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == [
        "alpha",
        "body.fc.weight",
        "body.fc.bias",
        "body.norm.weight",
        "body.norm.bias",
        "head.weight",
    ]
    assert [p for p in net.parameters()] == [p for _, p in net.named_parameters()]
    assert [n for n, _ in net.named_buffers()] == ["body.steps", "body.scale"]
    assert [n for n, _ in net.named_modules()] == [
        "",
        "body",
        "body.fc",
        "body.norm",
        "body.drop",
        "head",
    ]
    assert list(net.children()) == [net.body, net.head]
    assert net.head.bias is None and "head.bias" not in net.state_dict()
    assert net.note == "not registered" and "note" not in dict(net.named_parameters())
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in net.parameters())


def test_shared_parameters_and_modules_are_listed_once() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    net[1].weight = net[0].weight  # tie
    names = [n for n, _ in net.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.bias"]
    shared = nn.Linear(2, 2)
    twice = nn.Sequential(shared, nn.Tanh(), shared)
    assert len(list(twice.parameters())) == 2
    assert len([m for m in twice.modules() if m is shared]) == 1


def test_reassigning_and_deleting_attributes() -> None:
    lin = nn.Linear(2, 2)
    new_w = nn.Parameter(tl.zeros(2, 2))
    lin.weight = new_w
    assert lin.weight is new_w and dict(lin.named_parameters())["weight"] is new_w
    lin.bias = None  # type: ignore[assignment]
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    del lin.weight
    assert list(lin.parameters()) == []
    with pytest.raises(AttributeError, match="weight"):
        _ = lin.weight


def test_assigning_before_super_init_is_explained() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            self.w = nn.Parameter(tl.ones(1))

    with pytest.raises(AttributeError, match=r"super\(\).__init__\(\)"):
        Broken()


def test_register_errors() -> None:
    m = nn.Module()
    with pytest.raises(TypeError, match="Tensor"):
        m.register_buffer("b", np.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Parameter"):
        m.register_parameter("p", tl.ones(2))  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="Module"):
        m(tl.ones(1))


def test_train_and_eval_propagate_to_every_submodule() -> None:
    net = Net()
    assert net.eval() is net
    assert all(not m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())
    net.body.train(False)
    assert net.training and not net.body.training and not net.body.drop.training


def test_zero_grad_to_none_and_in_place() -> None:
    net = Net()
    net(tl.randn(5, 3)).sum().backward()
    grads = {n: p.grad for n, p in net.named_parameters()}
    assert all(g is not None for g in grads.values())
    net.zero_grad(set_to_none=False)
    for n, p in net.named_parameters():
        assert p.grad is grads[n]  # same tensor, zeroed in place
        assert p.grad is not None and not p.grad.numpy().any()
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_to_dtype_keeps_identity_casts_grads_and_leaves_integer_buffers() -> None:
    net = Net()
    params = list(net.parameters())
    opt = tl.optim.SGD(net.parameters(), lr=0.1)
    net(tl.randn(2, 3)).sum().backward()
    assert net.to(dtype=tl.float64) is net
    assert list(net.parameters()) == params  # same objects: the optimizer still holds them
    assert all(p.dtype == tl.float64 for p in params)
    assert all(p.grad is not None and p.grad.dtype == tl.float64 for p in params)
    assert net.body.scale.dtype == tl.float64
    assert net.body.steps.dtype == tl.int64  # an integer buffer is not a float to cast
    before = params[1].numpy().copy()
    opt.step()
    assert not np.array_equal(params[1].numpy(), before)
    out = net(tl.randn(2, 3, dtype=tl.float64))
    assert out.dtype == tl.float64
    net.to(tl.float32)  # a dtype given positionally
    assert all(p.dtype == tl.float32 for p in params)
    assert net.body.steps.dtype == tl.int64
    net.to("cpu", tl.float16)
    assert params[0].dtype == tl.float16 and net.body.steps.dtype == tl.int64
    assert net.to() is net


# ============================================================================ state dicts
def test_state_dict_names_and_sharing() -> None:
    net = Net()
    sd = net.state_dict()
    # Like PyTorch: a module's own parameters, then its own buffers, then its children.
    assert list(sd) == [
        "alpha",
        "body.steps",
        "body.scale",
        "body.fc.weight",
        "body.fc.bias",
        "body.norm.weight",
        "body.norm.bias",
        "head.weight",
    ]
    assert all(not t.requires_grad for t in sd.values())
    assert np.shares_memory(sd["head.weight"].numpy(), net.head.weight.numpy())


def test_load_state_dict_copies_values_in_place() -> None:
    tl.manual_seed(0)
    src = Net()
    tl.manual_seed(1)
    dst = Net()
    w = dst.head.weight
    assert not np.array_equal(w.numpy(), src.head.weight.numpy())
    sd = {k: v.numpy().copy() if k == "alpha" else v for k, v in src.state_dict().items()}
    assert dst.load_state_dict(sd) == []
    assert dst.head.weight is w
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
        assert not np.shares_memory(a.numpy(), b.numpy()), name
    wide = {
        k: v.astype(np.float64) if v.dtype == tl.float32 else v for k, v in src.state_dict().items()
    }
    dst.load_state_dict(wide)
    assert dst.head.weight.dtype == tl.float32  # the model's dtype wins


def test_load_state_dict_strict_reports_missing_and_unexpected_keys() -> None:
    net = Net()
    sd = dict(net.state_dict())
    del sd["head.weight"]
    del sd["body.steps"]
    sd["head.bias"] = tl.zeros(2)
    with pytest.raises(KeyError) as info:
        net.load_state_dict(sd)
    message = str(info.value)
    assert "missing keys: ['body.steps', 'head.weight']" in message
    assert "unexpected keys: ['head.bias']" in message


def test_load_state_dict_shape_mismatch_names_key_and_both_shapes() -> None:
    net = Net()
    sd = dict(net.state_dict())
    sd["body.fc.weight"] = tl.zeros(4, 5)
    before = net.body.fc.bias.numpy().copy()
    sd["body.fc.bias"] = tl.full((4,), 3.0)
    with pytest.raises(ValueError, match=r"body\.fc\.weight.*\(4, 5\).*\(4, 3\)"):
        net.load_state_dict(sd)
    np.testing.assert_array_equal(net.body.fc.bias.numpy(), before)  # nothing half-loaded
    with pytest.raises(ValueError, match=r"body\.fc\.weight"):
        net.load_state_dict(sd, strict=False)


def test_load_state_dict_non_strict_returns_missing_and_loads_the_rest() -> None:
    net = Net()
    missing = net.load_state_dict({"alpha": tl.full((1,), 5.0), "extra": tl.ones(3)}, strict=False)
    assert "head.weight" in missing and "alpha" not in missing and "extra" not in missing
    assert net.alpha.item() == 5.0


def test_seeded_init_is_deterministic() -> None:
    def build(seed: int) -> nn.Module:
        tl.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Embedding(5, 3), nn.Linear(3, 2))

    a, b, c = build(0), build(0), build(1)
    for (name, pa), (_, pb), (_, pc) in zip(
        a.state_dict().items(), b.state_dict().items(), c.state_dict().items(), strict=True
    ):
        np.testing.assert_array_equal(pa.numpy(), pb.numpy(), err_msg=name)
        assert not np.array_equal(pa.numpy(), pc.numpy()), name
    g1, g2 = tl.Generator(3), tl.Generator(3)
    np.testing.assert_array_equal(
        nn.Linear(3, 3, generator=g1).weight.numpy(), nn.Linear(3, 3, generator=g2).weight.numpy()
    )


# ============================================================================ layers
@pytest.mark.parametrize("device", DEVICES)
def test_linear(device: str) -> None:
    tl.manual_seed(0)
    lin = nn.Linear(4, 3, device=device)
    w, b = lin.weight.numpy(), lin.bias.numpy()
    assert w.shape == (3, 4) and b.shape == (3,) and lin.weight.device == device
    bound = 1 / math.sqrt(4)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    x = np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32)
    y = lin(tl.tensor(x, device=device))
    assert y.shape == (2, 5, 3)
    np.testing.assert_allclose(y.numpy(), x @ w.T + b, rtol=1e-5, atol=1e-6)
    nb = nn.Linear(4, 3, bias=False, dtype=tl.float64)
    assert nb.bias is None and nb.weight.dtype == tl.float64
    assert "in_features=4, out_features=3, bias=False" in repr(nb)
    with pytest.raises(ValueError, match="in_features=0"):
        nn.Linear(0, 3)


def test_embedding_lookup_and_repeated_index_gradients() -> None:
    emb = nn.Embedding(5, 3, dtype=tl.float64)
    idx = tl.tensor([[0, 2, 2], [4, 0, 0]])
    out = emb(idx)
    assert out.shape == (2, 3, 3)
    np.testing.assert_array_equal(out.numpy(), emb.weight.numpy()[idx.numpy()])
    out.sum().backward()
    counts = np.array([3, 0, 2, 0, 1], dtype=np.float64)
    np.testing.assert_array_equal(emb.weight.grad.numpy(), np.repeat(counts[:, None], 3, 1))  # type: ignore[union-attr]
    with pytest.raises(IndexError, match="5"):
        emb(tl.tensor([5]))
    with pytest.raises(TypeError, match="integer"):
        emb(tl.tensor([0.0]))


def test_layer_norm_normalizes_the_last_axes() -> None:
    x = np.random.default_rng(1).standard_normal((3, 2, 4)) * 5 + 2
    ln = nn.LayerNorm(4, dtype=tl.float64)
    y = ln(tl.tensor(x)).numpy()
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-4)
    ln2 = nn.LayerNorm((2, 4), dtype=tl.float64)
    ln2.weight.numpy()[...] = 2.0
    ln2.bias.numpy()[...] = 0.5
    flat = x.reshape(3, 8)
    ref = (flat - flat.mean(1, keepdims=True)) / np.sqrt(flat.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ln2(tl.tensor(x)).numpy(), (ref * 2 + 0.5).reshape(x.shape))
    plain = nn.LayerNorm(4, elementwise_affine=False)
    assert list(plain.parameters()) == []


def test_dropout_train_and_eval() -> None:
    x = tl.ones(100_000, requires_grad=True)
    drop = nn.Dropout(0.25, generator=tl.Generator(0))
    y = drop(x).numpy()
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    again = nn.Dropout(0.25, generator=tl.Generator(0))(x).numpy()
    np.testing.assert_array_equal(y, again)  # reproducible from the generator
    drop.eval()
    assert drop(x) is x
    assert nn.Dropout(0.0)(x) is x
    assert not nn.Dropout(1.0)(x).numpy().any()
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match="dropout probability"):
            nn.Dropout(p)


def test_dropout_gradient_follows_the_mask() -> None:
    x = tl.ones(1000, dtype=tl.float64, requires_grad=True)
    y = nn.Dropout(0.5, generator=tl.Generator(1))(x)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), y.numpy())  # type: ignore[union-attr]


def test_activations() -> None:
    xv = np.linspace(-4, 4, 17)
    x = tl.tensor(xv)
    np.testing.assert_allclose(nn.ReLU()(x).numpy(), np.maximum(xv, 0))
    np.testing.assert_allclose(nn.Tanh()(x).numpy(), np.tanh(xv), rtol=1e-6)
    np.testing.assert_allclose(nn.Sigmoid()(x).numpy(), 1 / (1 + np.exp(-xv)), rtol=1e-6)
    gelu = 0.5 * xv * (1 + np.tanh(math.sqrt(2 / math.pi) * (xv + 0.044715 * xv**3)))
    np.testing.assert_allclose(nn.GELU()(x).numpy(), gelu, rtol=1e-5, atol=1e-7)
    assert nn.Identity()(x) is x
    assert nn.Flatten()(tl.zeros(2, 3, 4)).shape == (2, 12)


def test_sequential_and_module_list() -> None:
    tl.manual_seed(0)
    seq = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    x = tl.randn(4, 3)
    manual = seq[2](seq[1](seq[0](x)))
    np.testing.assert_array_equal(seq(x).numpy(), manual.numpy())
    assert len(seq) == 3 and isinstance(seq[-1], nn.Linear)
    assert [type(m).__name__ for m in seq] == ["Linear", "ReLU", "Linear"]
    seq.append(nn.Tanh())
    assert len(seq) == 4 and seq(x).shape == (4, 2)
    named = nn.Sequential(OrderedDict([("inp", nn.Linear(3, 2)), ("act", nn.Tanh())]))
    assert [n for n, _ in named.named_parameters()] == ["inp.weight", "inp.bias"]
    assert "(inp): Linear(in_features=3" in repr(named)
    with pytest.raises(TypeError, match="item 1"):
        nn.Sequential(nn.ReLU(), lambda t: t)  # type: ignore[arg-type]
    ml = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    ml.append(nn.Linear(2, 1))
    assert len(ml) == 3 and len(list(ml.parameters())) == 6 and ml[2].out_features == 1


def test_loss_modules_match_the_functions() -> None:
    logits = tl.randn(4, 3)
    target = tl.tensor([0, 2, 1, 2])
    assert nn.CrossEntropyLoss()(logits, target).item() == F.cross_entropy(logits, target).item()
    a, b = tl.randn(5), tl.randn(5)
    np.testing.assert_allclose(
        nn.MSELoss(reduction="sum")(a, b).item(), ((a.numpy() - b.numpy()) ** 2).sum(), rtol=1e-6
    )


# ============================================================================ whole-model gradient
def _mlp_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


def test_mlp_gradients_match_finite_differences() -> None:
    tl.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 7, dtype=tl.float64), nn.Tanh(), nn.Linear(7, 3, dtype=tl.float64)
    )
    x = tl.randn(6, 5, dtype=tl.float64)
    y = tl.tensor([0, 1, 2, 2, 1, 0])
    _mlp_loss(model, x, y).backward()
    eps = 1e-6
    checked = 0
    for name, p in model.named_parameters():
        data = p.numpy()
        numeric = np.zeros_like(data)
        for i in np.ndindex(data.shape):
            old = data[i]
            with tl.no_grad():
                data[i] = old + eps
                up = _mlp_loss(model, x, y).item()
                data[i] = old - eps
                down = _mlp_loss(model, x, y).item()
            data[i] = old
            numeric[i] = (up - down) / (2 * eps)
            checked += 1
        assert p.grad is not None
        np.testing.assert_allclose(p.grad.numpy(), numeric, rtol=1e-5, atol=1e-9, err_msg=name)
    assert checked == 5 * 7 + 7 + 7 * 3 + 3


def _grad_of(p: Any) -> np.ndarray[Any, Any]:
    assert p.grad is not None
    return p.grad.numpy()


def test_training_reduces_the_loss() -> None:
    tl.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    x = tl.randn(32, 5)
    y = tl.tensor(np.argmax(x.numpy()[:, :3], axis=1))
    opt = tl.optim.Adam(model.parameters(), lr=0.02)
    first = _mlp_loss(model, x, y).item()
    for _ in range(60):
        opt.zero_grad()
        loss = _mlp_loss(model, x, y)
        loss.backward()
        assert all(np.isfinite(_grad_of(p)).all() for p in model.parameters())
        opt.step()
    assert _mlp_loss(model, x, y).item() < 0.3 * first
