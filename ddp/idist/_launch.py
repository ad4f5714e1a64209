"""Ignite's ``spawn`` and ``Parallel`` over :func:`collectives.spawn` and ``collectives.Parallel``.

Both call ``fn(local_rank, *args, **kwargs)`` with the group initialized. ``spawn`` starts
ranks on this host only; a job on several hosts starts one ``python -m collectives.run
--nnodes N --node-rank I ...`` per host and uses ``Parallel(backend=...)`` without
``nproc_per_node``.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import collectives

from ._config import check_backend, get_local_rank

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
    if kwargs.get("join", True) is not True:
        raise ValueError(f"{where}: join=False is not supported here; use collectives.spawn")
    opts = {k: kwargs[k] for k in ("start_method", "grace_period", "max_restarts") if k in kwargs}
    timeout = kwargs.get("timeout")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if timeout is not None:
        opts["timeout"] = float(timeout)
    return opts  # daemon: spawned ranks never outlive the call anyway


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
) -> list[Any] | None:
    """Start ``nproc_per_node`` ranks on this host, each running ``fn(local_rank, *args,
    **kwargs_dict)`` in a group on ``backend``, and wait for them.

    Args:
        backend: ``"cpu"`` (or ``"gloo"``), ``"nccl"``; one rank alone runs on the serial
            backend whatever is asked.
        fn: a module-level function (it is pickled to the new processes).
        args: its positional arguments after ``local_rank``.
        kwargs_dict: its keyword arguments.
        nproc_per_node: number of ranks.
        nnodes: must be 1 (see the module docstring for several hosts).
        node_rank: must be 0.
        master_addr: None (the ranks meet on 127.0.0.1).
        master_port: the store's port (None: a free one).
        **kwargs: ``timeout`` (seconds or timedelta), ``start_method``, ``grace_period``,
            ``max_restarts`` of :func:`collectives.spawn`; ``join=True``, ``daemon`` and
            ``init_method="env://"`` are accepted for Ignite's sake.

    Returns:
        The ranks' return values in rank order when all are JSON-able, else None.

    Raises:
        collectives.SpawnError: when a rank fails (the others are ended; the message holds
            its traceback).
        ValueError: for an unusable backend or a multi-host request.
        TypeError: for an unknown keyword argument.
    """
    name = check_backend(backend, "idist.spawn")
    _one_node("idist.spawn", nnodes, node_rank, master_addr)
    if (
        isinstance(nproc_per_node, bool)
        or not isinstance(nproc_per_node, int)
        or nproc_per_node < 1
    ):
        raise ValueError(
            f"idist.spawn: nproc_per_node must be a positive int, got {nproc_per_node!r}"
        )
    opts = _spawn_options("idist.spawn", kwargs)
    target = functools.partial(fn, **kwargs_dict) if kwargs_dict else fn
    return collectives.spawn(
        target,
        args=tuple(args),
        nprocs=nproc_per_node,
        backend="serial" if nproc_per_node == 1 else name,
        master_port=master_port,
        **opts,
    )


class Parallel:
    """Run a training function alone, under a launcher, or on spawned ranks (Ignite's
    ``idist.Parallel``).

    - ``backend`` and ``nproc_per_node``: :meth:`run` spawns that many ranks on this host.
    - ``backend`` alone: the group is joined at ``__enter__`` (the launched ranks, or a world
      of one when nobody launched this process) and destroyed at ``__exit__``.
    - neither: a world of one when alone; a launched rank still joins its launcher's group
      (Ignite would run every launched copy alone, each unaware of the others).

    Example:
        >>> with idist.Parallel(backend="cpu", nproc_per_node=2) as parallel:
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
        **spawn_kwargs: Any,
    ) -> None:
        """Check the configuration; nothing starts before ``__enter__``/:meth:`run`.

        Raises:
            ValueError: for an unusable backend, spawn arguments without a backend, a
                non-positive ``nproc_per_node``, or a multi-host request.
            TypeError: for an unknown spawn argument.
        """
        where = "idist.Parallel"
        self.backend = check_backend(backend, where)
        given = {
            "nproc_per_node": nproc_per_node,
            "nnodes": nnodes,
            "node_rank": node_rank,
            "master_addr": master_addr,
            "master_port": master_port,
        }
        if backend is None:
            for key, value in given.items():
                if value is not None:
                    raise ValueError(
                        f"{where}: with backend None, {key} must be None too, got {value!r}"
                    )
        if nproc_per_node is not None:
            if (
                isinstance(nproc_per_node, bool)
                or not isinstance(nproc_per_node, int)
                or nproc_per_node < 1
            ):
                raise ValueError(
                    f"{where}: nproc_per_node must be a positive int, got {nproc_per_node!r}"
                )
            _one_node(where, nnodes or 1, node_rank or 0, master_addr)
        elif nnodes not in (None, 1):
            raise ValueError(
                f"{where}: nnodes without nproc_per_node: the launcher places the ranks"
            )
        opts = _spawn_options(where, {**spawn_kwargs, "init_method": init_method})
        self.nproc_per_node = nproc_per_node
        spawn_n = nproc_per_node if nproc_per_node is not None else None
        if spawn_n == 1:
            self.backend = "serial"  # one rank: the serial backend, as spawn does
        self._inner = collectives.Parallel(
            backend=self.backend, nproc_per_node=spawn_n, master_port=master_port, **opts
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
            return self._inner.run(fn, *args, **kwargs)
        # Not the inner run: idist's local rank honours idist.set_local_rank (a launcher that
        # sets no LOCAL_RANK), which collectives' does not know.
        return fn(get_local_rank(), *args, **kwargs)
