"""Backends. Importing this package registers the built-in ones."""

from . import cpu, mpi, nccl, serial, threads  # noqa: F401  (importing registers them)

__all__: list[str] = []
