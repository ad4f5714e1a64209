"""The :class:`Metric` base (Ignite's ``ignite.metrics.Metric``) and its distributed helpers.

A metric keeps a local state (NumPy arrays and Python numbers on the host: counts as
integers, sums in float64) that each ``update`` adds one batch to. Under several ranks
``compute()`` all-reduces a *copy* of that state (:func:`sync_all_reduce`) and computes from
the copy, so the local state never changes: update -> compute -> update -> compute gives the
result over everything seen so far on every rank, every time.
"""

from __future__ import annotations

import numbers
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from functools import wraps
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

import ddp.idist as idist
import tensorlib as tl

from ._usage import MetricUsage, check_usage

if TYPE_CHECKING:
    from ddp.engine import Engine

__all__ = [
    "Metric",
    "NotComputableError",
    "all_reduce_copy",
    "reinit__is_reduced",
    "sync_all_reduce",
    "to_host",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_OPS = ("MIN", "MAX", "SUM", "PRODUCT")
_RESULT_MODES = ("flatten", "named", "both")


class NotComputableError(RuntimeError):
    """Raised by ``compute()`` when the metric has nothing to compute from (no update yet)."""


def to_host(x: Any, who: str, what: str) -> np.ndarray[Any, Any]:
    """``x`` (a tensorlib Tensor, maybe on a GPU, or a NumPy array) as a host NumPy array.

    One copy at most (from a GPU); a CPU tensor's array is shared, never written.

    Raises:
        TypeError: for anything else (lists, numbers, torch tensors...).
    """
    if isinstance(x, tl.Tensor):
        return x.numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(
        f"{who}: {what} should be a tensorlib Tensor or a NumPy array, got {type(x).__name__}"
    )


def all_reduce_copy(value: Any, op: str = "SUM") -> Any:
    """The all-reduction of a copy of ``value`` (a number, NumPy array or tensorlib Tensor);
    ``value`` itself is left as it was."""
    if isinstance(value, np.ndarray):
        return idist.all_reduce(value.copy(), op)
    if isinstance(value, tl.Tensor):
        return idist.all_reduce(tl.tensor(value.detach(), device=value.device), op)
    return idist.all_reduce(value, op)


def _parse_attr(spec: Any) -> tuple[str, str]:
    if not isinstance(spec, str):
        raise TypeError(f"sync_all_reduce: attribute names are strings, got {spec!r}")
    name, sep, op = spec.partition(":")
    if not sep:
        return name, "SUM"
    if op not in _OPS:
        raise ValueError(f"Reduction operation is not valid (expected : {list(_OPS)}, got: {op})")
    return name, op


def sync_all_reduce(*attrs: str) -> Callable[[_F], _F]:
    """Decorate a :class:`Metric` method (``compute``) so that, under several ranks, it sees
    the named attributes all-reduced across the ranks, and the local values come back after.

    Each name may carry its reduction, ``"_max_seen:MAX"`` (``SUM``, ``MIN``, ``MAX`` or
    ``PRODUCT``; default ``SUM``). A reduced *copy* is set for the call and the local value
    is restored when it returns or raises: the local state goes on accumulating unchanged.
    At world size 1 the method runs on the local state, with no collective.

    Raises:
        ValueError: for an unknown reduction (when decorating), or, when called (at any world
            size), for a name the metric has no attribute of.
        TypeError: when called, for an attribute that is not a number, array or Tensor.
        RuntimeError: when the decorated method is called on something not a Metric.
    """
    parsed = [_parse_attr(a) for a in attrs]

    def wrapper(func: _F) -> _F:
        @wraps(func)
        def reduced(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(self, Metric):
                raise RuntimeError(
                    "Decorator sync_all_reduce should be used on ddp.metrics.Metric methods only"
                )
            values = {}
            for name, _ in parsed:  # checked at every world size, so bugs show at one rank
                if name not in self.__dict__:
                    raise ValueError(f"Metric {type(self).__name__} has no attribute {name!r}")
                value = self.__dict__[name]
                if not isinstance(value, numbers.Number | np.ndarray | tl.Tensor):
                    raise TypeError(
                        "Attribute provided to sync_all_reduce should be a number, NumPy "
                        f"array or Tensor but {name!r} has type {type(value).__name__}"
                    )
                values[name] = value
            if idist.get_world_size() <= 1:
                return func(self, *args, **kwargs)
            try:
                for name, op in parsed:
                    setattr(self, name, all_reduce_copy(values[name], op))
                return func(self, *args, **kwargs)
            finally:
                for name, value in values.items():
                    setattr(self, name, value)

        reduced._decorated = True  # type: ignore[attr-defined]
        return reduced  # type: ignore[return-value]

    return wrapper


def reinit__is_reduced(func: _F) -> _F:
    """Decorate ``reset``/``update``: after the call a cached ``_result`` (if the metric
    keeps one) is dropped, so the next ``compute()`` sees the new state."""

    @wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = func(self, *args, **kwargs)
        if "_result" in self.__dict__:
            self._result = None
        return out

    wrapper._decorated = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _is_tensor_or_number(x: Any) -> bool:
    return isinstance(x, tl.Tensor | np.ndarray | numbers.Number)


def _is_list_of_tensors_or_numbers(x: Any) -> bool:
    return isinstance(x, Sequence) and all(_is_tensor_or_number(t) for t in x)


def _to_batched(x: Any, like: Any = None) -> Any:
    """One sample as a batch of one: a leading axis on a Tensor/array, a 1-element tensor
    (on ``like``'s device) for a number."""
    if isinstance(x, tl.Tensor):
        return x.unsqueeze(0)
    if isinstance(x, np.ndarray):
        return x[None]
    device = like.device if isinstance(like, tl.Tensor) else None
    return tl.tensor([x], device=device)


class Metric(metaclass=ABCMeta):
    """Base class of the metrics: ``reset``, ``update(output)``, ``compute`` plus the engine
    plumbing (:meth:`attach`, :meth:`detach`, :meth:`is_attached`).

    Subclasses keep their state as NumPy arrays and Python numbers on the host and decorate
    ``compute`` with :func:`sync_all_reduce` so that it is exact across ranks.

    Args:
        output_transform: turns ``engine.state.output`` into what :meth:`update` takes
            (``(y_pred, y)`` by default; a mapping is read at :attr:`required_output_keys`).
        device: where the tensors ``compute()`` returns are put (the state itself always
            lives on the host): ``"cpu"``, ``"cuda:N"`` or a :class:`tensorlib.Device`.
        skip_unrolling: pass ``output`` to ``update`` as it is, even when it is a pair of
            lists of tensors or numbers (which are otherwise fed one sample at a time).
        metrics_result_mode: for a mapping result, ``"flatten"`` puts its keys into
            ``engine.state.metrics``, ``"named"`` puts the mapping under the metric's name,
            ``"both"`` does both.

    Attributes:
        required_output_keys: the keys read from a mapping output, in ``update``'s order
            (None: a mapping output is an error).

    Raises:
        TypeError: if ``output_transform`` is not callable or ``device`` is not a device.
        ValueError: for an unknown device or ``metrics_result_mode``.
    """

    required_output_keys: tuple[str, ...] | None = ("y_pred", "y")
    _required_output_keys = required_output_keys

    def __init__(
        self,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | tl.Device = "cpu",
        skip_unrolling: bool = False,
        metrics_result_mode: Literal["flatten", "named", "both"] = "both",
    ) -> None:
        if not callable(output_transform):
            raise TypeError(
                "Argument output_transform should be callable, got "
                f"{type(output_transform).__name__}"
            )
        if metrics_result_mode not in _RESULT_MODES:
            raise ValueError(
                f"Argument metrics_result_mode should be one of {_RESULT_MODES}, got "
                f"{metrics_result_mode!r}"
            )
        self._output_transform = output_transform
        self._device = tl.Device(device)
        self._skip_unrolling = skip_unrolling
        self._metrics_result_mode = metrics_result_mode
        self.reset()

    @abstractmethod
    def reset(self) -> None:
        """Reset the metric to its initial state (by default at the start of each epoch)."""

    @abstractmethod
    def update(self, output: Any) -> None:
        """Add one batch's output (after ``output_transform``) to the local state."""

    @abstractmethod
    def compute(self) -> Any:
        """The metric over everything seen since the last reset, on every rank.

        Raises:
            NotComputableError: when there is nothing to compute from.
        """

    def _tensor(self, arr: Any) -> tl.Tensor:
        """A result array as a tensor on the metric's device."""
        return tl.tensor(np.asarray(arr), device=self._device)

    # ---------------------------------------------------------------- engine handlers
    def started(self, engine: Engine) -> None:
        """Handler of the usage's STARTED event: :meth:`reset`."""
        self.reset()

    def iteration_completed(self, engine: Engine) -> None:
        """Handler of the usage's ITERATION_COMPLETED event: :meth:`update` with
        ``output_transform(engine.state.output)``, outside autograd.

        A mapping output is read at :attr:`required_output_keys`; a pair of equally long
        lists of tensors/numbers is fed one sample at a time (unless ``skip_unrolling``).

        Raises:
            TypeError: for a mapping output when the metric takes no keys.
            ValueError: for a mapping without the keys, or lists of different lengths.
        """
        output = self._output_transform(engine.state.output)
        if isinstance(output, Mapping):
            keys = self.required_output_keys
            if keys is None:
                raise TypeError(
                    f"Transformed engine output for {type(self).__name__} metric should be a "
                    f"tuple/list, but given {type(output).__name__}"
                )
            if not all(k in output for k in keys):
                raise ValueError(
                    "When transformed engine's output is a mapping, it should contain "
                    f"{keys} keys, but given {list(output.keys())}"
                )
            output = tuple(output[k] for k in keys)
        with tl.no_grad():
            if (
                not self._skip_unrolling
                and isinstance(output, Sequence)
                and all(_is_list_of_tensors_or_numbers(o) for o in output)
            ):
                if not (len(output) == 2 and len(output[0]) == len(output[1])):
                    lengths = ", ".join(str(len(o)) for o in output)
                    raise ValueError(
                        "Output should have 2 items of the same length, got "
                        f"{len(output)} items of lengths {lengths}"
                    )
                for o1, o2 in zip(output[0], output[1], strict=True):
                    b1 = _to_batched(o1)
                    self.update((b1, _to_batched(o2, like=b1)))
            else:
                self.update(output)

    def completed(self, engine: Engine, name: str) -> None:
        """Handler of the usage's COMPLETED event: ``engine.state.metrics[name] =
        compute()``; a 0-d tensor becomes a number, another tensor is put on the CPU, and a
        mapping is spread into its keys (see ``metrics_result_mode``).

        Raises:
            ValueError: when a mapping result has a key equal to ``name``.
        """
        result = self.compute()
        if isinstance(result, Mapping):
            mode = self._metrics_result_mode
            if mode in ("named", "both") and name in result:
                raise ValueError(
                    f"Argument name '{name}' is conflicting with mapping keys: "
                    f"{list(result.keys())}"
                )
            if mode in ("flatten", "both"):
                for key, value in result.items():
                    engine.state.metrics[key] = value
            if mode in ("named", "both"):
                engine.state.metrics[name] = result
            return
        if isinstance(result, tl.Tensor):
            result = result.item() if result.ndim == 0 else result.cpu()
        elif isinstance(result, np.ndarray | np.generic) and np.ndim(result) == 0:
            result = result.item()
        engine.state.metrics[name] = result

    # ---------------------------------------------------------------- attach / detach
    def attach(self, engine: Engine, name: str, usage: str | MetricUsage = "epoch_wise") -> None:
        """Attach to ``engine``: after each COMPLETED event of ``usage``,
        ``engine.state.metrics[name]`` holds the metric.

        Args:
            engine: the engine.
            name: the key in ``engine.state.metrics``.
            usage: a :class:`MetricUsage` or its ``usage_name`` (``"epoch_wise"``,
                ``"batch_wise"``, ``"running_batch_wise"``...).
        """
        use = check_usage(usage)
        if not engine.has_event_handler(self.started, use.STARTED):
            engine.add_event_handler(use.STARTED, self.started)
        if not engine.has_event_handler(self.iteration_completed, use.ITERATION_COMPLETED):
            engine.add_event_handler(use.ITERATION_COMPLETED, self.iteration_completed)
        engine.add_event_handler(use.COMPLETED, self.completed, name)

    def detach(self, engine: Engine, usage: str | MetricUsage = "epoch_wise") -> None:
        """Remove this metric's handlers of ``usage`` from ``engine``."""
        use = check_usage(usage)
        if engine.has_event_handler(self.completed, use.COMPLETED):
            engine.remove_event_handler(self.completed, use.COMPLETED)
        if engine.has_event_handler(self.started, use.STARTED):
            engine.remove_event_handler(self.started, use.STARTED)
        if engine.has_event_handler(self.iteration_completed, use.ITERATION_COMPLETED):
            engine.remove_event_handler(self.iteration_completed, use.ITERATION_COMPLETED)

    def is_attached(self, engine: Engine, usage: str | MetricUsage = "epoch_wise") -> bool:
        """Whether this metric writes into ``engine.state.metrics`` on ``usage``'s events."""
        use = check_usage(usage)
        return bool(engine.has_event_handler(self.completed, use.COMPLETED))
