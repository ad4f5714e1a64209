"""Running a threads job: ``fn(rank, *args)`` in one thread per rank, each bound to its device.

:func:`run_threads` is what ``spawn(..., backend="threads")`` does. Each rank thread becomes its
rank (``collectives._api`` keeps its world), makes its device current, joins the default group
when asked, runs ``fn`` and leaves the group. Return values come back as they are (no JSON).

Failure rules (those of ``spawn`` with processes, as far as threads allow): the first rank
thread that raises fails every group it is in at once (:meth:`ThreadJob.fail`), so the other
ranks' pending and later collectives raise within a moment; :func:`run_threads` then waits up
to ``grace_period`` for the others to end and raises :class:`ThreadsFailedError` with the root
cause (errors that only say "another rank failed" come last) and its traceback. A thread
cannot be killed: one still running after the grace period (stuck outside collectives) is
left behind as a daemon thread, and the error says so.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tensorlib as tl

from .._errorfile import exception_name
from .._errors import SpawnError
from ..backends.threads._engines import ThreadJob, check_devices
from ._launcher import Failure, format_banner, format_failure, pick_first
from ._restarts import attempt_title, restart_line

__all__ = ["ThreadsFailedError", "normalize_devices", "run_threads", "spawn_threads"]


class ThreadsFailedError(RuntimeError):
    """A rank thread failed; ``failure`` is the root cause, ``text`` the report."""

    def __init__(self, text: str, failure: Failure) -> None:
        super().__init__(text)
        self.failure = failure


@dataclass
class _Outcome:
    done: bool = False
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    time: float = 0.0


def normalize_devices(devices: Sequence[Any] | None, nprocs: int) -> list[Any]:
    """One device per rank: strings become tensorlib devices, None means the CPU for all.

    Raises:
        ValueError: a count other than ``nprocs``, mixed kinds, or a kind without engine.
    """
    from tensorlib import device

    if devices is None:
        return [device("cpu")] * nprocs
    if isinstance(devices, str | bytes):
        raise TypeError(f"spawn: devices must be a list with one device per rank, got {devices!r}")
    found = [device(d) if isinstance(d, str) else d for d in devices]
    if len(found) != nprocs:
        raise ValueError(
            f"spawn: devices has {len(found)} entries but nprocs={nprocs}: give one device per rank"
        )
    check_devices(found)
    return found


def run_threads(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    devices: Sequence[Any],
    *,
    init: bool,
    timeout: float,
    grace_period: float,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in one thread per device (see the module docstring).

    Returns:
        Every rank's return value, in rank order.

    Raises:
        ThreadsFailedError: a rank raised (after the others ended or the grace period passed).
    """
    job = ThreadJob(devices, timeout)
    n = job.size
    # Every rank thread starts from a copy of the caller's default generator (as a forked
    # process would) and then draws and seeds its own.
    seed_state = tl.default_generator.get_state()
    outcomes = [_Outcome() for _ in range(n)]
    changed = threading.Condition()

    def main(rank: int) -> None:
        out = outcomes[rank]
        try:
            out.value = _rank_main(job, rank, fn, args, init, timeout, seed_state)
        except BaseException as exc:
            out.error, out.time = exc, time.time()
            out.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        finally:
            with changed:
                out.done = True
                changed.notify_all()

    threads = [
        threading.Thread(target=main, args=(r,), name=f"threads-rank-{r}", daemon=True)
        for r in range(n)
    ]
    for t in threads:
        t.start()
    try:
        _wait(outcomes, changed, grace_period)
    except BaseException as exc:  # KeyboardInterrupt in the caller: fail every rank's groups
        for r in range(n):
            job.fail(r, exc)
        raise
    failures = [_failure(r, o) for r, o in enumerate(outcomes) if o.error is not None]
    if failures:
        first = pick_first(failures)
        text = format_failure(first, n, " threads")
        raise ThreadsFailedError(f"{text}\nother ranks: {_others(outcomes, first.rank)}", first)
    return [o.value for o in outcomes]


def _rank_main(
    job: ThreadJob,
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    init: bool,
    timeout: float,
    seed_state: dict[str, Any],
) -> Any:
    from .. import _api

    _api.bind_rank_thread(job, rank)
    own = tl.Generator()
    own.set_state(seed_state)
    tl.set_thread_generator(own)
    dev = job.devices[rank]
    try:
        # CuPy arrays made without a device go to the rank's GPU.
        ctx = dev if getattr(dev, "type", "") == "cuda" else contextlib.nullcontext()
        with ctx:
            try:
                if init:
                    _api.init_process_group("threads", timeout=timeout)
                return fn(rank, *args)
            except BaseException as exc:
                job.fail(rank, exc)  # before leaving: peers report the failure, not a departure
                raise
            finally:
                _api.destroy_process_group()
    finally:
        job.store.set(f"world/left/{rank}", b"1")  # peers' setup waits name a rank that left
        _api.bind_rank_thread(None, -1)
        tl.set_thread_generator(None)


def _wait(outcomes: list[_Outcome], changed: threading.Condition, grace: float) -> None:
    """Until every rank ended, or ``grace`` seconds after the first failure."""
    end = None
    with changed:
        while not all(o.done for o in outcomes):
            if end is None and any(o.error is not None for o in outcomes):
                end = time.monotonic() + grace
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return
            changed.wait(0.5 if left is None else min(left, 0.5))


def _failure(rank: int, o: _Outcome) -> Failure:
    exc = o.error
    assert exc is not None
    return Failure(
        rank=rank,
        returncode=None,
        exc_type=exception_name(type(exc)),
        message=str(exc),
        traceback=o.traceback,
        traceback_source="its thread",
        time=o.time,
    )


def _others(outcomes: list[_Outcome], first: int) -> str:
    parts = []
    for r, o in enumerate(outcomes):
        if r == first:
            continue
        if not o.done:
            what = "still running (a thread cannot be killed: it is left behind, as a daemon)"
        elif o.error is not None:
            what = f"also failed: {type(o.error).__name__}"
        else:
            what = "had already finished"
        parts.append(f"rank {r} {what}")
    return "; ".join(parts) if parts else "none"


def spawn_threads(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    devices: Sequence[Any] | None,
    init: bool,
    timeout: float,
    grace_period: float,
    max_restarts: int,
) -> list[Any]:
    """``spawn(..., backend="threads")``: :func:`run_threads`, a failure raised as
    :class:`~collectives.SpawnError`, and ``max_restarts`` as ``spawn`` has them."""
    found = normalize_devices(devices, nprocs)
    attempt = 0
    while True:
        try:
            return run_threads(
                fn, args, found, init=init, timeout=timeout, grace_period=grace_period
            )
        except ThreadsFailedError as failed:
            f = failed.failure
            last = attempt == max_restarts
            line = restart_line("spawn", attempt, max_restarts, "")
            err = SpawnError(
                f"spawn: {failed}" + (f"\n{line}" if max_restarts and last else ""),
                rank=f.rank,
                exc_type=f.exc_type,
                traceback_text=f.traceback,
                attempts=attempt + 1,
            )
            if last:
                raise err from None
            title = f"spawn: job failed{attempt_title(attempt, max_restarts)}"
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(format_banner(title, f"{err}\n{line}"))
                sys.stderr.flush()
            attempt += 1
