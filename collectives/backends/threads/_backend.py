"""The ``threads`` backend: every rank is a thread of this process, bound to one device.

``spawn(fn, nprocs=N, backend="threads", devices=[...])`` runs ``fn(rank, ...)`` in N threads
(:mod:`collectives.launch._threads_run`); inside each, the module-level API is that rank's
(``collectives._api`` keeps the default group per rank thread), so DDP, the sampler and user
code are the same as with one process a rank. Ranks meet in process memory (:mod:`._meet`);
the store of the job is an in-process dict (:mod:`._store`).

**Engines, by where the arrays live.** The devices of a group's members decide which engine
moves its data, through a small registry keyed by the device's kind (``device.type``):

=======  ================================================================================
kind     engine
=======  ================================================================================
cpu      NumPy (:mod:`._numpy`): each rank reduces its slice of the peers' arrays,
         in place, in process memory (no shared-memory segments, no copies through a store)
cuda     NCCL (:mod:`._nccl`): one communicator per device thread, made in this
         process, each thread issuing its own calls on its own stream
=======  ================================================================================

A package *above* collectives adds an engine for its own devices with
:func:`register_engine` (the remote package registers ``"remote"``: collectives never imports
it). An engine is a :class:`~collectives.Backend` built per group and rank thread by
``factory(info, job)``; one that moves data itself subclasses :class:`ThreadEngine`, whose
:meth:`~ThreadEngine.meet` and :meth:`~ThreadEngine.phase` give the in-memory rendezvous with
its signature check, timeouts and failure rules.
"""

from __future__ import annotations

from ..._registry import register_backend
from . import _nccl, _numpy  # noqa: F401  (importing registers the engines)
from ._engines import make_backend

register_backend(
    "threads",
    make_backend,
    description="rank threads of one process, one device each (NumPy in process memory; "
    "CuPy on NCCL communicators of this process; engines of other packages)",
)
