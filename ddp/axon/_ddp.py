"""axonml's ``DistributedDataParallel::new(model, process_group)``: DDP over an axon group."""

from __future__ import annotations

from typing import Any

from tensorlib.nn import Module

from .._ddp import DistributedDataParallel as _DistributedDataParallel
from ._group import ProcessGroup

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(_DistributedDataParallel):
    """:class:`ddp.DistributedDataParallel` that also takes a ``ddp.axon.ProcessGroup``.

    The same DDP: ``loss.backward()`` averages the gradients by itself, bucketed and
    overlapped with backward; :meth:`sync_parameters` and :meth:`sync_gradients` are axonml's
    calls (see them for what each does here). ``process_group`` is the
    :class:`collectives.ProcessGroup` under the axon group given.

    Args:
        module: the model.
        process_group: ``world.default_group()`` (axonml's), a collectives group, or None for
            the default group.
        **kwargs: the options of :class:`ddp.DistributedDataParallel`.
    """

    def __init__(self, module: Module, process_group: Any = None, **kwargs: Any) -> None:
        if isinstance(process_group, ProcessGroup):
            process_group = process_group.group
        super().__init__(module, process_group, **kwargs)
