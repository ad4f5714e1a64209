"""Ignite-style ``Parallel``: run one training function spawned, under a launcher, or alone."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from .._env import mpiexec_world_size
from ._launcher import DEFAULT_GRACE_PERIOD
from ._spawn import DEFAULT_TIMEOUT, spawn

__all__ = ["Parallel"]


class Parallel:
    """Run a training function on every rank, as PyTorch Ignite's ``idist.Parallel`` does.

    Three modes, chosen at ``__enter__``:

    - ``nproc_per_node=N``: :meth:`run` spawns N ranks on this host (via :func:`spawn`), each
      with the group initialized, and calls ``fn(local_rank, *args, **kwargs)`` in each; with
      ``backend="threads"`` the ranks are threads of this process, bound to ``devices``.
    - ``nproc_per_node=None`` inside a launched rank (RANK and WORLD_SIZE set, e.g. under
      ``python -m collectives.run``; or one of several ranks ``mpiexec`` started, for
      ``backend="mpi"``): the group is initialized in this process and :meth:`run`
      calls the function directly.
    - ``nproc_per_node=None`` without such an environment: world size 1 in this process (the
      serial backend).

    Example:
        >>> with Parallel(backend="cpu", nproc_per_node=2) as p:
        ...     p.run(training, config)
    """

    def __init__(
        self,
        backend: str | None = None,
        nproc_per_node: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        master_port: int | None = None,
        start_method: str = "spawn",
        grace_period: float = DEFAULT_GRACE_PERIOD,
        max_restarts: int = 0,
        devices: Sequence[Any] | None = None,
    ) -> None:
        """Describe the job; nothing starts before ``__enter__``/:meth:`run`.

        Args:
            backend: the group's backend (None chooses automatically).
            nproc_per_node: ranks to spawn, or None to use the current process.
            timeout: the group's collective timeout in seconds.
            master_port: the store's port when spawning (None picks a free one).
            start_method: multiprocessing start method when spawning.
            grace_period: seconds between SIGTERM and SIGKILL after a failure.
            max_restarts: when spawning, start the whole job again up to this many times
                after a failed attempt (``spawn(max_restarts=...)``); a launched job restarts
                through its launcher (``collectives.run --max-restarts``) instead.
            devices: with ``backend="threads"``: one device per rank thread (see
                :func:`spawn`); None puts every rank on the CPU.

        Raises:
            ValueError: when ``nproc_per_node`` is not a positive int, or ``threads`` is
                asked for without ``nproc_per_node`` (its ranks are threads it starts).
        """
        if nproc_per_node is not None and (
            isinstance(nproc_per_node, bool)
            or not isinstance(nproc_per_node, int)
            or nproc_per_node < 1
        ):
            raise ValueError(
                f"Parallel: nproc_per_node must be a positive int or None, got {nproc_per_node!r}"
            )
        if backend == "threads" and nproc_per_node is None:
            nproc_per_node = len(devices) if devices is not None else None
            if nproc_per_node is None:
                raise ValueError(
                    "Parallel(backend='threads') starts its ranks as threads: give "
                    "nproc_per_node=N (or devices=[...], one per rank)"
                )
        self.backend = backend
        self.devices = devices
        self.nproc_per_node = nproc_per_node
        self.timeout = timeout
        self.master_port = master_port
        self.start_method = start_method
        self.grace_period = grace_period
        self.max_restarts = max_restarts
        self.mode: str | None = None  # "spawn", "launched" or "serial" once entered
        self._owns_group = False

    def __enter__(self) -> Parallel:
        from .. import _api

        if self.nproc_per_node is not None:
            self.mode = "spawn"
            return self
        launched = ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or mpiexec_world_size() > 1
        self.mode = "launched" if launched else "serial"
        if not _api.is_initialized():
            if launched:
                _api.init_process_group(backend=self.backend, timeout=self.timeout)
            else:
                # World size 1 is always served by the serial backend, whatever was asked for.
                _api.init_process_group(
                    backend="serial", rank=0, world_size=1, timeout=self.timeout
                )
            self._owns_group = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._owns_group:
            from .. import _api

            _api.destroy_process_group()
            self._owns_group = False
        self.mode = None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(local_rank, *args, **kwargs)`` on every rank.

        Returns:
            When spawning: what :func:`spawn` returns (the per-rank values if all are JSON,
            else None). In this process: ``fn``'s return value.

        Raises:
            SpawnError: when a spawned rank fails (others are ended first).
            RuntimeError: when called outside a ``with Parallel(...)`` block.
        """
        if self.mode is None:
            raise RuntimeError("Parallel.run() must be called inside `with Parallel(...) as p:`")
        if self.mode == "spawn" and self.nproc_per_node is not None:
            target = functools.partial(fn, **kwargs) if kwargs else fn
            return spawn(
                target,
                args=tuple(args),
                nprocs=self.nproc_per_node,
                backend=self.backend,
                init=True,
                timeout=self.timeout,
                start_method=self.start_method,
                master_port=self.master_port,
                grace_period=self.grace_period,
                max_restarts=self.max_restarts,
                devices=self.devices,
            )
        from .. import _api

        return fn(_api.get_local_rank(), *args, **kwargs)
