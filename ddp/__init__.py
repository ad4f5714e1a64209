"""ddp: DistributedDataParallel with bucketed, overlapped gradient all-reduce, and helpers.

Helpers in the spirit of PyTorch Ignite's ``idist`` and Horovod: a distributed sampler and
data loader, ``auto_model``/``auto_optim``/``auto_dataloader``, ``one_rank_only``, rank-0
atomic checkpoints, ``join`` for uneven inputs; ``ddp.idist`` (Ignite's ``idist`` API),
``sync_gradients``/``sync_parameters`` and ``ddp.functional`` (collectives with gradients);
``ddp.learner`` (Burn's Learner, SupervisedTraining and ExecutionStrategy); ``ddp.axon``
(axonml-distributed's API: World, ProcessGroup, MockBackend, GradientBucket...);
``ZeroRedundancyOptimizer`` (ZeRO-1) and ``memory_stats`` (bytes held per rank).
"""

from . import axon, functional, idist, learner
from ._auto import auto_dataloader, auto_model, auto_optim, one_rank_only
from ._checkpoint import load_checkpoint, save_checkpoint
from ._clip import clip_grad_norm_
from ._data import DataLoader
from ._ddp import DistributedDataParallel
from ._hooks import GradBucket, allreduce_hook, fp16_compress_hook
from ._join import Join, join
from ._memory import memory_stats
from ._reducer import StepStats
from ._sampler import DistributedSampler
from ._sync import sync_gradients, sync_parameters
from .fsdp import MixedPrecisionPolicy, fully_shard
from .zero import ZeroRedundancyOptimizer

__all__ = [
    "DataLoader",
    "DistributedDataParallel",
    "DistributedSampler",
    "GradBucket",
    "Join",
    "MixedPrecisionPolicy",
    "StepStats",
    "ZeroRedundancyOptimizer",
    "allreduce_hook",
    "auto_dataloader",
    "auto_model",
    "auto_optim",
    "axon",
    "clip_grad_norm_",
    "fp16_compress_hook",
    "fully_shard",
    "functional",
    "idist",
    "join",
    "learner",
    "load_checkpoint",
    "memory_stats",
    "one_rank_only",
    "save_checkpoint",
    "sync_gradients",
    "sync_parameters",
]
