"""What a step returns (:class:`TrainOutput`) and what a run returns (:class:`TrainingResult`).

Burn's ``TrainStep``/``ValidStep`` return a ``TrainOutput`` holding the loss and, for metrics,
the model's output and the targets; here ``train_step``/``valid_step`` return the loss Tensor
or a :class:`TrainOutput`. Per-epoch figures are kept as sums (:class:`Tally`) so that the
shards of a batch, on one device or on many, add up to the same epoch means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorlib import Tensor, nn

__all__ = ["EpochMetrics", "Tally", "TrainOutput", "TrainingResult"]


@dataclass
class TrainOutput:
    """A step's result: the loss, and optionally the output and targets for accuracy.

    Attributes:
        loss: the loss Tensor (one element), the mean over the batch's samples: the
            strategies weight each device's shard by its share of the global batch, which
            reproduces one device's gradient only for a mean.
        output: the model's output (class scores ``(n, classes)`` give accuracy), or None.
        targets: the targets (integer labels ``(n,)`` give accuracy), or None.
    """

    loss: Tensor
    output: Tensor | None = None
    targets: Tensor | None = None


@dataclass
class Tally:
    """Sums over the samples one worker saw in one phase of an epoch.

    Attributes:
        loss_sum: the sum of each shard's mean loss times its samples.
        samples: the samples seen.
        correct: the correctly classified samples (of those with class scores and labels).
        scored: the samples accuracy could be computed for.
    """

    loss_sum: float = 0.0
    samples: int = 0
    correct: int = 0
    scored: int = 0

    def add(self, loss: float, samples: int, correct: int | None) -> None:
        """Count one shard: its mean loss, its samples, its correct predictions (or None)."""
        self.loss_sum += loss * samples
        self.samples += samples
        if correct is not None:
            self.correct += correct
            self.scored += samples

    def as_list(self) -> list[float]:
        """``[loss_sum, samples, correct, scored]`` (what ranks exchange)."""
        return [self.loss_sum, float(self.samples), float(self.correct), float(self.scored)]

    @classmethod
    def total(cls, parts: list[list[float]]) -> Tally:
        """The sum of :meth:`as_list` values, in the order given."""
        out = cls()
        for loss_sum, samples, correct, scored in parts:
            out.loss_sum += loss_sum
            out.samples += int(samples)
            out.correct += int(correct)
            out.scored += int(scored)
        return out

    def loss(self) -> float | None:
        """The mean loss per sample, or None when no sample was seen."""
        return self.loss_sum / self.samples if self.samples else None

    def accuracy(self) -> float | None:
        """The share of correct predictions, or None when no output had class scores."""
        return self.correct / self.scored if self.scored else None


@dataclass
class EpochMetrics:
    """One epoch's figures (means over the epoch's samples).

    Attributes:
        epoch: the epoch's number, from 1.
        train_loss: the mean training loss (as the batches were seen, before each step).
        train_accuracy: the training accuracy, or None without class scores and labels.
        valid_loss: the mean validation loss after the epoch, or None without a valid loader.
        valid_accuracy: the validation accuracy, or None.
        seconds: the epoch's wall time for training and validation (the checkpoint after
            it is not counted: its figure is part of what it writes).
    """

    epoch: int
    train_loss: float | None
    train_accuracy: float | None
    valid_loss: float | None
    valid_accuracy: float | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """The figures as a dict of numbers and None (what the checkpoint stores)."""
        return {
            "epoch": self.epoch,
            "train_loss": self.train_loss,
            "train_accuracy": self.train_accuracy,
            "valid_loss": self.valid_loss,
            "valid_accuracy": self.valid_accuracy,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpochMetrics:
        """The inverse of :meth:`to_dict` (numbers stored as 0-d arrays come back as floats)."""

        def num(v: Any) -> float | None:
            return None if v is None else float(v)

        return cls(
            epoch=int(d["epoch"]),
            train_loss=num(d.get("train_loss")),
            train_accuracy=num(d.get("train_accuracy")),
            valid_loss=num(d.get("valid_loss")),
            valid_accuracy=num(d.get("valid_accuracy")),
            seconds=float(d.get("seconds") or 0.0),
        )

    def describe(self, num_epochs: int) -> str:
        """``epoch 2/5  train loss 0.4120 acc 87.50%  valid loss ...  1.23 s``."""
        parts = [f"epoch {self.epoch}/{num_epochs}"]
        for name, loss, acc in (
            ("train", self.train_loss, self.train_accuracy),
            ("valid", self.valid_loss, self.valid_accuracy),
        ):
            if loss is None:
                continue
            text = f"{name} loss {loss:.4f}"
            if acc is not None:
                text += f" acc {100 * acc:.2f}%"
            parts.append(text)
        parts.append(f"{self.seconds:.2f} s")
        return "  ".join(parts)


@dataclass
class TrainingResult:
    """What :meth:`SupervisedTraining.launch` returns.

    Attributes:
        model: the trained model (the one given to the Learner, on the main device).
        history: one :class:`EpochMetrics` per completed epoch, resumed ones included.
        resumed_from: the epochs a checkpoint already held when the launch started (0: none).
        checkpoint: the checkpoint file in the artifact directory.
    """

    model: nn.Module
    history: list[EpochMetrics] = field(default_factory=list)
    resumed_from: int = 0
    checkpoint: Path | None = None

    @property
    def train_loss(self) -> list[float | None]:
        """The training loss of each epoch."""
        return [m.train_loss for m in self.history]

    @property
    def valid_loss(self) -> list[float | None]:
        """The validation loss of each epoch."""
        return [m.valid_loss for m in self.history]

    @property
    def train_accuracy(self) -> list[float | None]:
        """The training accuracy of each epoch."""
        return [m.train_accuracy for m in self.history]

    @property
    def valid_accuracy(self) -> list[float | None]:
        """The validation accuracy of each epoch."""
        return [m.valid_accuracy for m in self.history]
