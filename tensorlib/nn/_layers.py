"""Layers: Linear, Embedding, LayerNorm, Dropout, activations, Sequential, losses."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import functional as F
from .._creation import ones, zeros
from .._device import Device
from .._dtype import float32, normalize_dtype
from .._random import Generator, default_generator
from .._tensor import Tensor
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
    "ModuleList",
    "ReLU",
    "Sequential",
    "Sigmoid",
    "Tanh",
]


def _uniform(
    shape: tuple[int, ...], bound: float, dtype: Any, device: Any, gen: Generator | None
) -> Parameter:
    g = gen if gen is not None else default_generator
    host = g.rng.uniform(-bound, bound, size=shape)
    return Parameter(Tensor(host, dtype=dtype, device=device))


class Linear(Module):
    """``y = x @ weight.T + bias`` with weight (out_features, in_features).

    Initialized like PyTorch: weight and bias uniform in +-1/sqrt(in_features), drawn from
    ``generator`` (or the default generator, seeded with ``tensorlib.manual_seed``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: Any = None,
        device: str | Device | None = None,
        generator: Generator | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"Linear needs positive sizes, got in_features={in_features}, "
                f"out_features={out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        dt = normalize_dtype(dtype) if dtype is not None else float32
        bound = 1.0 / math.sqrt(in_features)
        self.weight = _uniform((out_features, in_features), bound, dt, device, generator)
        if bias:
            self.bias = _uniform((out_features,), bound, dt, device, generator)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


class Embedding(Module):
    """A lookup table of ``num_embeddings`` vectors of size ``embedding_dim`` (init N(0, 1)).

    ``padding_idx`` (as in torch): that row starts as zeros and receives no gradient.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        dtype: Any = None,
        device: str | Device | None = None,
        generator: Generator | None = None,
    ) -> None:
        super().__init__()
        padding_idx = F._padding_index(padding_idx, num_embeddings, "Embedding")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        g = generator if generator is not None else default_generator
        host = g.rng.standard_normal((num_embeddings, embedding_dim))
        if padding_idx is not None:
            host[padding_idx] = 0
        dt = normalize_dtype(dtype) if dtype is not None else float32
        self.weight = Parameter(Tensor(host, dtype=dt, device=device))

    def forward(self, indices: Tensor | Any) -> Tensor:
        return F.embedding(indices, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class LayerNorm(Module):
    """Layer normalization over the trailing ``normalized_shape`` axes.

    As torch's: ``elementwise_affine`` adds a weight (ones) and, unless ``bias=False``, a bias
    (zeros).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype: Any = None,
        device: str | Device | None = None,
    ) -> None:
        super().__init__()
        ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps = ns, eps
        if elementwise_affine:
            self.weight = Parameter(ones(*ns, dtype=dtype, device=device))
            if bias:
                self.bias = Parameter(zeros(*ns, dtype=dtype, device=device))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Dropout(Module):
    """Zero elements with probability ``p`` while training; identity in eval mode."""

    def __init__(self, p: float = 0.5, *, generator: Generator | None = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p
        self.generator = generator

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training, self.generator)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class GELU(Module):
    """GELU, tanh approximation (``torch.nn.GELU(approximate='tanh')``; see ``F.gelu``)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        F._check_gelu(approximate)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Tanh(Module):
    """Hyperbolic tangent."""

    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class Sigmoid(Module):
    """Logistic sigmoid."""

    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Identity(Module):
    """Returns its input."""

    def forward(self, x: Tensor) -> Tensor:
        return x


class Flatten(Module):
    """Flattens all axes from ``start_axis`` on (default 1: keep the batch axis)."""

    def __init__(self, start_axis: int = 1) -> None:
        super().__init__()
        self.start_axis = start_axis

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(self.start_axis)


class Sequential(Module):
    """Runs its modules in order, feeding each one's output to the next."""

    def __init__(self, *modules: Module | OrderedDict[str, Module]) -> None:
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            for name, m in modules[0].items():
                self.add_module(name, m)
        else:
            for i, mod in enumerate(modules):
                if not isinstance(mod, Module):
                    raise TypeError(f"Sequential: item {i} is a {type(mod).__name__}, not a Module")
                self.add_module(str(i), mod)

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, i: int) -> Module:
        mods = list(self._modules.values())
        return mods[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(m for m in self._modules.values() if m is not None)

    def append(self, module: Module) -> Sequential:
        """Add a module at the end."""
        self.add_module(str(len(self._modules)), module)
        return self


class ModuleList(Module):
    """A list of modules, registered so their parameters are found."""

    def __init__(self, modules: list[Module] | None = None) -> None:
        super().__init__()
        for m in modules or []:
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        """Add a module at the end."""
        self.add_module(str(len(self._modules)), module)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(m for m in self._modules.values() if m is not None)


class CrossEntropyLoss(Module):
    """:func:`tensorlib.functional.cross_entropy` as a module."""

    def __init__(
        self, reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0
    ) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(
                f"CrossEntropyLoss: label_smoothing must be in [0, 1], got {label_smoothing}"
            )
        self.reduction, self.ignore_index = reduction, ignore_index
        self.label_smoothing = label_smoothing

    def forward(self, logits: Tensor, target: Tensor | np.ndarray[Any, Any]) -> Tensor:
        return F.cross_entropy(
            logits, target, self.reduction, self.ignore_index, self.label_smoothing
        )


class MSELoss(Module):
    """:func:`tensorlib.functional.mse_loss` as a module."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(x, target, self.reduction)
