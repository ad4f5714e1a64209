"""Metric usages: which engine events reset, update and complete a metric (Ignite's names).

The events come from :mod:`ddp.engine`, imported when a usage is built (not when this module
is), so ``ddp.engine`` may itself import ``ddp.metrics``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "BatchFiltered",
    "BatchWise",
    "EpochWise",
    "MetricUsage",
    "RunningBatchWise",
    "RunningEpochWise",
    "SingleEpochRunningBatchWise",
]


def _events() -> Any:
    from ddp.engine import Events  # late: ddp.engine may import ddp.metrics

    return Events


class MetricUsage:
    """The events on which a metric starts, updates and completes.

    Args:
        started: the event that calls :meth:`Metric.started` (a reset).
        completed: the event that calls :meth:`Metric.completed` (compute, then write
            ``engine.state.metrics``).
        iteration_completed: the event (possibly filtered) that calls
            :meth:`Metric.iteration_completed` (an update).
    """

    usage_name: str

    def __init__(self, started: Any, completed: Any, iteration_completed: Any) -> None:
        self.__started = started
        self.__completed = completed
        self.__iteration_completed = iteration_completed

    @property
    def STARTED(self) -> Any:
        """The event that resets the metric."""
        return self.__started

    @property
    def COMPLETED(self) -> Any:
        """The event that computes the metric into ``engine.state.metrics``."""
        return self.__completed

    @property
    def ITERATION_COMPLETED(self) -> Any:
        """The event that updates the metric with the engine's output."""
        return self.__iteration_completed


class EpochWise(MetricUsage):
    """The default: reset on ``EPOCH_STARTED``, update on every ``ITERATION_COMPLETED``,
    complete on ``EPOCH_COMPLETED``."""

    usage_name: str = "epoch_wise"

    def __init__(self) -> None:
        ev = _events()
        super().__init__(ev.EPOCH_STARTED, ev.EPOCH_COMPLETED, ev.ITERATION_COMPLETED)


class RunningEpochWise(EpochWise):
    """Reset on ``STARTED``, update and complete on every ``EPOCH_COMPLETED``."""

    usage_name: str = "running_epoch_wise"

    def __init__(self) -> None:
        ev = _events()
        MetricUsage.__init__(self, ev.STARTED, ev.EPOCH_COMPLETED, ev.EPOCH_COMPLETED)


class BatchWise(MetricUsage):
    """Reset on ``ITERATION_STARTED``, update and complete on every ``ITERATION_COMPLETED``."""

    usage_name: str = "batch_wise"

    def __init__(self) -> None:
        ev = _events()
        super().__init__(ev.ITERATION_STARTED, ev.ITERATION_COMPLETED, ev.ITERATION_COMPLETED)


class RunningBatchWise(BatchWise):
    """Reset on ``STARTED``, update and complete on every ``ITERATION_COMPLETED``."""

    usage_name: str = "running_batch_wise"

    def __init__(self) -> None:
        ev = _events()
        MetricUsage.__init__(self, ev.STARTED, ev.ITERATION_COMPLETED, ev.ITERATION_COMPLETED)


class SingleEpochRunningBatchWise(BatchWise):
    """Reset on ``EPOCH_STARTED``, update and complete on every ``ITERATION_COMPLETED``."""

    usage_name: str = "single_epoch_running_batch_wise"

    def __init__(self) -> None:
        ev = _events()
        MetricUsage.__init__(self, ev.EPOCH_STARTED, ev.ITERATION_COMPLETED, ev.ITERATION_COMPLETED)


class BatchFiltered(MetricUsage):
    """Epoch-wise, but updated only on the iterations ``Events.ITERATION_COMPLETED(*args,
    **kwargs)`` lets through (``every=``, ``once=``, ``event_filter=``)."""

    usage_name: str = "batch_filtered"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ev = _events()
        super().__init__(
            ev.EPOCH_STARTED, ev.EPOCH_COMPLETED, ev.ITERATION_COMPLETED(*args, **kwargs)
        )


# By name, as ``attach(..., usage="batch_wise")`` accepts them (BatchFiltered needs arguments).
USAGES: dict[str, Callable[[], MetricUsage]] = {
    cls.usage_name: cls
    for cls in (
        EpochWise,
        RunningEpochWise,
        BatchWise,
        RunningBatchWise,
        SingleEpochRunningBatchWise,
    )
}


def check_usage(usage: str | MetricUsage) -> MetricUsage:
    """The usage named by ``usage`` (a ``usage_name``), or ``usage`` itself.

    Raises:
        ValueError: for an unknown name.
        TypeError: for something that is neither a name nor a :class:`MetricUsage`.
    """
    if isinstance(usage, str):
        make = USAGES.get(usage)
        if make is not None:
            return make()
        names = ", ".join(repr(name) for name in USAGES)
        raise ValueError(f"Argument usage should be one of {names} or a MetricUsage, got {usage!r}")
    if not isinstance(usage, MetricUsage):
        raise TypeError(
            f"Unhandled usage type {type(usage).__name__}; expected a MetricUsage or str"
        )
    return usage
