"""Ignite's ``EarlyStopping``: stop the trainer when a score stops improving."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from ddp._sampler import check_int

__all__ = ["EarlyStopping"]


class EarlyStopping:
    """Call ``trainer.terminate()`` after ``patience`` calls without improvement.

    Each call reads ``score_function(engine)`` (higher is better). A score improves when it
    exceeds the best one by more than ``min_delta``; then the counter restarts at 0,
    otherwise it counts one more call and the trainer stops when it reaches ``patience``.
    The first call only records the score.

    Attach it to the engine whose state the score reads, typically an evaluator run after
    every epoch: ``evaluator.add_event_handler(Events.COMPLETED, handler)``. In a job of
    several ranks every rank must run it and see the same score (metrics computed with
    ``compute()`` are all-reduced), so that all ranks stop at the same epoch.

    Args:
        patience: calls without improvement before stopping (at least 1).
        score_function: ``fn(engine) -> number``.
        trainer: the engine to stop (anything with ``terminate()``).
        min_delta: the smallest increase that counts as an improvement (not negative).
        cumulative_delta: when True, a score that rose by ``min_delta`` or less does not
            become the best one, so small gains add up until they exceed ``min_delta``
            against the score of the last improvement; when False (default), the best
            score follows them and each call must beat the previous best by ``min_delta``.

    Raises:
        TypeError: when ``score_function`` is not callable, ``trainer`` has no
            ``terminate()``, or ``patience`` is not an int.
        ValueError: for ``patience < 1`` or a negative ``min_delta``.

    Attributes:
        counter: calls since the last improvement.
        best_score: the best score so far (None before the first call).
    """

    def __init__(
        self,
        patience: int,
        score_function: Callable[[Any], Any],
        trainer: Any,
        min_delta: float = 0.0,
        cumulative_delta: bool = False,
    ) -> None:
        where = "EarlyStopping"
        if not callable(score_function):
            raise TypeError(f"{where}: score_function should be a function, got {score_function!r}")
        patience = check_int(where, "patience", patience)
        if patience < 1:
            raise ValueError(f"{where}: patience should be a positive integer, got {patience}")
        if not isinstance(min_delta, numbers.Real) or isinstance(min_delta, bool):
            raise TypeError(f"{where}: min_delta should be a number, got {min_delta!r}")
        if min_delta < 0.0:
            raise ValueError(f"{where}: min_delta should not be a negative number, got {min_delta}")
        if not callable(getattr(trainer, "terminate", None)):
            raise TypeError(
                f"{where}: trainer should be an Engine (the one to stop), got {type(trainer)}"
            )
        self.score_function: Callable[[Any], Any] = score_function
        self.patience: int = patience
        self.min_delta: float = float(min_delta)
        self.cumulative_delta: bool = bool(cumulative_delta)
        self.trainer: Any = trainer
        self.counter: int = 0
        self.best_score: Any = None
        self.logger: logging.Logger = logging.getLogger(f"{__name__.rsplit('.', 1)[0]}.{where}")

    def __call__(self, engine: Any) -> None:
        """Compare this call's score with the best one; stop the trainer when patience runs out."""
        score = self.score_function(engine)
        if self.best_score is None:
            self.best_score = score
        elif score <= self.best_score + self.min_delta:
            if not self.cumulative_delta and score > self.best_score:
                self.best_score = score
            self.counter += 1
            self.logger.debug("EarlyStopping: %i / %i", self.counter, self.patience)
            if self.counter >= self.patience:
                self.logger.info("EarlyStopping: Stop training")
                self.trainer.terminate()
        else:
            self.best_score = score
            self.counter = 0

    def reset(self) -> None:
        """Forget the counter and the best score (before another run)."""
        self.counter = 0
        self.best_score = None

    def state_dict(self) -> dict[str, Any]:
        """``{"counter": int, "best_score": number or None}``."""
        return {"counter": self.counter, "best_score": self.best_score}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (a 0-d Tensor read from a file is unwrapped).

        Raises:
            TypeError: when ``state_dict`` is not a dict.
            ValueError: when ``counter`` or ``best_score`` is missing.
        """
        where = "EarlyStopping.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}: state_dict must be a dict, got {type(state_dict)}")
        for key in ("counter", "best_score"):
            if key not in state_dict:
                raise ValueError(
                    f"{where}: required state attribute {key!r} is absent in the state_dict "
                    f"(keys {list(state_dict)})"
                )
        best = state_dict["best_score"]
        self.counter = check_int(where, "counter", state_dict["counter"], 0)
        self.best_score = best.item() if hasattr(best, "item") else best
