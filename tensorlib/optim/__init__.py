"""Optimizers (SGD with momentum and Nesterov, Adam and AdamW with amsgrad) and, in
``lr_scheduler``, learning-rate schedulers."""

from . import lr_scheduler
from ._algorithms import SGD, Adam, AdamW, adam_update
from ._optimizer import Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "adam_update", "lr_scheduler"]
