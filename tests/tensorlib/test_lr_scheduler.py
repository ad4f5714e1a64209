"""Learning-rate schedulers without torch: argument errors, state dicts, import paths.

The schedules themselves are checked against torch in parity/test_lr_scheduler.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tensorlib as tl
from tensorlib import nn, optim
from tensorlib.optim import lr_scheduler as L


def _opt(groups: int = 1, lr: float = 0.1) -> optim.SGD:
    return optim.SGD(
        [{"params": [nn.Parameter(tl.ones(2))]} for _ in range(groups)], lr=lr, momentum=0.9
    )


def test_importable_as_torch_users_expect() -> None:
    import tensorlib.optim.lr_scheduler as by_path

    assert by_path is L is optim.lr_scheduler
    assert issubclass(L.CosineAnnealingLR, L.LRScheduler)


def test_warmup_then_cosine_in_one_line() -> None:
    opt = _opt()
    sched = L.SequentialLR(
        opt, [L.LinearLR(opt, 0.1, total_iters=4), L.CosineAnnealingLR(opt, T_max=4)], [4]
    )
    lrs = [sched.get_last_lr()[0]]
    for _ in range(8):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    want = [0.01, 0.0325, 0.055, 0.0775, 0.1]
    want += [0.05 * (1 + math.cos(math.pi * t / 4)) for t in (1, 2, 3, 4)]
    assert lrs == pytest.approx(want, abs=1e-15)


def test_construction_sets_initial_lr_once() -> None:
    opt = _opt(groups=2)
    opt.param_groups[1]["lr"] = 0.5
    sched = L.StepLR(opt, 2)
    assert [g["initial_lr"] for g in opt.param_groups] == [0.1, 0.5] == sched.base_lrs
    opt.param_groups[0]["lr"] = 0.3
    L.ExponentialLR(opt, 0.5)  # a second scheduler keeps the first one's initial_lr
    assert opt.param_groups[0]["initial_lr"] == 0.1


# ============================================================================ errors
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [  # deliberately wrong types (mypy would catch them in user code too)
        (lambda o: L.StepLR([o], 3), TypeError, "Optimizer, got list"),  # type: ignore[arg-type]
        (lambda o: L.LambdaLR(None, lambda e: 1.0), TypeError, "got NoneType"),  # type: ignore[arg-type]
        (lambda o: L.LambdaLR(o, [lambda e: 1.0] * 3), ValueError, "expected 2 lr_lambdas"),
        (lambda o: L.LambdaLR(o, 0.5), TypeError, "callable"),  # type: ignore[arg-type]
        (lambda o: L.StepLR(o, 0), ValueError, "step_size"),
        (lambda o: L.StepLR(o, 2.5), ValueError, "step_size"),  # type: ignore[arg-type]
        (lambda o: L.MultiStepLR(o, [10, 5]), ValueError, "increasing"),
        (lambda o: L.MultiStepLR(o, [-1, 5]), ValueError, "milestone"),
        (lambda o: L.CosineAnnealingLR(o, T_max=0), ValueError, "T_max"),
        (lambda o: L.CosineAnnealingLR(o, T_max=-5), ValueError, "T_max"),
        (lambda o: L.LinearLR(o, start_factor=0.0), ValueError, "start_factor"),
        (lambda o: L.LinearLR(o, start_factor=1.5), ValueError, "start_factor"),
        (lambda o: L.LinearLR(o, end_factor=-0.1), ValueError, "end_factor"),
        (lambda o: L.LinearLR(o, total_iters=0), ValueError, "total_iters"),
        (lambda o: L.StepLR(o, 2, last_epoch=-2), ValueError, "last_epoch"),
        (lambda o: L.StepLR(o, 2, last_epoch=5), KeyError, "initial_lr"),
        (lambda o: L.SequentialLR(o, [], []), ValueError, "at least one"),
        (lambda o: L.SequentialLR(o, [L.StepLR(o, 2)], [3]), ValueError, "one milestone fewer"),
        (lambda o: L.SequentialLR(o, [o], []), TypeError, "not a scheduler"),
        (lambda o: L.SequentialLR(o, [L.StepLR(_opt(2), 2)], []), ValueError, "another"),
        (
            lambda o: L.SequentialLR(o, [L.StepLR(o, 2)] * 3, [5, 5]),
            ValueError,
            "strictly increasing",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(
    make: Callable[[optim.Optimizer], Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make(_opt(groups=2))


def test_multistep_accepts_a_repeated_milestone() -> None:
    opt = _opt()
    sched = L.MultiStepLR(opt, [2, 2], gamma=0.5)
    for _ in range(2):
        opt.step()
        sched.step()
    assert sched.get_last_lr() == [0.1 * 0.25]


# ============================================================================ state dicts
class Warmup:
    """A callable object: its ``__dict__`` goes into LambdaLR's state dict."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, epoch: int) -> float:
        return min(1.0, (epoch + 1) / self.steps)


def test_lambda_state_dict_stores_objects_dicts_not_functions(tmp_path: Path) -> None:
    opt = _opt(groups=2)
    sched = L.LambdaLR(opt, [Warmup(10), lambda e: 0.9**e])
    sd = sched.state_dict()
    assert sd["lr_lambdas"] == [{"steps": 10}, None]
    tl.save(sd, tmp_path / "sched.npz")  # plain data: no pickle needed
    other = Warmup(3)
    fresh = L.LambdaLR(_opt(groups=2), [other, lambda e: 1.0])
    fresh.load_state_dict(tl.load(tmp_path / "sched.npz"))
    assert other.steps == 10 and fresh.last_epoch == 0


def test_lambda_state_dict_with_a_builtin_callable() -> None:
    """A callable without a ``__dict__`` (a builtin) is stored as None too."""
    opt = _opt()
    sched = L.LambdaLR(opt, math.exp)
    sd = sched.state_dict()
    assert sd["lr_lambdas"] == [None]
    L.LambdaLR(_opt(), math.exp).load_state_dict(sd)


def test_state_dict_is_a_snapshot_and_get_last_lr_a_copy() -> None:
    opt = _opt()
    sched = L.MultiStepLR(opt, [1, 3])
    sd = sched.state_dict()
    last = sched.get_last_lr()
    last.append(5.0)
    for _ in range(4):
        opt.step()
        sched.step()
    assert sd["last_epoch"] == 0 and sd["_last_lr"] == [0.1] and sd["milestones"] == {1: 1, 3: 1}
    assert sched.get_last_lr() == pytest.approx([0.001])


def test_load_state_dict_rejects_another_schedulers_state() -> None:
    opt = _opt()
    sd = L.StepLR(opt, 2).state_dict()
    with pytest.raises(ValueError, match=r"unexpected entries \['gamma', 'step_size'\]"):
        L.CosineAnnealingLR(opt, 10).load_state_dict(sd)
    with pytest.raises(TypeError, match="expects a dict"):
        L.StepLR(opt, 2).load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base_lrs has 1 entries, the optimizer has 2"):
        L.StepLR(_opt(groups=2), 2).load_state_dict(sd)
    seq = L.SequentialLR(opt, [L.StepLR(opt, 2), L.StepLR(opt, 3)], [4])
    with pytest.raises(ValueError, match="has 1 schedulers, this SequentialLR has 2"):
        seq.load_state_dict(L.SequentialLR(opt, [L.StepLR(opt, 2)], []).state_dict())


def test_resuming_with_last_epoch_after_loading_the_optimizer() -> None:
    """The other way to resume: the optimizer's state dict carries initial_lr."""
    opt = _opt()
    sched = L.StepLR(opt, 3, gamma=0.5)
    for _ in range(7):
        opt.step()
        sched.step()
    opt2 = _opt(lr=0.7)
    opt2.load_state_dict(opt.state_dict())
    sched2 = L.StepLR(opt2, 3, gamma=0.5, last_epoch=sched.last_epoch)
    assert sched2.base_lrs == [0.1]
    for _ in range(5):
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()
    assert sched2.get_last_lr() == sched.get_last_lr()
