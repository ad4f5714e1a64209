"""collectives: process groups, async Work handles and backends (serial, cpu, nccl, mpi).

This package is being built (see docs/design.md); it exposes no public names yet.
"""

__all__: list[str] = []
