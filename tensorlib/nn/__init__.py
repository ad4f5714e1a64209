"""Neural-network building blocks: Module, Parameter, layers and losses."""

from . import init
from ._layers import (
    GELU,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    Flatten,
    Identity,
    LayerNorm,
    Linear,
    ModuleList,
    MSELoss,
    ReLU,
    Sequential,
    Sigmoid,
    Tanh,
)
from ._module import Module, Parameter

__all__ = [
    "GELU",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "Flatten",
    "Identity",
    "LayerNorm",
    "Linear",
    "MSELoss",
    "Module",
    "ModuleList",
    "Parameter",
    "ReLU",
    "Sequential",
    "Sigmoid",
    "Tanh",
    "init",
]
