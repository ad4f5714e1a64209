"""RunningAverage (Ignite's ``ignite.metrics.RunningAverage``): an exponential moving
average of the engine's output or of another metric, the same on every rank."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

import ddp.idist as idist
import tensorlib as tl

from ._metric import Metric, NotComputableError, reinit__is_reduced, to_host
from ._usage import MetricUsage, RunningBatchWise, SingleEpochRunningBatchWise, check_usage

if TYPE_CHECKING:
    from ddp.engine import Engine

__all__ = ["RunningAverage"]


def _as_value(x: Any, what: str) -> float | np.ndarray[Any, Any]:
    """A number or tensor as a float or a float64 host array (a copy)."""
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, tl.Tensor | np.ndarray):
        arr = np.array(to_host(x, "RunningAverage", what), dtype=np.float64)
        return float(arr) if arr.ndim == 0 else arr
    raise TypeError(
        f"RunningAverage: {what} should be a number, a tensorlib Tensor or a NumPy array, got "
        f"{type(x).__name__}"
    )


class RunningAverage(Metric):
    """``value = alpha * value + (1 - alpha) * new`` after every update (the first update
    sets it), where ``new`` is either

    - the engine's output (``src=None``): ``output_transform(engine.state.output)``, a number
      or tensor, averaged over the ranks (one all-reduce per update); or
    - ``src.compute()`` (``src`` a metric, updated on every iteration and reset after each
      read), which is itself reduced over the ranks.

    Attached with :class:`RunningBatchWise` usage by default: reset at ``STARTED``, updated and
    written to ``engine.state.metrics`` at every ``ITERATION_COMPLETED``.

    Args:
        src: a metric to average, or None to average the output.
        alpha: the weight of the running value, ``0 < alpha <= 1``.
        output_transform: with ``src=None``, required: picks the value from the output.
        epoch_bound: deprecated (as in Ignite): True attaches with
            :class:`SingleEpochRunningBatchWise` usage, False with :class:`RunningBatchWise`.
        device: with ``src=None``, where a returned tensor goes; with a ``src``, that metric's.
        skip_unrolling: see :class:`Metric`.

    Raises:
        TypeError: when ``src`` is neither a Metric nor None.
        ValueError: for ``alpha`` out of range, an ``output_transform`` or ``device`` given
            with a ``src``, or no ``output_transform`` without one.
    """

    required_output_keys = None

    def __init__(
        self,
        src: Metric | None = None,
        alpha: float = 0.98,
        output_transform: Callable[[Any], Any] | None = None,
        epoch_bound: bool | None = None,
        device: str | tl.Device | None = None,
        skip_unrolling: bool = False,
    ) -> None:
        if not (isinstance(src, Metric) or src is None):
            raise TypeError(f"Argument src should be a Metric or None, got {type(src).__name__}.")
        if not (isinstance(alpha, numbers.Real) and 0.0 < alpha <= 1.0):
            raise ValueError(
                f"Argument alpha should be a float between 0.0 and 1.0, got {alpha!r}."
            )
        if src is not None:
            if output_transform is not None:
                raise ValueError("Argument output_transform should be None if src is a Metric.")
            if device is not None:
                raise ValueError("Argument device should be None if src is a Metric.")
            output_transform, device = (lambda x: x), src._device
        elif output_transform is None:
            raise ValueError(
                "Argument output_transform should not be None if src corresponds to the output "
                "of process function."
            )
        if epoch_bound is not None:
            warnings.warn(
                "`epoch_bound` is deprecated and will be removed in the future. Consider using "
                "`usage` argument of `attach` method instead. `epoch_bound=True` is equivalent "
                "with `usage=SingleEpochRunningBatchWise()` and `epoch_bound=False` is "
                "equivalent with `usage=RunningBatchWise()`.",
                stacklevel=2,
            )
        self.src: Metric | None = src
        self.epoch_bound: bool | None = epoch_bound
        self.alpha: float = float(alpha)
        super().__init__(output_transform, device=device or "cpu", skip_unrolling=skip_unrolling)

    @reinit__is_reduced
    def reset(self) -> None:
        """Forget the running value (and reset ``src``)."""
        self._value: float | np.ndarray[Any, Any] | None = None
        if self.src is not None:
            self.src.reset()

    @reinit__is_reduced
    def update(self, output: Any) -> None:
        """Fold one new value in: the output averaged over the ranks, or ``src.compute()``
        (after which ``src`` is reset)."""
        if self.src is None:
            # _as_value copies an array, so the in-place all-reduce leaves the output alone.
            value = idist.all_reduce(_as_value(output, "the output")) / idist.get_world_size()
        else:
            value = _as_value(self.src.compute(), "src.compute()")
            self.src.reset()
        if self._value is None:
            self._value = value
        else:
            self._value = self._value * self.alpha + (1.0 - self.alpha) * value

    def compute(self) -> float | tl.Tensor:
        """The running value: a float, or a float64 tensor for tensor values.

        Raises:
            NotComputableError: before the first update since the last reset.
        """
        if self._value is None:
            raise NotComputableError(
                "RunningAverage must have at least one update before it can be computed."
            )
        if isinstance(self._value, np.ndarray):
            return self._tensor(self._value)
        return self._value

    def _usage(self, usage: str | MetricUsage) -> MetricUsage:
        use = check_usage(usage)
        if self.epoch_bound is not None:
            return SingleEpochRunningBatchWise() if self.epoch_bound else RunningBatchWise()
        return use

    def attach(
        self, engine: Engine, name: str, usage: str | MetricUsage = "running_batch_wise"
    ) -> None:
        """Attach to ``engine`` (and ``src``'s update to every ``ITERATION_COMPLETED``, before
        this metric's own handlers)."""
        use = self._usage(usage)
        if self.src is not None:
            from ddp.engine import Events

            if not engine.has_event_handler(
                self.src.iteration_completed, Events.ITERATION_COMPLETED
            ):
                engine.add_event_handler(Events.ITERATION_COMPLETED, self.src.iteration_completed)
        super().attach(engine, name, use)

    def detach(self, engine: Engine, usage: str | MetricUsage = "running_batch_wise") -> None:
        """Detach from ``engine``, ``src``'s update included."""
        use = self._usage(usage)
        if self.src is not None:
            from ddp.engine import Events

            if engine.has_event_handler(self.src.iteration_completed, Events.ITERATION_COMPLETED):
                engine.remove_event_handler(
                    self.src.iteration_completed, Events.ITERATION_COMPLETED
                )
        super().detach(engine, use)

    def is_attached(self, engine: Engine, usage: str | MetricUsage = "running_batch_wise") -> bool:
        """Whether this metric writes into ``engine.state.metrics`` on ``usage``'s events."""
        return super().is_attached(engine, self._usage(usage))
