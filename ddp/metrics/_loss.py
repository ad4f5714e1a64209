"""Loss (Ignite's ``ignite.metrics.Loss``): the mean of a loss function over the samples,
from a float64 sum of ``loss * batch_size`` and an integer count, reduced across ranks."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import tensorlib as tl

from ._metric import Metric, NotComputableError, reinit__is_reduced, sync_all_reduce

__all__ = ["Loss"]


def _average_loss(value: Any) -> float:
    """The loss function's result as a float; it must be one number (the batch mean)."""
    if isinstance(value, tl.Tensor | np.ndarray | np.generic):
        if np.ndim(value) != 0:
            raise ValueError(
                f"loss_fn did not return the average loss: got shape {tuple(np.shape(value))}, "
                "expected a 0-d tensor (reduction='mean')"
            )
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"Loss: loss_fn should return a 0-d Tensor or a number, got {type(value).__name__}"
    )


class Loss(Metric):
    """The average of ``loss_fn(y_pred, y)`` over the samples of every rank.

    Each update adds ``loss_fn(y_pred, y, **criterion_kwargs) * batch_size(y)`` to a float64
    sum and ``batch_size(y)`` to an integer count; ``compute()`` divides their all-reduced
    copies. A mapping output is read at ``("y_pred", "y", "criterion_kwargs")``.

    Args:
        loss_fn: returns the *mean* loss of a batch, e.g. ``tensorlib.functional.cross_entropy``.
        output_transform: turns the engine's output into ``(y_pred, y)`` or ``(y_pred, y,
            kwargs)`` (keyword arguments for ``loss_fn``).
        batch_size: how many samples ``y`` holds (``len`` by default).
        device: kept for Ignite's signature (this metric returns a float).
        skip_unrolling: see :class:`Metric`.

    Raises:
        TypeError: when ``loss_fn`` or ``batch_size`` is not callable.
    """

    required_output_keys = ("y_pred", "y", "criterion_kwargs")

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        output_transform: Callable[[Any], Any] = lambda x: x,
        batch_size: Callable[[Any], int] = len,
        device: str | tl.Device = "cpu",
        skip_unrolling: bool = False,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"Argument loss_fn should be callable, got {type(loss_fn).__name__}")
        if not callable(batch_size):
            raise TypeError(
                f"Argument batch_size should be callable, got {type(batch_size).__name__}"
            )
        self._loss_fn = loss_fn
        self._batch_size = batch_size
        super().__init__(output_transform, device=device, skip_unrolling=skip_unrolling)

    @reinit__is_reduced
    def reset(self) -> None:
        """Zero the sum and the count."""
        self._sum = 0.0
        self._num_examples = 0

    @reinit__is_reduced
    def update(self, output: Sequence[Any]) -> None:
        """Add one batch: ``(y_pred, y)`` or ``(y_pred, y, criterion_kwargs)``."""
        if not isinstance(output, Sequence) or len(output) not in (2, 3):
            raise TypeError(
                "Loss.update: output should be (y_pred, y) or (y_pred, y, criterion_kwargs), "
                f"got {output!r:.80}"
            )
        y_pred, y = output[0], output[1]
        kwargs = output[2] if len(output) == 3 else {}
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"Loss.update: criterion_kwargs should be a mapping, got {type(kwargs).__name__}"
            )
        average = _average_loss(self._loss_fn(y_pred, y, **kwargs))
        n = self._batch_size(y)
        if not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"Loss: batch_size(y) should be a count (an int >= 0), got {n!r}")
        self._sum += average * int(n)
        self._num_examples += int(n)

    @sync_all_reduce("_sum", "_num_examples")
    def compute(self) -> float:
        """The mean loss over every rank's samples since the last reset.

        Raises:
            NotComputableError: before any example.
        """
        if self._num_examples == 0:
            raise NotComputableError(
                "Loss must have at least one example before it can be computed."
            )
        return self._sum / self._num_examples
