"""Where this process stands: Ignite's ``initialize``/``finalize`` and the ``get_*`` queries
(with the seed's ``rank()``/``world_size()``), and what a spawned worker knows of its spawner.

Nothing is cached: every query reads the collectives' default group as it is now, so a group
made with ``collectives.init_process_group`` directly is seen at once (Ignite's ``sync()`` has
no state to refresh). Outside any group every query answers for a world of one (Ignite's
serial model), and nothing is initialized by asking.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import collectives
import tensorlib as tl

from .._auto import default_device

__all__ = [
    "available_backends",
    "backend",
    "check_backend",
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
    "is_distributed",
    "model_name",
    "rank",
    "set_local_rank",
    "show_config",
    "spawned_worker",
    "world_size",
]

# Ignite scripts name torch's CPU backend; ours is "cpu".
ALIASES = {"gloo": "cpu"}
_INIT_KWARGS = ("timeout", "init_method", "rank", "world_size")


class _Support:
    """``has_*_support``: true when that backend is usable here. Ignite's are plain bools
    (``if idist.has_native_dist_support:``); these also answer when called."""

    def __init__(self, name: str | None) -> None:
        self.name = name

    def __bool__(self) -> bool:
        return self.name is not None and self.name in collectives.available_backends()

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return f"<has {self.name or 'no'} support: {bool(self)}>"


has_native_dist_support = _Support("cpu")
has_mpi_support = _Support("mpi")
has_nccl_support = _Support("nccl")
# Neither exists here; scripts that test for them take their other branch.
has_xla_support = _Support(None)
has_hvd_support = _Support(None)

_ext_local_rank: int | None = None


def is_distributed() -> bool:
    """True inside a process group of more than one rank."""
    return collectives.is_initialized() and collectives.get_world_size() > 1


def available_backends() -> tuple[str, ...]:
    """The backends usable here for a distributed run (the serial backend is not one)."""
    return tuple(b for b in collectives.available_backends() if b != "serial")


def check_backend(name: str | None, where: str) -> str | None:
    """``name`` with Ignite's aliases resolved (``gloo`` is ``cpu``), checked to be usable.

    Raises:
        ValueError: for a backend that is unknown or not usable here, listing those that are.
    """
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"{where}: backend must be a string or None, got {name!r}")
    resolved = ALIASES.get(name, name)
    if resolved == "serial" or resolved in available_backends():
        return resolved
    raise ValueError(
        f"{where}: backend {name!r} is not usable here; available backends: "
        f"{available_backends()} (and 'gloo', which means 'cpu')"
    )


@dataclass
class _Worker:
    """What a worker that ``idist.spawn``/``Parallel`` started knows of its spawner.

    Attributes:
        backend: the backend the spawner was given (resolved; None: choose).
        nprocs: number of ranks the spawner started.
        timeout: the spawner's group timeout in seconds (None: the default).
        in_group: True when the spawner joined the worker to its group before calling it
            (Ignite's ``spawn(backend, fn, ...)`` and ``Parallel``); False when the worker
            joins itself with :func:`initialize` (the seed's ``spawn(fn, args, nprocs)``).
        joined: the worker called :func:`initialize`.
    """

    backend: str | None
    nprocs: int
    timeout: float | None
    in_group: bool
    joined: bool = False


# Per thread: a spawned worker is a process's main thread, or one rank thread of a threads job.
_worker = threading.local()


def current_worker() -> _Worker | None:
    """This thread's spawner record, or None outside a spawned worker."""
    return getattr(_worker, "record", None)


@contextlib.contextmanager
def spawned_worker(
    backend: str | None, nprocs: int, timeout: float | None, in_group: bool
) -> Iterator[_Worker]:
    """Mark the calling thread as a spawned worker for the duration of the block, so that
    :func:`initialize` in it joins the spawner's ranks (see :class:`_Worker`)."""
    record = _Worker(backend, nprocs, timeout, in_group)
    _worker.record = record
    try:
        yield record
    finally:
        _worker.record = None


def _seconds(timeout: Any, default: float | None) -> float:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if timeout is None:
        return default if default is not None else 300.0
    return float(timeout)


def initialize(backend: str | None = None, **kwargs: Any) -> None:
    """Join the job's process group, as Ignite's ``idist.initialize``.

    Under a launcher (``python -m collectives.run``, torchrun-style variables, or ``mpiexec``
    for ``backend="mpi"``) this joins the launched ranks; in a process nobody launched it is a
    world of one on the serial backend (``backend()`` is then None).

    In a worker that ``idist.spawn(fn, args, nprocs)`` started (the seed's form), this joins
    the spawned ranks (processes or rank threads), on ``backend`` or else the one given to
    ``spawn`` (none: nccl with GPUs, else cpu). In a worker that the spawner has already put
    in its group (Ignite's ``spawn(backend, fn, ...)``, ``Parallel``), it has nothing to do
    when ``backend`` is None or the spawner's.

    Args:
        backend: ``"cpu"`` (or Ignite's ``"gloo"``), ``"nccl"``, ``"mpi"``, ``"threads"`` (in a
            rank thread), or None to choose.
        **kwargs: ``timeout`` (seconds or a timedelta), ``init_method``, ``rank`` and
            ``world_size``, as ``collectives.init_process_group`` takes them.

    Raises:
        ValueError: for an unusable backend, or one other than the group's that a spawner
            already made for this worker.
        TypeError: for another keyword argument, or options for a group the spawner made.
        RuntimeError: when a process group already exists (and no spawner made it).
    """
    name = check_backend(backend, "idist.initialize")
    unknown = sorted(set(kwargs) - set(_INIT_KWARGS))
    if unknown:
        raise TypeError(
            f"idist.initialize: unexpected arguments {unknown}; accepted: {_INIT_KWARGS}"
        )
    worker = current_worker()
    if worker is not None and worker.in_group and collectives.is_initialized():
        _adopt(worker, name, kwargs)
        return
    if collectives.is_initialized():
        raise RuntimeError(
            "idist.initialize: a process group already exists; call idist.finalize() first"
        )
    seconds = _seconds(kwargs.pop("timeout", None), worker.timeout if worker else None)
    if kwargs:
        # An explicit rendezvous (tcp://, or rank and world size given): exactly as asked.
        collectives.init_process_group(name, timeout=seconds, **kwargs)
    elif worker is not None:
        # The seed's spawn: the spawner set this rank's environment (or bound this rank
        # thread) and left the joining to the worker. Alone is serial, as everywhere here.
        chosen = name or worker.backend
        if worker.nprocs == 1 and worker.backend != "threads":
            chosen = "serial"
        collectives.init_process_group(chosen, timeout=seconds)
    else:
        # collectives.Parallel is the one place that tells a launched rank from a lone
        # process (torchrun variables, mpiexec's); entered without spawning it just joins
        # or starts alone.
        collectives.Parallel(backend=name, timeout=seconds).__enter__()
    if worker is not None:
        worker.joined = True


def _adopt(worker: _Worker, name: str | None, kwargs: dict[str, Any]) -> None:
    """``initialize`` in a worker the spawner has already joined: the group is the one asked
    for (no backend, or the spawner's), or the call is an error."""
    have = collectives.get_backend()
    if name is not None and name not in (worker.backend, have):
        raise ValueError(
            f"idist.initialize({name!r}): this worker is already in the group its spawner "
            f"made on backend {worker.backend or have!r}; give the backend to idist.spawn or "
            "idist.Parallel, or call initialize() without one"
        )
    if kwargs:
        raise TypeError(
            f"idist.initialize: this worker is already in the group its spawner made; "
            f"{sorted(kwargs)} are the spawner's options (pass them to idist.spawn or "
            "idist.Parallel)"
        )
    worker.joined = True


def finalize() -> None:
    """Leave and destroy the process group (a no-op when there is none)."""
    global _ext_local_rank
    from ._ops import forget_groups

    forget_groups()
    collectives.destroy_process_group()
    _ext_local_rank = None


def backend() -> str | None:
    """The default group's backend name, or None when not distributed (world size 1)."""
    if not collectives.is_initialized():
        return None
    name = collectives.get_backend()
    return None if name == "serial" else name


def model_name() -> str:
    """``"serial"`` alone, ``"native-dist"`` in a group of our own backends (Ignite's name for
    torch's native distributed model, which these backends stand in for)."""
    return "serial" if backend() is None else "native-dist"


def get_rank() -> int:
    """This process's global rank (0 outside any group)."""
    return collectives.get_rank()


def get_world_size() -> int:
    """Number of ranks (1 outside any group)."""
    return collectives.get_world_size()


def rank() -> int:
    """This process's global rank (0 outside any group): the seed's name for :func:`get_rank`."""
    return collectives.get_rank()


def world_size() -> int:
    """Number of ranks (1 outside any group): the seed's name for :func:`get_world_size`."""
    return collectives.get_world_size()


def get_local_rank() -> int:
    """This process's rank on its host (0 outside any group).

    The launcher's LOCAL_RANK wins; without one, the index given to :func:`set_local_rank`.
    """
    if not collectives.is_initialized():
        return 0
    if _ext_local_rank is not None and "LOCAL_RANK" not in os.environ:
        return _ext_local_rank
    return collectives.get_local_rank()


def get_nproc_per_node() -> int:
    """Number of ranks on each host (1 outside any group)."""
    if not collectives.is_initialized():
        return 1
    return max(1, collectives.get_local_world_size())


def get_nnodes() -> int:
    """Number of hosts (1 outside any group)."""
    return max(1, get_world_size() // get_nproc_per_node())


def get_node_rank() -> int:
    """This host's index among the hosts (0 outside any group)."""
    return get_rank() // get_nproc_per_node()


def hostname() -> str:
    """This host's name."""
    return socket.gethostname()


def device() -> tl.Device:
    """This rank's device: its GPU (``cuda:local_rank % count``) on nccl, else the CPU.

    Raises:
        RuntimeError: when the backend is nccl but no GPU is visible.
    """
    spec = default_device()
    return tl.device(spec if spec is not None else "cpu")


def set_local_rank(index: int) -> None:
    """Tell ``idist`` this process's local rank, for code that starts its own processes and
    makes the group itself without setting LOCAL_RANK.

    Raises:
        ValueError: when ``index`` is not a non-negative int.
    """
    global _ext_local_rank
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"idist.set_local_rank: index must be an int >= 0, got {index!r}")
    _ext_local_rank = index


def config_lines() -> list[str]:
    """What :func:`show_config` prints, one item a line."""
    return [
        f"distributed configuration: {model_name()}",
        f"backend: {backend()}",
        f"device: {device().type}",
        f"hostname: {hostname()}",
        f"world size: {get_world_size()}",
        f"rank: {get_rank()}",
        f"local rank: {get_local_rank()}",
        f"num processes per_node: {get_nproc_per_node()}",
        f"num nodes: {get_nnodes()}",
        f"node rank: {get_node_rank()}",
    ]


def show_config() -> None:
    """Print the distributed configuration to stderr, one ``ddp.idist: name: value`` a line."""
    for line in config_lines():
        print(f"ddp.idist: {line}", file=sys.stderr)
