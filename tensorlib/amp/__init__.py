"""Mixed precision (``tensorlib.amp``, as ``torch.amp``): ``autocast`` and ``GradScaler``."""

from .._autocast import autocast
from ._grad_scaler import GradScaler, register_found_inf_reducer

__all__ = ["GradScaler", "autocast", "register_found_inf_reducer"]
