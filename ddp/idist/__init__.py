"""``ddp.idist``: PyTorch Ignite's ``ignite.distributed`` API over collectives and ddp.

Ignite scripts keep their code with ``import ddp.idist as idist``: the same names, signatures
and result shapes, tensorlib Tensors where Ignite takes torch tensors; the names and argument
orders of the seed's page work too (``rank()``, ``world_size()``, ``spawn(fn, args, nprocs)``,
``Parallel(backend, nprocs)``, ``all_reduce(tensor, group, op)``, ``auto_dataloader(loader)``).
Outside any process group every call behaves as world size 1 (Ignite's serial model), so a
script never branches on "am I distributed". docs/idist.md maps every name and lists the few
semantics that differ.
"""

from ._auto import auto_dataloader, auto_model, auto_optim, one_rank_first, one_rank_only
from ._config import (
    available_backends,
    backend,
    device,
    finalize,
    get_local_rank,
    get_nnodes,
    get_node_rank,
    get_nproc_per_node,
    get_rank,
    get_world_size,
    has_hvd_support,
    has_mpi_support,
    has_native_dist_support,
    has_nccl_support,
    has_xla_support,
    hostname,
    initialize,
    model_name,
    rank,
    set_local_rank,
    show_config,
    world_size,
)
from ._launch import Parallel, spawn
from ._ops import all_gather, all_reduce, barrier, broadcast, new_group, sync

__all__ = [
    "Parallel",
    "all_gather",
    "all_reduce",
    "auto_dataloader",
    "auto_model",
    "auto_optim",
    "available_backends",
    "backend",
    "barrier",
    "broadcast",
    "device",
    "finalize",
    "get_local_rank",
    "get_nnodes",
    "get_node_rank",
    "get_nproc_per_node",
    "get_rank",
    "get_world_size",
    "has_hvd_support",
    "has_mpi_support",
    "has_native_dist_support",
    "has_nccl_support",
    "has_xla_support",
    "hostname",
    "initialize",
    "model_name",
    "new_group",
    "one_rank_first",
    "one_rank_only",
    "rank",
    "set_local_rank",
    "show_config",
    "spawn",
    "sync",
    "world_size",
]
