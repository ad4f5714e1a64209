"""Start ranks from Python: ``spawn(fn, args, nprocs)`` and Ignite-style ``Parallel``.

Also holds what ``python -m collectives.run`` shares with them: the torchrun-compatible
environment of a rank, the GPU binding, the free-port choice, and the failure policy (on the
first failure, SIGTERM every other rank's process group, SIGKILL what outlives the grace period,
report the failed rank's own traceback).

Children carry results and errors home as JSON text over a pipe; the parent never unpickles
anything a child sends.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol, overload

from ._env import mpiexec_world_size
from .backends._shm import remove_run_segments

__all__ = [
    "ALLOW_SHARED_GPU_ENV",
    "Parallel",
    "SpawnContext",
    "SpawnError",
    "spawn",
]

ALLOW_SHARED_GPU_ENV = "DPT_ALLOW_SHARED_GPU"
DEFAULT_GRACE_PERIOD = 5.0
DEFAULT_TIMEOUT = 300.0

# A child's JSON report (result or traceback) larger than this is replaced by a short note.
_REPORT_LIMIT = 64 << 20
# Ranks failing with these were most likely failed by another rank: report the other one first.
_SECONDARY_ERRORS = ("PeerFailureError", "GroupAbortedError")


# ---------------------------------------------------------------------- shared helpers
def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bind port 0, read, close).

    Another process may take it before rank 0's store binds it; that race is rare and gives a
    clear "address in use" error from the store, not a hang.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def signal_name(signum: int) -> str:
    """``9 -> "SIGKILL"``; unknown numbers become ``"signal 42"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """Say how a process ended, from a ``Popen.returncode``/``Process.exitcode``."""
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    return f"exited with code {returncode}"


def exit_status(returncode: int) -> int:
    """The shell's exit status for a child's end: its code, or 128 + signal number."""
    return 128 - returncode if returncode < 0 else returncode


def rank_env(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    master_port: int,
    run_id: str,
) -> dict[str, str]:
    """The torchrun-compatible variables that describe one rank (read back by ``env://``)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "DPT_RUN_ID": run_id,
        "DPT_RESTART_COUNT": "0",
    }


def thread_env(environ: Mapping[str, str], local_world_size: int) -> dict[str, str]:
    """Like torchrun: one OpenMP thread per rank when several share a host, unless set."""
    if local_world_size > 1 and "OMP_NUM_THREADS" not in environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def new_run_id() -> str:
    """A fresh job id for ``DPT_RUN_ID``."""
    return uuid.uuid4().hex[:12]


def gpu_assignment(
    local_world_size: int,
    environ: Mapping[str, str],
    device_count: int | None = None,
) -> list[str] | None:
    """Choose the ``CUDA_VISIBLE_DEVICES`` value of each local rank: one GPU per rank.

    An existing ``CUDA_VISIBLE_DEVICES`` list is respected (rank i gets its i-th entry).

    Args:
        local_world_size: ranks on this host.
        environ: the environment the ranks inherit.
        device_count: visible GPUs; None asks ``tensorlib.cuda_device_count()`` (which imports
            CuPy only when it is installed).

    Returns:
        One device string per local rank, or None when no GPU is visible (nothing to bind).

    Raises:
        ValueError: when there are fewer GPUs than local ranks and ``DPT_ALLOW_SHARED_GPU=1`` is
            not set (then ranks share GPUs round-robin).
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None  # GPUs hidden on purpose: skip probing (and importing CuPy) entirely
    if device_count is None:
        from tensorlib import cuda_device_count

        device_count = cuda_device_count()
    if device_count <= 0:
        return None
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()][:device_count]
    else:
        ids = [str(i) for i in range(device_count)]
    if not ids:
        return None
    if len(ids) < local_world_size and environ.get(ALLOW_SHARED_GPU_ENV, "") not in ("1", "true"):
        shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ValueError(
            f"{local_world_size} local ranks but only {len(ids)} GPU(s) visible{shown}: each "
            f"rank gets its own GPU. Start at most {len(ids)} ranks per node, set "
            f"{ALLOW_SHARED_GPU_ENV}=1 to let ranks share GPUs round-robin, or set "
            "CUDA_VISIBLE_DEVICES= (empty) to run every rank on the CPU."
        )
    return [ids[i % len(ids)] for i in range(local_world_size)]


_libc: Any = None


def load_prctl() -> Any:
    """libc's prctl, loaded in the parent (loading after fork is not async-signal-safe)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        try:
            # The running program's own symbols include libc's (find_library would run ldconfig).
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    return _libc.prctl if _libc else None


def set_parent_death_signal(sig: int, parent_pid: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere).

    Exits at once when the parent is already gone, which closes the race between the fork and
    this call. This is what keeps workers from outliving a launcher killed by SIGKILL.
    """
    prctl = load_prctl()
    if prctl is None:
        return
    pr_set_pdeathsig = 1
    prctl(pr_set_pdeathsig, sig, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


class ProcLike(Protocol):
    """What the failure policy needs from a child: its pid and a non-blocking poll."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


def signal_group(proc: ProcLike, sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (workers lead their own), or to it alone."""
    try:
        os.killpg(proc.pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    # Not (yet) a group leader: a spawned child calls setsid() only once it runs.
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Ending:
    """How shutdown ended one process."""

    signaled: bool = False  # we sent it the first signal while it was running
    killed: bool = False  # it outlived the grace period and got SIGKILL


def shutdown(
    procs: Sequence[ProcLike],
    grace_period: float,
    *,
    sig: int = signal.SIGTERM,
    spare: Iterable[int] = (),
    wait: Callable[[float], None] | None = None,
) -> list[Ending]:
    """End every process: ``sig`` to each group, then SIGKILL to what outlives the grace period.

    Args:
        procs: the children.
        grace_period: seconds between ``sig`` and SIGKILL.
        sig: the first signal (SIGTERM, or the one the launcher received).
        spare: indices that get no first signal, only SIGKILL if still alive after the grace
            period (a rank that already reported its failure and is exiting on its own).
        wait: sleeps up to the given seconds while doing useful work (draining output).

    Returns:
        One :class:`Ending` per process.
    """
    spared = set(spare)
    endings = [Ending() for _ in procs]
    for i, proc in enumerate(procs):
        if i not in spared and proc.poll() is None:
            endings[i].signaled = True
        if i not in spared:
            # Also exited leaders: their group may still hold grandchildren.
            signal_group(proc, sig)
    deadline = time.monotonic() + max(0.0, grace_period)
    sleep = wait or time.sleep
    while any(p.poll() is None for p in procs):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sleep(min(left, 0.02))
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            endings[i].killed = True
        signal_group(proc, signal.SIGKILL)
    # SIGKILL cannot be ignored, but a process stuck in the kernel (D state) may take a while:
    # wait a bounded time, then report it as it is rather than hang.
    deadline = time.monotonic() + 10.0
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.005)
    return endings


@dataclass
class Failure:
    """A rank that failed: how it ended and what it said."""

    rank: int
    returncode: int | None  # None while it is still running (it reported an error first)
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    traceback_source: str | None = None  # "error file", "stderr" or "the rank's report"
    time: float | None = None  # when the rank recorded the error (its clock), if known
    note: str | None = None  # when there is no traceback: what we know instead


def pick_first(failures: Sequence[Failure]) -> Failure:
    """Among failures seen at the same time, the likeliest root cause.

    Errors that say "another rank failed" come last; then the earliest recorded error; then
    the lowest rank.
    """

    def key(f: Failure) -> tuple[bool, float, int]:
        secondary = bool(f.exc_type) and str(f.exc_type).endswith(_SECONDARY_ERRORS)
        return (secondary, f.time if f.time is not None else math.inf, f.rank)

    return min(failures, key=key)


def describe_others(
    ranks: Sequence[int],
    returncodes: Sequence[int | None],
    endings: Sequence[Ending],
    first: int,
    grace_period: float,
    sig: int = signal.SIGTERM,
) -> str:
    """One phrase per other rank: finished, also failed, terminated or killed."""
    parts = []
    for rank, rc, ending in zip(ranks, returncodes, endings, strict=True):
        if rank == first:
            continue
        if ending.killed:
            what = f"killed by SIGKILL after the {grace_period:g} s grace period"
        elif ending.signaled:
            if rc == -sig:
                what = f"terminated by {signal_name(sig)}"
            else:
                what = f"{describe_exit(rc if rc is not None else 0)} after {signal_name(sig)}"
        elif rc == 0:
            what = "had already finished (exit code 0)"
        elif rc is not None:
            what = f"also failed: {describe_exit(rc)}"
        else:
            what = "still running"
        parts.append(f"rank {rank} {what}")
    return "; ".join(parts) if parts else "none"


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


def format_failure(failure: Failure, world_size: int, where: str = "") -> str:
    """The lines that say which rank failed, how, and its traceback."""
    how = (
        describe_exit(failure.returncode) if failure.returncode is not None else "reported an error"
    )
    lines = [f"rank {failure.rank} (of {world_size}{where}) failed first: {how}"]
    if failure.exc_type is not None:
        lines.append(f"error: {failure.exc_type}: {failure.message or ''}".rstrip())
    if failure.traceback:
        lines.append(f"traceback of rank {failure.rank} (from {failure.traceback_source}):")
        lines.append(_indent(failure.traceback))
    elif failure.note:
        lines.append(failure.note)
    return "\n".join(lines)


# ---------------------------------------------------------------------- spawn
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


@dataclass(frozen=True)
class _ChildSpec:
    rank: int
    env: dict[str, str]
    unset: tuple[str, ...]
    init: bool
    backend: str | None
    timeout: float
    parent_pid: int
    death_signal: bool


def _qualname(exc: BaseException) -> str:
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _error_report(exc: BaseException, tb: TracebackType | None) -> dict[str, Any]:
    return {
        "status": "error",
        "exc_type": _qualname(exc),
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
    try:
        from . import _api

        _api.destroy_process_group()
    except Exception:
        pass


def _child_main(
    spec: _ChildSpec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of a spawned rank (runs in the child)."""
    # Own process group, so the parent can end this rank and anything it started in one go,
    # and a Ctrl-C in the terminal reaches only the parent, which then ends the ranks in order.
    try:
        os.setsid()
    except OSError:
        pass
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
        code = exc.code
        if code is None or code == 0:
            value = None
        else:
            # Report before cleaning up: the parent can stop the other ranks right away.
            _send(conn, _error_report(exc, exc.__traceback__))
            if initialized:
                _destroy_quietly()
            conn.close()
            sys.exit(code if isinstance(code, int) else 1)
    except BaseException as exc:
        _send(conn, _error_report(exc, exc.__traceback__))
        if initialized:
            _destroy_quietly()
        conn.close()
        sys.exit(1)
    try:
        if initialized:
            from . import _api

            _api.destroy_process_group()
    except BaseException as exc:
        _send(conn, _error_report(exc, exc.__traceback__))
        conn.close()
        sys.exit(1)
    _send(conn, {"status": "ok", "json": True, "value": value})
    conn.close()


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
    report: dict[str, Any] | None = None
    conn: multiprocessing.connection.Connection | None = None
    failed_seen: bool = False


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

    def _pump(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a report or an exit, reading every report that arrived."""
        readers: list[Any] = [s.conn for s in self._states if s.conn is not None]
        readers += [p.sentinel for p in self.processes if p.exitcode is None]
        if readers and seconds > 0:
            multiprocessing.connection.wait(readers, timeout=seconds)
        for state in self._states:
            self._read(state)

    def _read(self, state: _RankState) -> None:
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
            note = f"it left no traceback: {describe_exit(rc)} before it could report one" + (
                " (out of memory? see dmesg)" if rc == -signal.SIGKILL else ""
            )
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
            self._pump(0)
            failures = [f for r, rc in enumerate(returncodes) if (f := self._failure(r, rc))]
            if failures:
                self._fail(pick_first(failures))
            if all(p.exitcode == 0 for p in self.processes):
                self._finish()
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            left = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            self._pump(left)

    def _finish(self) -> None:
        for state in self._states:
            self._read(state)
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
            wait=lambda s: self._pump(s),
        )
        for state in self._states:
            self._read(state)
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
    common = thread_env(os.environ, nprocs)
    # Error files belong to an outer launcher's rank, not to these children.
    unset = ("DPT_ERROR_FILE",)
    main_thread = threading.current_thread() is threading.main_thread()
    load_prctl()

    processes: list[multiprocessing.process.BaseProcess] = []
    states: list[_RankState] = []
    try:
        for rank in range(nprocs):
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
            )
            env.update(common)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus[rank]
            spec = _ChildSpec(
                rank=rank,
                env=env,
                unset=unset,
                init=init,
                backend=backend,
                timeout=float(timeout),
                parent_pid=os.getpid(),
                # The death signal fires when the starting *thread* ends, and only the main
                # thread lives as long as the process; forkserver children have another parent.
                death_signal=main_thread and start_method != "forkserver",
            )
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(spec, fn, tuple(args), writer),
                name=f"spawn-rank{rank}",
            )
            with _ENV_LOCK:
                _start_with_env(proc, env, unset)
            writer.close()
            processes.append(proc)
            states.append(_RankState(conn=reader))
    except BaseException:
        shutdown([_MPChild(p) for p in processes if p.pid is not None], grace_period)
        for s in states:
            if s.conn is not None:
                s.conn.close()
        raise
    context = SpawnContext(
        processes=processes, grace_period=grace_period, _states=states, run_id=run_id
    )
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


# ---------------------------------------------------------------------- Parallel
class Parallel:
    """Run a training function on every rank, as PyTorch Ignite's ``idist.Parallel`` does.

    Three modes, chosen at ``__enter__``:

    - ``nproc_per_node=N``: :meth:`run` spawns N ranks on this host (via :func:`spawn`), each
      with the group initialized, and calls ``fn(local_rank, *args, **kwargs)`` in each.
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
    ) -> None:
        """Describe the job; nothing starts before ``__enter__``/:meth:`run`.

        Args:
            backend: the group's backend (None chooses automatically).
            nproc_per_node: ranks to spawn, or None to use the current process.
            timeout: the group's collective timeout in seconds.
            master_port: the store's port when spawning (None picks a free one).
            start_method: multiprocessing start method when spawning.
            grace_period: seconds between SIGTERM and SIGKILL after a failure.

        Raises:
            ValueError: when ``nproc_per_node`` is not a positive int.
        """
        if nproc_per_node is not None and (
            isinstance(nproc_per_node, bool)
            or not isinstance(nproc_per_node, int)
            or nproc_per_node < 1
        ):
            raise ValueError(
                f"Parallel: nproc_per_node must be a positive int or None, got {nproc_per_node!r}"
            )
        self.backend = backend
        self.nproc_per_node = nproc_per_node
        self.timeout = timeout
        self.master_port = master_port
        self.start_method = start_method
        self.grace_period = grace_period
        self.mode: str | None = None  # "spawn", "launched" or "serial" once entered
        self._owns_group = False

    def __enter__(self) -> Parallel:
        from . import _api

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
            from . import _api

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
            )
        from . import _api

        return fn(_api.get_local_rank(), *args, **kwargs)
