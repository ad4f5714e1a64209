"""Sharded data parallelism: PyTorch FSDP2's ``fully_shard`` (ZeRO-3, or ZeRO-2 with
``reshard_after_forward=False``)."""

from . import _scaler  # noqa: F401  (registers the GradScaler reducer)
from ._api import FSDPModule, fully_shard
from ._mp import MixedPrecisionPolicy
from ._optim_state import full_optim_state_dict, shard_full_optim_state_dict
from ._stats import ShardStats

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ShardStats",
    "full_optim_state_dict",
    "fully_shard",
    "shard_full_optim_state_dict",
]
