"""``Learner`` and ``SupervisedTraining``: Burn's training front door over a strategy.

::

    strategy = ExecutionStrategy.ddp(tl.Device.enumerate("cpu"))
    model = make_model().to(strategy.main_device())
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    result = (
        SupervisedTraining("runs/exp1", train_loader, valid_loader, loss_fn=F.cross_entropy)
        .with_training_strategy(strategy)
        .num_epochs(10)
        .launch(Learner(model, opt, lr_scheduler))
    )
    result.model, result.valid_accuracy
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tensorlib import nn
from tensorlib.optim import Optimizer

from ._loop import Plan
from ._outputs import TrainingResult
from ._step import LossFn, check_steppable
from ._strategy import ExecutionStrategy

__all__ = ["Learner", "SupervisedTraining"]


class Learner:
    """The model, its optimizer and an optional lr scheduler (Burn's ``Learner::new``).

    Args:
        model: the model (a ``tensorlib.nn.Module``), built on the strategy's main device
            (it is moved there at launch when it is elsewhere).
        optimizer: an optimizer over the model's parameters.
        lr_scheduler: a scheduler of ``optimizer`` (``tensorlib.optim.lr_scheduler``), or
            anything with ``step()``, ``state_dict()`` and ``load_state_dict()``; it steps
            once per optimizer step.

    Raises:
        TypeError: for a model that is not an ``nn.Module``, an optimizer that is not a
            tensorlib Optimizer, a scheduler without those methods, or an optimizer holding a
            tensor that is not one of the model's parameters.
    """

    def __init__(self, model: nn.Module, optimizer: Optimizer, lr_scheduler: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Learner: model must be a tensorlib nn.Module, got {type(model)!r}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"Learner: optimizer must be a tensorlib.optim.Optimizer, got {type(optimizer)!r}"
            )
        if lr_scheduler is not None and not all(
            callable(getattr(lr_scheduler, m, None))
            for m in ("step", "state_dict", "load_state_dict")
        ):
            raise TypeError(
                "Learner: lr_scheduler must have step(), state_dict() and load_state_dict() "
                f"(a tensorlib.optim.lr_scheduler scheduler), got {type(lr_scheduler).__name__}"
            )
        owned = {id(p) for p in model.parameters()}
        strays = [
            i
            for g in optimizer.param_groups
            for i, p in enumerate(g["params"])
            if id(p) not in owned
        ]
        if strays:
            raise TypeError(
                f"Learner: the optimizer holds {len(strays)} tensor(s) that are not parameters "
                "of the model; build it from model.parameters()"
            )
        if (
            lr_scheduler is not None
            and getattr(lr_scheduler, "optimizer", optimizer) is not optimizer
        ):
            raise TypeError("Learner: lr_scheduler was built on another optimizer than this one")
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler


class SupervisedTraining:
    """A training run's settings (Burn's ``SupervisedTraining``), then :meth:`launch`.

    Each epoch trains on every batch of ``train_loader`` (one optimizer step and one
    lr_scheduler step per batch), validates on ``valid_loader``, writes an atomic checkpoint
    (model, optimizer, scheduler, epoch, step, random generators, the figures so far) to
    ``artifact_dir/checkpoint.npz``, and reports. Launching again with the same
    ``artifact_dir`` resumes after the last completed epoch, ending with the same parameters,
    bit for bit, as a run that was never interrupted (same strategy).

    A batch is a Tensor or array, or a tuple, list or dict of them sharing a first dimension;
    each global batch is split across the strategy's devices in contiguous shards (the first
    ``n % k`` one sample larger), so every strategy sees the same global batches. A training
    batch needs at least one sample per device. The loss must be the mean over the batch's
    samples: shards are weighted by their share of the batch, so ``multi_device`` and ``ddp``
    with Mean reproduce one device's gradient for any batch size.

    Args:
        artifact_dir: directory of the checkpoint (made when missing).
        train_loader: training batches, re-iterable (a list, a ``ddp.DataLoader``: its
            ``set_epoch(epoch)`` is called before each epoch).
        valid_loader: validation batches, or None.
        loss_fn: ``loss_fn(model(x), y)`` for ``(x, y)`` batches; None when the model has
            ``train_step(batch)`` (and ``valid_step(batch)``), returning the loss or a
            :class:`~ddp.learner.TrainOutput`.

    Raises:
        TypeError: a loader that is not iterable, or a loss_fn that is not callable.
    """

    def __init__(
        self,
        artifact_dir: str | os.PathLike[str],
        train_loader: Iterable[Any],
        valid_loader: Iterable[Any] | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        for name, loader in (("train_loader", train_loader), ("valid_loader", valid_loader)):
            if loader is None and name == "valid_loader":
                continue
            if not isinstance(loader, Iterable):
                raise TypeError(
                    f"SupervisedTraining: {name} must be an iterable of batches (a list, a "
                    f"ddp.DataLoader), got {type(loader).__name__}"
                )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"SupervisedTraining: loss_fn must be callable, got {type(loss_fn).__name__}"
            )
        self.artifact_dir = Path(os.fspath(artifact_dir))
        self.train_loader = train_loader
        self.valid_loader = valid_loader
        self.loss_fn = loss_fn
        self._strategy: ExecutionStrategy | None = None
        self._epochs = 1
        self._progress = True
        self._resume = True

    def with_training_strategy(self, strategy: ExecutionStrategy) -> SupervisedTraining:
        """Train with ``strategy`` (default: single_device on the model's device).

        Raises:
            TypeError: when ``strategy`` is not an ExecutionStrategy.
        """
        if not isinstance(strategy, ExecutionStrategy):
            raise TypeError(
                "SupervisedTraining.with_training_strategy: expected an ExecutionStrategy "
                f"(ExecutionStrategy.single_device/ddp/multi_device), got {type(strategy).__name__}"
            )
        self._strategy = strategy
        return self

    def num_epochs(self, epochs: int) -> SupervisedTraining:
        """The epochs the run has when it ends (resumed ones included; default 1).

        Raises:
            ValueError: when ``epochs`` is not a positive int.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"SupervisedTraining.num_epochs: expected an int >= 1, got {epochs!r}")
        self._epochs = epochs
        return self

    def with_progress(self, enabled: bool = True) -> SupervisedTraining:
        """Show a tqdm bar (where installed) and a line per epoch; False: quiet."""
        self._progress = bool(enabled)
        return self

    def with_resume(self, enabled: bool = True) -> SupervisedTraining:
        """Resume from ``artifact_dir``'s checkpoint (default); False starts over and
        overwrites it."""
        self._resume = bool(enabled)
        return self

    def launch(self, learner: Learner) -> TrainingResult:
        """Train ``learner``'s model; return it trained, with the per-epoch figures.

        Raises:
            TypeError: when ``learner`` is not a Learner, or the model has neither
                ``train_step`` nor a ``loss_fn``.
            ValueError: a batch that cannot be split across the devices, an empty train
                loader, or a checkpoint holding more epochs than asked for.
        """
        if not isinstance(learner, Learner):
            raise TypeError(
                f"SupervisedTraining.launch: expected a Learner(model, optimizer, lr_scheduler), "
                f"got {type(learner).__name__}"
            )
        model, optimizer = learner.model, learner.optimizer
        check_steppable(model, self.loss_fn)
        strategy = self._strategy
        if strategy is None:
            first = next(iter(model.parameters()), None)
            strategy = ExecutionStrategy.single_device(first.device if first is not None else "cpu")
        _place(model, optimizer, strategy.main_device())
        self.artifact_dir.mkdir(parents=True, exist_ok=True)
        plan = Plan(
            self.artifact_dir, self.train_loader, self.valid_loader, self.loss_fn,
            self._epochs, self._progress, self._resume,
        )  # fmt: skip
        history, resumed = strategy.run(plan, model, optimizer, learner.lr_scheduler)
        return TrainingResult(model, history, resumed, plan.checkpoint)


def _place(model: nn.Module, optimizer: Optimizer, device: Any) -> None:
    """Move the model (and its optimizer's state) to ``device`` when it is elsewhere."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device is device for t in tensors):
        return
    state = optimizer.state_dict()
    model.to(device)
    optimizer.load_state_dict(state)  # the state follows each parameter to its device
