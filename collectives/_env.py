"""env:// configuration: rank, world size, local rank and the store's address from the environment.

Sources, in order of precedence (the first one present gives rank and world size):

1. torchrun's names: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT`` (also set by ``python -m collectives.run`` and ``spawn``).
2. Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
   ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``. It comes before SLURM because
   processes that ``mpirun`` starts inside a SLURM job inherit ``SLURM_*`` variables that
   describe mpirun's daemons (one per node), not the ranks.
3. MPICH's Hydra ``mpiexec`` (and Intel MPI): ``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``; before SLURM for the same reason.
4. SLURM's ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``,
   ``SLURM_LOCALID``, and the tasks on this node from ``SLURM_STEP_TASKS_PER_NODE``/
   ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``, indexed by ``SLURM_NODEID``) or
   ``SLURM_NTASKS_PER_NODE``.
5. Nothing set: a single process (rank 0 of 1).

Explicit ``rank``/``world_size`` arguments override the environment. ``MASTER_ADDR`` defaults to
``127.0.0.1`` when the world size is 1 or every rank is on this host (LOCAL_WORLD_SIZE equals
WORLD_SIZE); in a SLURM job it falls back to the first host of the step's node list (where
srun puts task 0), then ``SLURM_LAUNCH_NODE_IPADDR``; otherwise a world size > 1 without it is
an error. ``MASTER_PORT`` falls back, in a SLURM job, to ``15000 + SLURM_JOB_ID % 20000`` (the
same on every task, and likely different between jobs); a world size of 1 needs no port
(``master_port`` is 0).

When torchrun's names and Open MPI's or SLURM's are both set they must agree where they
describe the same processes: if ``WORLD_SIZE`` equals the other launcher's size, ``RANK``,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` must equal its values. A larger ``WORLD_SIZE`` is a
launcher nested inside the other (``srun ... torchrun --nproc-per-node 4``) and wins; a
smaller one is an error. When a launcher's marker is set (``TORCHELASTIC_RUN_ID`` from
torchrun, ``DPT_RUN_ID`` from ``collectives.run``/``spawn``) the torchrun names were written by
a launcher started inside the other one and win without comparison. Every error is an
:class:`EnvError` naming the variable and its value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ._store import is_local_address

__all__ = [
    "EnvConfig",
    "EnvError",
    "check_host",
    "mpiexec_world_size",
    "read_env",
]

_INT = re.compile(r"[+-]?[0-9]+")
_TASKS_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_HOST = re.compile(r"[A-Za-z0-9._:%-]+")
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 20000
# Variables a launcher sets next to RANK/WORLD_SIZE (torchrun; collectives.run and spawn).
_LAUNCHER_MARKERS = ("TORCHELASTIC_RUN_ID", "DPT_RUN_ID")


class EnvError(ValueError):
    """The launch configuration is missing, malformed or inconsistent (names the variable)."""


@dataclass(frozen=True)
class EnvConfig:
    """Where this process sits in the job, and where the rendezvous store is.

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        local_rank: rank among the processes on this host (selects the GPU).
        local_world_size: number of processes on this host.
        master_addr: host of rank 0, which hosts the store.
        master_port: the store's port; 0 when ``world_size == 1`` and none was given.
        source: where rank and world size came from: ``"torchrun"``, ``"ompi"``, ``"pmi"``
            (MPICH's Hydra), ``"slurm"``, ``"args"`` (both given as arguments) or
            ``"default"`` (nothing set).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str


class _Sourced(NamedTuple):
    """An integer setting and the variable (or argument) it came from, for messages."""

    value: int
    var: str


@dataclass(frozen=True)
class _LauncherReading:
    """What one launcher's variables say about this process (None: the variable is unset)."""

    name: str  # the EnvConfig.source it gives: "torchrun", "ompi", "pmi" or "slurm"
    rank_var: str  # the variables named when rank or world size is missing
    world_var: str
    present: bool  # this launcher started the process (its rank or size variable is set)
    rank: _Sourced | None
    world: _Sourced | None
    local_rank: _Sourced | None
    local_world: _Sourced | None


class _MasterHints(NamedTuple):
    """Where rank 0's host may be named: ``MASTER_ADDR`` (checked) and SLURM's node list."""

    env: str | None
    slurm: str | None


class _EnvReader:
    """Reads variables, treating empty ones as unset, and parses integers with clear errors."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def text(self, name: str) -> str | None:
        raw = self.environ.get(name)
        if raw is None or not raw.strip():
            return None
        return raw.strip()

    def integer(self, name: str, minimum: int = 0) -> _Sourced | None:
        raw = self.text(name)
        if raw is None:
            return None
        if not _INT.fullmatch(raw):
            raise EnvError(f"{name} must be an integer, got {self.environ[name]!r}")
        value = int(raw)
        if value < minimum:
            raise EnvError(f"{name} must be >= {minimum}, got {self.environ[name]!r}")
        return _Sourced(value, name)


def read_env(
    environ: Mapping[str, str] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> EnvConfig:
    """Read this process's place in the job from the launcher's environment variables.

    See the module docstring for the variables, their precedence and the defaults.

    Args:
        environ: the variables to read (default: ``os.environ``).
        rank: this process's rank; overrides the environment.
        world_size: the number of processes; overrides the environment.

    Returns:
        The validated configuration.

    Raises:
        EnvError: a variable is missing, not an integer, out of range, or two launchers'
            variables disagree; the message names the variables and their values.
    """
    env = _EnvReader(os.environ if environ is None else environ)
    rank_arg = _check_arg("rank", rank, 0)
    world_arg = _check_arg("world_size", world_size, 1)
    # Read in order of precedence (the first present one gives rank and world size).
    torchrun = _read_launcher(env, "torchrun")
    readings = [torchrun, _read_launcher(env, "ompi"), _read_launcher(env, "pmi"), _read_slurm(env)]
    launchers = [r for r in readings if r.present]
    primary = launchers[0] if launchers else None
    # Both arguments given: they replace the launchers' view of the job, layout included.
    layout_from = None if rank_arg is not None and world_arg is not None else primary

    rank_val, world = _rank_and_world(primary, rank_arg, world_arg)
    if layout_from is not None:
        _check_consistent(env, launchers, override_rank=rank_arg is not None)
    local_rank, local_world = _launcher_local_values(torchrun, layout_from, world)
    hints = _MasterHints(_master_addr_env(env), _slurm_master(env))
    local_rank, local_world = _local_layout(local_rank, local_world, rank_val, world, hints)
    if layout_from is not None:
        source = layout_from.name
    else:
        source = "default" if rank_arg is None and world_arg is None else "args"
    return EnvConfig(
        rank=rank_val.value,
        world_size=world.value,
        local_rank=local_rank.value,
        local_world_size=local_world.value,
        master_addr=_master_addr(hints, world, local_world),
        master_port=_master_port(env, world),
        source=source,
    )


def _rank_and_world(
    primary: _LauncherReading | None, rank_arg: _Sourced | None, world_arg: _Sourced | None
) -> tuple[_Sourced, _Sourced]:
    """Rank and world size: the arguments, else the first launcher's, else a world of one."""
    world = world_arg
    if world is None and primary is not None:
        world = primary.world
        if world is None:
            raise EnvError(f"{primary.world_var} is not set ({primary.rank_var} is)")
    if world is None:
        if rank_arg is not None and rank_arg.value > 0:
            raise EnvError(
                f"rank={rank_arg.value} given without world_size, and WORLD_SIZE is not set"
            )
        world = _Sourced(1, "world_size")
    rank = rank_arg
    if rank is None and primary is not None:
        rank = primary.rank
    if rank is None:
        if world.value > 1:
            name = primary.rank_var if primary is not None else "RANK"
            raise EnvError(f"{name} is not set (needed with {world.var}={world.value} > 1)")
        rank = _Sourced(0, "rank")
    if rank.value >= world.value:
        raise EnvError(
            f"{rank.var}={rank.value} must be < {world.var}={world.value} (ranks count from 0)"
        )
    return rank, world


def _launcher_local_values(
    torchrun: _LauncherReading, layout_from: _LauncherReading | None, world: _Sourced
) -> tuple[_Sourced | None, _Sourced | None]:
    """Local rank and size as set: torchrun's names first, then the launcher's."""
    local_rank, local_world = torchrun.local_rank, torchrun.local_world
    if layout_from is not None:
        local_rank = local_rank or layout_from.local_rank
        local_world = local_world or layout_from.local_world
    if local_world is not None and local_world.value > world.value:
        raise EnvError(
            f"{local_world.var}={local_world.value} must be <= {world.var}={world.value}"
        )
    return local_rank, local_world


def _local_layout(
    local_rank: _Sourced | None,
    local_world: _Sourced | None,
    rank: _Sourced,
    world: _Sourced,
    hints: _MasterHints,
) -> tuple[_Sourced, _Sourced]:
    """Fill in what the launchers left unset of the local layout, or say why it cannot be."""
    if world.value == 1:
        local_rank = local_rank or _Sourced(0, "rank")
        local_world = local_world or _Sourced(1, "world_size")
    elif local_world is not None and local_world.value == world.value:
        local_rank = local_rank or rank
    elif local_rank is None or local_world is None:
        known_master = hints.env or hints.slurm
        if local_world is None and known_master is None:
            raise EnvError(
                f"MASTER_ADDR is not set: with {world.var}={world.value} > 1 every rank needs "
                "the address of rank 0's host (set MASTER_ADDR, e.g. 127.0.0.1 when all ranks "
                "run on this machine)"
            )
        if local_world is None and known_master is not None and is_local_address(known_master):
            # The store's host is this one: take every rank to be here (one machine).
            local_rank, local_world = local_rank or rank, world
        else:
            missing = "LOCAL_RANK" if local_rank is None else "LOCAL_WORLD_SIZE"
            if local_world is not None:
                why = (
                    f"{local_world.var}={local_world.value} < {world.var}={world.value} "
                    "puts ranks on several hosts"
                )
            else:
                why = f"MASTER_ADDR={known_master} is not this host, so ranks span several hosts"
            raise EnvError(
                f"{missing} is not set: {why}, and each rank needs LOCAL_RANK and "
                "LOCAL_WORLD_SIZE (torchrun and collectives.run set them)"
            )
    if local_rank.value >= local_world.value:
        raise EnvError(
            f"{local_rank.var}={local_rank.value} must be < {local_world.var}={local_world.value}"
        )
    return local_rank, local_world


def _master_addr_env(env: _EnvReader) -> str | None:
    """``MASTER_ADDR`` when set, checked (IPv6 brackets removed)."""
    master = env.text("MASTER_ADDR")
    return None if master is None else check_host("MASTER_ADDR", master)


def _master_addr(hints: _MasterHints, world: _Sourced, local_world: _Sourced) -> str:
    """Rank 0's host: MASTER_ADDR, else loopback when every rank is here, else SLURM's."""
    if hints.env is not None:
        return hints.env
    if world.value == 1 or local_world.value == world.value:
        return "127.0.0.1"
    if hints.slurm is not None:
        return hints.slurm
    raise EnvError(
        f"MASTER_ADDR is not set: with {world.var}={world.value} ranks on several hosts "
        f"({local_world.var}={local_world.value}) every rank needs rank 0's host address"
    )


def _master_port(env: _EnvReader, world: _Sourced) -> int:
    """The store's port: MASTER_PORT, else one derived from SLURM's job id, else 0 alone."""
    port = env.integer("MASTER_PORT", minimum=-(1 << 62))  # range checked below, one message
    if port is not None:
        if not 1 <= port.value <= 65535:
            raise EnvError(f"MASTER_PORT must be in 1..65535, got {env.environ['MASTER_PORT']!r}")
        return port.value
    if world.value > 1 and (job := env.integer("SLURM_JOB_ID")) is not None:
        return _SLURM_PORT_BASE + job.value % _SLURM_PORT_SPAN
    if world.value == 1:
        return 0
    raise EnvError(
        f"MASTER_PORT is not set (needed with {world.var}={world.value} > 1: the store's "
        "port, the same on every rank, e.g. 29500)"
    )


def mpiexec_world_size(environ: Mapping[str, str] | None = None) -> int:
    """How many ranks an MPI launcher says it started (Open MPI's ``OMPI_COMM_WORLD_SIZE``,
    MPICH's ``PMI_SIZE``), or 1 when this process was not started by one."""
    env = os.environ if environ is None else environ
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        raw = env.get(var, "").strip()
        if raw.isdigit():
            return int(raw)
    return 1


# ----------------------------------------------------------------------------- helpers
def _check_arg(name: str, value: int | None, minimum: int) -> _Sourced | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise EnvError(f"{name} must be >= {minimum}, got {value}")
    return _Sourced(value, name)


def check_host(name: str, host: str) -> str:
    """``host`` (brackets dropped from an IPv6 one) if it is a plain host name or address."""
    plain = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not _HOST.fullmatch(plain):
        raise EnvError(f"{name} must be a host name or IP address, got {host!r}")
    return plain


# Each launcher's names for (rank, world size, local rank, local world size); SLURM's are read
# by _read_slurm (its sizes have several sources).
_LAUNCHER_VARS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "ompi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    # MPICH's Hydra (and Intel MPI): PMI_* for the job, MPI_LOCAL* for this host.
    "pmi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def _read_launcher(env: _EnvReader, name: str) -> _LauncherReading:
    rank, world, local_rank, local_world = _LAUNCHER_VARS[name]
    rank_val, world_val = env.integer(rank), env.integer(world, 1)
    return _LauncherReading(
        name=name,
        rank_var=rank,
        world_var=world,
        present=rank_val is not None or world_val is not None,
        rank=rank_val,
        world=world_val,
        local_rank=env.integer(local_rank),
        local_world=env.integer(local_world, 1),
    )


def _read_slurm(env: _EnvReader) -> _LauncherReading:
    # The step's values (set by srun) describe this launch; the job's may be larger.
    world = env.integer("SLURM_STEP_NUM_TASKS", 1) or env.integer("SLURM_NTASKS", 1)
    world = world or env.integer("SLURM_NPROCS", 1)
    rank = env.integer("SLURM_PROCID")
    return _LauncherReading(
        name="slurm",
        rank_var="SLURM_PROCID",
        world_var="SLURM_NTASKS",
        present=rank is not None,  # srun sets SLURM_PROCID in each task it starts
        rank=rank,
        world=world,
        local_rank=env.integer("SLURM_LOCALID"),
        local_world=_slurm_tasks_here(env),
    )


def _slurm_tasks_here(env: _EnvReader) -> _Sourced | None:
    """The number of tasks on this node, from the per-node task counts."""
    node = env.integer("SLURM_NODEID")
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = env.text(name)
        if raw is None:
            continue
        counts = _parse_tasks_per_node(name, raw)
        if node is not None:
            if node.value >= len(counts):
                raise EnvError(
                    f"SLURM_NODEID={node.value} but {name}={raw!r} lists {len(counts)} nodes"
                )
            return _Sourced(counts[node.value], name)
        if len(set(counts)) == 1:
            return _Sourced(counts[0], name)
    return env.integer("SLURM_NTASKS_PER_NODE", 1)


def _parse_tasks_per_node(name: str, raw: str) -> list[int]:
    """``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for item in raw.split(","):
        m = _TASKS_ITEM.fullmatch(item.strip())
        if m is None:
            raise EnvError(f"{name} must look like '4(x2),3', got {raw!r}")
        count, repeat = int(m.group(1)), int(m.group(2) or 1)
        if count < 1 or repeat < 1 or repeat > 1_000_000:
            raise EnvError(f"{name} must look like '4(x2),3', got {raw!r}")
        counts.extend([count] * repeat)
    return counts


def _slurm_master(env: _EnvReader) -> str | None:
    """Rank 0's host in a SLURM job: first host of the node list, else the launch node."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        raw = env.text(name)
        if raw is not None:
            host = _first_host(raw)
            if host is not None:
                return host
    launch = env.text("SLURM_LAUNCH_NODE_IPADDR")
    if launch is not None and _HOST.fullmatch(launch):
        return launch
    return None


def _first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list (``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``).

    Returns None for anything not of that simple form.
    """
    depth = 0
    end = len(nodelist)
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()

    def first_of(m: re.Match[str]) -> str:
        return re.split(r"[-,]", m.group(1), maxsplit=1)[0]

    host = re.sub(r"\[([0-9]+(?:[-,][0-9]+)*)\]", first_of, first)
    return host if host and _HOST.fullmatch(host) else None


def _check_consistent(
    env: _EnvReader, launchers: list[_LauncherReading], *, override_rank: bool
) -> None:
    """Torchrun's names must agree with another launcher's that describe the same processes."""
    primary = launchers[0]
    if primary.name != "torchrun":
        # LOCAL_RANK set next to mpirun/srun (e.g. by a wrapper script) must match theirs.
        own = env.integer("LOCAL_RANK")
        theirs = primary.local_rank
        if own is not None and theirs is not None and own.value != theirs.value:
            _mismatch(own, theirs)
        return
    if any(env.text(marker) is not None for marker in _LAUNCHER_MARKERS):
        # Set by torchrun / collectives.run / spawn: a launcher started inside the other one
        # (srun ... torchrun, mpirun ... spawn) and its names describe this process.
        return
    for other in launchers[1:]:
        if primary.world is None or other.world is None:
            continue
        if other.world.value > primary.world.value:
            raise EnvError(
                f"inconsistent launcher variables: {primary.world.var}={primary.world.value} "
                f"but {other.world.var}={other.world.value} (the {other.name} launcher started "
                "more processes than WORLD_SIZE counts; unset the stale variables)"
            )
        if other.world.value < primary.world.value:
            continue  # a launcher started inside the other one: torchrun's names win
        pairs = [(primary.local_rank, other.local_rank), (primary.local_world, other.local_world)]
        if not override_rank:
            pairs.insert(0, (primary.rank, other.rank))
        for mine, theirs in pairs:
            if mine is not None and theirs is not None and mine.value != theirs.value:
                _mismatch(mine, theirs)


def _mismatch(a: _Sourced, b: _Sourced) -> None:
    raise EnvError(
        f"inconsistent launcher variables: {a.var}={a.value} but {b.var}={b.value} (both "
        "describe this process; unset one or make them agree)"
    )
