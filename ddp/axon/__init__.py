"""ddp.axon: axonml-distributed's API (its prelude) over this project's DDP and collectives.

``from ddp.axon import *`` brings every name of axonml-distributed's README, Python-cased:
``World.mock()``, ``ProcessGroup``, ``MockBackend.create_world(n)`` (rank threads of this
process, on the ``threads`` backend), ``all_reduce_sum(tensor, pg)`` and the other
communication functions, ``sync_gradients``, ``GradientBucket``, ``GradientSynchronizer``,
``DistributedDataParallel`` and ``ReduceOp``. docs/axon.md maps each name and says what
differs.
"""

from tensorlib import Tensor

from ._backend import Backend, MockBackend, ReduceOp
from ._comm import (
    all_gather,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_min,
    all_reduce_product,
    all_reduce_sum,
    barrier,
    broadcast,
    broadcast_from,
    is_main_process,
    rank,
    sync_gradient,
    sync_gradients,
    world_size,
)
from ._ddp import DistributedDataParallel
from ._grad import GradientBucket, GradientSynchronizer, GradSyncStrategy
from ._group import ProcessGroup, World

__all__ = [
    "Backend",
    "DistributedDataParallel",
    "GradSyncStrategy",
    "GradientBucket",
    "GradientSynchronizer",
    "MockBackend",
    "ProcessGroup",
    "ReduceOp",
    "Tensor",
    "World",
    "all_gather",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_min",
    "all_reduce_product",
    "all_reduce_sum",
    "barrier",
    "broadcast",
    "broadcast_from",
    "is_main_process",
    "rank",
    "sync_gradient",
    "sync_gradients",
    "world_size",
]
