"""Accuracy (Ignite's ``ignite.metrics.Accuracy``) and the input checks of the classification
metrics: binary, multiclass and multilabel inputs, told apart by their shapes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import tensorlib as tl

from ._metric import Metric, NotComputableError, reinit__is_reduced, sync_all_reduce, to_host

__all__ = ["Accuracy"]


def host_pair(output: Any, who: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(y_pred, y)`` as host NumPy arrays (one copy each from a GPU, none on the CPU).

    Raises:
        TypeError: when ``output`` is not a pair of Tensors/arrays.
    """
    if not isinstance(output, Sequence) or len(output) != 2:
        raise TypeError(f"{who}.update: output should be a pair (y_pred, y), got {output!r:.80}")
    return to_host(output[0], who, "y_pred"), to_host(output[1], who, "y")


def _binary_values(a: np.ndarray[Any, Any]) -> bool:
    # Ignite's test: x == x ** 2 holds exactly for 0 and 1 (and False/True).
    return bool(np.array_equal(a, a * a))


class _BaseClassification(Metric):
    """Shape and type checks shared by Accuracy, Precision and Recall.

    The input type is inferred from the shapes (Ignite's rule) and must stay the same
    between updates until the next reset:

    - binary: ``y_pred`` and ``y`` of shape ``(N, ...)`` (or ``y_pred`` ``(N, 1, ...)``)
      holding 0s and 1s;
    - multiclass: ``y_pred`` ``(N, C, ...)`` scores with ``C > 1``, ``y`` ``(N, ...)`` labels;
    - multilabel (``is_multilabel=True``): both ``(N, C, ...)`` with ``C > 1``, 0s and 1s.
    """

    def __init__(
        self,
        output_transform: Callable[[Any], Any] = lambda x: x,
        is_multilabel: bool = False,
        device: str | tl.Device = "cpu",
        skip_unrolling: bool = False,
    ) -> None:
        self._is_multilabel = is_multilabel
        self._type: str | None = None
        self._num_classes: int | None = None
        super().__init__(output_transform, device=device, skip_unrolling=skip_unrolling)

    def reset(self) -> None:
        """Forget the input type seen so far."""
        self._type = None
        self._num_classes = None

    def _check_shape(self, y_pred: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> None:
        if not (y.ndim == y_pred.ndim or y.ndim + 1 == y_pred.ndim):
            raise ValueError(
                "y must have shape of (batch_size, ...) and y_pred must have "
                "shape of (batch_size, num_categories, ...) or (batch_size, ...), "
                f"but given {y.shape} vs {y_pred.shape}."
            )
        pred_shape = y_pred.shape
        if y.ndim + 1 == y_pred.ndim:
            pred_shape = pred_shape[:1] + pred_shape[2:]
        if y.shape != pred_shape:
            raise ValueError(
                f"y and y_pred must have compatible shapes, but given {y.shape} vs {y_pred.shape}."
            )
        if self._is_multilabel and not (y.shape == y_pred.shape and y.ndim > 1 and y.shape[1] > 1):
            raise ValueError(
                "y and y_pred must have same shape of (batch_size, num_categories, ...) and "
                f"num_categories > 1, but given {y.shape} vs {y_pred.shape}."
            )

    @staticmethod
    def _check_binary_multilabel_cases(
        y_pred: np.ndarray[Any, Any], y: np.ndarray[Any, Any]
    ) -> None:
        if not _binary_values(y):
            raise ValueError("For binary cases, y must be comprised of 0's and 1's.")
        if not _binary_values(y_pred):
            raise ValueError("For binary cases, y_pred must be comprised of 0's and 1's.")

    def _check_type(self, y_pred: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> None:
        if y.ndim + 1 == y_pred.ndim:
            num_classes = int(y_pred.shape[1])
            if num_classes == 1:
                update_type = "binary"
                self._check_binary_multilabel_cases(y_pred, y)
            else:
                update_type = "multiclass"
        else:  # same number of dimensions (_check_shape ran first)
            self._check_binary_multilabel_cases(y_pred, y)
            if self._is_multilabel:
                update_type, num_classes = "multilabel", int(y_pred.shape[1])
            else:
                update_type, num_classes = "binary", 1
        if self._type is None:
            self._type, self._num_classes = update_type, num_classes
            return
        if self._type != update_type:
            raise RuntimeError(f"Input data type has changed from {self._type} to {update_type}.")
        if self._num_classes != num_classes:
            raise ValueError(
                f"Input data number of classes has changed from {self._num_classes} to "
                f"{num_classes}"
            )

    def _checked(self, output: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        y_pred, y = host_pair(output, type(self).__name__)
        self._check_shape(y_pred, y)
        self._check_type(y_pred, y)
        return y_pred, y


def rows_by_class(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``(N, C, ...)`` as ``(N * ..., C)``: one row per sample and position."""
    return np.moveaxis(a, 1, -1).reshape(-1, a.shape[1])


class Accuracy(_BaseClassification):
    """The fraction of correct predictions, exact across ranks (integer counts).

    - binary: ``y_pred`` of 0s and 1s equal to ``y``;
    - multiclass: ``argmax(y_pred, axis=1) == y``, per sample and position;
    - multilabel: a sample (and position) is correct when all its labels are.

    Args:
        output_transform: turns the engine's output into ``(y_pred, y)``.
        is_multilabel: read ``(N, C, ...)`` pairs as multilabel.
        device: where returned tensors go (this metric returns a float).
        skip_unrolling: see :class:`Metric`.

    Raises (from ``update``):
        ValueError: for incompatible shapes, values other than 0/1 where they must be, or
            a number of classes that changed since the last reset.
        RuntimeError: when the input type (binary/multiclass/multilabel) changed.
    """

    def __init__(
        self,
        output_transform: Callable[[Any], Any] = lambda x: x,
        is_multilabel: bool = False,
        device: str | tl.Device = "cpu",
        skip_unrolling: bool = False,
    ) -> None:
        super().__init__(output_transform, is_multilabel, device, skip_unrolling)

    @reinit__is_reduced
    def reset(self) -> None:
        """Zero the counts."""
        self._num_correct = 0
        self._num_examples = 0
        super().reset()

    @reinit__is_reduced
    def update(self, output: Sequence[Any]) -> None:
        """Count the correct predictions of one batch ``(y_pred, y)``."""
        y_pred, y = self._checked(output)
        if self._type == "binary":
            correct = y_pred.reshape(-1) == y.reshape(-1)
        elif self._type == "multiclass":
            correct = np.argmax(y_pred, axis=1).reshape(-1) == y.reshape(-1)
        else:
            correct = np.all(rows_by_class(y_pred) == rows_by_class(y), axis=-1)
        self._num_correct += int(np.count_nonzero(correct))
        self._num_examples += int(correct.shape[0])

    @sync_all_reduce("_num_examples", "_num_correct")
    def compute(self) -> float:
        """Correct / examples over every rank's updates since the last reset.

        Raises:
            NotComputableError: before any example.
        """
        if self._num_examples == 0:
            raise NotComputableError(
                "Accuracy must have at least one example before it can be computed."
            )
        return self._num_correct / self._num_examples
