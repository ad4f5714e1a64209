"""Learning-rate schedulers with ``torch.optim.lr_scheduler``'s names, formulas and state.

A scheduler rewrites ``group["lr"]`` of every parameter group of its optimizer each time
:meth:`LRScheduler.step` is called (once per epoch or per iteration, after
``optimizer.step()``). Like torch's, most schedulers are *chainable*: each step multiplies
the group's current ``lr``, so the values follow torch's recursive formulas to the last bit,
and two schedulers on one optimizer compose. ``SequentialLR`` switches from one scheduler to
the next at milestones (warm-up, then cosine decay). A scheduler's ``state_dict`` holds plain
numbers, lists and dicts, so :func:`tensorlib.save` can store it.
"""

from __future__ import annotations

import math
import types
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise
from typing import Any

from ._optimizer import Optimizer

__all__ = [
    "CosineAnnealingLR",
    "ExponentialLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "SequentialLR",
    "StepLR",
]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int) -> None:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


class LRScheduler:
    """Base class: adjusts the ``lr`` of each of ``optimizer.param_groups`` on every step.

    Construction with ``last_epoch=-1`` (a fresh run) stores each group's ``lr`` as its
    ``initial_lr`` (kept if already there) and takes the first step, which sets the epoch-0
    learning rates. A ``last_epoch >= 0`` resumes a schedule and needs ``initial_lr`` in every
    group (a loaded optimizer state dict has it). Subclasses define :meth:`get_lr` and, for
    :class:`SequentialLR`'s milestones, ``_get_closed_form_lr``.

    Args:
        optimizer: the optimizer whose learning rates this scheduler sets.
        last_epoch: the index of the last epoch done; -1 for a fresh start.

    Raises:
        TypeError: if ``optimizer`` is not an :class:`~tensorlib.optim.Optimizer`.
        KeyError: if ``last_epoch >= 0`` and a group has no ``initial_lr``.
    """

    _is_initial: bool = False

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        _check_int("last_epoch", last_epoch, -1)
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(
                        f"param_groups[{i}] has no 'initial_lr', which resuming a scheduler "
                        f"with last_epoch={last_epoch} needs: load the optimizer's state dict "
                        "first, or use last_epoch=-1 for a fresh run"
                    )
        self.base_lrs: list[float] = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self) -> None:
        """Reset the step count and take the constructor's step (the epoch-0 rates)."""
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:
        """The learning rates for ``last_epoch``, one per parameter group (no side effects).

        To read the rates in use, call :meth:`get_last_lr`.
        """
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The learning rates set by the latest step, one per parameter group (a copy)."""
        return list(self._last_lr)

    def step(self) -> None:
        """Advance one epoch and set every group's ``lr`` (call after ``optimizer.step()``)."""
        self._step_count += 1
        self._update_lr()

    def _update_lr(self, epoch: int | None = None) -> None:
        """Advance one epoch (recursive formula), or jump to ``epoch`` (closed form)."""
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            closed = getattr(self, "_get_closed_form_lr", None)
            values = closed() if closed is not None else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _current_lrs(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute except the optimizer.

        Save it together with the optimizer's state dict; restore with
        :meth:`load_state_dict` on a scheduler built the same way.
        """
        return {k: _copy(v) for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`.

        Raises:
            TypeError: if ``state_dict`` is not a dict.
            ValueError: if it has entries this scheduler does not (another scheduler's state).
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"{type(self).__name__}.load_state_dict expects a dict, "
                f"got {type(state_dict).__name__}"
            )
        unknown = sorted(set(state_dict) - set(self.__dict__))
        if unknown:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: unexpected entries {unknown} "
                "(was the state saved from another kind of scheduler?)"
            )
        groups = len(self.optimizer.param_groups)
        for key in ("base_lrs", "_last_lr"):
            if key in state_dict and len(state_dict[key]) != groups:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: {key} has "
                    f"{len(state_dict[key])} entries, the optimizer has {groups} parameter groups"
                )
        self.__dict__.update({k: _copy(v) for k, v in state_dict.items()})


def _copy(value: Any) -> Any:
    """A copy of lists and dicts in a state dict, so it is a snapshot."""
    if isinstance(value, Counter):
        return Counter(value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(v) for v in value)
    return value


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"a learning-rate scheduler needs a tensorlib.optim.Optimizer, "
            f"got {type(optimizer).__name__}"
        )


# ============================================================================ multiplicative
class LambdaLR(LRScheduler):
    """``lr = initial_lr * lr_lambda(epoch)`` for each group.

    Args:
        optimizer: the optimizer.
        lr_lambda: a function of the epoch (an int) giving the factor, or a list of such
            functions, one per parameter group.
        last_epoch: the index of the last epoch done; -1 for a fresh start.

    Raises:
        ValueError: if a list of lambdas does not have one per parameter group.
        TypeError: if a lambda is not callable.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
        last_epoch: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        n = len(optimizer.param_groups)
        if isinstance(lr_lambda, list | tuple):
            if len(lr_lambda) != n:
                raise ValueError(f"expected {n} lr_lambdas (one per group), got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * n
        for fn in self.lr_lambdas:
            if not callable(fn):
                raise TypeError(f"lr_lambda must be callable, got {type(fn).__name__}")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """``base_lr * lr_lambda(last_epoch)`` per group."""
        return [
            base * fn(self.last_epoch)
            for fn, base in zip(self.lr_lambdas, self.base_lrs, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        """The state, with each lambda as None (functions cannot be stored) or, for a callable
        object, a copy of its ``__dict__`` (as torch does)."""
        state = {
            k: _copy(v) for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")
        }
        state["lr_lambdas"] = [
            None
            if isinstance(fn, types.FunctionType) or not hasattr(fn, "__dict__")
            else dict(fn.__dict__)
            for fn in self.lr_lambdas
        ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state; a saved callable object's ``__dict__`` updates this one's."""
        rest = {k: v for k, v in state_dict.items() if k != "lr_lambdas"}
        super().load_state_dict(rest)
        for fn, saved in zip(self.lr_lambdas, state_dict.get("lr_lambdas", []), strict=False):
            if saved is not None:
                fn.__dict__.update(saved)


class StepLR(LRScheduler):
    """Multiply every group's ``lr`` by ``gamma`` every ``step_size`` epochs.

    Raises:
        ValueError: if ``step_size`` is not a positive integer.
    """

    def __init__(
        self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        _check_int("step_size", step_size, 1)
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The current rates, times ``gamma`` at each non-zero multiple of ``step_size``."""
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._current_lrs()
        return [lr * self.gamma for lr in self._current_lrs()]

    def _get_closed_form_lr(self) -> list[float]:
        return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """Multiply every group's ``lr`` by ``gamma`` at each milestone epoch.

    A milestone listed ``n`` times multiplies by ``gamma ** n`` there.

    Raises:
        ValueError: if the milestones are not non-negative integers in increasing order.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        milestones: Iterable[int],
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        listed = list(milestones)
        for m in listed:
            _check_int("each milestone", m, 0)
        if listed != sorted(listed):
            raise ValueError(f"milestones must be increasing, got {listed}")
        self.milestones = Counter(listed)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The current rates, times ``gamma ** count`` at a milestone."""
        if self.last_epoch not in self.milestones:
            return self._current_lrs()
        factor = self.gamma ** self.milestones[self.last_epoch]
        return [lr * factor for lr in self._current_lrs()]

    def _get_closed_form_lr(self) -> list[float]:
        passed = bisect_right(sorted(self.milestones.elements()), self.last_epoch)
        return [base * self.gamma**passed for base in self.base_lrs]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state (milestones come back as a ``Counter`` from a saved file too)."""
        super().load_state_dict(state_dict)
        self.milestones = Counter({int(k): int(v) for k, v in dict(self.milestones).items()})


class ExponentialLR(LRScheduler):
    """Multiply every group's ``lr`` by ``gamma`` every epoch."""

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The current rates times ``gamma`` (unchanged by the constructor's step)."""
        if self._is_initial:
            return self._current_lrs()
        return [lr * self.gamma for lr in self._current_lrs()]

    def _get_closed_form_lr(self) -> list[float]:
        return [base * self.gamma**self.last_epoch for base in self.base_lrs]


class LinearLR(LRScheduler):
    """Scale each group's ``lr`` by a factor going linearly from ``start_factor`` to
    ``end_factor`` over ``total_iters`` epochs, then keep it (a warm-up, or a linear decay).

    Raises:
        ValueError: if ``start_factor`` is not in (0, 1], ``end_factor`` not in [0, 1], or
            ``total_iters`` not a positive integer.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        total_iters: int = 5,
        last_epoch: int = -1,
    ) -> None:
        if not 0.0 < start_factor <= 1.0:
            raise ValueError(f"start_factor must be in (0, 1], got {start_factor}")
        if not 0.0 <= end_factor <= 1.0:
            raise ValueError(f"end_factor must be in [0, 1], got {end_factor}")
        _check_int("total_iters", total_iters, 1)
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The current rates times this epoch's ratio of consecutive factors."""
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in self._current_lrs()]
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._current_lrs()
        span = self.end_factor - self.start_factor
        ratio = 1.0 + span / (self.total_iters * self.start_factor + (self.last_epoch - 1) * span)
        return [lr * ratio for lr in self._current_lrs()]

    def _get_closed_form_lr(self) -> list[float]:
        span = self.end_factor - self.start_factor
        done = min(self.total_iters, self.last_epoch)
        return [
            base * (self.start_factor + span * done / self.total_iters) for base in self.base_lrs
        ]


class CosineAnnealingLR(LRScheduler):
    """Anneal each group's ``lr`` from its initial value to ``eta_min`` along half a cosine
    over ``T_max`` epochs (then back up, periodically, if stepped further), as torch does:

    ``lr_t = eta_min + (initial_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2``, computed
    recursively from the previous epoch's ``lr`` (so it composes with other schedulers).

    Raises:
        ValueError: if ``T_max`` is not a positive number.
    """

    def __init__(
        self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1
    ) -> None:
        if isinstance(T_max, bool) or not isinstance(T_max, int | float) or not T_max > 0:
            raise ValueError(f"T_max must be a positive number of epochs, got {T_max!r}")
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The next rates by torch's recursive cosine formula."""
        t, T, lo = self.last_epoch, self.T_max, self.eta_min
        if self._is_initial:
            return self._current_lrs()
        if self._step_count == 1 and t > 0:
            return [
                lo + (base - lo) * (1 + math.cos(t * math.pi / T)) / 2 for base in self.base_lrs
            ]
        if (t - 1 - T) % (2 * T) == 0:
            # the bottom of the cosine: the ratio below would divide by 1 + cos(pi) = 0
            return [
                lr + (base - lo) * (1 - math.cos(math.pi / T)) / 2
                for base, lr in zip(self.base_lrs, self._current_lrs(), strict=True)
            ]
        ratio = (1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T))
        return [ratio * (lr - lo) + lo for lr in self._current_lrs()]

    def _get_closed_form_lr(self) -> list[float]:
        cos = 1 + math.cos(math.pi * self.last_epoch / self.T_max)
        return [self.eta_min + (base - self.eta_min) * cos / 2 for base in self.base_lrs]


# ============================================================================ composition
class SequentialLR(LRScheduler):
    """Run ``schedulers`` one after another, switching at the ``milestones`` epochs.

    Scheduler ``i`` runs from ``milestones[i - 1]`` (restarted there at its epoch 0) until
    ``milestones[i]``. A warm-up then a cosine decay::

        warm = LinearLR(opt, start_factor=0.01, total_iters=100)
        decay = CosineAnnealingLR(opt, T_max=900)
        sched = SequentialLR(opt, [warm, decay], milestones=[100])

    Args:
        optimizer: the optimizer every scheduler in ``schedulers`` was built on.
        schedulers: the schedulers, in order.
        milestones: ``len(schedulers) - 1`` epochs, strictly increasing.
        last_epoch: the index of the last epoch done; -1 for a fresh start.

    Raises:
        TypeError: if ``optimizer`` is not an Optimizer or a scheduler not an LRScheduler.
        ValueError: on no schedulers, one built on another optimizer, or bad milestones.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        schedulers: Sequence[LRScheduler],
        milestones: Sequence[int],
        last_epoch: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        _check_sequence(optimizer, schedulers, milestones)
        _check_int("last_epoch", last_epoch, -1)
        self._schedulers = list(schedulers)
        self._milestones = list(milestones)
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        # Start over from the initial rates: the schedulers' constructors each took a step.
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        self._undo_steps(self)
        first = self._schedulers[bisect_right(self._milestones, 0)]
        first._initial_step()
        self._last_lr = first.get_last_lr()

    def _undo_steps(self, scheduler: LRScheduler) -> None:
        """Take back the constructor's step of every (nested) scheduler."""
        if isinstance(scheduler, SequentialLR):
            for s in scheduler._schedulers:
                self._undo_steps(s)
        else:
            scheduler.last_epoch -= 1

    def step(self) -> None:
        """Advance one epoch with the scheduler whose turn it is (restarting it at a milestone)."""
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The state, with each scheduler's own state dict under ``_schedulers``."""
        state = {
            k: _copy(v) for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")
        }
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state and each scheduler's.

        Raises:
            ValueError: if the number of saved schedulers differs from this one's.
        """
        saved = state_dict.get("_schedulers", []) if isinstance(state_dict, dict) else []
        if len(saved) != len(self._schedulers):
            raise ValueError(
                f"SequentialLR.load_state_dict: the state has {len(saved)} schedulers, "
                f"this SequentialLR has {len(self._schedulers)}"
            )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "_schedulers"})
        for scheduler, state in zip(self._schedulers, saved, strict=True):
            scheduler.load_state_dict(state)


def _check_sequence(
    optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int]
) -> None:
    if len(schedulers) < 1:
        raise ValueError("SequentialLR needs at least one scheduler, got none")
    for i, s in enumerate(schedulers):
        if not isinstance(s, LRScheduler):
            raise TypeError(
                f"SequentialLR: schedulers[{i}] is a {type(s).__name__}, not a scheduler"
            )
        if s.optimizer is not optimizer:
            raise ValueError(
                f"SequentialLR: schedulers[{i}] ({type(s).__name__}) was built on another "
                "optimizer; all must share SequentialLR's"
            )
    if len(milestones) != len(schedulers) - 1:
        raise ValueError(
            f"SequentialLR needs one milestone fewer than schedulers: got {len(schedulers)} "
            f"schedulers and {len(milestones)} milestones"
        )
    for m in milestones:
        _check_int("each milestone", m, 0)
    if any(b <= a for a, b in pairwise(milestones)):
        raise ValueError(
            f"SequentialLR milestones must be strictly increasing, got {list(milestones)}"
        )
