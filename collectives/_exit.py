"""The one ``sys.excepthook`` of collectives: what a rank does when an uncaught exception ends it.

Several parts must act then: the error file (so the launcher can report this rank's own
traceback), the cpu and nccl backends (tell the peers why this rank fails, so they report
"rank 1 failed: ValueError: ..." instead of waiting for their timeout), and the mpi backend
(``MPI_Abort`` once the traceback is printed, or the other ranks would wait inside MPI). Each
registers a callback with :func:`on_uncaught` when it starts to matter (a group exists, a
launcher asked for an error file); importing collectives installs nothing.

The first registration installs one hook that chains to the hook it replaces: it runs the
``before`` callbacks, then the previous hook (which prints the traceback), then the ``after``
callbacks. A callback that raises is reported on stderr and never hides the real error.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import TracebackType

__all__ = ["ExceptHook", "on_uncaught"]

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], None]

_MARK = "_dpt_collectives_hook"
_lock = threading.Lock()
_before: list[ExceptHook] = []
_after: list[ExceptHook] = []
# The exception the hook is handling: a hook of ours that runs again for it, because another
# hook wrapped ours and we were installed on top of that one, only passes it on.
_handling: BaseException | None = None


def on_uncaught(callback: ExceptHook, *, after_print: bool = False) -> None:
    """Run ``callback(exc_type, exc, tb)`` when an uncaught exception is about to end the process.

    Registering the same callback again does nothing. Installs the hook if ``sys.excepthook``
    is not ours (the first time, or after something replaced it).

    Args:
        callback: what to do; it must be quick and must not rely on other threads.
        after_print: run it after the previous hook printed the traceback (for callbacks that
            end the process, such as ``MPI_Abort``).
    """
    with _lock:
        target = _after if after_print else _before
        if callback not in target:
            target.append(callback)
        if not getattr(sys.excepthook, _MARK, False):
            sys.excepthook = _chain(sys.excepthook)


def _chain(previous: ExceptHook) -> ExceptHook:
    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        global _handling
        if value is not None and value is _handling:
            previous(tp, value, tb)
            return
        _handling = value
        _run(_before, tp, value, tb)
        previous(tp, value, tb)
        _run(_after, tp, value, tb)

    setattr(hook, _MARK, True)
    return hook


def _run(
    callbacks: list[ExceptHook],
    tp: type[BaseException],
    value: BaseException,
    tb: TracebackType | None,
) -> None:
    for callback in list(callbacks):
        try:
            callback(tp, value, tb)
        except Exception as err:  # never let reporting hide the real error
            print(f"collectives: an exit hook failed: {type(err).__name__}: {err}", file=sys.stderr)
