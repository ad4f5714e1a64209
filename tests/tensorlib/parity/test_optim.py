"""Optimizer trajectories against torch.optim: 20 steps on the same nonconvex loss.

Each case starts both libraries from the same parameters (several shapes), computes the same
loss in each library (so every gradient depends on the trajectory so far), steps both
optimizers, and compares the parameters after every step and the optimizer state at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import optim

from .compare import DTYPES, assert_close, pair, to_numpy, torch

SHAPES = [(3, 4), (5,), (2, 1, 3)]
STEPS = 20


# ============================================================================ the problem
class Problem:
    """Parameters, constants and the loss, the same in tensorlib and torch."""

    def __init__(self, dtype: Any, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.init = [rng.standard_normal(s) * 1.5 for s in SHAPES]
        self.consts = [
            (rng.standard_normal(s), rng.standard_normal(s)) for s in SHAPES
        ]  # (R, S) per parameter: a non-uniform weighting of each term

    def params(self) -> tuple[list[tl.Tensor], list[Any]]:
        pairs = [pair(a, self.dtype) for a in self.init]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def loss(self, params: list[Any], lib: str) -> Any:
        """A nonconvex loss with bounded gradients (so ``maximize`` cannot blow up)."""
        make = (
            (lambda a: tl.tensor(a.astype(self.dtype)))
            if lib == "tl"
            else (lambda a: torch.tensor(a.astype(self.dtype)))
        )
        total = None
        for p, (r, s) in zip(params, self.consts, strict=True):
            term = ((p * 1.5).tanh() * make(r)).sum() + ((p * p + 1.0).log() * make(s)).sum() * 0.3
            total = term if total is None else total + term
        coupling = params[0].tanh().sum() * params[1].tanh().sum() * 0.1
        return total + coupling


def _step_both(
    problem: Problem, ours: list[tl.Tensor], theirs: list[Any], opt: Any, topt: Any
) -> None:
    opt.zero_grad()
    problem.loss(ours, "tl").backward()
    opt.step()
    topt.zero_grad()
    problem.loss(theirs, "torch").backward()
    topt.step()


def _assert_params(ours: list[tl.Tensor], theirs: list[Any], what: str) -> None:
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        assert_close(o, t, f"{what}: param {i}")


def _assert_state(
    opt: optim.Optimizer, topt: Any, ours: list[tl.Tensor], theirs: list[Any]
) -> None:
    """The per-parameter state (moments, buffers, step count) matches torch's, key for key."""
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        mine, ref = opt.state.get(o, {}), topt.state.get(t, {})
        assert set(mine) == set(ref), f"param {i}: state keys {sorted(mine)} vs {sorted(ref)}"
        for key, value in ref.items():
            if key == "step":
                assert mine[key] == int(value.item()), f"param {i}: step"
            else:
                # moments and buffers are sums of gradients: the harness's gradient tolerance
                assert_close(tl.tensor(mine[key]), value, f"param {i}: state {key}", grad=True)


def _run(
    dtype: Any,
    make: Callable[[list[Any]], optim.Optimizer],
    tmake: Callable[[list[Any]], Any],
    steps: int = STEPS,
) -> None:
    problem = Problem(dtype)
    ours, theirs = problem.params()
    opt, topt = make(ours), tmake(theirs)
    for step in range(steps):
        _step_both(problem, ours, theirs, opt, topt)
        _assert_params(ours, theirs, f"after step {step + 1}")
    _assert_state(opt, topt, ours, theirs)


def _ids(kwargs: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in kwargs.items()) or "defaults"


# ============================================================================ SGD
SGD_CASES: list[dict[str, Any]] = [
    {"lr": 0.1},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.5},
    {"lr": 0.05, "momentum": 0.8, "nesterov": True},
    {"lr": 0.1, "weight_decay": 0.1},
    {"lr": 0.1, "maximize": True},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.05, "maximize": True},
    {"lr": 0.05, "momentum": 0.7, "nesterov": True, "weight_decay": 0.01, "maximize": True},
    {},  # torch's default lr (1e-3)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", SGD_CASES, ids=_ids)
def test_sgd_trajectory_matches_torch(kwargs: dict[str, Any], dtype: Any) -> None:
    _run(dtype, lambda ps: optim.SGD(ps, **kwargs), lambda ps: torch.optim.SGD(ps, **kwargs))


# ============================================================================ Adam, AdamW
ADAM_CASES: list[dict[str, Any]] = [
    {"lr": 0.01},
    {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6},
    {"lr": 0.02, "betas": (0.3, 0.4)},  # 1 - beta >= 0.5: torch's other lerp formula
    {"lr": 0.01, "weight_decay": 0.1},
    {"lr": 0.01, "amsgrad": True},
    {"lr": 0.02, "amsgrad": True, "betas": (0.5, 0.9), "eps": 1e-3},
    {"lr": 0.01, "amsgrad": True, "weight_decay": 0.05, "maximize": True},
    {"lr": 0.01, "maximize": True},
    {},
]
ADAMS = {"Adam": (optim.Adam, "Adam"), "AdamW": (optim.AdamW, "AdamW")}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", ADAM_CASES, ids=_ids)
@pytest.mark.parametrize("name", list(ADAMS))
def test_adam_trajectory_matches_torch(name: str, kwargs: dict[str, Any], dtype: Any) -> None:
    ours, theirs = ADAMS[name]
    tcls = getattr(torch.optim, theirs)
    _run(dtype, lambda ps: ours(ps, **kwargs), lambda ps: tcls(ps, **kwargs))


# ============================================================================ param groups
def _groups(params: list[Any], specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Split [p0, p1, p2] into groups [p0], [p1, p2] with the given hyper-parameters."""
    return [{"params": params[:1], **specs[0]}, {"params": params[1:], **specs[1]}]


GROUP_CASES: dict[str, tuple[str, dict[str, Any], list[dict[str, Any]]]] = {
    "sgd": (
        "SGD",
        {"lr": 0.05, "momentum": 0.9},
        [{"lr": 0.1, "nesterov": True}, {"dampening": 0.3, "weight_decay": 0.1}],
    ),
    "sgd-maximize": ("SGD", {"lr": 0.05}, [{"maximize": True}, {"momentum": 0.5}]),
    "adam": (
        "Adam",
        {"lr": 0.01},
        [{"amsgrad": True, "betas": (0.8, 0.9)}, {"lr": 0.03, "weight_decay": 0.1}],
    ),
    "adamw": (
        "AdamW",
        {"lr": 0.01, "amsgrad": True},
        [{"weight_decay": 0.5}, {"amsgrad": False, "maximize": True, "eps": 1e-4}],
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_param_groups_with_their_own_hyper_parameters_match_torch(case: str, dtype: Any) -> None:
    name, defaults, specs = GROUP_CASES[case]
    ours, tcls = getattr(optim, name), getattr(torch.optim, name)
    _run(
        dtype,
        lambda ps: ours(_groups(ps, specs), **defaults),
        lambda ps: tcls(_groups(ps, specs), **defaults),
    )


# ============================================================================ resuming
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("via_file", [False, True], ids=["memory", "file"])
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_state_dict_at_step_10_continues_torchs_trajectory(
    case: str, via_file: bool, dtype: Any, tmp_path: Path
) -> None:
    """Save at step 10, load into fresh parameters and a fresh optimizer, run 10 more steps:
    the resumed run follows torch's uninterrupted one."""
    name, defaults, specs = GROUP_CASES[case]
    ours_cls, tcls = getattr(optim, name), getattr(torch.optim, name)
    problem = Problem(dtype, seed=1)
    ours, theirs = problem.params()
    opt = ours_cls(_groups(ours, specs), **defaults)
    topt = tcls(_groups(theirs, specs), **defaults)
    for _ in range(10):
        _step_both(problem, ours, theirs, opt, topt)
    ckpt = {"params": [p.numpy().copy() for p in ours], "optim": opt.state_dict()}
    if via_file:
        tl.save(ckpt, tmp_path / "ckpt.npz")
        ckpt = tl.load(tmp_path / "ckpt.npz")
    resumed = [tl.tensor(to_numpy(a), requires_grad=True) for a in ckpt["params"]]
    # fresh hyper-parameters that differ: everything must come from the state dict
    opt2 = ours_cls(_groups(resumed, [{}, {}]), lr=0.5)
    opt2.load_state_dict(ckpt["optim"])
    for step in range(10, STEPS):
        _step_both(problem, resumed, theirs, opt2, topt)
        _assert_params(resumed, theirs, f"after step {step + 1} (resumed at 10)")
    _assert_state(opt2, topt, resumed, theirs)


def test_state_dict_keys_match_torchs() -> None:
    """amsgrad's running max is stored under torch's name, next to torch's other keys."""
    problem = Problem(np.float64)
    ours, theirs = problem.params()
    opt = optim.AdamW(ours, lr=0.01, amsgrad=True)
    topt = torch.optim.AdamW(theirs, lr=0.01, amsgrad=True)
    _step_both(problem, ours, theirs, opt, topt)
    sd, tsd = opt.state_dict(), topt.state_dict()
    assert sorted(sd["state"]) == sorted(tsd["state"])
    assert (
        set(sd["state"][0])
        == set(tsd["state"][0])
        == {
            "step",
            "exp_avg",
            "exp_avg_sq",
            "max_exp_avg_sq",
        }
    )
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert sd["param_groups"][0][key] == tsd["param_groups"][0][key], key
