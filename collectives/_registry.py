"""Backend registry: backends register a factory and an availability probe under a name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._backend import Backend, GroupInfo

__all__ = [
    "BackendSpec",
    "available_backends",
    "backend_unavailable_reason",
    "get_backend_spec",
    "register_backend",
]


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend.

    Attributes:
        name: what users pass as ``backend=``.
        factory: builds the backend for one group (collective over the group's members).
        probe: returns None when usable here, else the reason it is not.
        description: one line for ``show_config()``.
        world: for backends whose own runtime started the job (mpi: ``mpiexec``), returns
            this process's place in it as ``(rank, size, local_rank, local_size)``; the
            backend then needs no TCP store. None for backends that rendezvous through it.
    """

    name: str
    factory: Callable[[GroupInfo], Backend]
    probe: Callable[[], str | None]
    description: str
    world: Callable[[], tuple[int, int, int, int]] | None = None


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(
    name: str,
    factory: Callable[[GroupInfo], Backend],
    probe: Callable[[], str | None] | None = None,
    description: str = "",
    world: Callable[[], tuple[int, int, int, int]] | None = None,
) -> None:
    """Register (or replace) a backend under ``name`` (see :class:`BackendSpec`)."""
    _REGISTRY[name] = BackendSpec(name, factory, probe or (lambda: None), description, world)


def get_backend_spec(name: str) -> BackendSpec:
    """Look up a backend by name.

    Raises:
        ValueError: for unknown names, listing the registered ones.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown backend {name!r}; registered backends: {sorted(_REGISTRY)}")
    return spec


def registered_backends() -> list[str]:
    """Names of every registered backend, usable here or not."""
    return sorted(_REGISTRY)


def available_backends() -> list[str]:
    """Names of the registered backends that are usable on this machine."""
    return [n for n in sorted(_REGISTRY) if _REGISTRY[n].probe() is None]


def backend_unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` is usable here, else the reason it is not (the nccl
    backend's names every library path it tried, one per line).

    Raises:
        ValueError: for unknown names, listing the registered ones.
    """
    return get_backend_spec(name).probe()
