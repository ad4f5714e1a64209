"""The handler registry of an ``Engine``: adding, finding, removing and firing handlers.

``EventsDispatcher`` keeps one list per event (a filtered event is stored under its bare
event, its filter checked when the event fires) and calls each handler with the engine first
when it takes one. ``Engine`` (``_engine.py``) adds the run loop on top.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from ._events import CallableEventWithFilter, EventEnum, Events, EventsList, check_signature
from ._state import State

__all__ = ["ControlFlow", "EventsDispatcher", "RemovableEventHandle", "note"]

Handler = Callable[..., Any]


class ControlFlow(Exception):  # noqa: N818 (terminate signals, never seen by users)
    """Base of the engine's terminate signals: passed through handlers without a note."""


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class RemovableEventHandle:
    """What ``add_event_handler`` returns: ``remove()`` (or leaving a ``with``) detaches it."""

    def __init__(self, event_name: Any, handler: Handler, engine: EventsDispatcher) -> None:
        self.event_name = event_name
        self.handler = handler
        self.engine = weakref.ref(engine)

    def remove(self) -> None:
        """Remove the handler from the engine, if both still exist and it is registered."""
        engine = self.engine()
        if engine is None:
            return
        events = self.event_name if isinstance(self.event_name, EventsList) else [self.event_name]
        for e in events:
            if engine.has_event_handler(self.handler, e):
                engine.remove_event_handler(self.handler, e)

    def __enter__(self) -> RemovableEventHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class EventsDispatcher:
    """Handlers by event, for ``Engine``: Ignite's ``add_event_handler`` family."""

    def __init__(self) -> None:
        self._event_handlers: defaultdict[Any, list[tuple[Handler, Handler, tuple, dict]]] = (
            defaultdict(list)
        )
        self._allowed_events: list[Any] = list(Events)
        self.logger = logging.getLogger(f"ddp.engine.{type(self).__name__}")
        self.last_event_name: Any = None
        self.state = State()

    # ------------------------------------------------------------------ events
    def register_events(
        self, *event_names: Any, event_to_attr: Mapping[Any, str] | None = None
    ) -> None:
        """Allow handlers for custom events (strings or ``EventEnum`` members).

        Args:
            *event_names: the events.
            event_to_attr: for events with a counter, the ``State`` attribute holding it
                (created at 0), so filters like ``every=`` work on them.

        Raises:
            TypeError: for an event that is neither a string nor an event.
        """
        if event_to_attr is not None and not isinstance(event_to_attr, Mapping):
            raise ValueError(f"Expected event_to_attr to be a mapping, got {type(event_to_attr)}")
        for e in event_names:
            if not isinstance(e, str | EventEnum | CallableEventWithFilter):
                raise TypeError(
                    f"Value at {event_names.index(e)} of event_names should be a str or "
                    f"EventEnum, but given {e!r}"
                )
            self._allowed_events.append(e)
        if event_to_attr:
            self.state.event_to_attr = {**self.state.event_to_attr, **event_to_attr}
            self.state._update_attrs()

    def has_registered_events(self, event: Any) -> bool:
        """Whether ``event`` may have handlers (a built-in or registered event)."""
        return event in self._allowed_events

    def add_event_handler(
        self, event_name: Any, handler: Handler, *args: Any, **kwargs: Any
    ) -> RemovableEventHandle:
        """Call ``handler(engine, *args, **kwargs)`` (or without the engine, if it takes none)
        whenever ``event_name`` fires and its filter, if any, agrees.

        Args:
            event_name: an event, a filtered event (``Events.X(every=10)``) or a list
                (``Events.A | Events.B``).
            handler: the callable.
            *args: extra positional arguments for it.
            **kwargs: extra keyword arguments for it.

        Returns:
            A handle whose ``remove()`` detaches the handler.

        Raises:
            ValueError: for an event that was not registered, a filter on an event without a
                counter, or a handler that cannot take these arguments.
        """
        if isinstance(event_name, EventsList):
            for e in event_name:
                self.add_event_handler(e, handler, *args, **kwargs)
            return RemovableEventHandle(event_name, handler, self)
        if event_name not in self._allowed_events:
            raise ValueError(
                f"Event {event_name!r} is not a valid event for this {type(self).__name__}: "
                "register custom events with engine.register_events(...) first"
            )
        event_filter = getattr(event_name, "filter", None)
        if event_filter is not None and event_name not in self.state.event_to_attr:
            raise ValueError(
                f"{event_name!r} has no counter (iteration or epoch) for its filter; filters "
                "apply to iteration and epoch events (or custom events given event_to_attr)"
            )
        event_args = (Exception(),) if event_name == Events.EXCEPTION_RAISED else ()
        try:
            check_signature(handler, "handler", self, *event_args, *args, **kwargs)
            first: tuple[Any, ...] = (self,)
        except ValueError:
            check_signature(handler, "handler", *event_args, *args, **kwargs)
            first = ()
        call = handler
        if event_filter is not None:
            call = self._filtered(handler, event_name, event_filter)
        key = self._key(event_name)
        self._event_handlers[key].append((handler, call, first + args, kwargs))
        self.logger.debug(f"Added handler for event {event_name}")
        return RemovableEventHandle(event_name, handler, self)

    def _filtered(self, handler: Handler, event_name: Any, event_filter: Any) -> Handler:
        def filtered(*args: Any, **kwargs: Any) -> Any:
            if event_filter(self, self.state.get_event_attrib_value(event_name)):
                return handler(*args, **kwargs)
            return None

        filtered.__qualname__ = _name(handler)
        return filtered

    @staticmethod
    def _key(event_name: Any) -> Any:
        # Filtered copies hash and compare as their bare event; one list per event.
        return event_name.name if isinstance(event_name, CallableEventWithFilter) else event_name

    def on(self, event_name: Any, *args: Any, **kwargs: Any) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`add_event_handler`; returns the function unchanged."""

        def decorator(f: Handler) -> Handler:
            self.add_event_handler(event_name, f, *args, **kwargs)
            return f

        return decorator

    def has_event_handler(self, handler: Handler, event_name: Any = None) -> bool:
        """Whether ``handler`` is registered (for ``event_name``, or any event)."""
        keys = [self._key(event_name)] if event_name is not None else list(self._event_handlers)
        return any(
            h is handler or h == handler for k in keys for h, *_ in self._event_handlers.get(k, [])
        )

    def remove_event_handler(self, handler: Handler, event_name: Any) -> None:
        """Detach ``handler`` from ``event_name``.

        Raises:
            ValueError: when it is not registered for that event.
        """
        key = self._key(event_name)
        kept = [
            e for e in self._event_handlers.get(key, []) if not (e[0] is handler or e[0] == handler)
        ]
        if key not in self._event_handlers or len(kept) == len(self._event_handlers[key]):
            raise ValueError(
                f"Input handler '{handler}' is not found among registered event handlers"
            )
        self._event_handlers[key] = kept

    def fire_event(self, event_name: Any) -> None:
        """Fire a (custom) event now: its handlers run, ``last_event_name`` is set."""
        self._fire_event(event_name)

    def _fire_event(self, event_name: Any, *event_args: Any, **event_kwargs: Any) -> None:
        self.last_event_name = event_name
        for handler, call, args, kwargs in list(
            self._event_handlers.get(self._key(event_name), [])
        ):
            if event_kwargs:
                kwargs = {**kwargs, **event_kwargs}
            first, rest = args[:1], args[1:]
            if first and first[0] is not self:
                first, rest = (), args
            try:
                call(*first, *event_args, *rest, **kwargs)
            except ControlFlow:
                raise
            except Exception as exc:
                note(exc, f"raised in handler {_name(handler)} for {event_name!r}")
                raise


def note(exc: BaseException, text: str) -> None:
    """Add ``text`` to the exception's notes once (shown under its message in tracebacks)."""
    notes = getattr(exc, "__notes__", [])
    if not any(n.startswith("raised in") for n in notes):
        exc.add_note(text)
