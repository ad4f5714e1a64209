"""Optimizers (SGD with momentum and Nesterov, Adam and AdamW with amsgrad) and, in
``lr_scheduler``, learning-rate schedulers."""

from . import lr_scheduler
from ._algorithms import SGD, Adam, AdamW
from ._optimizer import Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "lr_scheduler"]
