"""axonml's ``ProcessGroup`` and ``World``, over a :class:`~ddp.axon.Backend`.

As in axonml, a group is a backend and a list of ranks: ``rank()`` and ``world_size()`` are the
backend's (this rank in the *world*, the world's size), ``size()`` is the number of ranks in
the group, ``contains(rank)`` asks about membership. Its collectives run on a
:class:`collectives.ProcessGroup` of exactly those ranks (:attr:`ProcessGroup.group`): the
world's group when the ranks are the whole world, else a subgroup that every rank makes,
members or not, in the same order (``world.new_group`` on every rank, as ``new_group``
everywhere). A group that names ranks the world does not have (``World.mock().new_group([0,
1])`` in a world of one, as axonml's README writes it) can still say ``size()`` and
``contains()``; its collectives raise, naming the missing ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

import collectives
from tensorlib import Tensor

from ._backend import Backend, MockBackend, ReduceOp, to_collectives_op

__all__ = ["ProcessGroup", "World"]


def _check_ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be a list of ints, got {ranks!r}")
    found = list(ranks)
    bad = [r for r in found if isinstance(r, bool) or not isinstance(r, int | np.integer)]
    if bad:
        raise TypeError(f"ranks must be ints, got {bad[0]!r} in {found!r}")
    given = tuple(int(r) for r in found)
    if not given or len(set(given)) != len(given) or min(given) < 0:
        raise ValueError(f"ranks must be unique, non-negative and non-empty, got {list(given)}")
    return tuple(sorted(given))


class ProcessGroup:
    """Ranks of a world that run collectives together (axonml's ``ProcessGroup``).

    Args:
        backend: this rank's end of the world.
        ranks: the members (None: the whole world), a set: kept in ascending order.

    Subgroups are made by every rank of the world in the same order (see the module
    docstring); :meth:`mock` is a world of one.
    """

    def __init__(self, backend: Backend, ranks: Iterable[int] | None = None) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(
                f"ProcessGroup(backend): expected a Backend (MockBackend.create_world(n)[r], "
                f"or Backend() for this process's group), got {type(backend).__name__}"
            )
        world = backend.world_size()
        self._backend = backend
        self._ranks = tuple(range(world)) if ranks is None else _check_ranks(ranks)
        missing = [r for r in self._ranks if r >= world]
        resolve: Callable[[], Any]
        if missing:
            resolve = self._refuse_missing
        elif len(self._ranks) == world:
            resolve = lambda: backend.group  # noqa: E731  (the world's own group)
        else:
            resolve = backend.subgroup(self._ranks)
        self._resolve = resolve

    @classmethod
    def mock(cls) -> ProcessGroup:
        """A group of a fresh world of one (rank 0 of 1), for tests."""
        return cls(MockBackend.single())

    @classmethod
    def with_ranks(cls, backend: Backend, ranks: Iterable[int]) -> ProcessGroup:
        """The group of ``ranks`` (axonml's ``ProcessGroup::with_ranks``)."""
        return cls(backend, ranks)

    def _refuse_missing(self) -> Any:
        world = self._backend.world_size()
        missing = [r for r in self._ranks if r >= world]
        raise ValueError(
            f"the group with ranks {list(self._ranks)} names rank(s) {missing}, which this world "
            f"of {world} rank(s) does not have: it can answer size() and contains(), but its "
            f"collectives need every member (make the world with "
            f"MockBackend.create_world({max(self._ranks) + 1}) to run them)"
        )

    # ------------------------------------------------------------------ identity
    def backend(self) -> Backend:
        """This rank's end of the world."""
        return self._backend

    def rank(self) -> int:
        """This rank in the world (as axonml's: not its position in the group)."""
        return self._backend.rank()

    def world_size(self) -> int:
        """Ranks in the world."""
        return self._backend.world_size()

    def size(self) -> int:
        """Ranks in this group."""
        return len(self._ranks)

    def ranks(self) -> list[int]:
        """The members, in ascending order."""
        return list(self._ranks)

    def contains(self, rank: int) -> bool:
        """Whether ``rank`` is a member."""
        return rank in self._ranks

    def clone(self) -> ProcessGroup:
        """The same group (axonml's ``.clone()``): same backend, ranks and collectives."""
        return copy.copy(self)

    @property
    def group(self) -> collectives.ProcessGroup:
        """The :class:`collectives.ProcessGroup` that runs this group's collectives on this
        rank (for :class:`ddp.DistributedDataParallel` and the rest of the project).

        Raises:
            ValueError: when the group names ranks the world does not have.
            RuntimeError: on a rank that is not a member.
        """
        group: collectives.ProcessGroup = self._resolve()
        return group

    def __repr__(self) -> str:
        return (
            f"<axon ProcessGroup ranks={list(self._ranks)} rank={self.rank()} "
            f"world_size={self.world_size()} backend={self._backend.name()!r}>"
        )

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        """Wait until every member reached this barrier."""
        self.group.barrier()

    def all_reduce_tensor(self, tensor: Any, op: Any = ReduceOp.SUM) -> Any:
        """Reduce ``tensor`` (a Tensor or NumPy array) over the members, in place.

        Returns:
            ``tensor``.
        """
        rop = to_collectives_op(op)
        group = self.group
        return _in_place(tensor, lambda arr: group.all_reduce(arr, rop))

    def broadcast_tensor(self, tensor: Any, src: int | None = None) -> Any:
        """Copy rank ``src``'s ``tensor`` (default: the group's first rank's) into every
        member's, in place.

        Returns:
            ``tensor``.
        """
        root = self._ranks[0] if src is None else src
        group = self.group
        return _in_place(tensor, lambda arr: group.broadcast(arr, root))

    def all_gather_tensor(self, tensor: Any) -> Any:
        """Every member's ``tensor``, stacked in rank order: shape ``(size(), *shape)``."""
        return self.group.all_gather(_contiguous(tensor))


def _contiguous(x: Any) -> Any:
    arr = x.data if isinstance(x, Tensor) else x
    if getattr(arr, "flags", None) is None or arr.flags.c_contiguous:
        return x
    return Tensor(arr.copy(), device=x.device) if isinstance(x, Tensor) else arr.copy()


def _in_place(x: Any, run: Callable[[Any], Any]) -> Any:
    """Run the in-place collective ``run`` on ``x``'s array; a Tensor whose array the
    collectives cannot write (a transposed view, a read-only array) goes through a copy."""
    if not isinstance(x, Tensor):
        run(x)
        return x
    arr = x.data
    if arr.flags.c_contiguous and arr.flags.writeable:
        run(arr)
        return x
    tmp = x.device.xp.array(arr, order="C")  # a contiguous, writable copy
    run(tmp)
    if arr.flags.writeable:
        arr[...] = tmp
    else:
        x.data = tmp
    return x


class World:
    """The distributed world as one rank sees it (axonml's ``World``).

    Args:
        default_group: the group of every rank.
    """

    def __init__(self, default_group: ProcessGroup) -> None:
        if not isinstance(default_group, ProcessGroup):
            raise TypeError(
                f"World(default_group): expected a ddp.axon.ProcessGroup, got "
                f"{type(default_group).__name__}"
            )
        self._default = default_group

    @classmethod
    def init(cls, backend: Backend | None = None) -> World:
        """The world of ``backend`` (None: this process's default group, e.g. under
        ``python -m collectives.run``; a world of one when nothing was initialized)."""
        return cls(ProcessGroup(backend if backend is not None else Backend()))

    @classmethod
    def mock(cls) -> World:
        """A fresh world of one (rank 0 of 1), for tests."""
        return cls(ProcessGroup.mock())

    def default_group(self) -> ProcessGroup:
        """The group of every rank."""
        return self._default

    def rank(self) -> int:
        """This rank."""
        return self._default.rank()

    def world_size(self) -> int:
        """Ranks in the world."""
        return self._default.world_size()

    def is_main(self) -> bool:
        """Whether this is rank 0."""
        return self.rank() == 0

    def barrier(self) -> None:
        """Wait until every rank reached this barrier."""
        self._default.barrier()

    def new_group(self, ranks: Iterable[int]) -> ProcessGroup:
        """The group of ``ranks``. Every rank calls it, members or not, in the same order."""
        return ProcessGroup(self._default.backend(), ranks)

    def __repr__(self) -> str:
        return f"<axon World rank {self.rank()} of {self.world_size()}>"
