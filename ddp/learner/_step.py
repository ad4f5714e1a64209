"""How a shard of a batch becomes a loss: the model's ``train_step``/``valid_step`` (Burn's
``TrainStep``/``ValidStep``) or ``loss_fn(model(x), y)``; and the accuracy of its output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tensorlib import Tensor, nn

from ._outputs import TrainOutput

__all__ = ["LossFn", "check_steppable", "correct_count", "run_step"]

LossFn = Callable[[Any, Any], Tensor]


def check_steppable(model: nn.Module, loss_fn: LossFn | None) -> None:
    """Refuse, before training, a model that gives the learner no way to compute a loss.

    Raises:
        TypeError: without ``train_step`` and without ``loss_fn``, or a non-callable loss_fn.
    """
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"SupervisedTraining: loss_fn must be callable as loss_fn(output, targets), got "
            f"{type(loss_fn).__name__}"
        )
    if loss_fn is None and not callable(getattr(model, "train_step", None)):
        raise TypeError(
            f"SupervisedTraining: the model {type(model).__name__} has no train_step(batch) "
            "method and no loss_fn was given; define train_step (and valid_step) returning the "
            "loss or a TrainOutput, or pass loss_fn=fn for fn(model(x), y) on (x, y) batches"
        )


def run_step(
    module: nn.Module, forward: Callable[..., Any], shard: Any, loss_fn: LossFn | None, train: bool
) -> TrainOutput:
    """The shard's :class:`TrainOutput`.

    ``module`` is the model whose ``train_step``/``valid_step`` is called (validation falls
    back to ``loss_fn``, then to ``train_step``, when there is no ``valid_step``; a model's
    own step wins over ``loss_fn``); ``forward`` computes
    ``model(x)`` for the ``loss_fn`` path (a DDP wrapper's forward in DDP).

    Raises:
        TypeError: when a step returns something else than a Tensor or TrainOutput, or a
            ``loss_fn`` batch is not an ``(x, y)`` pair.
        ValueError: when the loss has more than one element.
    """
    step = _step_method(module, train, loss_fn is not None)
    if step is not None:
        out = step(shard)
        where = f"{type(module).__name__}.{step.__name__}"
    else:
        if loss_fn is None:
            raise TypeError(f"{type(module).__name__} has no train_step and no loss_fn was given")
        if not isinstance(shard, tuple | list) or len(shard) != 2:
            raise TypeError(
                f"with loss_fn a batch must be an (x, y) pair, got {type(shard).__name__}"
                + (f" of {len(shard)} items" if isinstance(shard, tuple | list) else "")
                + "; give the model a train_step(batch) for other batches"
            )
        x, y = shard
        output = forward(x)
        out = TrainOutput(loss_fn(output, y), output, y)
        where = "loss_fn"
    if isinstance(out, Tensor):
        out = TrainOutput(out)
    if not isinstance(out, TrainOutput) or not isinstance(out.loss, Tensor):
        raise TypeError(
            f"{where} must return the loss Tensor or a TrainOutput(loss, output, targets), got "
            f"{type(out).__name__}"
        )
    if out.loss.size != 1:
        raise ValueError(
            f"{where} returned a loss of shape {out.loss.shape}; expected one element (the "
            "mean over the batch)"
        )
    return out


def _step_method(module: nn.Module, train: bool, has_loss_fn: bool) -> Any:
    """``train_step`` in training; ``valid_step`` in validation, else ``train_step`` when
    there is no ``loss_fn`` to fall back on."""
    names = ["train_step"] if train else ["valid_step"] + ([] if has_loss_fn else ["train_step"])
    for name in names:
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def correct_count(out: TrainOutput) -> int | None:
    """Correct predictions when the output is class scores ``(n, classes)`` and the targets
    integer labels ``(n,)``; None otherwise."""
    output, targets = out.output, out.targets
    if not isinstance(output, Tensor) or not isinstance(targets, Tensor):
        return None
    if output.ndim != 2 or targets.ndim != 1 or output.shape[0] != targets.shape[0]:
        return None
    if np.dtype(targets.dtype).kind not in "iu" or np.dtype(output.dtype).kind != "f":
        return None
    pred = output.detach().argmax(axis=1).numpy()
    return int(np.count_nonzero(pred == targets.numpy()))
