"""Grad mode: whether operations record the graph, per thread (``no_grad`` and friends).

Kept apart from the engine (``_autograd``) so that the hot paths which only ask "record or
not?" (``Function.apply`` and the operators' shorter path) read one thread-local attribute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["enable_grad", "is_grad_enabled", "no_grad", "set_grad_enabled"]

F = TypeVar("F", bound=Callable[..., Any])


class _GradState(threading.local):
    def __init__(self) -> None:
        self.enabled = True
        # One list of queued callbacks per backward() call in progress on this thread.
        self.callback_stack: list[list[Callable[[], None]]] = []
        # The number of each of those backward() calls (see _backward.current_backward_id).
        self.backward_ids: list[int] = []
        # Leaves (by id) whose grad buffer an op already wrote into in this backward.
        self.taken: set[int] = set()


_state = _GradState()


def is_grad_enabled() -> bool:
    """Return True when operations record the graph for backward."""
    return _state.enabled


class set_grad_enabled:
    """Context manager (and decorator) that turns graph recording on or off."""

    def __init__(self, mode: bool) -> None:
        self.mode = bool(mode)
        self.prev = True

    def __enter__(self) -> None:
        self.prev = _state.enabled
        _state.enabled = self.mode

    def __exit__(self, *exc: object) -> None:
        _state.enabled = self.prev

    def __call__(self, fn: F) -> F:
        mode = self.mode

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with set_grad_enabled(mode):
                return fn(*args, **kwargs)

        wrapper.__name__ = getattr(fn, "__name__", "wrapper")
        wrapper.__doc__ = fn.__doc__
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]


class no_grad(set_grad_enabled):
    """Disable graph recording: ``with no_grad(): ...`` or ``@no_grad()``."""

    def __init__(self) -> None:
        super().__init__(False)


class enable_grad(set_grad_enabled):
    """Re-enable graph recording inside a ``no_grad`` block."""

    def __init__(self) -> None:
        super().__init__(True)
