"""Rank threads of a threads job: which rank the calling thread is, and what its world needs.

``spawn(backend="threads")`` makes each of its threads a rank (:func:`bind`); the module-level
API (``collectives._api``) then keeps that thread's own world (default group, groups, store)
in :data:`thread` instead of the process's, so every thread's ``get_rank()``,
``all_reduce(x)`` and ``new_group`` are its rank's. A thread that is not a rank sees the
process's world (usually none).
"""

from __future__ import annotations

import threading
from typing import Any, cast

from tensorlib import Device
from tensorlib import device as tl_device

from ._backend import GroupInfo
from ._env import EnvConfig

__all__ = ["bind", "device_of", "leave", "thread", "world_info"]


class RankThread(threading.local):
    """Inside a rank thread of a threads job: which rank it is, and its own world."""

    def __init__(self) -> None:
        self.job: Any = None  # the ThreadJob whose rank this thread is (None: not a rank)
        self.rank = -1
        self.world: Any = None  # collectives._api._World once the rank joined


thread = RankThread()


def bind(job: Any, rank: int) -> None:
    """Make the calling thread rank ``rank`` of ``job`` (None: no rank any more)."""
    thread.job = job
    thread.rank = rank if job is not None else -1
    thread.world = None


def world_info(backend: str | None, seconds: float) -> tuple[EnvConfig, GroupInfo]:
    """The calling rank thread's place in its job and its default group's info.

    Raises:
        RuntimeError: not a rank thread, or it joined already.
        ValueError: a backend other than threads.
    """
    job, rank = thread.job, thread.rank
    if job is None:
        raise RuntimeError(
            "init_process_group(backend='threads') joins a threads job from one of its rank "
            "threads: start them with spawn(fn, nprocs=N, backend='threads') or "
            "Parallel(backend='threads', nproc_per_node=N)"
        )
    if backend not in (None, "threads"):
        raise ValueError(
            f"init_process_group(backend={backend!r}) in rank thread {rank} of a threads job: "
            "its ranks are threads of one process and use backend 'threads'"
        )
    if thread.world is not None:
        raise RuntimeError(
            f"init_process_group() was already called in rank thread {rank}; call "
            "destroy_process_group() first"
        )
    size = job.size
    env = EnvConfig(rank, size, rank, size, "", 0, "threads")
    info = GroupInfo(
        rank=rank,
        size=size,
        ranks=tuple(range(size)),
        global_rank=rank,
        name="world",
        store=job.store,
        timeout=seconds,
        local_rank=rank,
    )
    return env, info


def leave(groups: list[Any], store: Any, rank: int) -> None:
    """Destroy every group of the calling rank thread; it then has no world."""
    try:
        for g in reversed(groups):
            g.destroy()
    finally:
        # Setup waits of the peers (new_group) name a rank that left the job.
        store.set(f"world/left/{rank}", b"1")
        thread.world = None


def device_of(backend: Any) -> Device:
    """The calling rank's device: a rank thread's bound device, the GPU of an nccl group
    (``backend`` is the default group's; None: no group), else the CPU."""
    if thread.job is not None:
        return cast(Device, thread.job.devices[thread.rank])
    if backend is None:
        return tl_device("cpu")
    bound = getattr(backend, "bound_device", None)
    if bound is not None:
        return cast(Device, bound)
    if backend.name == "nccl":
        return tl_device(f"cuda:{backend.device}")
    return tl_device("cpu")
