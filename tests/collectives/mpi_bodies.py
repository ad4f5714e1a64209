"""Bodies specific to the ``mpi`` backend (the shared ones are in ``bodies.py``)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import collectives as C
from tests.collectives.bodies import _try


def init_source() -> dict[str, Any]:
    """Where the default group's place came from, and MPI's own view."""
    from mpi4py import MPI

    return {
        "config": C.show_config().splitlines()[-1],
        "mpi": [MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()],
    }


def new_group_other_backend() -> dict[str, Any]:
    """A cpu group inside an mpi job (no store) is refused with a clear error."""
    return _try(lambda: C.new_group([0, 1], backend="cpu"))


def new_group_missing_rank(skipper: int, sleep: float) -> dict[str, Any]:
    """Rank ``skipper`` does not call new_group in time; the others fail under the timeout."""
    if C.get_rank() == skipper:
        time.sleep(sleep)
        return {"type": None}
    return _try(lambda: C.new_group([0, 1]))


def user_comm_untouched(seed: int) -> int:
    """The user's own COMM_WORLD traffic does not mix with the group's (it uses a duplicate):
    post a user message, run collectives, then receive it."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    msg = np.full(3, seed + rank, dtype=np.int64)
    got = np.zeros(3, dtype=np.int64)
    reqs = [world.Isend(msg, dest=(rank + 1) % n, tag=1), world.Irecv(got, (rank - 1) % n, 1)]
    x = np.ones(10)
    for _ in range(3):
        C.all_reduce(x)
    C.barrier()
    MPI.Request.Waitall(reqs)
    if not (got == seed + (rank - 1) % n).all():
        raise AssertionError(f"user message corrupted: {got}")
    return int(x[0])


def pid() -> int:
    return os.getpid()


def mpi_subgroup_of_cpu_world(members: list[int]) -> dict[str, Any]:
    """In a cpu-backend world that mpiexec started, an mpi group over some ranks
    (``Comm.Create_group``): a SUM over its members, and the other ranks left out."""
    rank = C.get_rank()
    g = C.new_group(members, backend="mpi")
    if rank not in members:
        return {"member": False, "backend": C.get_backend()}
    if not isinstance(g, C.ProcessGroup):
        raise AssertionError(f"rank {rank} is a member but got {g!r}")
    x = np.full(5, rank + 1.0)
    C.all_reduce(x, group=g)
    expect = sum(m + 1.0 for m in members)
    if not (x == expect).all():
        raise AssertionError(f"sum over {members}: got {x}, expected {expect}")
    out = {"member": True, "backend": g.backend_name, "size": g.size, "value": float(x[0])}
    C.destroy_process_group(g)
    return out
