"""axonml's ``ReduceOp``, ``Backend`` and ``MockBackend``, over this project's process groups.

axonml's ``Backend`` trait is one rank's end of a world: ``rank()``, ``world_size()`` and
collectives on flat buffers. Here :class:`Backend` is that, over a
:class:`collectives.ProcessGroup` (``Backend()``: the process's default group, from the
launcher or ``init_process_group``), and :class:`MockBackend` is a world of rank *threads* of
this process: ``MockBackend.create_world(n)`` makes one threads job of the ``threads`` backend
(its in-memory meeting and NumPy engine, the same code that ``spawn(backend="threads")`` runs)
and returns its n ends. Each end is used from its own thread, as axonml's are; a collective
waits until every member called it, and a mismatch, a timeout, or a rank that left fails on
every rank with the usual messages.

A mock end's process groups are made on first use, in the thread that first calls a
collective through them, which then owns them (one thread issues a group's calls: see
``ProcessGroup.bind_thread``). A thread that already issues another rank's collectives of the
same world is refused at once: each of the two ranks would wait for the other for ever.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

import collectives
import tensorlib as tl
from collectives import GroupInfo
from collectives.backends.threads import Meeting, NumpyEngine, ThreadJob

__all__ = ["Backend", "MockBackend", "ReduceOp", "to_collectives_op"]


class ReduceOp(enum.Enum):
    """How a reduction combines the ranks' values (axonml's ``ReduceOp``).

    Both spellings work: ``ReduceOp.AVERAGE`` and axonml's ``ReduceOp.Average`` are one member.
    """

    SUM = "sum"
    PRODUCT = "prod"
    MIN = "min"
    MAX = "max"
    AVERAGE = "avg"
    # axonml's spelling: aliases of the members above.
    Sum = "sum"
    Product = "prod"
    Min = "min"
    Max = "max"
    Average = "avg"


def to_collectives_op(op: Any) -> collectives.ReduceOp:
    """The collectives' reduction for ``op``: an axon :class:`ReduceOp`, a
    :class:`collectives.ReduceOp`, or a name (``"sum"``, ``"average"``, ``"avg"``...).

    Raises:
        ValueError: for anything else.
    """
    if isinstance(op, ReduceOp):
        return collectives.ReduceOp(op.value)
    if isinstance(op, collectives.ReduceOp):
        return op
    if isinstance(op, str):
        name = op.lower()
        found = ReduceOp.__members__.get(op) or ReduceOp.__members__.get(name.upper())
        if found is not None:
            return collectives.ReduceOp(found.value)
        if name in ("sum", "prod", "min", "max", "avg"):
            return collectives.ReduceOp(name)
    raise ValueError(
        f"op must be a ReduceOp (SUM, PRODUCT, MIN, MAX, AVERAGE) or its name, got {op!r}"
    )


class Backend:
    """One rank's end of a world, over a :class:`collectives.ProcessGroup` (axonml's trait).

    Args:
        group: the world's group on this rank (None: the process's default group; a world of
            one when nothing was initialized).

    Collectives take NumPy arrays or tensorlib Tensors and work in place (``all_reduce``,
    ``broadcast``), as axonml's take ``&mut [f32]``.
    """

    def __init__(self, group: collectives.ProcessGroup | None = None) -> None:
        if group is not None and not isinstance(group, collectives.ProcessGroup):
            raise TypeError(
                f"Backend(group): expected a collectives.ProcessGroup or None, got "
                f"{type(group).__name__}"
            )
        self._group = group if group is not None else collectives.get_default_group()

    # ------------------------------------------------------------------ identity
    def name(self) -> str:
        """The backend's name (the collectives backend: ``"cpu"``, ``"nccl"``...)."""
        return self.group.backend_name

    def rank(self) -> int:
        """This rank, in the world."""
        return self.group.rank

    def world_size(self) -> int:
        """Ranks in the world."""
        return self.group.size

    @property
    def group(self) -> collectives.ProcessGroup:
        """The world's :class:`collectives.ProcessGroup` on this rank (for DDP and the rest
        of the project)."""
        return self._group

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name()!r} rank {self.rank()} of {self.world_size()}>"

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, data: Any, op: Any = ReduceOp.SUM) -> Any:
        """Reduce ``data`` (an array or Tensor, contiguous) over the world, in place."""
        return self.group.all_reduce(data, to_collectives_op(op))

    def broadcast(self, data: Any, src: int = 0) -> Any:
        """Copy rank ``src``'s ``data`` into every rank's ``data``, in place."""
        return self.group.broadcast(data, src)

    def all_gather(self, send: Any, recv: Any = None) -> Any:
        """Every rank's ``send``, in rank order.

        Args:
            send: this rank's contribution.
            recv: where to write them (axonml's flat ``world_size * len(send)`` buffer, or
                an array of shape ``(world_size, *send.shape)``); None for a new array of that
                shape.

        Returns:
            ``recv`` (or the new array).
        """
        if recv is None:
            return self.group.all_gather(send)
        data = send.data if isinstance(send, tl.Tensor) else send
        out = recv.data if isinstance(recv, tl.Tensor) else recv
        want = (self.world_size(), *data.shape)
        if out.size != int(np.prod(want)) or not out.flags.c_contiguous:
            raise ValueError(
                f"all_gather: recv must be a contiguous array of {int(np.prod(want))} elements "
                f"(world size {self.world_size()} x {data.size}), got shape {tuple(out.shape)}"
            )
        self.group.all_gather(send, out=out.reshape(want))
        return recv

    def barrier(self) -> None:
        """Wait until every rank of the world reached this barrier."""
        self.group.barrier()

    # ------------------------------------------------------------------ groups
    def subgroup(self, ranks: tuple[int, ...]) -> Callable[[], Any]:
        """Make the group of ``ranks`` (sorted, in range); return what gives it on this rank
        (a :class:`collectives.ProcessGroup`, or a refusal on a rank outside it).

        Every rank of the world calls it, in the same order (``collectives.new_group``).
        """
        if self.group is not collectives.get_default_group():
            raise ValueError(
                "new_group: subgroups are made from the process's default group; this backend "
                f"serves another one ({self.group!r})"
            )
        made = collectives.new_group(list(ranks))
        return lambda: made


class _MockWorld:
    """What the ends of one ``MockBackend.create_world`` share."""

    _ids = itertools.count()

    def __init__(self, size: int, timeout: float) -> None:
        self.job = ThreadJob([tl.device("cpu")] * size, timeout)
        self.timeout = timeout
        self.name = f"axon-mock-{next(self._ids)}"
        self.lock = threading.Lock()
        self.acting: dict[int, threading.Thread] = {}  # rank -> the thread issuing its calls
        self.meetings: list[tuple[tuple[int, ...], Meeting]] = []  # every group's, any rank's
        self.gone: dict[int, str | None] = {}  # ranks that ended -> why they failed (or None)

    def claim(self, rank: int) -> None:
        """The calling thread is about to issue rank ``rank``'s collectives.

        Raises:
            RuntimeError: when it already issues another rank's: a collective waits for every
                rank, so one thread cannot be two of them.
        """
        me = threading.current_thread()
        with self.lock:
            other = [r for r, t in self.acting.items() if t is me and r != rank]
            if other:
                raise RuntimeError(
                    f"MockBackend rank {rank}: thread {me.name!r} already issues the collectives "
                    f"of rank {other[0]} of this mock world, and a collective waits until every "
                    "rank called it, so one thread cannot be two ranks: run each backend in a "
                    "thread of its own (threading.Thread(target=..., args=(backend,)))"
                )
            self.acting.setdefault(rank, me)

    def register(self, ranks: tuple[int, ...], meeting: Meeting) -> None:
        """A group's meeting was made: it learns which of its ranks already ended."""
        with self.lock:
            self.meetings.append((ranks, meeting))
            gone = [(r, why) for r, why in self.gone.items() if r in ranks]
        for r, why in gone:
            _tell(meeting, ranks, r, why)

    def depart(self, rank: int, why: str | None) -> None:
        """Rank ``rank`` ended (``why``: its failure, None when it ended normally): every
        meeting it belongs to, made by any rank, stops waiting for it."""
        with self.lock:
            self.gone[rank] = why
            self.acting.pop(rank, None)
            meetings = [(ranks, m) for ranks, m in self.meetings if rank in ranks]
        for ranks, meeting in meetings:
            _tell(meeting, ranks, rank, why)


def _tell(meeting: Meeting, ranks: tuple[int, ...], rank: int, why: str | None) -> None:
    """Peers in ``meeting`` that wait for ``rank`` fail at once, naming it (and ``why``)."""
    if why is None:
        meeting.leave(ranks.index(rank))  # group ranks, as ThreadEngine.close gives them
    else:
        meeting.rank_failed(rank, why)  # global ranks, as ThreadJob.fail gives them


class MockBackend(Backend):
    """One rank of a mock world: rank threads of this process (see the module docstring).

    Make them with :meth:`create_world` (or :meth:`single` for a world of one), not directly.
    Use each from its own thread; ``with backend:`` (or :meth:`close`) ends its rank at the
    end of that thread's work, so that peers still waiting for it fail at once, naming it.
    """

    def __init__(self, world: _MockWorld, rank: int) -> None:
        if not isinstance(world, _MockWorld):
            raise TypeError("make mock backends with MockBackend.create_world(n)")
        self._world = world
        self._rank = rank
        self._lock = threading.Lock()
        self._made: list[collectives.ProcessGroup] = []
        self._world_group: collectives.ProcessGroup | None = None
        self._subgroups = 0  # subgroups asked for so far: the k-th pairs with the peers' k-th

    @classmethod
    def create_world(cls, world_size: int, timeout: float = 30.0) -> list[MockBackend]:
        """``world_size`` backends connected to each other: one per rank, in rank order.

        Args:
            world_size: number of ranks.
            timeout: seconds a collective waits for the other ranks before it fails (naming
                the ranks that never arrived).

        Raises:
            ValueError: for a world size below 1 or a non-positive timeout.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"create_world: world_size must be an int >= 1, got {world_size!r}")
        if not timeout > 0:
            raise ValueError(f"create_world: timeout must be positive seconds, got {timeout!r}")
        world = _MockWorld(world_size, float(timeout))
        return [cls(world, r) for r in range(world_size)]

    @classmethod
    def single(cls) -> MockBackend:
        """A world of one (rank 0 of 1): every collective returns this rank's own values."""
        return cls.create_world(1)[0]

    def name(self) -> str:
        """``"mock"``, as axonml's."""
        return "mock"

    def rank(self) -> int:
        """This end's rank."""
        return self._rank

    def world_size(self) -> int:
        """Ranks in its world."""
        return self._world.job.size

    @property
    def group(self) -> collectives.ProcessGroup:
        """The world's group on this rank (made on first use, owned by the calling thread)."""
        if self._world_group is None:
            self._world_group = self._make(tuple(range(self.world_size())), "world")
        return self._world_group

    def subgroup(self, ranks: tuple[int, ...]) -> Callable[[], Any]:
        """The group of ``ranks`` on this rank, made on first use (see :class:`Backend`)."""
        with self._lock:
            name = f"group{self._subgroups}"
            self._subgroups += 1
        made: list[collectives.ProcessGroup] = []

        def get() -> collectives.ProcessGroup:
            if not made:
                made.append(self._make(ranks, name))
            return made[0]

        if self._rank not in ranks:
            outside = collectives.NonMemberGroup(ranks, self._rank)  # its collectives raise
            return lambda: outside
        return get

    def _make(self, ranks: tuple[int, ...], name: str) -> collectives.ProcessGroup:
        world = self._world
        if self.world_size() > 1:
            world.claim(self._rank)
        info = GroupInfo(
            rank=ranks.index(self._rank),
            size=len(ranks),
            ranks=ranks,
            global_rank=self._rank,
            name=f"{world.name}/{name}",
            store=world.job.store,
            timeout=world.timeout,
            local_rank=self._rank,
        )
        engine = NumpyEngine(info, world.job)
        world.register(ranks, engine.meeting)
        group = collectives.ProcessGroup(engine)
        with self._lock:
            self._made.append(group)
        return group

    # ------------------------------------------------------------------ lifetime
    def close(self, error: BaseException | None = None) -> None:
        """End this rank: its groups are destroyed, and peers waiting for it fail at once.

        Args:
            error: why the rank ended, if it failed (peers' errors then name it).
        """
        why = None if error is None else f"its thread raised {type(error).__name__}: {error}"
        self._world.depart(self._rank, why)
        with self._lock:
            made, self._made = self._made, []
        for group in reversed(made):
            group.destroy()

    def __enter__(self) -> MockBackend:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)
