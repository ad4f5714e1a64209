"""Test bodies for faults during group setup (``new_group``, ``alloc``, DDP's buckets).

Run in every rank of a :class:`~tests.collectives.harness.RankPool`. One rank (the victim)
dies just before (or, for DDP, inside) a setup call that every rank makes; the others report
what that call raised and how long it took.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

import collectives as C
from tests.collectives.bodies import _try, _world


def _die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "raise":  # run with uncaught=True: the exception ends the process
        # Its abort flag must not reach peers still checking the barrier before (that barrier
        # would fail instead of the setup call).
        time.sleep(0.3)
        raise ValueError("boom before the setup call")
    if how == "leave":  # alive, but done with the job
        C.destroy_process_group()
        return
    os._exit(3)  # "exit": ends without cleanup code, as a crashing extension would


def die_at_setup(step: str, victim: int, how: str = "kill") -> dict[str, Any]:
    """Every rank makes setup call ``step``; rank ``victim`` dies instead (``how``: ``kill``,
    ``exit``, ``raise`` an uncaught exception, or ``leave`` the job with
    destroy_process_group). Returns what the call raised on this rank (the victim's reply:
    none, or ``{"left": True}``)."""
    rank, n = _world()
    C.barrier()  # everyone is up and past init: the death is at the setup call itself
    if step == "new_group":
        return _attempt(lambda: C.new_group(list(range(n))), rank, victim, how)
    if step == "alloc":
        return _attempt(lambda: C.alloc(1000, "float32"), rank, victim, how)
    if step == "ddp":
        return _ddp(rank, victim, how)
    raise ValueError(step)


def _attempt(fn: Any, rank: int, victim: int, how: str) -> dict[str, Any]:
    if rank == victim:
        _die(how)
        return {"left": True}
    return _try(fn)


def _ddp(rank: int, victim: int, how: str) -> dict[str, Any]:
    """DDP construction: the victim takes part in the model check and the broadcast, then
    dies in its first bucket allocation, while the others allocate theirs."""
    import tensorlib as tl
    from ddp import DistributedDataParallel
    from tensorlib import nn

    tl.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    group = C.get_default_group()
    if rank == victim:

        def die_in_alloc(*args: Any, **kwargs: Any) -> Any:
            _die(how)

        group.alloc = die_in_alloc  # type: ignore[method-assign]
    return _try(lambda: DistributedDataParallel(model))


def after_setup_is_usable(size: int) -> float:
    """A sanity body: after a clean new_group and alloc, an all_reduce on both works."""
    rank, n = _world()
    g = C.new_group(list(range(n)))
    assert isinstance(g, C.ProcessGroup)
    x = g.alloc(size, "float32")
    x[:] = rank + 1.0
    g.all_reduce(x)
    C.destroy_process_group(g)
    return float(np.asarray(x)[0])


__all__ = ["after_setup_is_usable", "die_at_setup"]
