"""``MixedPrecisionPolicy``: the dtypes a ``fully_shard`` unit gathers, computes, reduces and
returns in (PyTorch FSDP2's policy, same names and defaults).

The shards (and so the optimizer's master weights and its state) keep the module's dtype,
say float32; with ``param_dtype=float16`` each shard is cast as it is copied into the
all-gather's send buffer, so the all-gather moves half the bytes and the unit's forward and
backward compute with float16 parameters; the full gradient is cast to ``reduce_dtype`` as it
is copied into the reduce-scatter's buffer, and the averaged rows are cast to the shards'
dtype as they land in ``.grad``. ``reduce_dtype`` defaults to ``param_dtype`` (FSDP2's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorlib import Tensor

__all__ = ["MixedPrecisionPolicy"]

_FLOATING = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)})


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How a ``fully_shard`` unit casts (``torch.distributed.fsdp.MixedPrecisionPolicy``).

    Attributes:
        param_dtype: the dtype of the gathered (full) parameters, which forward and backward
            compute with and the all-gather sends; None: the shards' dtype.
        reduce_dtype: the dtype gradients are reduce-scattered (averaged) in; None: the
            ``param_dtype`` (or the shards' dtype when that is None too).
        output_dtype: floating outputs of the unit's forward are cast to it; None: not cast.
        cast_forward_inputs: cast the floating Tensors among forward's positional arguments to
            ``param_dtype`` (when it is set).

    Raises:
        TypeError: for a dtype that is not a floating type (float16, float32, float64).
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                dt = np.dtype(value)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"MixedPrecisionPolicy: {name}={value!r} is not a dtype ({e})"
                ) from None
            if dt not in _FLOATING:
                raise TypeError(
                    f"MixedPrecisionPolicy: {name} must be a floating dtype (float16, float32, "
                    f"float64), got {dt}"
                )
            object.__setattr__(self, name, dt)

    def dtypes(self, shard_dtype: Any) -> tuple[np.dtype[Any], np.dtype[Any]]:
        """``(gather dtype, reduce dtype)`` for shards of ``shard_dtype``."""
        gather = self.param_dtype if self.param_dtype is not None else np.dtype(shard_dtype)
        reduce = self.reduce_dtype if self.reduce_dtype is not None else gather
        return gather, reduce

    def describe(self) -> str:
        """A stable text of the policy (compared across ranks at ``fully_shard``)."""
        return (
            f"param={self.param_dtype} reduce={self.reduce_dtype} output={self.output_dtype} "
            f"cast_inputs={bool(self.cast_forward_inputs)}"
        )


def cast_floating(value: Any, dtype: np.dtype[Any]) -> Any:
    """``value`` with every floating Tensor in it (a Tensor, or a tuple/list of them, nested)
    cast to ``dtype`` through tensorlib's differentiable cast; everything else unchanged."""
    if isinstance(value, Tensor):
        if value.dtype in _FLOATING and value.dtype != dtype:
            return value.to(dtype=dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(v, dtype) for v in value)
    return value
