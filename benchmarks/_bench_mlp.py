"""The benchmarks' model, built the same way in tensorlib and in torch.

``mlp_step`` and ``ddp_scaling`` time the same MLP in both libraries; building it in one place
keeps the two sides layer for layer alike (and their seeded initial weights in step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def mlp(nn: Any, dims: Sequence[int], **linear_kw: Any) -> Any:
    """``nn.Sequential`` of ``nn.Linear(dims[i], dims[i + 1])`` with an ``nn.ReLU()`` between.

    Args:
        nn: ``tensorlib.nn`` or ``torch.nn`` (the two spell these three classes alike).
        dims: layer widths, the input's first and the output's last.
        **linear_kw: passed to every ``nn.Linear`` (e.g. ``device=`` for tensorlib).

    Returns:
        The model, its layers created in order (so a seeded generator gives equal weights).
    """
    layers: list[Any] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1], **linear_kw))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
