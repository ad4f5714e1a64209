"""Module-level API: the default process group and functions that act on it."""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorlib import Device

from . import _rank_threads
from ._backend import GroupInfo
from ._env import EnvConfig, EnvError, mpiexec_world_size, read_env
from ._errorfile import install_excepthook
from ._exit import on_uncaught
from ._group import NonMemberGroup, ProcessGroup
from ._init_method import resolve_init_method
from ._lifecycle import Peers, agree_on_members, bound_store, leave, reachable, release, rendezvous
from ._rank_threads import thread as _thread
from ._registry import available_backends, get_backend_spec, registered_backends
from ._setup_wait import SetupWatch, remember_peers
from ._types import ReduceOp

__all__ = [
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "alloc",
    "barrier",
    "broadcast",
    "broadcast_object",
    "destroy_process_group",
    "get_backend",
    "get_default_group",
    "get_device",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "show_config",
]

DEFAULT_TIMEOUT = 300.0


@dataclass
class _World:
    default: ProcessGroup
    env: EnvConfig
    store: Any
    timeout: float
    groups: list[ProcessGroup] = field(default_factory=list)
    group_counter: int = 0
    peers: Peers = field(default_factory=dict)  # every rank's (pid, host), from the store


_world: _World | None = None  # the process's (every backend but threads)
_lock = threading.RLock()

_atexit_registered = False
# An uncaught exception is ending this process (see _on_uncaught).
_failing = False


def _seconds(timeout: float | datetime.timedelta | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    t = float(timeout)
    if not t > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return t


def _default_backend(world_size: int) -> str:
    if world_size == 1:
        return "serial"
    avail = available_backends()
    if "nccl" in avail:
        from tensorlib import cuda_is_available

        if cuda_is_available():
            return "nccl"
    return "cpu"


def init_process_group(
    backend: str | None = None,
    init_method: str = "env://",
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT,
) -> ProcessGroup:
    """Join the job's default process group.

    Args:
        backend: ``"serial"``, ``"cpu"``, ``"nccl"``, ``"mpi"``, or None to choose: mpi for
            several ranks that mpiexec started without MASTER_PORT (when mpi4py is
            installed), serial at world size 1, nccl when GPUs and NCCL are present, else cpu.
        init_method: ``"env://"`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT..., or SLURM's or
            Open MPI's variables) or ``"tcp://host:port"`` with ``rank``/``world_size``.
        rank: this process's rank (overrides the environment).
        world_size: number of processes (overrides the environment).
        timeout: seconds (or a timedelta) a collective may take before it fails on every rank.

    Returns:
        The default group.

    Raises:
        RuntimeError: if already initialized.
        ValueError: for missing or inconsistent configuration (the error names the variable).
    """
    global _world, _atexit_registered
    if _thread.job is not None or backend == "threads":
        return _init_rank_thread(backend, seconds=_seconds(timeout))
    with _lock:
        if _world is not None:
            raise RuntimeError(
                "init_process_group() was already called; call destroy_process_group() first"
            )
        seconds = _seconds(timeout)
        install_excepthook()  # under a launcher: this rank's traceback goes to its error file
        store: Any = None
        peers: Peers = {}
        if backend is None and _started_by_mpiexec():
            backend = "mpi"
        if backend is not None and get_backend_spec(backend).world is not None:
            # The backend's own runtime (mpiexec) placed this process: no store to meet at.
            spec = get_backend_spec(backend)
            reason = spec.probe()
            if reason is not None:
                raise RuntimeError(f"backend {backend!r} is not usable here: {reason}")
            env = _world_from_backend(spec, init_method, rank, world_size)
        else:
            env = resolve_init_method(init_method, rank=rank, world_size=world_size)
            name = backend if backend is not None else _default_backend(env.world_size)
            spec = get_backend_spec(name)
            reason = spec.probe()
            if reason is not None:
                raise RuntimeError(f"backend {name!r} is not usable here: {reason}")
            if env.world_size > 1:
                store, peers = rendezvous(env, seconds)
                remember_peers(store, peers, env.rank)  # for setups that outlive rank 0
                # Registered before the backends' own callbacks, so that it runs first.
                on_uncaught(_on_uncaught)
        info = GroupInfo(
            rank=env.rank,
            size=env.world_size,
            ranks=tuple(range(env.world_size)),
            global_rank=env.rank,
            name="world",
            store=store,
            timeout=seconds,
            local_rank=env.local_rank,
        )
        try:
            group = ProcessGroup(spec.factory(info))
        except BaseException:
            if store is not None:
                release(store)
            raise
        _world = _World(default=group, env=env, store=store, timeout=seconds, peers=peers)
        _world.groups.append(group)
        if store is not None and not _atexit_registered:
            # Ranks that end without destroy_process_group() still tell the store host.
            atexit.register(destroy_process_group)
            _atexit_registered = True
        return group


def _init_rank_thread(backend: str | None, seconds: float) -> ProcessGroup:
    """``init_process_group`` in a rank thread of a threads job: that thread's own world."""
    env, info = _rank_threads.world_info(backend, seconds)
    group = ProcessGroup(get_backend_spec("threads").factory(info))
    world = _World(default=group, env=env, store=info.store, timeout=seconds)
    world.groups.append(group)
    _thread.world = world
    return group


def _started_by_mpiexec() -> bool:
    """Several ranks that an MPI launcher started, with no store address, and mpi4py here:
    ``init_process_group()`` then means the mpi backend (as under Horovod)."""
    env = os.environ
    if "MASTER_PORT" in env or ("RANK" in env and "WORLD_SIZE" in env):
        return False
    return mpiexec_world_size() > 1 and "mpi" in available_backends()


def _world_from_backend(
    spec: Any, init_method: str, rank: int | None, world_size: int | None
) -> EnvConfig:
    """Rank and size from the backend's runtime (MPI), checked against any the environment,
    the init method or the arguments give: they must describe the same process."""
    b_rank, b_size, b_local, b_local_size = spec.world()
    base = dict(os.environ)
    # The store's address is not needed; defaults keep read_env from asking for it.
    base.setdefault("MASTER_ADDR", "127.0.0.1")
    base.setdefault("MASTER_PORT", "1")
    try:
        given = resolve_init_method(init_method, rank=rank, world_size=world_size, environ=base)
    except EnvError as exc:
        raise EnvError(f"init_process_group(backend={spec.name!r}): {exc}") from exc
    if given.source != "default" and (given.rank, given.world_size) != (b_rank, b_size):
        raise EnvError(
            f"init_process_group(backend={spec.name!r}): the {given.source} settings make this "
            f"process rank {given.rank} of {given.world_size}, but {spec.name.upper()} started "
            f"it as rank {b_rank} of {b_size}"
            + (" (a singleton: it was not started by mpiexec/mpirun)" if b_size == 1 else "")
            + f". Start every rank with `mpiexec -n {given.world_size} python ...` (not "
            "collectives.run, torchrun or spawn, whose processes MPI cannot join), or use "
            "backend='cpu' with those launchers"
        )
    return EnvConfig(
        rank=b_rank,
        world_size=b_size,
        local_rank=b_local,
        local_world_size=b_local_size,
        master_addr="",
        master_port=0,
        source=spec.name if given.source == "default" else f"{given.source}+{spec.name}",
    )


def _current() -> _World | None:
    """The world of the calling thread: a rank thread's own, else the process's (a thread of
    a threads job that is not a rank sees the process's, usually none)."""
    if _thread.job is not None:
        return _thread.world
    return _world


def bind_rank_thread(job: Any, rank: int) -> None:
    """Make the calling thread rank ``rank`` of the threads ``job`` (None: no rank any more);
    ``init_process_group()`` in it then joins that job. Used by ``spawn(backend="threads")``."""
    _rank_threads.bind(job, rank)


def _require() -> _World:
    world = _current()
    if world is None:
        if _thread.job is not None:
            raise RuntimeError(
                f"rank thread {_thread.rank} of a threads job used collectives before calling "
                "init_process_group() (spawn(..., init=False) leaves that to the function)"
            )
        _implicit_serial()
        world = _world
    assert world is not None
    return world


def _implicit_serial() -> None:
    # Scripts run without a launcher behave as world size 1, so code never branches. A job
    # launched with several ranks but no init call is a bug: say so instead of silently
    # running every rank alone.
    try:
        env = read_env(dict(os.environ))
        size = env.world_size
    except ValueError:
        size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size > 1:
        raise RuntimeError(
            f"this process was launched as one of {size} ranks but init_process_group() was "
            "not called"
        )
    init_process_group(backend="serial", rank=0, world_size=1)


def is_initialized() -> bool:
    """True after ``init_process_group`` (or an implicit world-size-1 start); in a rank
    thread of a threads job, whether that rank joined."""
    return _current() is not None


def destroy_process_group(group: ProcessGroup | NonMemberGroup | None = None) -> None:
    """Destroy ``group``, or every group and the store when None (idempotent).

    Every rank may pass what ``new_group`` returned to it (a no-op on non-members).
    """
    global _world
    if _thread.job is not None:
        _destroy_rank_thread(group)
        return
    with _lock:
        if _world is None:
            return
        if group is not None and group is not _world.default:
            group.destroy()
            if group in _world.groups:
                _world.groups.remove(group)
            return
        world, store = _world, _world.store
        gone = False
        if store is not None:
            # Leaving gets short deadlines of its own, never the group's timeout: a store
            # host that is frozen or gone must not hold this rank's exit (see _lifecycle).
            bound_store(store)
            gone = not reachable(store, world.env.rank)
            if gone:
                release(store)  # the backends' goodbyes then fail at once, not each in 2 s
        for g in reversed(world.groups):
            g.destroy()
        if store is not None and not gone:
            failed = _failing or any(g.backend.error is not None for g in world.groups)
            leave(store, world.env, world.timeout, world.peers, failed)
            release(store)
        _world = None


def _destroy_rank_thread(group: ProcessGroup | NonMemberGroup | None) -> None:
    world = _thread.world
    if world is None:
        return
    if group is not None and group is not world.default:
        group.destroy()
        if group in world.groups:
            world.groups.remove(group)
        return
    _rank_threads.leave(world.groups, world.store, world.env.rank)


def _on_uncaught(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    # The process is ending: every store call from here on (the backends' "tell the peers",
    # then atexit's destroy) gets the short leaving deadline.
    global _failing
    _failing = True
    world = _world
    if world is not None and world.store is not None:
        bound_store(world.store)


def get_default_group() -> ProcessGroup:
    """The default group (initializing a world of one if nothing was initialized)."""
    return _require().default


def _group(group: ProcessGroup | NonMemberGroup | None) -> Any:
    return _require().default if group is None else group


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank (in ``group``; 0 when nothing was initialized)."""
    if group is None and _current() is None:
        return 0
    return int(_group(group).rank)


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks (in ``group``; 1 when nothing was initialized)."""
    if group is None and _current() is None:
        return 1
    return int(_group(group).size)


def get_local_rank() -> int:
    """This process's rank on its host (LOCAL_RANK; 0 when nothing was initialized)."""
    world = _current()
    return 0 if world is None else world.env.local_rank


def get_local_world_size() -> int:
    """Number of ranks on this host (LOCAL_WORLD_SIZE; 1 when nothing was initialized)."""
    world = _current()
    return 1 if world is None else world.env.local_world_size


def get_device() -> Device:
    """This rank's device: the device a threads rank is bound to, ``cuda:N`` under nccl (the
    GPU its group communicates on, ``LOCAL_RANK`` modulo the visible GPUs), else the CPU.

    Returns:
        A tensorlib :class:`~tensorlib.Device` (or the device object a threads job was given,
        e.g. a remote device).
    """
    world = _current()
    return _rank_threads.device_of(None if world is None else world.default.backend)


def get_backend(group: ProcessGroup | None = None) -> str:
    """Name of the backend of ``group`` (default group when None)."""
    return str(_group(group).backend_name)


def new_group(
    ranks: Sequence[int] | None = None,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> ProcessGroup | NonMemberGroup:
    """Create a group of some global ranks. Every rank of the job must call it, in the same order.

    ``ranks`` is a set: ``[1, 0]`` and ``[0, 1]`` make the same group, in which ranks are
    numbered in global rank order (as in PyTorch). When the job has a store, every rank
    checks that all passed the same ranks and backend before the group is built.

    Args:
        ranks: the members' global ranks, unique, in any order (None: every rank).
        backend: the group's backend (None: the default group's; serial for one member).
        timeout: the group's timeout (None: the default group's).

    Returns:
        The group on its members; a :class:`NonMemberGroup` (whose collectives raise) elsewhere.

    Raises:
        ValueError: ``ranks`` has duplicates, is empty or out of range.
        CollectiveMismatchError: the ranks passed different members or backends (the
            message shows which rank passed what).
        CollectiveTimeoutError: some ranks did not call ``new_group`` within the timeout.
    """
    world = _require()
    size = world.default.size
    given = tuple(range(size)) if ranks is None else tuple(int(r) for r in ranks)
    if not given or len(set(given)) != len(given):
        raise ValueError(f"new_group: ranks must be unique and non-empty, got {list(given)}")
    members = tuple(sorted(given))
    bad = [r for r in members if not 0 <= r < size]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are out of range for world size {size}")
    with _lock:
        world.group_counter += 1
        counter = world.group_counter
    me = world.default.info.global_rank
    default_backend = world.default.backend_name
    bname = backend or ("serial" if len(members) == 1 else default_backend)
    if bname == "serial" and len(members) > 1:
        bname = "cpu"
    if world.env.source == "threads" and bname not in ("threads", "serial"):
        raise ValueError(
            f"new_group(backend={bname!r}) in a threads job: its ranks are threads of one "
            "process, so its groups use backend 'threads' (pass backend=None)"
        )
    spec = get_backend_spec(bname)
    if world.store is None and size > 1 and len(members) > 1 and spec.world is None:
        raise ValueError(
            f"new_group(backend={bname!r}): that backend meets through the job's TCP store, "
            f"which a job initialized with backend {default_backend!r} does not have; use "
            f"backend={default_backend!r} for this group"
        )
    if spec.world is not None and bname != default_backend:
        # The backend's runtime (MPI) starts on every rank of the job, members or not (its
        # initialization is collective), and must see the same ranks as this job.
        b_rank, b_size, _, _ = spec.world()
        if (b_rank, b_size) != (me, size):
            raise ValueError(
                f"new_group(backend={bname!r}): this process is rank {me} of {size} in the "
                f"job but rank {b_rank} of {b_size} to {bname.upper()}; such groups need a job "
                "that mpiexec started"
            )
    seconds = _seconds(timeout) if timeout is not None else world.timeout
    if world.store is not None:
        # Different lists on different ranks would otherwise meet under different keys and
        # wait out the timeout; say at once which rank passed what.
        watch = SetupWatch(world.default.info, "new_group", counter)
        agree_on_members(watch, counter, members, bname, seconds)
    # A backend may build the new group from the default group's (ncclCommSplit): every rank
    # of the default group takes part, members or not.
    parent = world.default.backend if bname == default_backend else None
    if me not in members:
        if parent is not None:
            parent.split(None)
        return NonMemberGroup(members, me)
    digest = zlib.crc32(",".join(map(str, members)).encode())
    name = f"g{counter}-{digest:08x}"
    info = GroupInfo(
        rank=members.index(me),
        size=len(members),
        ranks=members,
        global_rank=me,
        name=name,
        store=world.store,
        timeout=seconds,
        local_rank=world.env.local_rank,
    )
    made = parent.split(info) if parent is not None else None
    group = ProcessGroup(made if made is not None else spec.factory(info))
    world.groups.append(group)
    return group


def show_config() -> str:
    """Describe every backend: usable here, or why not."""
    lines = ["collectives backends:"]
    for name in registered_backends():
        spec = get_backend_spec(name)
        reason = spec.probe()
        state = "available" if reason is None else f"unavailable: {reason}"
        lines.append(f"  {name:7s} {state}. {spec.description}")
    world = _current()
    if world is not None:
        d = world.default
        lines.append(
            f"initialized: backend={d.backend_name} rank={d.rank} world_size={d.size} "
            f"local_rank={world.env.local_rank} (from {world.env.source})"
        )
    else:
        lines.append("not initialized")
    return "\n".join(lines)


# ---------------------------------------------------------------------- collectives
def all_reduce(
    x: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``x`` across the group in place (see :meth:`ProcessGroup.all_reduce`)."""
    return _group(group).all_reduce(x, op, async_op=async_op)


def broadcast(x: Any, src: int, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Copy ``x`` from global rank ``src`` to every rank, in place."""
    return _group(group).broadcast(x, src, async_op=async_op)


def reduce(
    x: Any,
    dst: int,
    op: ReduceOp | str = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``x`` into global rank ``dst``'s ``x``."""
    return _group(group).reduce(x, dst, op, async_op=async_op)


def all_gather(
    x: Any, out: Any = None, group: ProcessGroup | None = None, async_op: bool = False
) -> Any:
    """Gather ``x`` from every rank into shape ``(world_size, *x.shape)``."""
    return _group(group).all_gather(x, out=out, async_op=async_op)


def reduce_scatter(
    x: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    out: Any = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``x`` and give each rank its block of the first axis."""
    return _group(group).reduce_scatter(x, op, out=out, async_op=async_op)


def all_to_all(
    x: Any, out: Any = None, group: ProcessGroup | None = None, async_op: bool = False
) -> Any:
    """Exchange blocks of the first axis between all ranks."""
    return _group(group).all_to_all(x, out=out, async_op=async_op)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Wait for every rank of the group."""
    return _group(group).barrier(async_op=async_op)


def send(x: Any, dst: int, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Send ``x`` to global rank ``dst``."""
    return _group(group).send(x, dst, async_op=async_op)


def recv(x: Any, src: int, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Receive into ``x`` from global rank ``src``."""
    return _group(group).recv(x, src, async_op=async_op)


def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Broadcast a small JSON-able value from ``src``."""
    return _group(group).broadcast_object(obj, src)


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Gather a small JSON-able value from every rank."""
    return list(_group(group).all_gather_object(obj))


def alloc(shape: Any, dtype: Any = "float32", group: ProcessGroup | None = None) -> Any:
    """Collectively allocate an array the backend reduces without copies (see ProcessGroup)."""
    return _group(group).alloc(shape, dtype)
