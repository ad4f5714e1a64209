"""Per-rank error files: how a worker's own traceback reaches the launcher's failure report.

The launcher (``python -m collectives.run``) gives every worker
``DPT_ERROR_FILE=<dir>/rank<k>.json``.
:func:`install_excepthook` (called by ``init_process_group``) makes an uncaught exception write
``{rank, exc_type, message, traceback, time, pid, host}`` there, atomically, before Python prints
it as usual. When a worker has no error file (it died before ``init_process_group``, or by a
signal), :func:`extract_traceback` finds the last traceback in the tail of its stderr instead.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from ._exit import on_uncaught

__all__ = [
    "ERROR_FILE_ENV",
    "exception_name",
    "extract_traceback",
    "install_excepthook",
    "read_error_file",
    "write_error_file",
]

ERROR_FILE_ENV = "DPT_ERROR_FILE"

# Error files are small; a corrupt or hostile one must not make the launcher read gigabytes.
_MAX_ERROR_FILE_BYTES = 1 << 20
_MAX_TRACEBACK_CHARS = 256 * 1024


def exception_name(exc_type: type[BaseException]) -> str:
    """The name a failure report gives an exception's class, as Python's traceback prints it:
    ``ValueError``, ``MyError`` (defined in ``__main__``), ``pkg.module.MyError``."""
    module = exc_type.__module__
    name = exc_type.__qualname__
    return name if module in ("builtins", "__main__") else f"{module}.{name}"


def _env_rank() -> int | None:
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def write_error_file(
    path: str | os.PathLike[str],
    exc_type: type[BaseException],
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    """Write one exception as a JSON error record to ``path``, atomically.

    The record is written to a temporary file in the same directory and renamed over ``path``,
    so a reader sees either nothing or the whole record, never half of it.

    Args:
        path: where the record goes (usually ``$DPT_ERROR_FILE``).
        exc_type: the exception's class.
        exc: the exception (None is allowed, as for ``sys.excepthook``).
        tb: its traceback.

    Raises:
        OSError: if the file cannot be written.
    """
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    record = {
        "rank": _env_rank(),
        "exc_type": exception_name(exc_type),
        "message": "" if exc is None else str(exc),
        "traceback": text[-_MAX_TRACEBACK_CHARS:],
        "time": time.time(),
        "pid": os.getpid(),
        "host": platform.node(),
    }
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def install_excepthook() -> bool:
    """Record uncaught exceptions in ``$DPT_ERROR_FILE`` when the launcher asked for it.

    Registers (with :func:`collectives._exit.on_uncaught`) a callback that writes the error
    record (see :func:`write_error_file`) before the previous ``sys.excepthook`` prints the
    traceback as usual. Calling it again is a no-op (a changed ``DPT_ERROR_FILE`` is followed).

    Returns:
        True when the hook is installed (now or before), False when ``DPT_ERROR_FILE`` is unset.
    """
    global _error_file
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return _error_file is not None
    _error_file = path
    on_uncaught(_write_uncaught)
    return True


_error_file: str | None = None


def _write_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    if _error_file is None:
        return
    try:
        write_error_file(_error_file, exc_type, exc, tb)
    except Exception as err:  # never let reporting hide the real error
        print(f"collectives: could not write error file {_error_file}: {err}", file=sys.stderr)


def read_error_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read an error record written by :func:`write_error_file`.

    Returns:
        The record (with at least ``exc_type``, ``message`` and ``traceback`` as strings), or
        None when the file is missing, too large or not a valid record.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_ERROR_FILE_BYTES + 1)
    except OSError:
        return None
    if len(raw) > _MAX_ERROR_FILE_BYTES:
        return None
    try:
        record = json.loads(raw.decode("utf-8", errors="replace"))
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    for key in ("exc_type", "message", "traceback"):
        if not isinstance(record.get(key), str):
            return None
    return record


# A top-level traceback header: plain, or an exception group's ("  + Exception Group ...").
# Tracebacks nested inside a group are prefixed with "| " and are part of the group's block.
# A line may also start after a "\r" (a progress bar printed just before the traceback).
_TB_HEADER = re.compile(
    r"(?:\A|(?<=\n)|(?<=\r))(?:  \+ Exception Group )?Traceback \(most recent call last\):"
)
# Lines that join chained tracebacks; the whole chain belongs to one failure.
_CHAIN_LINES = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def extract_traceback(text: str) -> str | None:
    """Find the last Python traceback in some captured stderr, with the tracebacks chained to it.

    Args:
        text: the tail of a process's stderr.

    Returns:
        The traceback text (from its first ``Traceback (most recent call last):`` line to the
        end of ``text``), or None when there is none.
    """
    starts = [m.start() for m in _TB_HEADER.finditer(text)]
    if not starts:
        return None
    i = len(starts) - 1
    # Walk back over "During handling of the above exception..." links to the chain's start.
    while i > 0:
        between = text[starts[i - 1] : starts[i]].rstrip().splitlines()
        if not between or between[-1].strip() not in _CHAIN_LINES:
            break
        i -= 1
    return text[starts[i] :].rstrip("\n")[-_MAX_TRACEBACK_CHARS:]
