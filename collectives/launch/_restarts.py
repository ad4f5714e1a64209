"""Restarts, shared by ``collectives.run --max-restarts N`` and ``spawn(max_restarts=N)``.

The policy, the same for both launchers:

1. An *attempt* is one start of every rank. Attempt ``k`` (0 on the first start) sees
   ``DPT_RESTART_COUNT=k`` and torchrun's ``TORCHELASTIC_RESTART_COUNT=k`` and
   ``TORCHELASTIC_MAX_RESTARTS=N`` (set by :func:`collectives.launch._launcher.rank_env`).
2. An attempt fails as the failure policy of :mod:`collectives.launch._launcher` says: every rank is
   ended and the failure is reported (rank, traceback or signal). The report ends with a line
   saying that the job restarts (:func:`restart_line`) or that the restarts are exhausted.
3. Between attempts nothing of the old one is left: every rank's process group has no live
   process (:func:`wait_groups_gone`), the attempt's shared-memory segments are removed, its
   error files too (``collectives.run``), and the next attempt gets a fresh free store port
   unless one was given (the store binds with ``SO_REUSEADDR``, so the same port rebinds at
   once).
4. Each attempt has its own ``DPT_RUN_ID`` (:func:`attempt_run_id`): the job's id on the
   first, ``<id>.r<k>`` on restart ``k``. Segment names carry a tag made of that id's hash,
   so no segment of one attempt can be taken for, or removed as, another attempt's.
5. A signal to the launcher ends the job without a restart. The result (exit code, the
   ``SpawnError``) is the last attempt's.

Restarts need every rank to start again, so with the static rendezvous ``collectives.run``
refuses ``--max-restarts`` with ``--nnodes > 1``: one node's launcher cannot re-form ranks that
other launchers own. With ``--rdzv-backend c10d`` the launchers restart together, through a
new rendezvous round (:mod:`collectives.launch._elastic`); there attempt ``k`` is round ``k``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

__all__ = [
    "attempt_run_id",
    "attempt_title",
    "check_max_restarts",
    "restart_line",
    "wait_groups_gone",
]


def check_max_restarts(value: object, who: str) -> int:
    """``value`` as a number of restarts (an int >= 0).

    Raises:
        ValueError: for a bool, a non-int or a negative number (the message starts with ``who``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{who}: max_restarts must be an int >= 0, got {value!r}")
    return value


def attempt_run_id(run_id: str, attempt: int) -> str:
    """The ``DPT_RUN_ID`` of attempt ``attempt``: the job's id first, then ``<id>.r<k>``."""
    return run_id if attempt == 0 else f"{run_id}.r{attempt}"


def attempt_title(attempt: int, max_restarts: int) -> str:
    """``" (attempt 2 of 3)"`` for reports, or nothing when the job has no restarts."""
    return f" (attempt {attempt + 1} of {max_restarts + 1})" if max_restarts > 0 else ""


def restart_line(prog: str, attempt: int, max_restarts: int, outcome: str) -> str:
    """The last line of a failed attempt's report: what happens next.

    Args:
        prog: who speaks (``collectives.run``, ``spawn``).
        attempt: the attempt that failed (0 for the first).
        max_restarts: restarts allowed in all.
        outcome: how the job ends if this attempt is the last (``"... exits with code 1"``).
    """
    if max_restarts == 0:
        return outcome
    if attempt < max_restarts:
        return (
            f"{prog}: restarting (attempt {attempt + 2} of {max_restarts + 1}, "
            f"DPT_RESTART_COUNT={attempt + 1})"
        )
    return f"{prog}: restarts exhausted ({max_restarts + 1} attempts ran); {outcome}"


def _live_members(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed grandchild may stay a zombie until its new parent reaps it (in a container
    # nobody may): it holds nothing, so look for a member that still runs.
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def wait_groups_gone(pgids: Iterable[int], timeout: float = 5.0) -> list[int]:
    """SIGKILL what is left of each process group, and wait until no member runs.

    The ranks themselves are gone when this is called (``shutdown`` waited for them); what it
    catches are their children, which the group's SIGKILL reached but nobody waited for.

    Returns:
        The groups that still have a running member after ``timeout`` (stuck in the kernel).
    """
    left = [g for g in pgids if g > 0]
    deadline = time.monotonic() + timeout
    while True:
        left = [g for g in left if _live_members(g)]
        if not left or time.monotonic() >= deadline:
            return left
        for g in left:
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
