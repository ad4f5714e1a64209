"""Optimizers: SGD (momentum, Nesterov, weight decay), Adam and AdamW."""

from ._algorithms import SGD, Adam, AdamW
from ._optimizer import Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
