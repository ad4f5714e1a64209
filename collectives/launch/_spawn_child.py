"""The child's side of ``spawn``: become rank ``rank``, run ``fn``, carry the outcome home.

:func:`child_main` is the entry point of every spawned process. It takes the rank's
environment from its :class:`ChildSpec`, joins the default group when asked, runs ``fn`` and
sends one JSON report (the value, or the error with its traceback) through the pipe before it
exits, so the parent knows what happened without unpickling anything.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn

from .._errorfile import exception_name
from ._launcher import set_parent_death_signal

__all__ = ["REPORT_LIMIT", "ChildSpec", "child_main"]

# A child's JSON report (result or traceback) larger than this is replaced by a short note.
REPORT_LIMIT = 64 << 20


@dataclass(frozen=True)
class ChildSpec:
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
    if len(data) > REPORT_LIMIT:
        data = json.dumps({**report, "value": None, "json": False, "traceback": ""}).encode()
    try:
        conn.send_bytes(data)
    except OSError:
        pass  # the parent is gone or stopped listening; nothing left to tell


def _destroy_quietly() -> None:
    with contextlib.suppress(Exception):
        from .. import _api

        _api.destroy_process_group()


def child_main(
    spec: ChildSpec,
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
            from .. import _api

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
            from .. import _api

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
