"""Small helpers shared by the handlers: an event's counter, another engine's global step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddp.engine import Engine

__all__ = ["event_count", "global_step_from_engine"]


def event_count(engine: Engine, event: Any) -> int:
    """``engine``'s counter for ``event``: its iteration or its epoch (``State.event_to_attr``).

    Raises:
        RuntimeError: for an event that has no counter (Ignite's message).
    """
    return int(engine.state.get_event_attrib_value(event))


def global_step_from_engine(
    engine: Engine, custom_event_name: Any = None, fallback_attr: str = "epoch"
) -> Callable[[Any, Any], int]:
    """A ``global_step_transform`` that reads ``engine``'s counter (Ignite's helper).

    Typical use: a handler attached to an evaluator names its files or log lines after the
    trainer's epoch, ``global_step_transform=global_step_from_engine(trainer)``.

    Args:
        engine: the engine whose state gives the step.
        custom_event_name: count this event instead of the one the handler fires on.
        fallback_attr: the ``State`` attribute used for events that have no counter
            (``COMPLETED`` has one; ``EXCEPTION_RAISED`` or a custom event without
            ``event_to_attr`` has not).

    Returns:
        ``fn(engine_the_handler_runs_on, event_name) -> int``.
    """

    def wrapper(_: Any, event_name: Any) -> int:
        if custom_event_name is not None:
            event_name = custom_event_name
        try:
            return event_count(engine, event_name)
        except RuntimeError:  # an event without a counter
            return int(getattr(engine.state, fallback_attr))

    return wrapper
