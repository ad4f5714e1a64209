"""Sharded data parallelism: PyTorch FSDP2's ``fully_shard`` (ZeRO-3, or ZeRO-2 with
``reshard_after_forward=False``)."""

from ._api import FSDPModule, fully_shard

__all__ = ["FSDPModule", "fully_shard"]
