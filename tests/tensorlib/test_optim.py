"""Optimizers against a NumPy transcription of PyTorch's update rules, and their state dicts."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F
from tensorlib import nn, optim
from tests.helpers import DEVICES

Array = np.ndarray[Any, Any]
SHAPES = [(3, 4), (4,), (1,)]


# ============================================================================ references
def ref_sgd(
    params: list[Array],
    grads: list[list[Array | None]],
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> list[Array]:
    """torch.optim.SGD, written out per step (a None grad skips that parameter)."""
    ps = [p.copy() for p in params]
    bufs: list[Array | None] = [None] * len(ps)
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            if g is None:
                continue
            d = g + weight_decay * ps[i] if weight_decay else g
            if momentum:
                buf = bufs[i]
                buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
                bufs[i] = buf
                d = d + momentum * buf if nesterov else buf
            ps[i] = ps[i] - lr * d
    return ps


def ref_adam(
    params: list[Array],
    grads: list[list[Array | None]],
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = False,
) -> list[Array]:
    """torch.optim.Adam (decoupled=False) and torch.optim.AdamW (decoupled=True)."""
    b1, b2 = betas
    ps = [p.copy() for p in params]
    m = [np.zeros_like(p) for p in ps]
    v = [np.zeros_like(p) for p in ps]
    t = [0] * len(ps)
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            if g is None:
                continue
            if weight_decay and decoupled:
                ps[i] = ps[i] * (1 - lr * weight_decay)
            elif weight_decay:
                g = g + weight_decay * ps[i]
            t[i] += 1
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1 ** t[i])
            v_hat = v[i] / (1 - b2 ** t[i])
            ps[i] = ps[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return ps


def _random_run(
    steps: int = 6, seed: int = 0, holes: bool = True
) -> tuple[list[Array], list[list[Array | None]]]:
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in SHAPES]
    grads: list[list[Array | None]] = []
    for step in range(steps):
        row: list[Array | None] = [rng.standard_normal(s) for s in SHAPES]
        if holes and step % 2 == 1:
            row[1] = None  # a parameter that got no gradient this step is left alone
        grads.append(row)
    return params, grads


def _run(
    make: Callable[[list[nn.Parameter]], optim.Optimizer],
    params: list[Array],
    grads: list[list[Array | None]],
) -> list[Array]:
    ps = [nn.Parameter(tl.tensor(p)) for p in params]
    opt = make(ps)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = None if g is None else tl.tensor(g)
        opt.step()
    return [p.numpy() for p in ps]


SGD_CASES = [
    {"lr": 0.1},
    {"lr": 0.05, "weight_decay": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.1, "momentum": 0.9, "dampening": 0.3},
    {"lr": 0.1, "momentum": 0.8, "nesterov": True},
    {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05, "nesterov": True},
    {"lr": 1.0, "momentum": 0.5},
]


def _assert_matches_reference(
    make: Callable[..., optim.Optimizer], reference: Callable[..., Any], kwargs: dict[str, Any]
) -> None:
    """``make(params, **kwargs)`` over a random run gives what ``reference`` computes."""
    params, grads = _random_run()
    got = _run(lambda ps: make(ps, **kwargs), params, grads)
    for g, r in zip(got, reference(params, grads, **kwargs), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs", SGD_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items())
)
def test_sgd_matches_reference(kwargs: dict[str, Any]) -> None:
    _assert_matches_reference(optim.SGD, ref_sgd, kwargs)


ADAM_CASES = [
    {"lr": 1e-2},
    {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6},
    {"lr": 5e-3, "weight_decay": 0.1},
]


@pytest.mark.parametrize(
    "kwargs", ADAM_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items())
)
def test_adam_matches_reference(kwargs: dict[str, Any]) -> None:
    _assert_matches_reference(optim.Adam, ref_adam, kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"lr": 1e-2}, {"lr": 1e-2, "weight_decay": 0.5, "betas": (0.5, 0.9)}], ids=str
)
def test_adamw_matches_reference(kwargs: dict[str, Any]) -> None:
    def reference(params: Any, grads: Any, **kw: Any) -> Any:
        # AdamW's default decay is 0.01
        return ref_adam(params, grads, decoupled=True, **{"weight_decay": 1e-2, **kw})

    _assert_matches_reference(optim.AdamW, reference, kwargs)


def test_adam_and_adamw_differ_only_by_weight_decay_placement() -> None:
    params, grads = _random_run(holes=False)
    plain = _run(lambda ps: optim.Adam(ps, lr=0.01), params, grads)
    no_decay = _run(lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.0), params, grads)
    for a, b in zip(plain, no_decay, strict=True):
        np.testing.assert_array_equal(a, b)
    l2 = _run(lambda ps: optim.Adam(ps, lr=0.01, weight_decay=0.1), params, grads)
    decoupled = _run(lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.1), params, grads)
    assert not np.allclose(l2[0], decoupled[0])


def test_first_adam_step_moves_each_weight_by_about_lr() -> None:
    p = nn.Parameter(tl.tensor([1.0, -2.0, 3.0], dtype=tl.float64))
    opt = optim.Adam([p], lr=0.1)
    p.grad = tl.tensor([1e-3, -50.0, 7.0], dtype=tl.float64)
    opt.step()
    np.testing.assert_allclose(p.numpy(), [0.9, -1.9, 2.9], rtol=0, atol=1e-5)  # eps shows


def test_param_groups_use_their_own_hyper_parameters() -> None:
    a = nn.Parameter(tl.tensor([1.0], dtype=tl.float64))
    b = nn.Parameter(tl.tensor([1.0], dtype=tl.float64))
    opt = optim.SGD([{"params": [a]}, {"params": b, "lr": 0.5}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    a.grad = tl.tensor([1.0], dtype=tl.float64)
    b.grad = tl.tensor([1.0], dtype=tl.float64)
    opt.step()
    assert a.item() == pytest.approx(0.9) and b.item() == pytest.approx(0.5)
    opt.param_groups[0]["lr"] = 0.0  # changing a group's lr (a scheduler) takes effect
    opt.step()
    assert a.item() == pytest.approx(0.9)


def test_step_records_no_graph() -> None:
    p = nn.Parameter(tl.tensor([1.0]))
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    (p * 2.0).sum().backward()
    opt.step()
    assert p.is_leaf and p.grad_fn is None and p.requires_grad


# ============================================================================ validation
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: optim.SGD(ps, lr=-0.1), "lr"),
        (lambda ps: optim.SGD(ps, lr=float("nan")), "lr"),
        (lambda ps: optim.SGD(ps, lr=0.1, momentum=-0.5), "momentum"),
        (lambda ps: optim.SGD(ps, lr=0.1, weight_decay=-1.0), "weight_decay"),
        (lambda ps: optim.SGD(ps, lr=0.1, nesterov=True), "Nesterov"),
        (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
        (lambda ps: optim.Adam(ps, lr=-1e-3), "lr"),
        (lambda ps: optim.Adam(ps, eps=-1e-8), "eps"),
        (lambda ps: optim.Adam(ps, betas=(1.0, 0.999)), "betas"),
        (lambda ps: optim.Adam(ps, betas=(0.9, -0.1)), "betas"),
        (lambda ps: optim.Adam(ps, weight_decay=-0.1), "weight_decay"),
        (lambda ps: optim.AdamW(ps, betas=(0.9, 1.5)), "betas"),
        (lambda ps: optim.AdamW(ps, weight_decay=-0.1), "weight_decay"),
        (lambda ps: optim.SGD([], lr=0.1), "empty"),
        (lambda ps: optim.SGD([tl.ones(2)], lr=0.1), "does not require grad"),
        (lambda ps: optim.SGD([tl.ones(2, requires_grad=True) * 2.0], lr=0.1), "leaf"),
        (lambda ps: optim.SGD([{"params": ps}, {"params": ps[:1]}], lr=0.1), "more than one"),
    ],
)
def test_bad_arguments_raise_value_error(
    make: Callable[[list[nn.Parameter]], Any], match: str
) -> None:
    ps = [nn.Parameter(tl.ones(2)), nn.Parameter(tl.ones(3))]
    with pytest.raises(ValueError, match=match):
        make(ps)


def test_sgd_lr_defaults_to_torchs() -> None:
    assert optim.SGD([nn.Parameter(tl.ones(1))]).param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize(
    "make",
    [
        lambda ps, m: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1, maximize=m),
        lambda ps, m: optim.Adam(ps, lr=0.1, amsgrad=True, weight_decay=0.1, maximize=m),
        lambda ps, m: optim.AdamW(ps, lr=0.1, maximize=m),
    ],
    ids=["sgd", "adam", "adamw"],
)
def test_maximize_is_minimizing_the_negated_gradient(make: Callable[..., Any]) -> None:
    params, grads = _random_run(holes=False)
    up = _run(lambda ps: make(ps, True), params, grads)
    down = _run(
        lambda ps: make(ps, False),
        params,
        [[None if g is None else -g for g in gs] for gs in grads],
    )
    for a, b in zip(up, down, strict=True):
        np.testing.assert_array_equal(a, b)


def test_amsgrad_keeps_the_running_max_of_the_second_moment() -> None:
    p = nn.Parameter(tl.tensor([1.0, 1.0], dtype=tl.float64))
    opt = optim.Adam([p], lr=0.1, betas=(0.0, 0.5), amsgrad=True)
    for g in ([4.0, 1.0], [0.0, 2.0]):
        p.grad = tl.tensor(g, dtype=tl.float64)
        opt.step()
    state = opt.state[p]
    np.testing.assert_array_equal(state["exp_avg_sq"], [4.0, 2.25])  # 0.5 * v + 0.5 * g * g
    np.testing.assert_array_equal(state["max_exp_avg_sq"], [8.0, 2.25])
    assert "max_exp_avg_sq" in opt.state_dict()["state"][0]


def test_amsgrad_resumes_from_a_state_saved_without_it() -> None:
    """An old checkpoint (amsgrad off) loaded into an amsgrad optimizer: the max starts then."""
    model = _model(0)
    opt = optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        del group["amsgrad"]
    model2 = _model(0)
    opt2 = optim.Adam(model2.parameters(), lr=0.01, amsgrad=True)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["amsgrad"] is True
    _train(model2, opt2, range(2, 3))
    for state in opt2.state.values():
        np.testing.assert_array_equal(state["max_exp_avg_sq"], state["exp_avg_sq"])


def test_bad_parameter_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match="Tensors"):
        optim.SGD([np.zeros(2)], lr=0.1)
    with pytest.raises(TypeError, match="'params'"):
        optim.SGD([nn.Parameter(tl.ones(1))], lr=0.1).add_param_group({"lr": 0.1})


# ============================================================================ zero_grad
def test_zero_grad_semantics() -> None:
    p = nn.Parameter(tl.tensor([1.0, 2.0]))
    q = nn.Parameter(tl.tensor([3.0]))
    opt = optim.SGD([p, q], lr=0.1)
    (p * p).sum().backward()
    g = p.grad
    opt.zero_grad(set_to_none=False)
    assert p.grad is g and g is not None and g.tolist() == [0.0, 0.0]
    assert q.grad is None  # a missing grad stays missing
    opt.step()
    assert p.tolist() == [1.0, 2.0]  # a zero gradient moves nothing
    opt.zero_grad()
    assert p.grad is None
    opt.step()  # no gradients at all: a no-op
    assert p.tolist() == [1.0, 2.0] and q.tolist() == [3.0]


# ============================================================================ state dicts
def _model(seed: int) -> nn.Module:
    tl.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6, dtype=tl.float64), nn.Tanh(), nn.Linear(6, 3, dtype=tl.float64)
    )


def _batch(step: int) -> tuple[tl.Tensor, tl.Tensor]:
    rng = np.random.default_rng(100 + step)
    return tl.tensor(rng.standard_normal((8, 4))), tl.tensor(rng.integers(0, 3, 8))


def _train(model: nn.Module, opt: optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


OPTIMIZERS: dict[str, Callable[[Any], optim.Optimizer]] = {
    "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: optim.Adam(ps, lr=0.01, weight_decay=1e-3),
    "adamw": lambda ps: optim.AdamW(ps, lr=0.01),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("via_file", [False, True], ids=["memory", "file"])
def test_resume_from_state_dict_continues_identically(
    name: str, via_file: bool, tmp_path: Path
) -> None:
    make = OPTIMIZERS[name]
    model = _model(0)
    opt = make(model.parameters())
    _train(model, opt, range(3))
    ckpt = {
        "model": {k: v.numpy().copy() for k, v in model.state_dict().items()},
        "optim": opt.state_dict(),
    }
    if via_file:
        tl.save(ckpt, tmp_path / "ckpt.npz")
    _train(model, opt, range(3, 5))  # the uninterrupted run

    if via_file:
        ckpt = tl.load(tmp_path / "ckpt.npz")
    resumed = _model(1)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt2 = make(resumed.parameters())
    opt2.load_state_dict(ckpt["optim"])
    _train(resumed, opt2, range(3, 5))
    for (k, a), (_, b) in zip(
        model.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=k)


def test_state_dict_is_a_snapshot() -> None:
    model = _model(0)
    opt = optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    saved = {k: dict(v) for k, v in sd["state"].items()}
    exp_avg = np.array(saved[0]["exp_avg"], copy=True)
    _train(model, opt, range(2, 4))
    assert sd["state"][0]["step"] == 2
    np.testing.assert_array_equal(sd["state"][0]["exp_avg"], exp_avg)


def test_state_dict_layout_and_hyper_parameter_restore() -> None:
    model = _model(0)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, range(1))
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sd["param_groups"][0]["lr"] == 0.1
    assert sd["state"][0]["momentum_buffer"].shape == (6, 4)
    sd["param_groups"][0]["lr"] = 0.01
    opt2 = optim.SGD(_model(1).parameters(), lr=0.5, momentum=0.9)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.01
    state = next(iter(opt2.state.values()))["momentum_buffer"]
    assert not np.shares_memory(state, sd["state"][0]["momentum_buffer"])


def test_adam_betas_survive_a_file_round_trip(tmp_path: Path) -> None:
    model = _model(0)
    opt = optim.Adam(model.parameters(), betas=(0.8, 0.9))
    _train(model, opt, range(1))
    tl.save(opt.state_dict(), tmp_path / "opt.npz")
    opt2 = optim.Adam(_model(0).parameters())
    opt2.load_state_dict(tl.load(tmp_path / "opt.npz"))
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9)
    assert isinstance(next(iter(opt2.state.values()))["step"], int)


def test_mismatched_state_dicts_raise_value_error() -> None:
    model = _model(0)
    opt = optim.Adam(model.parameters())
    _train(model, opt, range(1))
    sd = opt.state_dict()
    params = list(_model(1).parameters())
    with pytest.raises(ValueError, match=r"group has 4 parameters.*has 3"):
        optim.Adam(params[:3]).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"1 parameter groups.*has 2"):
        optim.Adam([{"params": params[:2]}, {"params": params[2:]}]).load_state_dict(sd)
    bad = {
        "state": {0: {**sd["state"][0], "exp_avg": np.zeros((2, 2))}},
        "param_groups": sd["param_groups"],
    }
    with pytest.raises(ValueError, match=r"exp_avg.*\(2, 2\)"):
        optim.Adam(params).load_state_dict(bad)
    with pytest.raises(ValueError, match="unknown parameter 9"):
        optim.Adam(params).load_state_dict({"state": {9: {}}, "param_groups": sd["param_groups"]})
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        optim.Adam(params).load_state_dict({"state": {}})


def test_loaded_state_follows_the_parameter_dtype() -> None:
    model = _model(0)
    opt = optim.Adam(model.parameters())
    _train(model, opt, range(1))
    tl.manual_seed(0)
    small = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))  # float32
    opt32 = optim.Adam(small.parameters())
    opt32.load_state_dict(opt.state_dict())
    for state in opt32.state.values():
        assert state["exp_avg"].dtype == np.float32 and state["exp_avg_sq"].dtype == np.float32
    assert math.isclose(opt32.param_groups[0]["lr"], 1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: optim.Adam(ps, lr=0.1, betas=(0.3, 0.4), amsgrad=True, weight_decay=0.1),
        lambda ps: optim.AdamW(ps, lr=0.1, amsgrad=True, maximize=True),
        lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, maximize=True),
    ],
    ids=["adam-amsgrad", "adamw-amsgrad-maximize", "sgd-nesterov-maximize"],
)
def test_every_option_runs_on_the_device_as_on_the_cpu(
    make: Callable[[list[nn.Parameter]], optim.Optimizer], device: str
) -> None:
    params, grads = _random_run(holes=False)
    ps = [nn.Parameter(tl.tensor(p, device=device)) for p in params]
    opt = make(ps)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = tl.tensor(g, device=device)
        opt.step()
    want = _run(make, params, grads)
    for p, w in zip(ps, want, strict=True):
        np.testing.assert_allclose(p.numpy(), w, rtol=1e-12, atol=1e-14)
