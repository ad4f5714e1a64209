"""ConfusionMatrix (Ignite's ``ignite.metrics.ConfusionMatrix``): an int64 count matrix,
exact across ranks; its normalized forms are computed from a reduced copy, never stored."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import tensorlib as tl

from ._accuracy import host_pair
from ._metric import Metric, NotComputableError, reinit__is_reduced, sync_all_reduce

__all__ = ["ConfusionMatrix"]

_AVERAGES = ("samples", "recall", "precision")


class ConfusionMatrix(Metric):
    """Counts of (true class, predicted class) pairs for multiclass input.

    ``y_pred`` holds scores ``(N, C, ...)`` (the prediction is their argmax over axis 1),
    ``y`` integer labels ``(N, ...)``; labels outside ``[0, C)`` (an ignore index such as
    -1 or 255) are left out. Rows are true classes, columns predicted ones.

    Args:
        num_classes: ``C``, more than 1.
        average: None: the int64 counts; ``'samples'``: the counts divided by the number of
            samples (``N`` summed over the batches, Ignite's rule); ``'recall'``: each row
            divided by its sum; ``'precision'``: each column divided by its sum (float64).
        output_transform: turns the engine's output into ``(y_pred, y)``.
        device: where the returned tensor goes.
        skip_unrolling: see :class:`Metric` (True by default here, as in Ignite).

    Raises:
        ValueError: for an unknown ``average`` or ``num_classes < 2``.
    """

    def __init__(
        self,
        num_classes: int,
        average: str | None = None,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | tl.Device = "cpu",
        skip_unrolling: bool = True,
    ) -> None:
        if average is not None and average not in _AVERAGES:
            raise ValueError(
                f"Argument average can None or one of 'samples', 'recall', 'precision', got "
                f"{average!r}"
            )
        if not isinstance(num_classes, numbers.Integral) or isinstance(num_classes, bool):
            raise TypeError(f"Argument num_classes should be an int, got {num_classes!r}")
        if num_classes <= 1:
            raise ValueError(f"Argument num_classes needs to be > 1, got {num_classes}")
        self.num_classes: int = int(num_classes)
        self.average: str | None = average
        super().__init__(output_transform, device=device, skip_unrolling=skip_unrolling)

    @reinit__is_reduced
    def reset(self) -> None:
        """Zero the counts."""
        self.confusion_matrix = np.zeros((self.num_classes, self.num_classes), np.int64)
        self._num_examples = 0

    def _check_shape(self, y_pred: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> None:
        c = self.num_classes
        if y_pred.ndim < 2:
            raise ValueError(
                f"y_pred must have shape (batch_size, num_classes (currently set to {c}), ...), "
                f"but given {y_pred.shape}"
            )
        if y_pred.shape[1] != c:
            raise ValueError(
                f"y_pred does not have correct number of classes: {y_pred.shape[1]} vs {c}"
            )
        if y.ndim + 1 != y_pred.ndim:
            raise ValueError(
                f"y_pred must have shape (batch_size, num_classes (currently set to {c}), ...) "
                f"and y must have shape of (batch_size, ...), but given {y.shape} vs "
                f"{y_pred.shape}."
            )
        if y.shape != y_pred.shape[:1] + y_pred.shape[2:]:
            raise ValueError(
                f"y and y_pred must have compatible shapes, but given {y.shape} vs {y_pred.shape}."
            )
        if not (np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_):
            raise TypeError(f"y must hold integer class labels, got dtype {y.dtype}")

    @reinit__is_reduced
    def update(self, output: Sequence[Any]) -> None:
        """Count the (label, argmax) pairs of one batch ``(y_pred, y)``."""
        y_pred, y = host_pair(output, "ConfusionMatrix")
        self._check_shape(y_pred, y)
        c = self.num_classes
        pred = np.argmax(y_pred, axis=1).reshape(-1)
        true = y.reshape(-1).astype(np.int64)
        keep = (true >= 0) & (true < c)
        counts = np.bincount(c * true[keep] + pred[keep], minlength=c * c)
        self.confusion_matrix += counts.reshape(c, c)
        self._num_examples += int(y_pred.shape[0])

    @sync_all_reduce("confusion_matrix", "_num_examples")
    def compute(self) -> tl.Tensor:
        """The matrix over every rank's updates since the last reset (an int64 tensor, or
        float64 with an ``average``); the local counts are not changed.

        Raises:
            NotComputableError: before any example.
        """
        if self._num_examples == 0:
            raise NotComputableError(
                "Confusion matrix must have at least one example before it can be computed."
            )
        if not self.average:
            return self._tensor(self.confusion_matrix)
        matrix = self.confusion_matrix.astype(np.float64)
        if self.average == "samples":
            return self._tensor(matrix / self._num_examples)
        return self._tensor(self.normalize(matrix, self.average))

    @staticmethod
    def normalize(matrix: np.ndarray[Any, Any], average: str) -> np.ndarray[Any, Any]:
        """``matrix`` with each row (``'recall'``) or column (``'precision'``) divided by its
        sum (plus 1e-15, so an empty row or column stays 0).

        Raises:
            ValueError: for another ``average``.
        """
        if average == "recall":
            return matrix / (matrix.sum(axis=1)[:, None] + 1e-15)
        if average == "precision":
            return matrix / (matrix.sum(axis=0) + 1e-15)
        raise ValueError(
            f"Argument average should be one of 'samples', 'recall', 'precision', got {average!r}"
        )
