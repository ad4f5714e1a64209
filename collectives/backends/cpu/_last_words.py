"""What a cpu-backend rank tells its peers when its process ends, and what it heard from theirs.

An uncaught exception is about to end this process: every live group of it sets its abort flag
with the exception as the reason, so its peers report "rank 1 failed: ValueError: ..." instead
of only noticing that the process is gone. A setup wait quotes the reasons that peers gave
(``register_last_words``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..._exit import on_uncaught
from ..._setup_wait import register_last_words
from ._layout import W_ABORT

__all__ = ["forget", "track"]

_UNCAUGHT = "uncaught "  # how an abort reason says the rank's process is ending
_LIVE: set[Any] = set()  # the CpuBackends of this process with peers


def track(backend: Any) -> None:
    """Tell ``backend``'s peers (a CpuBackend of more than one rank) if this process ends with
    an uncaught exception, and read their reasons in setup waits."""
    _LIVE.add(backend)
    on_uncaught(_tell_peers_uncaught)


def forget(backend: Any) -> None:
    """``backend`` is closed: no more last words through it."""
    _LIVE.discard(backend)


def _last_words() -> dict[int, str]:
    """Global rank -> the reason it gave, in a group this process shares with it, for ending
    (an uncaught exception: see above). A setup wait quotes it."""
    said: dict[int, str] = {}
    for b in list(_LIVE):
        for q, view in enumerate(b.views):
            if q != b.rank and view.hdr[W_ABORT]:
                reason = view.abort_reason()
                if reason.startswith(_UNCAUGHT):
                    said.setdefault(b.info.ranks[q], reason)
    return said


def _tell_peers_uncaught(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    for b in list(_LIVE):
        with contextlib.suppress(Exception):
            b.sync.set_abort(f"{_UNCAUGHT}{tp.__name__}: {value}")


register_last_words(_last_words)
