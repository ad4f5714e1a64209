"""Rank bodies for ``ddp.engine`` at every world size: an evaluation over the digits set and a
short DDP training, each returning what the test compares with one process.

They run on every rank of a pool (tests/ddp/conftest.py) or alone in the test process.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import ddp.idist as idist
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import create_supervised_evaluator, create_supervised_trainer
from ddp.metrics import Accuracy, Loss
from tensorlib import nn, optim

DIGITS = 1797  # samples in scikit-learn's digits set: no world size 2-4 divides it


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return ((x - 8.0) / 8.0).astype(np.float32), y.astype(np.int64)


def _model() -> nn.Module:
    tl.manual_seed(0)  # the same weights on every rank (DDP would broadcast them anyway)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def evaluate(batch_size: int, shuffle: bool = False) -> dict[str, Any]:
    """Accuracy and loss of an untrained model over the whole digits set, through
    ``auto_dataloader(..., shuffle=False)`` and ``create_supervised_evaluator``."""
    x, y = _digits()
    model = idist.auto_model(_model())
    loader = idist.auto_dataloader((x, y), batch_size=batch_size, shuffle=shuffle)
    acc, loss = Accuracy(), Loss(F.cross_entropy)
    evaluator = create_supervised_evaluator(model, metrics={"acc": acc, "loss": loss})
    state = evaluator.run(loader)
    return {
        "acc": state.metrics["acc"],
        "loss": state.metrics["loss"],
        "local_samples": loader.num_samples if loader.sampler is None else len(loader.sampler),  # type: ignore[arg-type]
        "batches": state.iteration,
    }


def train(batch_size: int, epochs: int) -> list[Any]:
    """A few epochs of ``create_supervised_trainer`` under DDP on even shuffled shards; the
    final parameters (the same global batches at every world size)."""
    x, y = _digits()
    model = idist.auto_model(_model())
    opt = idist.auto_optim(optim.SGD(model.parameters(), lr=0.1))
    loader = idist.auto_dataloader((x, y), batch_size=batch_size, shuffle=True, drop_last=True)
    create_supervised_trainer(model, opt, F.cross_entropy).run(loader, max_epochs=epochs)
    return [p.numpy().tolist() for p in model.parameters()]
