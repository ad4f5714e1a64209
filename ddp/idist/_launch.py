"""``spawn`` and ``Parallel`` over :func:`collectives.spawn` and ``collectives.Parallel``.

``spawn`` has two forms, told apart by the first argument's type:

- Ignite's ``spawn(backend, fn, args, kwargs_dict=None, nproc_per_node=1, ...)``: every
  rank calls ``fn(local_rank, *args, **kwargs_dict)`` with the group already initialized.
- the seed's ``spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn")``
  (torch.multiprocessing's signature): every rank calls ``fn(rank, *args)`` in the launcher's
  environment, and the worker joins the group itself with ``idist.initialize()``.

``Parallel`` takes Ignite's ``nproc_per_node`` or the seed's ``nprocs``. Ranks start on this
host only; a job on several hosts starts one ``python -m collectives.run --nnodes N
--node-rank I ...`` per host and uses ``Parallel(backend=...)`` without a count.
"""

from __future__ import annotations

import atexit
import datetime
import functools
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, overload

import collectives

from ._config import check_backend, finalize, get_local_rank, spawned_worker

__all__ = ["Parallel", "spawn"]

_SPAWN_KWARGS = ("timeout", "start_method", "grace_period", "max_restarts", "join", "daemon")
_LOOPBACK = (None, "127.0.0.1", "localhost", "::1")


def _one_node(where: str, nnodes: int, node_rank: int, master_addr: str | None) -> None:
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"{where}: nnodes must be a positive int, got {nnodes!r}")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"{where}: node_rank must be in [0, {nnodes}), got {node_rank!r}")
    if nnodes > 1:
        raise ValueError(
            f"{where}: nnodes={nnodes}: this spawn starts ranks on this host only; on several "
            "hosts run `python -m collectives.run --nnodes N --node-rank I --master-addr A "
            "--master-port P script.py` on each, with idist.Parallel(backend=...) and no "
            "nproc_per_node in the script"
        )
    if master_addr not in _LOOPBACK:
        raise ValueError(
            f"{where}: master_addr={master_addr!r}: ranks spawned on one host meet on "
            "127.0.0.1; leave master_addr None"
        )


def _spawn_options(where: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(_SPAWN_KWARGS) - {"init_method"})
    if unknown:
        raise TypeError(f"{where}: unexpected arguments {unknown}; accepted: {_SPAWN_KWARGS}")
    if kwargs.get("init_method") not in (None, "env://"):
        raise ValueError(
            f"{where}: spawned ranks meet through env://, got init_method={kwargs['init_method']!r}"
        )
    opts = {k: kwargs[k] for k in ("start_method", "grace_period", "max_restarts") if k in kwargs}
    timeout = kwargs.get("timeout")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if timeout is not None:
        opts["timeout"] = float(timeout)
    return opts


def _flag(where: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be True or False, got {value!r}")
    return value


def _count(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


def _started(context: collectives.SpawnContext, daemon: bool) -> collectives.SpawnContext:
    """``join=False``: the caller joins ``context``; ``daemon`` ends its ranks with this
    process (as daemonic processes are), else this process waits for them at exit."""
    if daemon:

        def end_ranks() -> None:
            if any(p.exitcode is None for p in context.processes):
                context.terminate()

        atexit.register(end_ranks)
    return context


# collectives.spawn's overloads type join as a literal; here it is a run-time value.
_start: Callable[..., Any] = collectives.spawn


# ---------------------------------------------------------------------- the workers
def _worker_joining(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str | None,
    nprocs: int,
    timeout: float | None,
) -> Any:
    """A rank of the seed's ``spawn``: ``fn(rank, *args)``, which joins the group itself."""
    with spawned_worker(backend, nprocs, timeout, in_group=False) as worker:
        value = fn(rank, *args)
    if collectives.is_initialized():
        finalize()  # a worker that joined and did not leave: leave for it, as spawn would
    elif nprocs > 1 and not worker.joined:
        # Its idist calls all answered "world size 1": it trained alone, unknown to the others.
        raise RuntimeError(
            f"idist.spawn: worker rank {rank} of {nprocs} returned without joining the group: "
            "in the form idist.spawn(fn, args, nprocs) each worker calls idist.initialize() "
            "itself (as the seed's example does); idist.spawn(backend, fn, args, "
            "nproc_per_node=N) joins the workers before calling them"
        )
    return value


def _worker_in_group(
    fn: Callable[..., Any],
    backend: str | None,
    nprocs: int,
    rank: int,
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A rank of Ignite's ``spawn`` or of ``Parallel``: the group exists already, and an
    ``idist.initialize()`` in ``fn`` joins it (it has nothing to do)."""
    with spawned_worker(backend, nprocs, None, in_group=True):
        return fn(rank, *args, **kwargs)


@overload
def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    master_port: int | None = None,
) -> Any: ...


@overload
def spawn(
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs_dict: Mapping[str, Any] | None = None,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    **kwargs: Any,
) -> Any: ...


def spawn(*args: Any, **kwargs: Any) -> Any:
    """Start ranks on this host, in Ignite's form or the seed's, told apart by the first
    argument: a string (the backend) is Ignite's, a function is the seed's. Called with
    keywords only, ``backend=`` without ``nprocs=`` is Ignite's.

    - ``spawn(backend, fn, args, kwargs_dict=None, nproc_per_node=1, ...)`` (Ignite): see
      :func:`spawn_ignite`; each rank runs ``fn(local_rank, *args, **kwargs_dict)`` in the
      group already made.
    - ``spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn")`` (the
      seed, torch.multiprocessing's signature): see :func:`spawn_seed`; each rank runs
      ``fn(rank, *args)`` and joins the group itself with ``idist.initialize()``.

    Returns:
        With ``join=True`` the ranks' return values in rank order (when all are JSON-able,
        else None); with ``join=False`` a :class:`collectives.SpawnContext` to ``join()``.

    Raises:
        TypeError: when the first argument is neither a backend name nor a function.
    """
    first = args[0] if args else kwargs.get("fn", kwargs.get("backend"))
    ignite = isinstance(args[0], str) if args else ("backend" in kwargs and "nprocs" not in kwargs)
    if ignite:
        return spawn_ignite(*args, **kwargs)
    if not callable(first):
        raise TypeError(
            "idist.spawn: the first argument is the backend (Ignite's spawn(backend, fn, args, "
            "nproc_per_node=N)) or the function (the seed's spawn(fn, args, nprocs)), got "
            f"{first!r}"
        )
    return spawn_seed(*args, **kwargs)


def spawn_seed(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    master_port: int | None = None,
) -> Any:
    """The seed's ``idist.spawn(fn, args=(), nprocs=1, join=True, daemon=False,
    start_method="spawn")``: ``fn(rank, *args)`` on ``nprocs`` new ranks of this host, each
    of which joins the group itself.

    Each rank starts with the environment ``python -m collectives.run`` gives (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT...), so ``idist.initialize()`` in ``fn`` joins the
    ``nprocs`` ranks and ``idist.finalize()`` leaves (a rank that returns still in the group
    leaves it then). A rank that returns without ever joining fails the job when
    ``nprocs > 1``: every idist call in it answered for a world of one.

    Args:
        fn: a module-level function (it is pickled to the new processes), called with the
            rank first.
        args: its positional arguments after the rank.
        nprocs: number of ranks.
        join: wait for the ranks; False returns a :class:`collectives.SpawnContext` at once
            (``join(timeout=None)``, ``results``, ``pids()``, ``terminate()``).
        daemon: with ``join=False``, end the ranks when this process exits (else it waits
            for them at exit, as for non-daemonic processes).
        start_method: ``"spawn"``, ``"forkserver"`` or ``"fork"``.
        backend: the backend ``idist.initialize()`` joins when the worker names none (None:
            nccl with GPUs, else cpu), or ``"threads"``: the ranks are threads of this
            process (``join=True`` only).
        timeout: the group's timeout (seconds or a timedelta) when the worker gives none.
        master_port: the store's port (None: a free one).

    Returns:
        With ``join=True`` the ranks' return values in rank order (when all are JSON-able,
        else None; rank threads' as they are); with ``join=False`` the context.

    Raises:
        collectives.SpawnError: when a rank fails (the others are ended; the message holds
            its traceback).
        ValueError: for a bad count, flag or start method, an unusable backend, or
            ``join=False`` with rank threads.
    """
    where = "idist.spawn"
    name = check_backend(backend, where)
    nprocs = _count(where, "nprocs", nprocs)
    join, daemon = _flag(where, "join", join), _flag(where, "daemon", daemon)
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    seconds = None if timeout is None else float(timeout)
    opts: dict[str, Any] = {"start_method": start_method, "master_port": master_port}
    if seconds is not None:
        opts["timeout"] = seconds
    if name == "threads":
        opts["backend"] = "threads"
    result = _start(
        _worker_joining,
        args=(fn, tuple(args), name, nprocs, seconds),
        nprocs=nprocs,
        init=False,
        join=join,
        **opts,
    )
    return result if join else _started(result, daemon)


def spawn_ignite(
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs_dict: Mapping[str, Any] | None = None,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    **kwargs: Any,
) -> Any:
    """Ignite's ``idist.spawn``: start ``nproc_per_node`` ranks on this host, each running
    ``fn(local_rank, *args, **kwargs_dict)`` in a group on ``backend``.

    Args:
        backend: ``"cpu"`` (or ``"gloo"``), ``"nccl"``, ``"threads"``; one rank alone runs on
            the serial backend whatever is asked.
        fn: a module-level function (it is pickled to the new processes).
        args: its positional arguments after ``local_rank``.
        kwargs_dict: its keyword arguments.
        nproc_per_node: number of ranks.
        nnodes: must be 1 (see the module docstring for several hosts).
        node_rank: must be 0.
        master_addr: None (the ranks meet on 127.0.0.1).
        master_port: the store's port (None: a free one).
        **kwargs: ``timeout`` (seconds or timedelta), ``start_method``, ``grace_period``,
            ``max_restarts`` of :func:`collectives.spawn`; ``join`` (False: return the
            context to join), ``daemon`` (as in :func:`spawn_seed`) and
            ``init_method="env://"``.

    Returns:
        With ``join=True`` (the default) the ranks' return values in rank order when all
        are JSON-able, else None; with ``join=False`` a :class:`collectives.SpawnContext`.

    Raises:
        collectives.SpawnError: when a rank fails (the others are ended; the message holds
            its traceback).
        ValueError: for an unusable backend or a multi-host request.
        TypeError: for an unknown keyword argument.
    """
    where = "idist.spawn"
    name = check_backend(backend, where)
    _one_node(where, nnodes, node_rank, master_addr)
    nproc_per_node = _count(where, "nproc_per_node", nproc_per_node)
    opts = _spawn_options(where, kwargs)
    join = _flag(where, "join", kwargs.get("join", True))
    daemon = _flag(where, "daemon", kwargs.get("daemon", False))
    result = _start(
        functools.partial(_worker_in_group, fn, name, nproc_per_node, **dict(kwargs_dict or {})),
        args=tuple(args),
        nprocs=nproc_per_node,
        backend="serial" if nproc_per_node == 1 else name,
        master_port=master_port,
        join=join,
        **opts,
    )
    return result if join else _started(result, daemon)


class Parallel:
    """Run a training function alone, under a launcher, or on spawned ranks (Ignite's
    ``idist.Parallel``; the seed's ``Parallel(backend=None, nprocs=None, **kwargs)``).

    - a count (Ignite's ``nproc_per_node`` or the seed's ``nprocs``): :meth:`run` spawns
      that many ranks on this host, each already in the group. With ``nproc_per_node`` a
      backend is needed, as in Ignite; with ``nprocs`` and no backend one is chosen (nccl
      with GPUs, else cpu).
    - ``backend`` alone: the group is joined at ``__enter__`` (the launched ranks, or a world
      of one when nobody launched this process) and destroyed at ``__exit__``.
    - neither: a world of one when alone; a launched rank still joins its launcher's group
      (Ignite would run every launched copy alone, each unaware of the others).

    Example:
        >>> with idist.Parallel(backend="cpu", nproc_per_node=2) as parallel:
        ...     parallel.run(training, config)
        >>> with idist.Parallel("gloo", nprocs=2) as parallel:  # the seed's name
        ...     parallel.run(training, config)
    """

    def __init__(
        self,
        backend: str | None = None,
        nproc_per_node: int | None = None,
        nnodes: int | None = None,
        node_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        init_method: str | None = None,
        *,
        nprocs: int | None = None,
        **spawn_kwargs: Any,
    ) -> None:
        """Check the configuration; nothing starts before ``__enter__``/:meth:`run`.

        Args:
            backend: ``"cpu"`` (or ``"gloo"``), ``"nccl"``, ``"mpi"``, ``"threads"``, or None.
            nproc_per_node: ranks to spawn here (Ignite's name; needs ``backend``).
            nnodes: must be None or 1 (see the module docstring for several hosts).
            node_rank: None or 0.
            master_addr: None (spawned ranks meet on 127.0.0.1).
            master_port: the store's port when spawning (None: a free one).
            init_method: None or ``"env://"``.
            nprocs: ranks to spawn here (the seed's name for ``nproc_per_node``; without a
                backend, one is chosen).
            **spawn_kwargs: ``timeout``, ``start_method``, ``grace_period``,
                ``max_restarts`` (and ``join=True``, ``daemon``, for Ignite's sake).

        Raises:
            ValueError: for an unusable backend, spawn arguments without a backend, a
                non-positive count or two different ones, ``join=False``, or a multi-host
                request.
            TypeError: for an unknown spawn argument.
        """
        where = "idist.Parallel"
        self.backend = check_backend(backend, where)
        self._asked = self.backend  # what a spawned worker's initialize() may name
        if nprocs is not None:
            nprocs = _count(where, "nprocs", nprocs)
            if nproc_per_node not in (None, nprocs):
                raise ValueError(
                    f"{where}: nprocs={nprocs} and nproc_per_node={nproc_per_node!r} are two "
                    "names for the number of ranks to spawn; give one"
                )
        given = {
            "nproc_per_node": nproc_per_node,
            "nnodes": nnodes,
            "node_rank": node_rank,
            "master_addr": master_addr,
            "master_port": master_port,
        }
        if backend is None and nprocs is None:
            for key, value in given.items():
                if value is not None:
                    raise ValueError(
                        f"{where}: with backend None, {key} must be None too, got {value!r}"
                    )
        count = nprocs if nprocs is not None else nproc_per_node
        if count is not None:
            count = _count(where, "nproc_per_node", count)
            _one_node(where, nnodes or 1, node_rank or 0, master_addr)
        elif nnodes not in (None, 1):
            raise ValueError(
                f"{where}: nnodes without nproc_per_node: the launcher places the ranks"
            )
        if spawn_kwargs.get("join", True) is not True:
            raise ValueError(
                f"{where}: join=False: Parallel.run waits for its ranks; for a context to "
                "join, use idist.spawn(..., join=False)"
            )
        opts = _spawn_options(where, {**spawn_kwargs, "init_method": init_method})
        self.nproc_per_node = count
        if count == 1:
            self.backend = "serial"  # one rank: the serial backend, as spawn does
        self._inner = collectives.Parallel(
            backend=self.backend, nproc_per_node=count, master_port=master_port, **opts
        )

    def __enter__(self) -> Parallel:
        self._inner.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        from ._ops import forget_groups

        if self._inner.mode != "spawn":
            forget_groups()
        self._inner.__exit__(exc_type, exc, tb)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(local_rank, *args, **kwargs)`` on every rank.

        Returns:
            When spawning, the ranks' return values (when all are JSON-able, else None); in
            this process, ``fn``'s value.

        Raises:
            RuntimeError: outside a ``with idist.Parallel(...)`` block.
            collectives.SpawnError: when a spawned rank fails.
        """
        mode = self._inner.mode
        if mode is None:
            raise RuntimeError(
                "idist.Parallel.run() must be called inside `with idist.Parallel(...) as p:`"
            )
        if mode == "spawn":
            n = self.nproc_per_node or 1
            return self._inner.run(
                functools.partial(_worker_in_group, fn, self._asked, n), *args, **kwargs
            )
        # Not the inner run: idist's local rank honours idist.set_local_rank (a launcher that
        # sets no LOCAL_RANK), which collectives' does not know.
        return fn(get_local_rank(), *args, **kwargs)
