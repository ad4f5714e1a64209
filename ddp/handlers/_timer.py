"""Ignite's ``Timer``: the (average) time between engine events, with pause and resume."""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any

from ddp.engine import Events

if TYPE_CHECKING:
    from ddp.engine import Engine

__all__ = ["Timer"]


class Timer:
    """Measure the time between events, optionally averaged over steps.

    The timer runs from :meth:`reset` (and construction); :meth:`pause` adds the running
    stretch to :attr:`total` and stops it, :meth:`resume` starts a new stretch, :meth:`step`
    counts one step. :meth:`value` is the total so far (including a running stretch),
    divided by the steps when ``average`` (at least 1). The clock is ``time.perf_counter``;
    each rank measures its own time.

    Args:
        average: divide :meth:`value` by the number of steps.

    Attributes:
        total: seconds measured by finished stretches.
        step_count: steps counted (a float, as in Ignite).
        running: whether a stretch is being measured.

    Example:
        >>> timer = Timer(average=True)
        >>> timer.attach(trainer, start=Events.EPOCH_STARTED, resume=Events.ITERATION_STARTED,
        ...              pause=Events.ITERATION_COMPLETED, step=Events.ITERATION_COMPLETED)
        >>> # timer.value(): mean seconds per iteration of the current epoch
    """

    def __init__(self, average: bool = False) -> None:
        self._average = bool(average)
        self.reset()

    def attach(
        self,
        engine: Engine,
        start: Any = Events.STARTED,
        pause: Any = Events.COMPLETED,
        resume: Any = None,
        step: Any = None,
    ) -> Timer:
        """Drive the timer with ``engine``'s events.

        Args:
            engine: the engine.
            start: resets (and starts) the timer.
            pause: pauses it.
            resume: resumes it (None: never).
            step: counts a step (None: never).

        Returns:
            This timer.
        """
        engine.add_event_handler(start, self.reset)
        engine.add_event_handler(pause, self.pause)
        if resume is not None:
            engine.add_event_handler(resume, self.resume)
        if step is not None:
            engine.add_event_handler(step, self.step)
        return self

    def reset(self, *args: Any) -> Timer:
        """Zero the total and the steps and start measuring (extra arguments: an engine)."""
        self._t0 = perf_counter()
        self.total = 0.0
        self.step_count = 0.0
        self.running = True
        return self

    def pause(self, *args: Any) -> None:
        """Add the running stretch to the total and stop (when paused already: nothing)."""
        if self.running:
            self.total += self._elapsed()
            self.running = False

    def resume(self, *args: Any) -> None:
        """Start a new stretch (when running already: nothing, the stretch goes on)."""
        if not self.running:
            self.running = True
            self._t0 = perf_counter()

    def value(self) -> float:
        """Seconds measured so far, divided by the steps (at least 1) when ``average``."""
        total = self.total
        if self.running:
            total += self._elapsed()
        denominator = max(self.step_count, 1.0) if self._average else 1.0
        return total / denominator

    def step(self, *args: Any) -> None:
        """Count one step."""
        self.step_count += 1.0

    def _elapsed(self) -> float:
        return perf_counter() - self._t0
