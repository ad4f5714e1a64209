"""ZeRO-1: :class:`ZeroRedundancyOptimizer` (torch.distributed.optim's API) over a flat,
evenly padded partition of the parameters (the layout: ``_layout.py``)."""

from ._optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
