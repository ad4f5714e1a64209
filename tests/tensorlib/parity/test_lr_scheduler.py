"""Learning-rate schedules against torch.optim.lr_scheduler, step by step.

Each case builds the same scheduler (same class name, same arguments) on an optimizer with two
parameter groups in each library and compares ``get_last_lr()`` and every group's ``lr`` after
construction and after each of 100 steps. The schedules are Python-float arithmetic, so with
torch's recursive formulas they agree to rounding: the check is rtol 1e-12, far tighter than
the harness's float64 tolerance (1e-7).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import optim
from tensorlib.optim import lr_scheduler

from .compare import torch

STEPS = 100
LRS = (0.1, 0.03)
RTOL, ATOL = 1e-12, 1e-15  # ATOL: values that anneal to (about) zero

# torch warns from inside a nested SequentialLR's construction (its own order check)
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")

Factory = Callable[..., Any]  # (lr_scheduler module, optimizer, **kw) -> scheduler


def _optimizers() -> tuple[optim.Optimizer, Any]:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 2)), rng.standard_normal(4)
    ours = optim.SGD(
        [
            {"params": [tl.tensor(a, requires_grad=True)]},
            {"params": [tl.tensor(b, requires_grad=True)], "lr": LRS[1]},
        ],
        lr=LRS[0],
        momentum=0.9,
    )
    tgroups: list[dict[str, Any]] = [
        {"params": [torch.tensor(a, requires_grad=True)]},
        {"params": [torch.tensor(b, requires_grad=True)], "lr": LRS[1]},
    ]
    theirs = torch.optim.SGD(tgroups, lr=LRS[0], momentum=0.9)
    return ours, theirs


def _assert_lrs(sched: Any, tsched: Any, opt: Any, topt: Any, what: str) -> None:
    got, want = sched.get_last_lr(), tsched.get_last_lr()
    assert len(got) == len(want) == 2, what
    assert all(isinstance(v, float) for v in got), f"{what}: get_last_lr gives {got}"
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{what}: get_last_lr")
    groups = [g["lr"] for g in opt.param_groups]
    tgroups = [g["lr"] for g in topt.param_groups]
    np.testing.assert_allclose(groups, tgroups, rtol=RTOL, atol=ATOL, err_msg=f"{what}: lr")


def _step(sched: Any, opt: Any) -> None:
    opt.step()  # no gradients: a no-op, but the order torch expects
    sched.step()


def _two_lambdas(L: Any, o: Any, **kw: Any) -> Any:
    return L.LambdaLR(o, [lambda e: 0.95**e, lambda e: 1.0 / (1 + e // 10)], **kw)


CASES: dict[str, Factory] = {
    "lambda-one": lambda L, o, **kw: L.LambdaLR(o, lambda e: math.sqrt(e + 1) / (e + 1), **kw),
    "lambda-per-group": _two_lambdas,
    "step-7": lambda L, o, **kw: L.StepLR(o, step_size=7, gamma=0.5, **kw),
    "step-1": lambda L, o, **kw: L.StepLR(o, 1, 0.97, **kw),
    "multistep": lambda L, o, **kw: L.MultiStepLR(o, [10, 30, 30, 60], gamma=0.5, **kw),
    "multistep-at-0": lambda L, o, **kw: L.MultiStepLR(o, [0, 5, 99], **kw),
    "exponential": lambda L, o, **kw: L.ExponentialLR(o, gamma=0.95, **kw),
    "exponential-up": lambda L, o, **kw: L.ExponentialLR(o, 1.01, **kw),
    "cosine-100": lambda L, o, **kw: L.CosineAnnealingLR(o, T_max=100, **kw),
    "cosine-periodic": lambda L, o, **kw: L.CosineAnnealingLR(o, T_max=30, eta_min=1e-3, **kw),
    "cosine-7": lambda L, o, **kw: L.CosineAnnealingLR(o, 7, 0.05, **kw),
    "linear-defaults": lambda L, o, **kw: L.LinearLR(o, **kw),
    "linear-warmup": lambda L, o, **kw: L.LinearLR(o, start_factor=0.01, total_iters=20, **kw),
    "linear-decay": lambda L, o, **kw: L.LinearLR(o, 1.0, 0.1, total_iters=50, **kw),
    "linear-to-zero": lambda L, o, **kw: L.LinearLR(o, 0.5, 0.0, 100, **kw),
}


def _warmup_cosine(L: Any, o: Any) -> Any:
    """The one-liner the brief asks for: LinearLR warm-up, then cosine decay."""
    return L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.1, total_iters=10), L.CosineAnnealingLR(o, 90)], [10]
    )


SEQUENTIAL: dict[str, Callable[[Any, Any], Any]] = {
    "warmup-cosine": _warmup_cosine,
    "warmup-cosine-eta": lambda L, o: L.SequentialLR(
        o,
        [L.LinearLR(o, 0.25, total_iters=5), L.CosineAnnealingLR(o, T_max=40, eta_min=0.002)],
        milestones=[20],
    ),
    "three-stages": lambda L, o: L.SequentialLR(
        o,
        [L.ExponentialLR(o, 0.9), L.StepLR(o, 5, 0.5), L.MultiStepLR(o, [0, 3, 20], 0.3)],
        milestones=[10, 40],
    ),
    "lambda-then-linear": lambda L, o: L.SequentialLR(
        o, [L.LambdaLR(o, lambda e: 1.0 / (e + 1)), L.LinearLR(o, 0.5, 0.01, 30)], [25]
    ),
    "nested": lambda L, o: L.SequentialLR(
        o,
        [
            L.SequentialLR(o, [L.LinearLR(o, 0.2, total_iters=4), L.ExponentialLR(o, 0.9)], [4]),
            L.CosineAnnealingLR(o, 50),
        ],
        [30],
    ),
}
ALL: dict[str, Callable[[Any, Any], Any]] = {**CASES, **SEQUENTIAL}


def _run_both(make: Callable[[Any, Any], Any], steps: int = STEPS) -> None:
    opt, topt = _optimizers()
    sched, tsched = make(lr_scheduler, opt), make(torch.optim.lr_scheduler, topt)
    _assert_lrs(sched, tsched, opt, topt, "after construction")
    assert [g["initial_lr"] for g in opt.param_groups] == list(LRS)
    for step in range(steps):
        _step(sched, opt)
        _step(tsched, topt)
        _assert_lrs(sched, tsched, opt, topt, f"after step {step + 1}")
        assert sched.last_epoch == tsched.last_epoch, f"after step {step + 1}: last_epoch"


@pytest.mark.parametrize("case", list(ALL))
def test_schedule_matches_torch_for_100_steps(case: str) -> None:
    _run_both(ALL[case])


def test_two_schedulers_on_one_optimizer_compose_as_in_torch() -> None:
    """Chainable schedulers multiply the current lr, so stepping two of them composes."""

    def both(L: Any, o: Any) -> Any:
        first = L.StepLR(o, 10, 0.5)
        second = L.ExponentialLR(o, 0.98)
        return L.SequentialLR(o, [second], []), first  # one-stage SequentialLR, plus StepLR

    opt, topt = _optimizers()
    (s1, s2), (t1, t2) = both(lr_scheduler, opt), both(torch.optim.lr_scheduler, topt)
    for step in range(STEPS):
        opt.step()
        topt.step()
        for mine, theirs in ((s1, t1), (s2, t2)):
            mine.step()
            theirs.step()
        _assert_lrs(s1, t1, opt, topt, f"after step {step + 1}")


@pytest.mark.parametrize("case", list(CASES))
def test_resuming_with_last_epoch_matches_torch(case: str) -> None:
    """``last_epoch=k`` with ``initial_lr`` in the groups: torch's (quirky) first step too."""
    opt, topt = _optimizers()
    for o in (opt, topt):
        for g, lr in zip(o.param_groups, LRS, strict=True):
            g["initial_lr"] = lr
            g["lr"] = lr * 0.5  # as if a schedule had been under way
    sched = CASES[case](lr_scheduler, opt, last_epoch=20)
    tsched = CASES[case](torch.optim.lr_scheduler, topt, last_epoch=20)
    _assert_lrs(sched, tsched, opt, topt, "after construction")
    for step in range(30):
        _step(sched, opt)
        _step(tsched, topt)
        _assert_lrs(sched, tsched, opt, topt, f"after step {step + 1}")


@pytest.mark.parametrize("via_file", [False, True], ids=["memory", "file"])
@pytest.mark.parametrize("case", list(ALL))
def test_state_dict_at_step_50_continues_torchs_schedule(
    case: str, via_file: bool, tmp_path: Path
) -> None:
    """Save optimizer and scheduler at step 50; a fresh pair built the usual way (scheduler,
    then the optimizer's state, then the scheduler's) continues with torch's rates."""
    make = ALL[case]
    opt, topt = _optimizers()
    sched, tsched = make(lr_scheduler, opt), make(torch.optim.lr_scheduler, topt)
    for _ in range(50):
        _step(sched, opt)
        _step(tsched, topt)
    ckpt = {"optim": opt.state_dict(), "sched": sched.state_dict()}
    if via_file:
        tl.save(ckpt, tmp_path / "ckpt.npz")
        ckpt = tl.load(tmp_path / "ckpt.npz")
    params = [
        tl.tensor(p.numpy(), requires_grad=True) for g in opt.param_groups for p in g["params"]
    ]
    opt2 = optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.5, momentum=0.9)
    sched2 = make(lr_scheduler, opt2)
    opt2.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    _assert_lrs(sched2, tsched, opt2, topt, "after loading")
    for step in range(50, STEPS):
        _step(sched2, opt2)
        _step(tsched, topt)
        _assert_lrs(sched2, tsched, opt2, topt, f"after step {step + 1} (resumed at 50)")
