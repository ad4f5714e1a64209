"""Ignite's ``TerminateOnNan``: stop the run when the output holds a NaN or an infinity."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import ddp.idist as idist
import tensorlib as tl

__all__ = ["TerminateOnNan"]


def _all_finite(x: Any, path: str) -> bool:
    """Whether every number in ``x`` (numbers, arrays, Tensors, nested containers) is finite.

    Raises:
        TypeError: for a value of another kind (None, an object, an object array).
    """
    if isinstance(x, tl.Tensor):
        x = x.numpy()
    if isinstance(x, numbers.Number | np.ndarray | np.generic):
        arr = np.asarray(x)
        if arr.dtype.kind not in "biufc":
            raise TypeError(
                f"TerminateOnNan: {path} is an array of dtype {arr.dtype}, not numbers; pass "
                "output_transform= to pick the values to check"
            )
        return bool(np.isfinite(arr).all())
    if isinstance(x, str | bytes):
        return True
    if isinstance(x, Mapping):
        return all(_all_finite(v, f"{path}[{k!r}]") for k, v in x.items())
    if isinstance(x, Sequence):
        return all(_all_finite(v, f"{path}[{i}]") for i, v in enumerate(x))
    raise TypeError(
        f"TerminateOnNan: {path} is a {type(x).__name__}; the output must hold numbers, NumPy "
        "arrays, Tensors, or tuples/lists/dicts of them (pass output_transform= to pick them)"
    )


class TerminateOnNan:
    """Call ``engine.terminate()`` when the output holds a NaN or an infinite value.

    Typically ``trainer.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())``.
    The output (``engine.state.output`` through ``output_transform``) may be a number, a NumPy
    array or scalar, a ``tensorlib.Tensor``, or tuples, lists and dicts of them (strings are
    skipped); a single NaN or infinity anywhere stops the run, after a warning on the
    ``ddp.handlers.TerminateOnNan`` logger.

    Under several ranks the decision is every rank's (unlike Ignite, where each rank checks
    only its own output): each call all-reduces one flag (a MAX over the ranks), so a NaN on
    one rank stops all of them at the same iteration. A rank stopping alone would leave the
    others waiting for it in their next collective. Attach it on every rank, then.

    Args:
        output_transform: ``fn(output)`` giving the values to check.

    Raises:
        TypeError: (when called) for an output holding a value of another kind (None, an
            object), naming where it is.
    """

    def __init__(self, output_transform: Callable[[Any], Any] = lambda x: x) -> None:
        if not callable(output_transform):
            raise TypeError(
                f"TerminateOnNan: output_transform must be a function, got {output_transform!r}"
            )
        self.logger = logging.getLogger(f"{__name__.rsplit('.', 1)[0]}.TerminateOnNan")
        self._output_transform = output_transform

    def __call__(self, engine: Any) -> None:
        """Check the output; terminate ``engine`` when a value is not finite."""
        output = self._output_transform(engine.state.output)
        bad = not _all_finite(output, "the output")
        if idist.get_world_size() > 1:
            bad = bool(idist.all_reduce(int(bad), op="MAX"))  # stop together, or hang
        if bad:
            self.logger.warning(
                "%s: Output '%s' contains NaN or Inf. Stop training", type(self).__name__, output
            )
            engine.terminate()
