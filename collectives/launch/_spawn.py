"""Start ranks from Python: ``spawn(fn, args, nprocs)`` runs ``fn(rank, *args)`` in new processes.

Each child gets the environment ``python -m collectives.run`` would give it and ends as the
launcher's failure policy says (both in :mod:`collectives.launch._launcher`). This module holds the
parent's side (:func:`spawn`, :class:`SpawnContext`, :class:`SpawnError`);
:mod:`collectives.launch._spawn_child` the child's.

Children carry results and errors home as JSON text over a pipe; the parent never unpickles
anything a child sends.

With ``max_restarts=N`` a failed attempt is printed to stderr and every rank starts again,
as :mod:`collectives.launch._restarts` says; the results, or the error, are the last attempt's.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from .._errorfile import ERROR_FILE_ENV
from .._errors import SpawnError
from .._registry import registered_backends
from ..backends.cpu._shm import remove_run_segments
from ._launcher import (
    DEFAULT_GRACE_PERIOD,
    Failure,
    describe_exit,
    describe_others,
    format_banner,
    format_failure,
    free_port,
    gpu_assignment,
    killed_hint,
    load_prctl,
    new_run_id,
    pick_first,
    rank_env,
    shutdown,
    thread_env,
)
from ._restarts import (
    attempt_run_id,
    attempt_title,
    check_max_restarts,
    restart_line,
    wait_groups_gone,
)
from ._spawn_child import REPORT_LIMIT, ChildSpec, child_main

__all__ = ["DEFAULT_TIMEOUT", "SpawnContext", "spawn"]

DEFAULT_TIMEOUT = 300.0


# ---------------------------------------------------------------------- the parent's side
class _MPChild:
    """A multiprocessing.Process seen through the :class:`ProcLike` protocol."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    def poll(self) -> int | None:
        return self.process.exitcode


_ENV_LOCK = threading.Lock()


@dataclass
class _RankState:
    """What the parent knows of one rank: its first report, and the pipe it comes through."""

    report: dict[str, Any] | None = None
    conn: multiprocessing.connection.Connection | None = None


@dataclass
class SpawnContext:
    """The running ranks of a :func:`spawn` call made with ``join=False``.

    Attributes:
        processes: one ``multiprocessing`` process per rank, in rank order.
    """

    processes: list[multiprocessing.process.BaseProcess]
    grace_period: float
    _states: list[_RankState] = field(repr=False)
    _results: list[Any] | None = field(default=None, repr=False)
    _done: bool = field(default=False, repr=False)
    run_id: str = ""

    def pids(self) -> list[int]:
        """The process id of each rank."""
        return [int(p.pid or 0) for p in self.processes]

    @property
    def results(self) -> list[Any] | None:
        """Per-rank return values once :meth:`join` returned True (None if any is not JSON).

        Raises:
            RuntimeError: before the ranks have finished.
        """
        if not self._done:
            raise RuntimeError("spawn: results are known only after join() returned True")
        return self._results

    def _await_reports(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a report or an exit, reading every report that arrived."""
        readers: list[Any] = [s.conn for s in self._states if s.conn is not None]
        readers += [p.sentinel for p in self.processes if p.exitcode is None]
        if readers and seconds > 0:
            multiprocessing.connection.wait(readers, timeout=seconds)
        for state in self._states:
            self._read_report(state)

    def _read_report(self, state: _RankState) -> None:
        conn = state.conn
        if conn is None:
            return
        try:
            while conn.poll(0):
                data = conn.recv_bytes(REPORT_LIMIT + 4096)
                try:
                    report = json.loads(data.decode("utf-8", errors="replace"))
                except ValueError:
                    report = None
                if isinstance(report, dict) and state.report is None:
                    state.report = report
        except (EOFError, OSError):
            conn.close()
            state.conn = None

    def _failure(self, rank: int, rc: int | None) -> Failure | None:
        state = self._states[rank]
        report = state.report
        if report is not None and report.get("status") == "error":
            return Failure(
                rank=rank,
                returncode=rc,
                exc_type=str(report.get("exc_type")),
                message=str(report.get("message", "")),
                traceback=str(report.get("traceback", "")) or None,
                traceback_source="the rank's report",
                time=report.get("time") if isinstance(report.get("time"), float) else None,
            )
        if rc is not None and rc != 0:
            note = f"it left no traceback: {describe_exit(rc)} before it could report one"
            note += killed_hint(rc)
            return Failure(rank=rank, returncode=rc, note=note)
        return None

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the ranks.

        Args:
            timeout: seconds to wait; None waits until every rank has finished or one failed.

        Returns:
            True when every rank finished successfully, False when ``timeout`` passed first.

        Raises:
            SpawnError: on the first failure, after ending every other rank (SIGTERM, then
                SIGKILL after the grace period). It names the rank and carries its traceback.
        """
        if self._done:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Exit codes first, reports second: a rank writes its report before it exits, so
            # every rank seen as exited here has its report read by the pump below.
            returncodes = [p.exitcode for p in self.processes]
            self._await_reports(0)
            failures = [f for r, rc in enumerate(returncodes) if (f := self._failure(r, rc))]
            if failures:
                self._fail(pick_first(failures))
            if all(p.exitcode == 0 for p in self.processes):
                self._finish()
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            left = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            self._await_reports(left)

    def _finish(self) -> None:
        for state in self._states:
            self._read_report(state)
        values: list[Any] = []
        all_json = True
        for state in self._states:
            report = state.report
            if report is None:  # exited 0 without reporting (os._exit(0))
                values.append(None)
                continue
            all_json = all_json and bool(report.get("json", True))
            values.append(report.get("value"))
        self._results = values if all_json else None
        self._close()
        self._done = True

    def _close(self) -> None:
        for state in self._states:
            if state.conn is not None:
                state.conn.close()
                state.conn = None
        for p in self.processes:
            p.join(timeout=1.0)
        if self.run_id:
            remove_run_segments(self.run_id)

    def _fail(self, first: Failure) -> None:
        children = [_MPChild(p) for p in self.processes]
        endings = shutdown(
            children,
            self.grace_period,
            spare=[first.rank],
            wait=lambda s: self._await_reports(s),
        )
        for state in self._states:
            self._read_report(state)
        returncodes = [p.exitcode for p in self.processes]
        if first.returncode is None:  # it reported first; now it has exited too
            first.returncode = returncodes[first.rank]
        self._close()
        text = format_failure(first, len(self.processes))
        others = describe_others(
            list(range(len(self.processes))), returncodes, endings, first.rank, self.grace_period
        )
        raise SpawnError(
            f"spawn: {text}\nother ranks: {others}",
            rank=first.rank,
            exit_code=first.returncode,
            exc_type=first.exc_type,
            traceback_text=first.traceback,
        )

    def terminate(self) -> None:
        """End every rank now (SIGTERM to its process group, SIGKILL after the grace period)."""
        shutdown([_MPChild(p) for p in self.processes], self.grace_period)
        self._close()


@overload
def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    *,
    backend: str | None = None,
    init: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    join: Literal[True] = True,
    start_method: str = "spawn",
    master_port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    max_restarts: int = 0,
    devices: Sequence[Any] | None = None,
) -> list[Any] | None: ...


@overload
def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    *,
    backend: str | None = None,
    init: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    join: Literal[False],
    start_method: str = "spawn",
    master_port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    max_restarts: Literal[0] = 0,
    devices: Sequence[Any] | None = None,
) -> SpawnContext: ...


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    *,
    backend: str | None = None,
    init: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    join: bool = True,
    start_method: str = "spawn",
    master_port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    max_restarts: int = 0,
    devices: Sequence[Any] | None = None,
) -> list[Any] | SpawnContext | None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes on this host, one rank each (or,
    with ``backend="threads"``, in ``nprocs`` threads of this process, one device each).

    Each process gets the environment ``python -m collectives.run`` would give it (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT, one GPU
    per rank through CUDA_VISIBLE_DEVICES when GPUs exist), joins the default group when
    ``init`` is True, runs ``fn``, and destroys the group. ``fn`` and ``args`` must be picklable
    (a module-level function), as for any ``multiprocessing`` start.

    Args:
        fn: called as ``fn(rank, *args)`` with the global rank.
        args: extra positional arguments (a tuple or list).
        nprocs: number of ranks.
        backend: passed to ``init_process_group`` (None chooses: serial for one rank, else cpu
            or nccl).
        init: call ``init_process_group``/``destroy_process_group`` around ``fn``.
        timeout: the group's collective timeout in seconds.
        join: wait for the ranks; False returns a :class:`SpawnContext` at once.
        start_method: ``"spawn"`` (default), ``"forkserver"`` or ``"fork"``. With ``"fork"``
            GPUs are not bound (probing them would initialize CUDA before the fork).
        master_port: the store's port; None picks a free one (a fresh one for each attempt).
        grace_period: seconds between SIGTERM and SIGKILL when ending ranks after a failure.
        max_restarts: after a failed attempt, print its failure to stderr and start every
            rank again, up to this many times (``join=True`` only). Attempt k's ranks see
            ``DPT_RESTART_COUNT=k`` and ``TORCHELASTIC_RESTART_COUNT=k``.
        devices: with ``backend="threads"`` only: one device per rank (``"cpu"``,
            ``"cuda:N"``, a tensorlib Device, or a device of a package that registered a
            threads engine, e.g. remote devices); None puts every rank on the CPU. Each rank
            thread is bound to its device (``collectives.get_device()``).

    Returns:
        With ``join=True``: the list of per-rank return values, in rank order, when every value
        is JSON-serializable (they travel home as JSON, so tuples come back as lists and dict
        keys as strings); None when any is not. With ``backend="threads"``: the return values
        as they are (no JSON). With ``join=False``: a :class:`SpawnContext`.

    Raises:
        SpawnError: when a rank fails (in the last attempt); the other ranks are ended first.
            The message names the rank and includes its traceback, or the signal that killed
            it, and says how many attempts ran.
        TypeError, ValueError: before any rank starts, for a wrong argument (the message
            names it, its value and what it must be); ValueError also for too few GPUs.
    """
    _check_arguments(fn, nprocs, start_method, join, max_restarts)
    _check_options(args, backend, init, timeout, master_port, grace_period)
    if backend == "threads" or devices is not None:
        t, g = float(timeout), float(grace_period)
        return _in_threads(fn, args, nprocs, backend, devices, init, t, join, g, max_restarts)
    # Typed as Any: typeshed gives a context chosen by name no Process attribute.
    ctx: Any = multiprocessing.get_context(start_method)
    gpus = None if start_method == "fork" else gpu_assignment(nprocs, os.environ)
    job_id = new_run_id()
    main_thread = threading.current_thread() is threading.main_thread()

    def start(attempt: int) -> SpawnContext:
        port = master_port if master_port is not None else free_port()
        run_id = attempt_run_id(job_id, attempt)
        specs = [
            ChildSpec(
                rank=rank,
                env=_rank_env_here(
                    rank,
                    nprocs,
                    port,
                    run_id,
                    None if gpus is None else gpus[rank],
                    restart_count=attempt,
                    max_restarts=max_restarts,
                ),
                unset=(ERROR_FILE_ENV,),  # error files belong to an outer launcher's rank
                init=init,
                backend=backend,
                timeout=float(timeout),
                parent_pid=os.getpid(),
                # The death signal fires when the starting *thread* ends, and only the main
                # thread lives as long as the process; forkserver children have another parent.
                death_signal=main_thread and start_method != "forkserver",
            )
            for rank in range(nprocs)
        ]
        return _start_children(ctx, fn, tuple(args), specs, grace_period, run_id)

    if not join:
        return start(0)
    return _join_with_restarts(start, max_restarts)


def _in_threads(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    backend: str | None,
    devices: Sequence[Any] | None,
    init: bool,
    timeout: float,
    join: bool,
    grace_period: float,
    max_restarts: int,
) -> list[Any]:
    """``spawn`` with rank threads (``backend="threads"``, see ``launch/_threads_run``)."""
    if backend != "threads":
        raise ValueError(
            f"spawn: devices= binds rank threads to devices and needs backend='threads'; "
            f"backend={backend!r} starts processes, which get one GPU each from "
            "CUDA_VISIBLE_DEVICES"
        )
    if not join:
        raise ValueError("spawn(backend='threads') needs join=True (its ranks are threads)")
    from ._threads_run import spawn_threads

    return spawn_threads(fn, args, nprocs, devices, init, timeout, grace_period, max_restarts)


def _check_arguments(
    fn: Callable[..., Any], nprocs: int, start_method: str, join: bool, max_restarts: int
) -> None:
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {fn!r}")
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"spawn: start_method {start_method!r} is not available here; choose from "
            f"{multiprocessing.get_all_start_methods()}"
        )
    if not isinstance(join, bool):
        raise TypeError(f"spawn: join must be a bool, got {join!r}")
    check_max_restarts(max_restarts, "spawn")
    if max_restarts > 0 and not join:
        raise ValueError(
            "spawn: max_restarts > 0 needs join=True (the restarts happen while spawn waits "
            "for the ranks); with join=False, call spawn again after a failed join()"
        )


def _check_options(
    args: object,
    backend: object,
    init: object,
    timeout: object,
    master_port: object,
    grace_period: object,
) -> None:
    """Refuse up front what a rank would fail on (its traceback says less about why)."""
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"spawn: args must be a tuple (or list) of fn's arguments after the rank, got "
            f"{args!r}; for one argument write args=({args!r},)"
        )
    if not isinstance(init, bool):
        raise TypeError(f"spawn: init must be a bool, got {init!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"spawn: backend must be a backend name (str) or None, got {backend!r}")
    if init and backend is not None and backend not in registered_backends():
        raise ValueError(f"spawn: unknown backend {backend!r}; registered: {registered_backends()}")
    _check_seconds("timeout", timeout, "a positive number of seconds", minimum_excluded=True)
    _check_seconds("grace_period", grace_period, "a number of seconds >= 0")
    if master_port is not None:
        if isinstance(master_port, bool) or not isinstance(master_port, int):
            raise TypeError(f"spawn: master_port must be None or an int, got {master_port!r}")
        if not 1 <= master_port <= 65535:
            raise ValueError(f"spawn: master_port must be in 1-65535, got {master_port}")


def _check_seconds(name: str, value: object, rule: str, minimum_excluded: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"spawn: {name} must be {rule}, got {value!r}")
    if not (float(value) > 0 if minimum_excluded else float(value) >= 0):  # NaN fails both
        raise ValueError(f"spawn: {name} must be {rule}, got {value!r}")


def _join_with_restarts(
    start: Callable[[int], SpawnContext], max_restarts: int
) -> list[Any] | None:
    """Start attempt 0, 1, ... until one succeeds or ``max_restarts`` restarts failed too."""
    attempt = 0
    while True:
        context = start(attempt)
        try:
            context.join()
            return context.results
        except SpawnError as err:
            # Every rank has exited; what they started goes too, before anything new starts.
            wait_groups_gone(context.pids())
            if max_restarts == 0:
                raise
            if attempt == max_restarts:
                outcome = "the failure above is the last attempt's"
                raise SpawnError(
                    f"{err}\n{restart_line('spawn', attempt, max_restarts, outcome)}",
                    rank=err.rank,
                    exit_code=err.exit_code,
                    exc_type=err.exc_type,
                    traceback_text=err.traceback_text,
                    attempts=attempt + 1,
                ) from None
            body = f"{err}\n{restart_line('spawn', attempt, max_restarts, '')}"
            title = f"spawn: job failed{attempt_title(attempt, max_restarts)}"
            with contextlib.suppress(OSError, ValueError):  # no stderr: restart all the same
                sys.stderr.write(format_banner(title, body))
                sys.stderr.flush()
            attempt += 1
        except BaseException:
            # KeyboardInterrupt or similar in the parent: leave no rank behind, no restart.
            context.terminate()
            raise


def _rank_env_here(
    rank: int,
    nprocs: int,
    port: int,
    run_id: str,
    gpu: str | None,
    *,
    restart_count: int = 0,
    max_restarts: int = 0,
) -> dict[str, str]:
    """Rank ``rank``'s variables: what ``collectives.run`` gives a worker on one node."""
    env = rank_env(
        rank=rank,
        world_size=nprocs,
        local_rank=rank,
        local_world_size=nprocs,
        node_rank=0,
        nnodes=1,
        master_addr="127.0.0.1",
        master_port=port,
        run_id=run_id,
        gpu=gpu,
        restart_count=restart_count,
        max_restarts=max_restarts,
    )
    env.update(thread_env(os.environ, nprocs))
    return env


def _start_children(
    ctx: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    specs: Sequence[ChildSpec],
    grace_period: float,
    run_id: str,
) -> SpawnContext:
    """Start one process per spec; if any start fails, end those already started."""
    load_prctl()
    processes: list[multiprocessing.process.BaseProcess] = []
    states: list[_RankState] = []
    try:
        for spec in specs:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=child_main,
                args=(spec, fn, args, writer),
                name=f"spawn-rank{spec.rank}",
            )
            with _ENV_LOCK:
                _start_with_env(proc, spec.env, spec.unset)
            writer.close()
            processes.append(proc)
            states.append(_RankState(conn=reader))
    except BaseException:
        shutdown([_MPChild(p) for p in processes if p.pid is not None], grace_period)
        for s in states:
            if s.conn is not None:
                s.conn.close()
        raise
    return SpawnContext(
        processes=processes, grace_period=grace_period, _states=states, run_id=run_id
    )


def _start_with_env(
    proc: multiprocessing.process.BaseProcess, env: Mapping[str, str], unset: Sequence[str]
) -> None:
    """Start ``proc`` with ``env`` in its environment from the first instruction.

    The variables must be there before the child imports NumPy (OMP_NUM_THREADS) or CUDA
    starts (CUDA_VISIBLE_DEVICES), which is before ``child_main`` runs; multiprocessing
    passes the parent's environment, so it is set around the start and restored.
    """
    saved = {k: os.environ.get(k) for k in [*env, *unset]}
    try:
        os.environ.update(env)
        for key in unset:
            os.environ.pop(key, None)
        proc.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
