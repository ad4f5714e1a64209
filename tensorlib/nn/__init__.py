"""Neural-network building blocks: Module, Parameter, layers and losses; `utils` (clipping)."""

from . import _layers, init, utils
from ._layers import *  # noqa: F403  (the layers and losses: listed once, in _layers.__all__)
from ._module import Module, Parameter

__all__ = ["Module", "Parameter", "init", "utils"]
__all__ += _layers.__all__
