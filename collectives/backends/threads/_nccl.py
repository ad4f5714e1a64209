"""The threads backend's CuPy engine: NCCL communicators made in this process, one a device.

Each rank thread builds the nccl backend's own engine (:class:`~.nccl.NcclBackend`) for its
device: its ``ncclCommInitRankConfig`` is made *in that thread* (one thread per device, which
NCCL allows without a group call), with the unique id shared through the job's in-process
store; its stream, signature check, watchdog, timeouts and ``ncclCommSplit`` for subgroups are
the nccl backend's. What the threads add: the communicator's GPU is the rank's bound device
(not ``LOCAL_RANK``), and a rank thread that raises aborts every communicator of its groups
(``ncclCommAbort``), so the other threads' pending and later calls fail at once.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..._backend import Backend, GroupInfo
from ..._errors import PeerFailureError
from ..nccl import NcclBackend
from ._engines import ThreadJob, register_engine

__all__ = ["ThreadNcclEngine"]


class ThreadNcclEngine(NcclBackend):
    """The nccl engine of one rank thread (see the module docstring).

    Args:
        info: the group (``local_rank`` is replaced by the bound device's index).
        job: the threads job.
        parent: the group this one is split from (``new_group``), if any.
    """

    name = "threads"

    def __init__(self, info: GroupInfo, job: ThreadJob, parent: NcclBackend | None = None) -> None:
        device = job.devices[info.global_rank]
        index = int(getattr(device, "index", 0) or 0)
        super().__init__(dataclasses.replace(info, local_rank=index), parent=parent)
        if self.device != index:
            self.close()
            raise ValueError(
                f"threads backend: rank {info.global_rank} is bound to {device} but this "
                f"process sees {self.cuda.device_count()} GPU(s)"
            )
        self.job = job
        self.bound_device = device
        job.on_failure(self._member_failed)

    def _member_failed(self, rank: int, reason: str) -> None:
        if rank in self.info.ranks and rank != self.info.global_rank and self.error is None:
            self.abort(self.info.error(PeerFailureError, "", None, f"rank {rank} failed: {reason}"))

    def split(self, info: GroupInfo | None) -> Backend | None:
        """``ncclCommSplit`` for ``new_group``, keeping the new group on this engine."""
        if not (self.lib.can_split and _flag("DPT_NCCL_SPLIT")):
            return None
        if info is not None:
            return ThreadNcclEngine(info, self.job, parent=self)
        self._split_out()
        return None


def _flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no")


def _make(info: GroupInfo, job: ThreadJob) -> Any:
    return ThreadNcclEngine(info, job)


register_engine(
    "cuda",
    _make,
    description="CuPy arrays on NCCL communicators made in this process, one per GPU thread",
)
