"""Burn's ``ReduceOperation`` and ``DistributedConfig``: what a device-list context reduces with."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .._types import ReduceOp

__all__ = ["DEFAULT_TIMEOUT_S", "DistributedConfig", "ReduceOperation", "reduce_op_of"]

DEFAULT_TIMEOUT_S = 300.0


class ReduceOperation(enum.Enum):
    """How :func:`~collectives.distributed.all_reduce` combines the devices' tensors (Burn's
    ``ReduceOperation``; ``Sum`` and ``Mean`` are Burn's, the others where an engine has them).
    """

    Sum = "sum"
    Mean = "mean"
    Prod = "prod"
    Min = "min"
    Max = "max"

    @property
    def op(self) -> ReduceOp:
        """The process-group :class:`~collectives.ReduceOp` of the same reduction."""
        return _TO_OP[self]

    def __str__(self) -> str:
        return self.name


_TO_OP = {
    ReduceOperation.Sum: ReduceOp.SUM,
    ReduceOperation.Mean: ReduceOp.AVG,
    ReduceOperation.Prod: ReduceOp.PROD,
    ReduceOperation.Min: ReduceOp.MIN,
    ReduceOperation.Max: ReduceOp.MAX,
}
_NAMES = {
    "sum": ReduceOperation.Sum,
    "mean": ReduceOperation.Mean,
    "avg": ReduceOperation.Mean,
    "prod": ReduceOperation.Prod,
    "product": ReduceOperation.Prod,
    "min": ReduceOperation.Min,
    "max": ReduceOperation.Max,
}


def reduce_op_of(op: Any) -> ReduceOperation:
    """``op`` as a :class:`ReduceOperation`: one already, a :class:`~collectives.ReduceOp`,
    or a name (``"sum"``, ``"mean"``, ``"avg"``, ``"prod"``, ``"min"``, ``"max"``).

    Raises:
        ValueError: ``op`` names no reduction.
    """
    if isinstance(op, ReduceOperation):
        return op
    if isinstance(op, ReduceOp):
        return next(k for k, v in _TO_OP.items() if v is op)
    if isinstance(op, str) and op.strip().lower() in _NAMES:
        return _NAMES[op.strip().lower()]
    raise ValueError(
        f"unknown reduce operation {op!r}: expected a ReduceOperation (Sum, Mean, Prod, Min, "
        "Max), a collectives.ReduceOp, or one of their names"
    )


@dataclass(frozen=True)
class DistributedConfig:
    """The settings of a :class:`~collectives.distributed.DistributedContext` (Burn's
    ``DistributedConfig``).

    Attributes:
        all_reduce_op: the reduction DDP applies to gradients (Burn's only field), and the
            default of :func:`~collectives.distributed.all_reduce` when it is given no op.
        timeout: seconds :meth:`CollectiveTensor.resolve` waits for the other devices'
            submissions (or an engine's completion) before it raises, naming who is missing.
    """

    all_reduce_op: ReduceOperation = ReduceOperation.Mean
    timeout: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "all_reduce_op", reduce_op_of(self.all_reduce_op))
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
            raise ValueError(f"DistributedConfig: timeout must be a positive number, got {t!r}")
        object.__setattr__(self, "timeout", float(t))
