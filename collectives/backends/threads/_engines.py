"""The threads backend's engine registry (keyed by device kind) and the base of engines
whose ranks meet in this process's memory. See :mod:`collectives.backends.threads`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..._backend import Backend, GroupInfo, Request
from ..._errors import CollectiveError
from ._meet import Meeting, ThreadJob

__all__ = [
    "EngineSpec",
    "ThreadEngine",
    "ThreadJob",
    "check_devices",
    "device_kind",
    "engine_kinds",
    "make_backend",
    "register_engine",
    "unregister_engine",
]

EngineFactory = Callable[[GroupInfo, ThreadJob], Backend]


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine.

    Attributes:
        kind: the device kind it serves (``device.type``: ``"cpu"``, ``"cuda"``...).
        factory: ``factory(info, job)`` builds the engine of one group on one rank thread
            (``job.devices[info.global_rank]`` is that rank's device).
        description: one line for the docs and error messages.
    """

    kind: str
    factory: EngineFactory
    description: str = ""


_ENGINES: dict[str, EngineSpec] = {}


def register_engine(kind: str, factory: EngineFactory, description: str = "") -> None:
    """Register (or replace) the engine of devices of kind ``kind`` (see the module docstring).

    Args:
        kind: the ``type`` attribute of the devices it serves.
        factory: builds a :class:`~collectives.Backend` (``name = "threads"``) from the
            group's :class:`~collectives.GroupInfo` and the :class:`ThreadJob`.
        description: one line saying what it does.
    """
    _ENGINES[kind] = EngineSpec(kind, factory, description)


def unregister_engine(kind: str) -> None:
    """Remove the engine of ``kind`` (if any)."""
    _ENGINES.pop(kind, None)


def engine_kinds() -> list[str]:
    """The device kinds an engine is registered for."""
    return sorted(_ENGINES)


def device_kind(device: Any) -> str:
    """The kind of ``device`` (its ``type``: a tensorlib Device, or a device of a package
    that registered an engine)."""
    kind = getattr(device, "type", None)
    if not isinstance(kind, str):
        raise TypeError(
            f"threads backend: {device!r} is not a device (expected 'cpu', 'cuda:N', a "
            "tensorlib Device, or a device whose package registered a threads engine)"
        )
    return kind


def check_devices(devices: Sequence[Any]) -> str:
    """The one engine kind of ``devices``; ValueError for mixed or unserved kinds."""
    kinds = sorted({device_kind(d) for d in devices})
    if len(kinds) != 1:
        shown = ", ".join(str(d) for d in devices)
        raise ValueError(
            f"threads backend: the devices of one group must be of one kind, got {kinds} "
            f"({shown}); one group all-reduces on one kind of device (as Burn's DDP does)"
        )
    if kinds[0] not in _ENGINES:
        raise ValueError(
            f"threads backend: no engine for devices of kind {kinds[0]!r}; registered: "
            f"{engine_kinds()} (a package adds its own with register_engine)"
        )
    return kinds[0]


def make_backend(info: GroupInfo) -> Backend:
    """The threads backend's factory: the engine of the members' device kind."""
    job = getattr(info.store, "job", None)
    if not isinstance(job, ThreadJob):
        raise ValueError(
            "the threads backend serves the rank threads of spawn(..., backend='threads') "
            "(or Parallel(backend='threads', ...)); a process started otherwise uses another "
            "backend ('cpu', 'nccl', 'mpi')"
        )
    kind = check_devices([job.devices[g] for g in info.ranks])
    return _ENGINES[kind].factory(info, job)


class ThreadEngine(Backend):
    """Base of engines whose ranks meet in this process's memory (see :class:`Meeting`).

    Engines implement ``_do_<op>(req)`` as synchronous engines do, using :meth:`meet` (post
    an item, get every member's, signatures checked) and :meth:`phase` (a barrier). A failure
    of this rank, or of any member's thread, reaches every member at once.

    Args:
        info: the group.
        job: the threads job.
    """

    name = "threads"

    def __init__(self, info: GroupInfo, job: ThreadJob) -> None:
        super().__init__(info)
        self.job = job
        self.bound_device = job.devices[info.global_rank]
        self.rank = info.rank  # in the group
        self.size = info.size
        self.meeting: Meeting = job.meeting(info)

    def meet(
        self, req: Request, item: Any, finish: Callable[[list[Any]], None] | None = None
    ) -> list[Any]:
        """Post ``item`` (e.g. this rank's array) for ``req``; every member's, in group-rank
        order, once all posted the same call (else CollectiveMismatchError on every rank).
        The last member to post runs ``finish(items)`` first (see :meth:`Meeting.begin`)."""
        return self.meeting.begin(self.rank, req, item, self.info, finish)

    def phase(self, req: Request) -> None:
        """Wait until every member reached this step of ``req``."""
        self.meeting.phase(self.rank, req, self.info)

    def abort(self, reason: CollectiveError) -> None:
        """Record the failure and tell the members (they fail instead of waiting)."""
        first = self.error is None
        super().abort(reason)
        if first and self.size > 1:
            self.meeting.abort(self.rank, reason)

    def close(self) -> None:
        """Finish queued work, then leave the meeting (peers waiting for this rank fail)."""
        super().close()
        self.meeting.leave(self.rank)
