"""Mixed precision (``tensorlib.amp``, as ``torch.amp``): ``autocast`` and ``GradScaler``."""

from .._autocast import autocast
from ._grad_scaler import GradScaler

__all__ = ["GradScaler", "autocast"]
