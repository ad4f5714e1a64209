"""The engines of a device-list context, keyed by device kind (a small registry).

A :class:`~collectives.distributed.DistributedContext` over a device list owns one engine,
made for the list by the factory registered for the devices' kind (``device.type``): the
NumPy engine for logical CPU devices is built in (:mod:`._numpy`), the NCCL group-call engine
for CUDA devices (:mod:`._nccl`) too; a package above collectives registers its own
(``remote`` registers ``"remote"``: collectives never imports it).

The context numbers the calls, collects every device's contribution, checks them against
each other and decides when a call is complete; an engine only moves data. When the last
device of the list submitted call ``seq``, the context calls ``engine.all_reduce(arrays, op,
seq)`` from that submitting thread, with one array per device in the context's device order,
and keeps the :class:`Completion` it returns: ``outputs`` (one new array per device, on that
device, in the same order; the inputs are not written), ``done()`` (whether the outputs are
ready, without waiting) and ``wait(timeout)`` (make them ready for the caller: for NumPy
nothing, for CUDA the caller's current stream waits on the reduction, for a remote server the
reads that follow wait). ``close()`` frees the engine's resources (communicators, keys).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._types import ReduceOp
from ._config import DistributedConfig

__all__ = [
    "Completed",
    "Completion",
    "ContextEngine",
    "ContextEngineSpec",
    "context_engine_kinds",
    "make_context_engine",
    "register_context_engine",
    "unregister_context_engine",
]


class Completion(Protocol):
    """One all-reduce an engine started (see the module docstring)."""

    outputs: list[Any]

    def done(self) -> bool:
        """Whether the outputs are ready (never waits)."""
        ...

    def wait(self, timeout: float) -> None:
        """Make the outputs ready for the caller within ``timeout`` seconds.

        Raises:
            CollectiveError: the reduction failed or did not complete in time (the message
                says which devices and why).
        """
        ...


class Completed:
    """A :class:`Completion` that is complete from the start: the engine's outputs are usable
    at once (the NumPy engine reduced synchronously; a remote session orders every later read
    after its record)."""

    __slots__ = ("outputs",)

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs

    def done(self) -> bool:
        """Always True."""
        return True

    def wait(self, timeout: float) -> None:
        """Nothing to wait for."""
        return None


class ContextEngine(Protocol):
    """What a context needs of an engine (see the module docstring).

    Attributes:
        ops: the reductions it supports (``ReduceOp.AVG`` is Mean).
    """

    ops: frozenset[ReduceOp]

    def all_reduce(self, arrays: list[Any], op: ReduceOp, seq: int) -> Completion:
        """Start reducing ``arrays`` (one a device, in the context's order) with ``op``."""
        ...

    def close(self) -> None:
        """Free what the engine holds (idempotent)."""
        ...


EngineFactory = Callable[[list[Any], DistributedConfig], ContextEngine]


@dataclass(frozen=True)
class ContextEngineSpec:
    """A registered context engine.

    Attributes:
        kind: the device kind it serves (``device.type``).
        factory: ``factory(devices, config)`` builds the engine of one device list; it raises
            ValueError for a list it cannot serve (say why: devices of two servers, a GPU
            listed that this process cannot see).
        description: one line for the docs and error messages.
    """

    kind: str
    factory: EngineFactory
    description: str = ""


_ENGINES: dict[str, ContextEngineSpec] = {}


def register_context_engine(kind: str, factory: EngineFactory, description: str = "") -> None:
    """Register (or replace) the context engine of devices of kind ``kind``."""
    _ENGINES[kind] = ContextEngineSpec(kind, factory, description)


def unregister_context_engine(kind: str) -> None:
    """Remove the context engine of ``kind`` (if any)."""
    _ENGINES.pop(kind, None)


def context_engine_kinds() -> list[str]:
    """The device kinds a context engine is registered for."""
    return sorted(_ENGINES)


def make_context_engine(devices: Sequence[Any], config: DistributedConfig) -> ContextEngine:
    """The engine of ``devices`` (all of one kind), from the registry.

    Raises:
        ValueError: mixed kinds, or a kind no engine serves.
    """
    kinds = sorted({str(getattr(d, "type", "?")) for d in devices})
    shown = ", ".join(str(d) for d in devices)
    if len(kinds) != 1:
        raise ValueError(
            f"DistributedContext: the devices must be of one kind, got {kinds} ({shown}); "
            "collectives run among devices of one kind (Burn requires collective support "
            "among them); use ExecutionStrategy.multi_device for devices without it"
        )
    spec = _ENGINES.get(kinds[0])
    if spec is None:
        hint = " (import remote first)" if kinds[0] == "remote" else ""
        raise ValueError(
            f"DistributedContext: no engine for devices of kind {kinds[0]!r}{hint}; "
            f"registered: {context_engine_kinds()}"
        )
    return spec.factory(list(devices), config)
