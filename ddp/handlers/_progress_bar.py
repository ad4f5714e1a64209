"""Ignite-contrib's ``ProgressBar``: a tqdm bar over an engine's iterations, on rank 0.

tqdm is optional (the ``examples`` extra): it is imported when a bar is built, and its absence
is an ImportError saying how to install it. In a job of several ranks the bar and
:meth:`ProgressBar.log_message` show on rank 0 only, where Ignite draws one bar per rank.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import tensorlib as tl
from ddp import idist
from ddp.engine import Events

from ._utils import event_count

if TYPE_CHECKING:
    from ddp.engine import Engine

__all__ = ["ProgressBar"]

_BAR_FORMAT = (
    "{desc}[{n_fmt}/{total_fmt}] {percentage:3.0f}%|{bar}{postfix} [{elapsed}<{remaining}]"
)

# Events a bar can advance or close on, in the order a run fires them.
_ORDER = [
    Events.STARTED,
    Events.EPOCH_STARTED,
    Events.ITERATION_STARTED,
    Events.ITERATION_COMPLETED,
    Events.EPOCH_COMPLETED,
    Events.COMPLETED,
]


def _import_tqdm() -> Any:
    try:
        from tqdm.autonotebook import tqdm
    except ImportError as exc:
        raise ImportError(
            "ProgressBar needs tqdm, which is not installed. Install it with:\n"
            "    pip install tqdm\n"
            "(or the package's 'examples' extra)"
        ) from exc
    return tqdm


def _position(where: str, event: Any) -> int:
    try:
        return _ORDER.index(event)  # events compare by name, filters aside
    except ValueError:
        raise ValueError(
            f"ProgressBar.attach: {where} {event!r} is not one of {[e.name for e in _ORDER]}"
        ) from None


def _max_events(event: Any, engine: Engine) -> int | None:
    """How many times ``event`` fires per bar: the epoch length or the number of epochs."""
    if event in (Events.ITERATION_STARTED, Events.ITERATION_COMPLETED):
        return engine.state.epoch_length
    if event in (Events.EPOCH_STARTED, Events.EPOCH_COMPLETED):
        return engine.state.max_epochs
    return 1


def _scalar(value: Any) -> Any:
    """A value the bar can print (numbers, 0-d arrays, strings), or None with a warning."""
    if isinstance(value, numbers.Number | str):
        return value
    if isinstance(value, tl.Tensor | np.ndarray) and value.ndim == 0:
        return value.item()
    warnings.warn(
        f"ProgressBar can not log metrics value type {type(value)}", UserWarning, stacklevel=4
    )
    return None


def _flatten(values: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    """Nested dicts, sequences and 1-d arrays as ``name_sub`` keys of printable scalars."""
    for key, value in values.items():
        name = f"{prefix}_{key}" if prefix else str(key)
        if isinstance(value, tl.Tensor):
            value = value.numpy()
        if isinstance(value, Mapping):
            _flatten(value, name, out)
        elif isinstance(value, np.ndarray) and value.ndim == 1:
            _flatten({str(i): v for i, v in enumerate(value.tolist())}, name, out)
        elif isinstance(value, Sequence) and not isinstance(value, str):
            _flatten({str(i): v for i, v in enumerate(value)}, name, out)
        else:
            shown = _scalar(value)
            if shown is not None:
                out[name] = shown


class ProgressBar:
    """A tqdm progress bar of an engine's run, with metrics and outputs as its postfix.

    Shown on rank 0 only: on the other ranks :meth:`attach` checks its arguments and adds
    nothing, and :meth:`log_message` prints nothing (Ignite draws a bar on every rank).

    Args:
        persist: keep the bar on screen once closed.
        bar_format: tqdm's ``bar_format`` (None: tqdm's default).
        tqdm_kwargs: more keyword arguments of ``tqdm`` (``file=``, ``ncols=``, ``desc=``:
            the description instead of ``Epoch``/``Iteration``).

    Raises:
        ImportError: when tqdm is not installed (``pip install tqdm``).

    Example:
        >>> pbar = ProgressBar()
        >>> pbar.attach(trainer, output_transform=lambda loss: {"loss": loss})
        Epoch [2/50]: [64/128]  50%|█████      , loss=0.123 [06:17<12:34]
    """

    def __init__(
        self,
        persist: bool = False,
        bar_format: str | None = _BAR_FORMAT,
        **tqdm_kwargs: Any,
    ) -> None:
        self.pbar_cls = _import_tqdm()
        self.pbar: Any = None
        self.persist = persist
        self.bar_format = bar_format
        self.tqdm_kwargs = tqdm_kwargs

    def log_message(self, message: str) -> None:
        """Print ``message`` (on rank 0) without breaking the bar (``tqdm.write``)."""
        if idist.get_rank() == 0:
            self.pbar_cls.write(message, file=self.tqdm_kwargs.get("file"))

    def attach(
        self,
        engine: Engine,
        metric_names: str | list[str] | None = None,
        output_transform: Callable[[Any], Any] | None = None,
        event_name: Any = Events.ITERATION_COMPLETED,
        closing_event_name: Any = Events.EPOCH_COMPLETED,
        state_attributes: list[str] | None = None,
    ) -> None:
        """Advance the bar at ``event_name`` and close it at ``closing_event_name`` (rank 0).

        Args:
            engine: the engine.
            metric_names: names in ``engine.state.metrics`` to show, or ``"all"``.
            output_transform: ``fn(engine.state.output)`` giving a dict ``{name: value}`` or
                one value (shown as ``output``) to show.
            event_name: advances the bar (``ITERATION_COMPLETED``, may be filtered).
            closing_event_name: closes it; must come after ``event_name`` in a run and not
                be filtered.
            state_attributes: attributes of ``engine.state`` to show.

        Raises:
            TypeError: for ``metric_names`` neither a list nor ``"all"``, or an
                ``output_transform`` that is not callable.
            ValueError: for events out of order, a filtered closing event, or events a bar
                does not follow.
        """
        if metric_names is not None and not (
            isinstance(metric_names, list) or metric_names == "all"
        ):
            raise TypeError(
                "ProgressBar.attach: metric_names should be either a list or equal 'all', "
                f"got {type(metric_names)} instead."
            )
        if output_transform is not None and not callable(output_transform):
            raise TypeError(
                f"ProgressBar.attach: output_transform should be a function, got "
                f"{type(output_transform)} instead."
            )
        if getattr(closing_event_name, "filter", None) is not None:
            raise ValueError("ProgressBar.attach: Closing Event should not be a filtered event")
        if _position("event_name", event_name) >= _position(
            "closing_event_name", closing_event_name
        ):
            raise ValueError(
                f"ProgressBar.attach: Logging event {event_name} should be called before closing "
                f"event {closing_event_name}"
            )
        if idist.get_rank() != 0:
            return
        handler = _OutputHandler(
            self.tqdm_kwargs.get("desc", ""),
            metric_names,
            output_transform,
            closing_event_name,
            state_attributes,
        )
        engine.add_event_handler(event_name, handler, self, event_name)
        engine.add_event_handler(closing_event_name, self._close)

    def _reset(self, total: int | None) -> None:
        self.pbar = self.pbar_cls(
            total=total,
            leave=self.persist,
            bar_format=self.bar_format,
            initial=1,
            **self.tqdm_kwargs,
        )

    def _close(self, engine: Engine) -> None:
        if self.pbar is not None:
            if self.pbar.total is not None:
                self.pbar.n = self.pbar.total  # a bar closed early would stay "unfinished"
            self.pbar.close()
        self.pbar = None


class _OutputHandler:
    """Updates the bar: description, postfix, position."""

    def __init__(
        self,
        description: str,
        metric_names: str | list[str] | None,
        output_transform: Callable[[Any], Any] | None,
        closing_event_name: Any,
        state_attributes: list[str] | None,
    ) -> None:
        self.tag = description
        self.metric_names = metric_names
        self.output_transform = output_transform
        self.closing_event_name = closing_event_name
        self.state_attributes = state_attributes

    def _values(self, engine: Engine) -> dict[str, Any]:
        values: dict[str, Any] = {}
        metrics = engine.state.metrics
        if self.metric_names == "all":
            values.update(metrics)
        elif self.metric_names is not None:
            for name in self.metric_names:
                if name not in metrics:
                    warnings.warn(
                        f"Provided metric name '{name}' is missing in engine's state metrics: "
                        f"{list(metrics)}",
                        UserWarning,
                        stacklevel=3,
                    )
                    continue
                values[name] = metrics[name]
        if self.output_transform is not None:
            out = self.output_transform(engine.state.output)
            values.update(out if isinstance(out, dict) else {"output": out})
        if self.state_attributes is not None:
            values.update({n: getattr(engine.state, n, None) for n in self.state_attributes})
        flat: dict[str, Any] = {}
        _flatten(values, "", flat)
        return flat

    def __call__(self, engine: Engine, bar: ProgressBar, event_name: Any) -> None:
        total = _max_events(event_name, engine)
        if bar.pbar is None:
            bar._reset(total)
        desc = self.tag or ("Iteration" if engine.state.max_epochs == 1 else "Epoch")
        closings = _max_events(self.closing_event_name, engine)
        if closings and closings > 1:
            desc += f" [{event_count(engine, self.closing_event_name)}/{closings}]"
        bar.pbar.set_description(desc)
        values = self._values(engine)
        if values:
            bar.pbar.set_postfix(values)
        step = event_count(engine, event_name)
        if total is not None:
            step = (step - 1) % total + 1
        bar.pbar.update(step - bar.pbar.n)
