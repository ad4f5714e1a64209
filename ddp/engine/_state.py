"""``State``: what a run knows (counters, the batch and output, metrics, times), a plain object."""

from __future__ import annotations

from typing import Any, ClassVar

from ._events import CallableEventWithFilter, Events

__all__ = ["State"]


class State:
    """An engine's run state; handlers read and write its attributes.

    Attributes:
        iteration: iterations done since the run began (not reset each epoch).
        epoch: the current epoch, counted from 1 (0 before the first).
        epoch_length: iterations per epoch (``len(data)`` unless given).
        max_epochs: epochs to run. max_iters: or iterations to run (then max_epochs follows).
        output: what the process function returned for the last batch.
        batch: the last batch.
        metrics: results of attached metrics, by name.
        dataloader: the data being run.
        seed: the seed of the run (set by ``run``; recorded for a user's own use).
        times: seconds taken, by event name (``EPOCH_COMPLETED``: the last epoch's,
            ``COMPLETED``: the run's).
    """

    # Which counter each event's filters see; an engine adds its custom events' to its copy.
    EVENT_TO_ATTR: ClassVar[dict[Any, str]] = {
        Events.GET_BATCH_STARTED: "iteration",
        Events.GET_BATCH_COMPLETED: "iteration",
        Events.ITERATION_STARTED: "iteration",
        Events.ITERATION_COMPLETED: "iteration",
        Events.EPOCH_STARTED: "epoch",
        Events.EPOCH_COMPLETED: "epoch",
        Events.STARTED: "epoch",
        Events.COMPLETED: "epoch",
    }

    def __init__(self, **kwargs: Any) -> None:
        self.event_to_attr: dict[Any, str] = dict(self.EVENT_TO_ATTR)
        self.iteration = 0
        self.epoch = 0
        self.epoch_length: int | None = None
        self.max_epochs: int | None = None
        self.max_iters: int | None = None
        self.output: Any = None
        self.batch: Any = None
        self.metrics: dict[str, Any] = {}
        self.dataloader: Any = None
        self.seed: int | None = None
        self.times: dict[str, float | None] = {
            Events.EPOCH_COMPLETED.name: None,
            Events.COMPLETED.name: None,
        }
        for k, v in kwargs.items():
            setattr(self, k, v)
        self._update_attrs()

    def _update_attrs(self) -> None:
        # Custom events registered with event_to_attr get their counter attribute.
        for value in self.event_to_attr.values():
            if not hasattr(self, value):
                setattr(self, value, 0)

    def get_event_attrib_value(self, event_name: CallableEventWithFilter | str) -> int:
        """The counter a filter of ``event_name`` is given (iteration or epoch).

        Raises:
            RuntimeError: for an event with no counter (e.g. EXCEPTION_RAISED).
        """
        if event_name not in self.event_to_attr:
            raise RuntimeError(f"Unknown event name '{event_name}'")
        return int(getattr(self, self.event_to_attr[event_name]))

    def __repr__(self) -> str:
        s = "State:\n"
        for attr, value in self.__dict__.items():
            if not isinstance(value, int | float | str | type(None) | dict):
                value = type(value).__name__
            s += f"\t{attr}: {value}\n"
        return s
