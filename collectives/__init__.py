"""collectives: process groups, async Work handles, rendezvous and backends.

Backends: ``serial`` (world size 1), ``cpu`` (shared memory on one host), ``threads`` (rank
threads of one process, one device each); ``nccl`` and ``mpi`` plug into the same registry.
See docs/collectives.md.
"""

from . import backends  # noqa: F401  (registers the built-in backends)
from ._api import (
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all,
    alloc,
    barrier,
    broadcast,
    broadcast_object,
    destroy_process_group,
    get_backend,
    get_default_group,
    get_device,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    send,
    show_config,
)
from ._backend import Backend, GroupInfo, Request
from ._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupAbortedError,
    PeerFailureError,
    SpawnError,
    where,
)
from ._group import NonMemberGroup, ProcessGroup
from ._registry import available_backends, backend_unavailable_reason, register_backend
from ._types import ReduceOp
from ._work import Work
from .launch._parallel import Parallel
from .launch._spawn import SpawnContext, spawn

__all__ = [
    "Backend",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GroupAbortedError",
    "GroupInfo",
    "NonMemberGroup",
    "Parallel",
    "PeerFailureError",
    "ProcessGroup",
    "ReduceOp",
    "Request",
    "SpawnContext",
    "SpawnError",
    "Work",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "alloc",
    "available_backends",
    "backend_unavailable_reason",
    "barrier",
    "broadcast",
    "broadcast_object",
    "destroy_process_group",
    "get_backend",
    "get_default_group",
    "get_device",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "register_backend",
    "send",
    "show_config",
    "spawn",
    "where",
]
