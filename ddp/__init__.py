"""ddp: DistributedDataParallel with bucketed, overlapped gradient all-reduce.

This package is being built (see docs/design.md); it exposes no public names yet.
"""

__all__: list[str] = []
