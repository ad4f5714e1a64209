"""Precision and Recall (Ignite's ``ignite.metrics.Precision`` / ``Recall``), exact across
ranks: per-class counts are integers, only the ``'samples'`` average sums floats (float64)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import ddp.idist as idist
import tensorlib as tl

from ._accuracy import _BaseClassification, rows_by_class
from ._metric import NotComputableError, all_reduce_copy, reinit__is_reduced

__all__ = ["Precision", "Recall"]

_AVERAGES = ("macro", "micro", "weighted", "samples")
_TYPE_CODES = {None: 0, "binary": 1, "multiclass": 2, "multilabel": 3}
_TYPE_NAMES = {code: name for name, code in _TYPE_CODES.items()}
_Counts = tuple[Any, Any, Any]


class _BasePrecisionRecall(_BaseClassification):
    """What Precision and Recall share: the averages, the counting, the reduction.

    Subclasses say which count is the denominator (:attr:`_positives`: ``"pred"`` for
    precision, ``"true"`` for recall).
    """

    _positives = "pred"

    def __init__(
        self,
        output_transform: Callable[[Any], Any] = lambda x: x,
        average: bool | str | None = False,
        is_multilabel: bool = False,
        device: str | tl.Device = "cpu",
        skip_unrolling: bool = False,
    ) -> None:
        if not (average is None or isinstance(average, bool) or average in _AVERAGES):
            raise ValueError(
                "Argument average should be None or a boolean or one of values "
                f"'macro', 'micro', 'weighted' and 'samples', got {average!r}."
            )
        self._average: bool | str | None = "macro" if average is True else average
        self.eps = 1e-20
        self._updated = False
        super().__init__(output_transform, is_multilabel, device, skip_unrolling)

    @reinit__is_reduced
    def reset(self) -> None:
        """Zero the counts (per-class arrays are made at the first update)."""
        # The scalar kinds are typed from the start so that every rank reduces the same type.
        self._numerator: Any = 0.0 if self._average == "samples" else 0
        self._denominator: Any = 0
        self._weight: Any = 0
        self._updated = False
        super().reset()

    def _check_type(self, y_pred: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> None:
        super()._check_type(y_pred, y)
        if self._type in ("binary", "multiclass") and self._average == "samples":
            raise ValueError(
                "Argument average='samples' is incompatible with binary and multiclass input data."
            )
        if self._type == "multiclass" and y.dtype != np.int64:
            warnings.warn(
                "`y` should be of dtype long when entry type is multiclass",
                RuntimeWarning,
                stacklevel=4,
            )
        if (
            self._type == "binary"
            and self._average is not False
            and (y.dtype != np.int64 or y_pred.dtype != np.int64)
        ):
            warnings.warn(
                "`y` and `y_pred` should be of dtype long when entry type is binary and "
                "average!=False",
                RuntimeWarning,
                stacklevel=4,
            )

    def _class_counts(self, y_pred: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> _Counts:
        """(true positives, predicted positives, actual positives) per class, int64; 0-d for
        binary input without an average."""
        if self._type == "multilabel":
            pred = rows_by_class(y_pred) != 0
            true = rows_by_class(y) != 0
            tp = np.count_nonzero(pred & true, axis=0)
            return tp, np.count_nonzero(pred, axis=0), np.count_nonzero(true, axis=0)
        if self._type == "binary" and self._average is False:
            pred, true = y_pred.reshape(-1) != 0, y.reshape(-1) != 0
            tp = np.count_nonzero(pred & true)
            return np.int64(tp), np.int64(np.count_nonzero(pred)), np.int64(np.count_nonzero(true))
        num_classes = 2 if self._type == "binary" else int(y_pred.shape[1])
        labels = y.reshape(-1).astype(np.int64)
        if labels.size and (labels.min() < 0 or labels.max() + 1 > num_classes):
            bad = int(labels.min()) if labels.min() < 0 else int(labels.max()) + 1
            raise ValueError(
                "y_pred contains fewer classes than y. Number of classes in the prediction is "
                f"{num_classes} and an element in y has invalid class = {bad}."
            )
        if self._type == "multiclass":
            pred = np.argmax(y_pred, axis=1).reshape(-1)
        else:
            pred = y_pred.reshape(-1).astype(np.int64)
        tp = np.bincount(labels[pred == labels], minlength=num_classes)
        predicted = np.bincount(pred, minlength=num_classes)
        return tp, predicted, np.bincount(labels, minlength=num_classes)

    @reinit__is_reduced
    def update(self, output: Sequence[Any]) -> None:
        """Add one batch ``(y_pred, y)`` to the counts."""
        y_pred, y = self._checked(output)
        if self._average == "samples":  # multilabel only (checked): per-sample ratios
            pred = rows_by_class(y_pred) != 0
            true = rows_by_class(y) != 0
            tp = np.count_nonzero(pred & true, axis=1).astype(np.float64)
            pos = np.count_nonzero(pred if self._positives == "pred" else true, axis=1)
            self._numerator += float(np.sum(tp / (pos + self.eps)))
            self._denominator += int(tp.shape[0])
        else:
            tp, predicted, actual = self._class_counts(y_pred, y)
            pos = predicted if self._positives == "pred" else actual
            if self._average == "micro":
                self._numerator += int(tp.sum())
                self._denominator += int(pos.sum())
            else:
                self._numerator = self._numerator + tp
                self._denominator = self._denominator + pos
                if self._average == "weighted":
                    self._weight = self._weight + actual
        self._updated = True

    def _count_shape(self, kind: str, num_classes: int) -> tuple[int, ...]:
        """The shape of the per-class counts for input of ``kind``."""
        if kind == "binary":
            return () if self._average is False else (2,)
        return (num_classes,)

    def _reduced(self) -> tuple[bool, Any, Any, Any]:
        """(updated anywhere, numerator, denominator, weight) summed over the ranks; the
        local state is left as it is. A rank without updates adds zeros of the right shape."""
        if idist.get_world_size() <= 1:
            return self._updated, self._numerator, self._denominator, self._weight
        mine = np.array(
            [int(self._updated), _TYPE_CODES[self._type], self._num_classes or 0], np.int64
        )
        seen = np.asarray(idist.all_gather(mine)).reshape(-1, 3)
        seen = seen[seen[:, 0] == 1]
        if len(seen) == 0:
            return False, None, None, None
        if not (seen[:, 1:] == seen[0, 1:]).all():
            kinds = sorted({(str(_TYPE_NAMES[int(t)]), int(c)) for _, t, c in seen})
            raise ValueError(
                f"{type(self).__name__}: the ranks saw different input types or numbers of "
                f"classes (type, classes): {kinds}; every rank must see the same kind of data"
            )
        num, den, weight = self._numerator, self._denominator, self._weight
        if not self._updated and self._average not in ("micro", "samples"):
            kind = str(_TYPE_NAMES[int(seen[0, 1])])
            zeros = np.zeros(self._count_shape(kind, int(seen[0, 2])), np.int64)
            num, den, weight = zeros, zeros, zeros
        num, den = all_reduce_copy(np.asarray(num)), all_reduce_copy(np.asarray(den))
        if self._average == "weighted":
            weight = all_reduce_copy(np.asarray(weight))
        return True, num, den, weight

    def compute(self) -> tl.Tensor | float:
        """The metric over every rank's updates since the last reset.

        Returns:
            a float for ``'macro'``, ``'micro'``, ``'weighted'`` and ``'samples'``; without
            an average, a float64 tensor (one value per class, or 0-d for binary input).

        Raises:
            NotComputableError: when no rank has updated since the last reset.
            ValueError: when the ranks saw different kinds of input.
        """
        updated, num, den, weight = self._reduced()
        if not updated:
            raise NotComputableError(
                f"{type(self).__name__} must have at least one example before it can be computed."
            )
        eps = 0.0 if self._average == "samples" else self.eps
        fraction = np.asarray(num, np.float64) / (np.asarray(den, np.float64) + eps)
        if self._average == "weighted":
            w = np.asarray(weight, np.float64)
            return float((fraction @ w) / (w.sum() + self.eps))
        if self._average in ("micro", "samples"):
            return float(fraction)
        if self._average == "macro":
            return float(fraction.mean())
        return self._tensor(fraction)


class Precision(_BasePrecisionRecall):
    """Precision, ``TP / (TP + FP)``, of binary, multiclass or multilabel input.

    Args:
        output_transform: turns the engine's output into ``(y_pred, y)``.
        average: ``False``/``None``: one value per class (a tensor; binary input without an
            average gives one 0-d value); ``True``/``'macro'``: their mean; ``'micro'``:
            from the counts summed over classes; ``'weighted'``: the mean weighted by each
            class's actual count; ``'samples'`` (multilabel): the mean of per-sample values.
        is_multilabel: read ``(N, C, ...)`` pairs as multilabel.
        device: where the returned tensor goes.
        skip_unrolling: see :class:`Metric`.

    Raises:
        ValueError: for an unknown ``average``; from ``update``, for bad shapes or labels
            (see :class:`Accuracy`), and ``'samples'`` with binary or multiclass input.
    """

    _positives = "pred"


class Recall(_BasePrecisionRecall):
    """Recall, ``TP / (TP + FN)``, of binary, multiclass or multilabel input.

    Args and errors are those of :class:`Precision`; the ``'samples'`` average is the mean
    of the per-sample recalls.
    """

    _positives = "true"
