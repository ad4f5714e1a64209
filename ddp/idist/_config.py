"""Where this process stands: Ignite's ``initialize``/``finalize`` and the ``get_*`` queries.

Nothing is cached: every query reads the collectives' default group as it is now, so a group
made with ``collectives.init_process_group`` directly is seen at once (Ignite's ``sync()`` has
nothing to do). Outside any group every query answers for a world of one (Ignite's serial
model), and nothing is initialized by asking.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
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
    "set_local_rank",
    "show_config",
    "sync",
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


def initialize(backend: str | None = None, **kwargs: Any) -> None:
    """Join the job's process group, as Ignite's ``idist.initialize``.

    Under a launcher (``python -m collectives.run``, torchrun-style variables, or ``mpiexec``
    for ``backend="mpi"``) this joins the launched ranks; in a process nobody launched it is a
    world of one on the serial backend (``backend()`` is then None).

    Args:
        backend: ``"cpu"`` (or Ignite's ``"gloo"``), ``"nccl"``, ``"mpi"``, or None to choose.
        **kwargs: ``timeout`` (seconds or a timedelta), ``init_method``, ``rank`` and
            ``world_size``, as ``collectives.init_process_group`` takes them.

    Raises:
        ValueError: for an unusable backend.
        TypeError: for another keyword argument.
        RuntimeError: when a process group already exists.
    """
    name = check_backend(backend, "idist.initialize")
    unknown = sorted(set(kwargs) - set(_INIT_KWARGS))
    if unknown:
        raise TypeError(
            f"idist.initialize: unexpected arguments {unknown}; accepted: {_INIT_KWARGS}"
        )
    if collectives.is_initialized():
        raise RuntimeError(
            "idist.initialize: a process group already exists; call idist.finalize() first"
        )
    timeout = kwargs.pop("timeout", None)
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    seconds = float(timeout) if timeout is not None else 300.0
    if kwargs:
        # An explicit rendezvous (tcp://, or rank and world size given): exactly as asked.
        collectives.init_process_group(name, timeout=seconds, **kwargs)
        return
    # collectives.Parallel is the one place that tells a launched rank from a lone process
    # (torchrun variables, mpiexec's); entered without spawning it just joins or starts alone.
    collectives.Parallel(backend=name, timeout=seconds).__enter__()


def finalize() -> None:
    """Leave and destroy the process group (a no-op when there is none)."""
    global _ext_local_rank
    from ._ops import forget_groups

    forget_groups()
    collectives.destroy_process_group()
    _ext_local_rank = None


def sync(temporary: bool = False) -> None:
    """Nothing to do: every ``idist`` call reads the process group as it is now.

    Kept so that Ignite scripts which call it after making a group by hand run unchanged.
    """


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
