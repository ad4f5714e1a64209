"""The epoch loop every strategy runs, over a :class:`Worker` that knows the devices.

Burn's learner never branches on its strategy; here neither does :func:`run_epochs`: it
resumes from the artifact directory's checkpoint, runs each epoch's training and validation
batches through the worker, combines the figures, writes the checkpoint and reports. A
worker runs a global batch on its devices (one device, several from one thread, or one DDP
rank's share) and holds the model, optimizer and scheduler it steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensorlib as tl
from tensorlib import nn, optim

from .._checkpoint import load_checkpoint, save_checkpoint
from ._batches import batch_size
from ._outputs import EpochMetrics, Tally
from ._progress import Progress
from ._step import LossFn

__all__ = ["CHECKPOINT_NAME", "Plan", "Worker", "check_train_batch", "run_epochs"]

CHECKPOINT_NAME = "checkpoint.npz"


@dataclass
class Plan:
    """What :class:`~ddp.learner.SupervisedTraining` asks for, checked.

    Attributes:
        artifact_dir: where the checkpoint is written.
        train_loader: the training batches (re-iterable, one pass per epoch).
        valid_loader: the validation batches, or None.
        loss_fn: ``fn(model(x), y)``, or None when the model has ``train_step``.
        num_epochs: the epochs the run should have when it ends.
        progress: show progress (the main worker only).
        resume: continue from the checkpoint when there is one.
    """

    artifact_dir: Path
    train_loader: Iterable[Any]
    valid_loader: Iterable[Any] | None
    loss_fn: LossFn | None
    num_epochs: int
    progress: bool
    resume: bool

    @property
    def checkpoint(self) -> Path:
        """The checkpoint file."""
        return self.artifact_dir / CHECKPOINT_NAME


def check_train_batch(batch: Any, devices: int, epoch: int, index: int) -> int:
    """The batch's sample count; a training batch needs a sample for every device.

    Raises:
        ValueError: fewer samples than devices (or a batch that cannot be split).
    """
    try:
        n = batch_size(batch)
    except ValueError as exc:
        raise ValueError(f"training batch {index} of epoch {epoch + 1}: {exc}") from None
    if n < devices:
        raise ValueError(
            f"training batch {index} of epoch {epoch + 1} has {n} sample(s), fewer than the "
            f"strategy's {devices} devices; every device needs at least one (use a batch "
            f"size of at least {devices}, or drop_last=True for a smaller last batch)"
        )
    return n


class Worker:
    """What :func:`run_epochs` drives; subclasses run batches on their devices.

    Attributes:
        module: the model this worker trains (a replica in DDP).
        optimizer: the optimizer whose state is checkpointed.
        scheduler: the lr scheduler, or None.
        is_main: whether this worker reports progress (DDP: rank 0).
        steps: optimizer steps taken.
    """

    module: nn.Module
    optimizer: optim.Optimizer
    scheduler: Any
    is_main: bool = True
    steps: int = 0

    def batches(
        self, loader: Iterable[Any], epoch: int, phase: str, progress: Progress
    ) -> Iterator[Any]:
        """This epoch's batches of ``loader`` (the main worker sets a loader's epoch)."""
        if phase == "train" and callable(getattr(loader, "set_epoch", None)):
            loader.set_epoch(epoch)  # type: ignore[attr-defined]
        return progress.batches(loader, epoch, phase)

    def train_batch(self, batch: Any, epoch: int, index: int, tally: Tally) -> None:
        """One optimizer step on ``batch``; its figures added to ``tally``."""
        raise NotImplementedError

    def valid_batch(self, batch: Any, tally: Tally) -> None:
        """``batch``'s validation figures added to ``tally`` (no gradients)."""
        raise NotImplementedError

    def combine(self, tallies: list[Tally]) -> list[Tally]:
        """The tallies summed over every worker of the run (one worker: as they are)."""
        return tallies

    def set_mode(self, train: bool) -> None:
        """Training or evaluation mode on the model(s)."""
        self.module.train(train)

    def before_save(self) -> None:
        """Bring the state the checkpoint holds up to date (a sharded optimizer's)."""

    def after_load(self) -> None:
        """Spread what :meth:`load` put into the main objects to the other devices."""

    def save(self, path: Path, epoch: int, extra: dict[str, Any]) -> None:
        """Write the checkpoint (atomic; in DDP every rank calls it, rank 0 writes)."""
        self.before_save()
        save_checkpoint(
            path,
            self.module,
            self.optimizer,
            step=self.steps,
            extra=extra,
            scheduler=self.scheduler,
            epoch=epoch,
        )

    def load(self, path: Path) -> dict[str, Any]:
        """Load the checkpoint into this worker's objects, random generators included."""
        info = load_checkpoint(
            path, self.module, self.optimizer, scheduler=self.scheduler, rng=True
        )
        self.steps = int(info["step"])
        self.after_load()
        return info


def _resume(worker: Worker, plan: Plan, progress: Progress) -> list[EpochMetrics]:
    """The history of the epochs the checkpoint holds (loaded into the worker), or []."""
    path = plan.checkpoint
    if not plan.resume or not path.is_file():
        return []
    info = worker.load(path)
    extra = info.get("extra") or {}
    history = [EpochMetrics.from_dict(d) for d in extra.get("history", [])]
    done = int(info["epoch"])
    if done > plan.num_epochs:
        raise ValueError(
            f"SupervisedTraining: {path} holds a run of {done} epochs, more than "
            f"num_epochs({plan.num_epochs}); ask for at least {done} epochs, use another "
            "artifact_dir, or with_resume(False) to start over"
        )
    progress.note(f"resuming from {path} after epoch {done}")
    return history[:done]


def run_epochs(worker: Worker, plan: Plan) -> tuple[list[EpochMetrics], int]:
    """Resume, then train and validate each remaining epoch, checkpointing after each.

    Returns:
        The history of every completed epoch, and how many a checkpoint already held.

    Raises:
        ValueError: the train loader yields no batch in an epoch, a batch cannot be split
            across the devices, or the checkpoint holds more epochs than asked for.
    """
    progress = Progress(plan.progress and worker.is_main, plan.num_epochs)
    history = _resume(worker, plan, progress)
    resumed = len(history)
    for epoch in range(resumed, plan.num_epochs):
        start = time.perf_counter()
        worker.set_mode(True)
        train = Tally()
        for index, batch in enumerate(worker.batches(plan.train_loader, epoch, "train", progress)):
            worker.train_batch(batch, epoch, index, train)
        valid = Tally()
        if plan.valid_loader is not None:
            worker.set_mode(False)
            with tl.no_grad():
                for batch in worker.batches(plan.valid_loader, epoch, "valid", progress):
                    worker.valid_batch(batch, valid)
            worker.set_mode(True)
        train, valid = worker.combine([train, valid])
        if train.samples == 0:
            raise ValueError(
                f"SupervisedTraining: the train loader yielded no batch in epoch {epoch + 1}; "
                "it must be re-iterable (a list, a ddp.DataLoader), not a one-shot iterator"
            )
        metrics = EpochMetrics(
            epoch + 1, train.loss(), train.accuracy(), valid.loss(), valid.accuracy(), 0.0
        )
        metrics.seconds = time.perf_counter() - start
        history.append(metrics)
        worker.save(plan.checkpoint, epoch + 1, {"history": [m.to_dict() for m in history]})
        progress.epoch_done(metrics)
    return history, resumed
