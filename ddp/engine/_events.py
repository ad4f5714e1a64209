"""Ignite's events: ``Events``, filtered events (``Events.X(every=n)``), ``EventEnum``, lists.

An event is a ``CallableEventWithFilter``: a name plus an optional filter, a plain callable
``(engine, event_count) -> bool`` where the count is the engine's iteration for iteration
events and its epoch for the others (``State.event_to_attr``). Calling an event
(``Events.ITERATION_COMPLETED(every=100)``) returns a copy with a filter; the engine stores
the handler under the bare event and checks the filter when the event fires. Two events are
equal when their names are (filters aside), as in Ignite, so ``Events.X(every=2) == Events.X``.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any

__all__ = ["CallableEventWithFilter", "EventEnum", "Events", "EventsList", "check_signature"]

Filter = Callable[[Any, int], bool]


def check_signature(fn: Callable[..., Any], what: str, *args: Any, **kwargs: Any) -> None:
    """Raise a ValueError when ``fn`` cannot be called with these arguments (Ignite's check).

    Raises:
        ValueError: naming ``fn``, its signature and the arguments it would get.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust the caller
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        fn_params = list(signature.parameters)
        raise ValueError(
            f"Error adding {fn} '{what}': takes parameters {fn_params} but will be called with "
            f"{list(args)}(missing {exc})."
        ) from None


def _positive_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) > 0


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


class CallableEventWithFilter:
    """An event name with an optional filter; calling it makes a filtered copy.

    Args:
        value: the event's name as a string (``"iteration_completed"``).
        event_filter: ``(engine, event_count) -> bool``, or None to fire every time.
        name: the enum member's name (``"ITERATION_COMPLETED"``).
    """

    def __init__(self, value: str, event_filter: Filter | None = None, name: str | None = None):
        self.filter = event_filter
        if not hasattr(self, "_value_"):
            self._value_ = value
        if not hasattr(self, "_name_") and name is not None:
            self._name_ = name

    # Enum members get these from Enum; copies made by __call__ from __init__.
    @property
    def name(self) -> str:
        """The event's name (``ITERATION_COMPLETED``)."""
        return str(self._name_)

    @property
    def value(self) -> str:
        """The event's value (``iteration_completed``)."""
        return str(self._value_)

    def __call__(
        self,
        event_filter: Filter | None = None,
        every: int | None = None,
        once: int | Sequence[int] | None = None,
        before: int | None = None,
        after: int | None = None,
    ) -> CallableEventWithFilter:
        """This event with a filter: fire ``every`` n-th time, ``once`` at count(s), only
        ``before``/``after`` a count (with or without ``every``), or when ``event_filter``
        says so.

        Raises:
            ValueError: when not exactly one kind of filter is given, or a count is not a
                positive integer (``before``/``after``: not negative).
            TypeError: when ``event_filter`` is not callable.
        """
        kinds = (
            event_filter is not None,
            once is not None,
            every is not None or before is not None or after is not None,
        )
        if sum(kinds) != 1:
            raise ValueError(
                "Only one of the input arguments should be specified, except before, after "
                "and every"
            )
        if event_filter is not None and not callable(event_filter):
            raise TypeError("Argument event_filter should be a callable")
        if every is not None and not _positive_int(every):
            raise ValueError("Argument every should be integer and greater than zero")
        if once is not None:
            counts: Any = [once] if isinstance(once, numbers.Integral) else once
            if not (
                isinstance(counts, Sequence) and counts and all(_positive_int(c) for c in counts)
            ):
                raise ValueError(
                    "Argument once should either be a positive integer or a list of positive "
                    f"integers, got {once}"
                )
            event_filter = _once(list(counts))
        for what, v in (("before", before), ("after", after)):
            if v is not None and not _non_negative_int(v):
                raise ValueError(f"Argument {what} should be integer and greater or equal to zero")
        if before is not None or after is not None:
            event_filter = _between(every or 1, before, after)
        elif every is not None:
            event_filter = None if every == 1 else _every(every)
        if event_filter is not None:
            check_signature(event_filter, "event_filter", "engine", "event")
        return CallableEventWithFilter(self.value, event_filter, self.name)

    def __or__(self, other: Any) -> EventsList:
        return EventsList() | self | other

    def __repr__(self) -> str:
        out = f"Events.{self.name}"
        return out if self.filter is None else f"{out}(filter={self.filter})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CallableEventWithFilter):
            return self.name == other.name
        if isinstance(other, str):
            return self.name == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._name_)


def _every(every: int) -> Filter:
    def every_filter(engine: Any, event: int) -> bool:
        return event % every == 0

    return every_filter


def _once(counts: list[int]) -> Filter:
    def once_filter(engine: Any, event: int) -> bool:
        return event in counts

    return once_filter


def _between(every: int, before: int | None, after: int | None) -> Filter:
    upper = float("inf") if before is None else before
    lower = 0 if after is None else after

    def between_filter(engine: Any, event: int) -> bool:
        return lower < event < upper and (event - lower - 1) % every == 0

    return between_filter


class EventEnum(CallableEventWithFilter, Enum):
    """Base of ``Events`` and of users' own events (register them with
    ``engine.register_events(*MyEvents)``, fire them with ``engine.fire_event``).

    Example:
        >>> class BackpropEvents(EventEnum):
        ...     BACKWARD_STARTED = "backward_started"
    """

    def __new__(cls, value: str) -> EventEnum:
        member = object.__new__(cls)
        member._value_ = value
        return member

    def __init__(self, value: str) -> None:
        CallableEventWithFilter.__init__(self, value)

    # Enum would otherwise take these by value/identity; Ignite compares by name.
    __eq__ = CallableEventWithFilter.__eq__
    __hash__ = CallableEventWithFilter.__hash__
    __call__ = CallableEventWithFilter.__call__
    __or__ = CallableEventWithFilter.__or__

    def __repr__(self) -> str:
        return f"Events.{self.name}"


class Events(EventEnum):
    """The events an ``Engine`` fires, in the order of a run.

    STARTED, then per epoch EPOCH_STARTED, per iteration GET_BATCH_STARTED,
    GET_BATCH_COMPLETED, ITERATION_STARTED, ITERATION_COMPLETED, then EPOCH_COMPLETED; at the
    end COMPLETED. DATALOADER_STOP_ITERATION when the data is exhausted and re-iterated,
    TERMINATE after ``terminate()``, TERMINATE_SINGLE_EPOCH after ``terminate_epoch()``,
    EXCEPTION_RAISED (with the exception) when the process function or a handler raises.
    """

    EPOCH_STARTED = "epoch_started"
    EPOCH_COMPLETED = "epoch_completed"
    STARTED = "started"
    COMPLETED = "completed"
    ITERATION_STARTED = "iteration_started"
    ITERATION_COMPLETED = "iteration_completed"
    EXCEPTION_RAISED = "exception_raised"
    GET_BATCH_STARTED = "get_batch_started"
    GET_BATCH_COMPLETED = "get_batch_completed"
    DATALOADER_STOP_ITERATION = "dataloader_stop_iteration"
    TERMINATE = "terminate"
    TERMINATE_SINGLE_EPOCH = "terminate_single_epoch"


class EventsList:
    """Several events for one handler: ``Events.STARTED | Events.COMPLETED``."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def _append(self, event: Any) -> None:
        if not isinstance(event, CallableEventWithFilter | str):
            raise TypeError(
                f"Argument event should be Events or CallableEventWithFilter, got: {event!r}"
            )
        self._events.append(event)

    def __or__(self, other: Any) -> EventsList:
        if isinstance(other, EventsList):
            for e in other:
                self._append(e)
        else:
            self._append(other)
        return self

    def __iter__(self) -> Iterator[Any]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, index: int) -> Any:
        return self._events[index]

    def __repr__(self) -> str:
        return " | ".join(repr(e) for e in self._events)
