"""Start ranks from Python: ``spawn(fn, args, nprocs)`` runs ``fn(rank, *args)`` in new processes.

Each child gets the environment ``python -m collectives.run`` would give it and ends as the
launcher's failure policy says (both in :mod:`collectives._launch`). This module holds the
parent's side (:func:`spawn`, :class:`SpawnContext`, :class:`SpawnError`) and the child's
(:func:`_child_main`).

Children carry results and errors home as JSON text over a pipe; the parent never unpickles
anything a child sends.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, NoReturn, overload

from ._errorfile import ERROR_FILE_ENV, exception_name
from ._launch import (
    DEFAULT_GRACE_PERIOD,
    Failure,
    describe_exit,
    describe_others,
    format_failure,
    free_port,
    gpu_assignment,
    killed_hint,
    load_prctl,
    new_run_id,
    pick_first,
    rank_env,
    set_parent_death_signal,
    shutdown,
    signal_name,
    thread_env,
)
from .backends._shm import remove_run_segments

__all__ = ["DEFAULT_TIMEOUT", "SpawnContext", "SpawnError", "spawn"]

DEFAULT_TIMEOUT = 300.0

# A child's JSON report (result or traceback) larger than this is replaced by a short note.
_REPORT_LIMIT = 64 << 20


# ---------------------------------------------------------------------- errors
class SpawnError(RuntimeError):
    """A rank started by :func:`spawn` or :class:`Parallel` failed.

    The message names the rank that failed first and includes its own traceback, or the signal
    that killed it.

    Attributes:
        rank: the global rank that failed first.
        exit_code: its exit code, ``-N`` when killed by signal N, None when it reported an error
            but had to be killed before it exited.
        signal_name: e.g. ``"SIGKILL"`` when it died by a signal, else None.
        exc_type: the qualified name of its exception, when it raised one.
        traceback_text: its formatted traceback, when it raised one.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exit_code: int | None = None,
        exc_type: str | None = None,
        traceback_text: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.signal_name = (
            signal_name(-exit_code) if exit_code is not None and exit_code < 0 else None
        )
        self.exc_type = exc_type
        self.traceback_text = traceback_text


# ---------------------------------------------------------------------- the child's side
@dataclass(frozen=True)
class _ChildSpec:
    """What a child needs to become rank ``rank`` (pickled to it at the start)."""

    rank: int
    env: dict[str, str]
    unset: tuple[str, ...]
    init: bool
    backend: str | None
    timeout: float
    parent_pid: int
    death_signal: bool


def _error_report(exc: BaseException, tb: TracebackType | None) -> dict[str, Any]:
    return {
        "status": "error",
        "exc_type": exception_name(type(exc)),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "time": time.time(),
    }


def _send(conn: multiprocessing.connection.Connection, report: dict[str, Any]) -> None:
    try:
        data = json.dumps(report).encode()
    except (TypeError, ValueError):  # the value is not JSON: say so, keep the rank's success
        data = json.dumps({**report, "value": None, "json": False}).encode()
    if len(data) > _REPORT_LIMIT:
        data = json.dumps({**report, "value": None, "json": False, "traceback": ""}).encode()
    try:
        conn.send_bytes(data)
    except OSError:
        pass  # the parent is gone or stopped listening; nothing left to tell


def _destroy_quietly() -> None:
    with contextlib.suppress(Exception):
        from . import _api

        _api.destroy_process_group()


def _child_main(
    spec: _ChildSpec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of a spawned rank (runs in the child)."""
    # Own process group, so the parent can end this rank and anything it started in one go,
    # and a Ctrl-C in the terminal reaches only the parent, which then ends the ranks in order.
    with contextlib.suppress(OSError):
        os.setsid()
    if spec.death_signal:
        set_parent_death_signal(signal.SIGKILL, spec.parent_pid)
    # The parent set these before the start; forkserver children inherit another environment.
    os.environ.update(spec.env)
    for key in spec.unset:
        os.environ.pop(key, None)

    initialized = False
    try:
        if spec.init:
            from . import _api

            _api.init_process_group(backend=spec.backend, timeout=spec.timeout)
            initialized = True
        value = fn(spec.rank, *args)
    except SystemExit as exc:
        if exc.code is not None and exc.code != 0:
            code = exc.code if isinstance(exc.code, int) else 1
            _report_and_exit(conn, exc, code, destroy_group=initialized)
        value = None
    except BaseException as exc:
        _report_and_exit(conn, exc, 1, destroy_group=initialized)
    try:
        if initialized:
            from . import _api

            _api.destroy_process_group()
    except BaseException as exc:
        _report_and_exit(conn, exc, 1, destroy_group=False)
    _send(conn, {"status": "ok", "json": True, "value": value})
    conn.close()


def _report_and_exit(
    conn: multiprocessing.connection.Connection,
    exc: BaseException,
    code: int,
    *,
    destroy_group: bool,
) -> NoReturn:
    """Send ``exc`` home, then clean up and exit with ``code``.

    The report goes first, before the group is destroyed: the parent can stop the other ranks
    right away.
    """
    _send(conn, _error_report(exc, exc.__traceback__))
    if destroy_group:
        _destroy_quietly()
    conn.close()
    sys.exit(code)


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
                data = conn.recv_bytes(_REPORT_LIMIT + 4096)
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
) -> list[Any] | SpawnContext | None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes on this host, one rank each.

    Each process gets the environment ``python -m collectives.run`` would give it (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT, one GPU
    per rank through CUDA_VISIBLE_DEVICES when GPUs exist), joins the default group when
    ``init`` is True, runs ``fn``, and destroys the group. ``fn`` and ``args`` must be picklable
    (a module-level function), as for any ``multiprocessing`` start.

    Args:
        fn: called as ``fn(rank, *args)`` with the global rank.
        args: extra positional arguments.
        nprocs: number of ranks.
        backend: passed to ``init_process_group`` (None chooses: serial for one rank, else cpu
            or nccl).
        init: call ``init_process_group``/``destroy_process_group`` around ``fn``.
        timeout: the group's collective timeout in seconds.
        join: wait for the ranks; False returns a :class:`SpawnContext` at once.
        start_method: ``"spawn"`` (default), ``"forkserver"`` or ``"fork"``. With ``"fork"``
            GPUs are not bound (probing them would initialize CUDA before the fork).
        master_port: the store's port; None picks a free one.
        grace_period: seconds between SIGTERM and SIGKILL when ending ranks after a failure.

    Returns:
        With ``join=True``: the list of per-rank return values, in rank order, when every value
        is JSON-serializable (they travel home as JSON, so tuples come back as lists and dict
        keys as strings); None when any is not. With ``join=False``: a :class:`SpawnContext`.

    Raises:
        SpawnError: when a rank fails; the other ranks are ended first. The message names the
            rank and includes its traceback, or the signal that killed it.
        ValueError: for an invalid ``nprocs``, ``start_method``, or too few GPUs.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {fn!r}")
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"spawn: start_method {start_method!r} is not available here; choose from "
            f"{multiprocessing.get_all_start_methods()}"
        )
    # Typed as Any: typeshed gives a context chosen by name no Process attribute.
    ctx: Any = multiprocessing.get_context(start_method)
    gpus = None if start_method == "fork" else gpu_assignment(nprocs, os.environ)
    port = master_port if master_port is not None else free_port()
    run_id = new_run_id()
    main_thread = threading.current_thread() is threading.main_thread()
    specs = [
        _ChildSpec(
            rank=rank,
            env=_rank_env_here(rank, nprocs, port, run_id, None if gpus is None else gpus[rank]),
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
    context = _start_children(ctx, fn, tuple(args), specs, grace_period, run_id)
    if not join:
        return context
    try:
        context.join()
    except SpawnError:
        raise
    except BaseException:
        # KeyboardInterrupt or similar in the parent: leave no rank behind.
        context.terminate()
        raise
    return context.results


def _rank_env_here(
    rank: int, nprocs: int, port: int, run_id: str, gpu: str | None
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
    )
    env.update(thread_env(os.environ, nprocs))
    return env


def _start_children(
    ctx: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    specs: Sequence[_ChildSpec],
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
                target=_child_main,
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
    starts (CUDA_VISIBLE_DEVICES), which is before ``_child_main`` runs; multiprocessing
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
