"""MeanSquaredError (Ignite's ``ignite.metrics.MeanSquaredError``): a float64 sum of squared
errors and an integer count of samples, reduced across ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._accuracy import host_pair
from ._metric import Metric, NotComputableError, reinit__is_reduced, sync_all_reduce

__all__ = ["MeanSquaredError"]


class MeanSquaredError(Metric):
    """The sum of squared errors over all elements divided by the number of samples.

    As in Ignite, the count is of samples (``y.shape[0]`` per batch), not of elements: for
    ``(N, D)`` outputs this is ``D`` times the elementwise mean. Errors are squared and summed
    in float64.

    Args:
        output_transform: turns the engine's output into ``(y_pred, y)``; ``y`` is read in
            ``y_pred``'s shape (same number of elements).
        device: kept for Ignite's signature (this metric returns a float).
        skip_unrolling: see :class:`Metric`.
    """

    @reinit__is_reduced
    def reset(self) -> None:
        """Zero the sum and the count."""
        self._sum_of_squared_errors = 0.0
        self._num_examples = 0

    @reinit__is_reduced
    def update(self, output: Sequence[Any]) -> None:
        """Add one batch ``(y_pred, y)``.

        Raises:
            ValueError: when ``y`` is 0-d or holds another number of elements than ``y_pred``.
        """
        y_pred, y = host_pair(output, "MeanSquaredError")
        if y.ndim == 0 or y.size != y_pred.size:
            raise ValueError(
                "MeanSquaredError: y must have a batch dimension and as many elements as "
                f"y_pred, but given {y.shape} vs {y_pred.shape}"
            )
        diff = y_pred.astype(np.float64).reshape(-1) - y.astype(np.float64).reshape(-1)
        self._sum_of_squared_errors += float(np.dot(diff, diff))
        self._num_examples += int(y.shape[0])

    @sync_all_reduce("_sum_of_squared_errors", "_num_examples")
    def compute(self) -> float:
        """The mean squared error over every rank's samples since the last reset.

        Raises:
            NotComputableError: before any example.
        """
        if self._num_examples == 0:
            raise NotComputableError(
                "MeanSquaredError must have at least one example before it can be computed."
            )
        return self._sum_of_squared_errors / self._num_examples
