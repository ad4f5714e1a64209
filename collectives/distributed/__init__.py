"""Collectives over a device list from one process: Burn's ``burn::tensor::distributed``.

::

    import tensorlib as tl
    from collectives.distributed import (
        DistributedConfig, DistributedContext, ReduceOperation, all_reduce,
    )

    devices = tl.Device.enumerate("cpu")  # or "cuda", or a remote.RemoteHost
    with DistributedContext(devices, DistributedConfig(all_reduce_op=ReduceOperation.Mean)):
        pending = [all_reduce(t, ReduceOperation.Sum, devices) for t in local]  # one thread
        reduced = [p.resolve() for p in pending]

``_config.py`` holds :class:`ReduceOperation` and :class:`DistributedConfig`; ``_context.py``
the :class:`DistributedContext` (numbering, matching and launching the devices' calls);
``_collective.py`` :func:`all_reduce` and :class:`CollectiveTensor`; ``_engines.py`` the
registry of engines by device kind, with ``_numpy.py`` (logical CPU devices) and ``_nccl.py``
(GPUs: one NCCL group call per all-reduce) built in; ``remote`` registers the engine of a
server's devices.
"""

from ._collective import CollectiveTensor, all_reduce
from ._config import DEFAULT_TIMEOUT_S, DistributedConfig, ReduceOperation, reduce_op_of
from ._context import DistributedContext
from ._engines import (
    Completed,
    Completion,
    ContextEngine,
    ContextEngineSpec,
    context_engine_kinds,
    make_context_engine,
    register_context_engine,
    unregister_context_engine,
)
from ._nccl import NcclContextEngine, make_nccl_engine
from ._numpy import NumpyContextEngine, make_numpy_engine

register_context_engine(
    "cpu", make_numpy_engine, "logical CPU devices: reduced in host memory, in device order"
)
# Loads CuPy and libnccl only when a context over GPUs is opened.
register_context_engine(
    "cuda", make_nccl_engine, "GPUs: one NCCL communicator each, one NCCL group call per all-reduce"
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveTensor",
    "Completed",
    "Completion",
    "ContextEngine",
    "ContextEngineSpec",
    "DistributedConfig",
    "DistributedContext",
    "NcclContextEngine",
    "NumpyContextEngine",
    "ReduceOperation",
    "all_reduce",
    "context_engine_kinds",
    "make_context_engine",
    "reduce_op_of",
    "register_context_engine",
    "unregister_context_engine",
]
