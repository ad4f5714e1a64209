"""TopKCategoricalAccuracy (Ignite's ``ignite.metrics.TopKCategoricalAccuracy``), with
integer counts reduced across ranks."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import tensorlib as tl

from ._accuracy import host_pair
from ._metric import Metric, NotComputableError, reinit__is_reduced, sync_all_reduce

__all__ = ["TopKCategoricalAccuracy"]


class TopKCategoricalAccuracy(Metric):
    """The fraction of samples whose true class is among the ``k`` highest scores.

    ``y_pred`` holds scores ``(N, C)``, ``y`` labels (``N`` of them). Ties are ordered by
    class index (the lower first, as ``argmax`` does), so ``k=1`` agrees with
    :class:`Accuracy`. A label outside ``[0, C)`` is never among the top ``k``.

    Args:
        k: how many of the highest scores count, ``1 <= k <= C``.
        output_transform: turns the engine's output into ``(y_pred, y)``.
        device: kept for Ignite's signature (this metric returns a float).
        skip_unrolling: see :class:`Metric`.

    Raises:
        ValueError: when ``k`` is not a positive int.
    """

    def __init__(
        self,
        k: int = 5,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | tl.Device = "cpu",
        skip_unrolling: bool = False,
    ) -> None:
        if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
            raise ValueError(f"Argument k should be a positive int, got {k!r}")
        self._k: int = int(k)
        super().__init__(output_transform, device=device, skip_unrolling=skip_unrolling)

    @reinit__is_reduced
    def reset(self) -> None:
        """Zero the counts."""
        self._num_correct = 0
        self._num_examples = 0

    @reinit__is_reduced
    def update(self, output: Sequence[Any]) -> None:
        """Count the samples of one batch ``(y_pred, y)`` whose label is in the top ``k``.

        Raises:
            ValueError: for ``y_pred`` not ``(N, C)`` with ``C >= k``, or ``y`` not ``N``
                labels.
        """
        y_pred, y = host_pair(output, "TopKCategoricalAccuracy")
        if y_pred.ndim != 2 or y.size != y_pred.shape[0]:
            raise ValueError(
                "TopKCategoricalAccuracy: y_pred must have shape (batch_size, num_classes) and "
                f"y hold batch_size labels, but given {y.shape} vs {y_pred.shape}"
            )
        n, c = y_pred.shape
        if self._k > c:
            raise ValueError(
                f"TopKCategoricalAccuracy: k={self._k} is more than the {c} classes of y_pred"
            )
        labels = y.reshape(-1).astype(np.int64)
        valid = (labels >= 0) & (labels < c)
        safe = np.where(valid, labels, 0)
        true_score = y_pred[np.arange(n), safe][:, None]
        # The label's place in the scores sorted high to low, ties by class index.
        ahead = (y_pred > true_score) | ((y_pred == true_score) & (np.arange(c) < safe[:, None]))
        correct = valid & (np.count_nonzero(ahead, axis=1) < self._k)
        self._num_correct += int(np.count_nonzero(correct))
        self._num_examples += int(n)

    @sync_all_reduce("_num_correct", "_num_examples")
    def compute(self) -> float:
        """Top-k correct / examples over every rank's updates since the last reset.

        Raises:
            NotComputableError: before any example.
        """
        if self._num_examples == 0:
            raise NotComputableError(
                "TopKCategoricalAccuracy must have at least one example before it can be computed."
            )
        return self._num_correct / self._num_examples
