"""tensorlib: a NumPy/CuPy tensor with reverse-mode autodiff, ``nn`` layers and optimizers.

``"cpu"`` tensors compute with NumPy; ``"cuda:N"`` tensors with CuPy (optional: install the
``cuda12`` or ``cuda13`` extra).
"""

from . import _autograd  # noqa: F401, I001  (must load before _tensor: Function is defined there)
from ._autograd import (
    Function,
    enable_grad,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)
from ._backward import queue_callback
from ._tensor import Tensor
from ._autocast import autocast
from ._api import (
    abs,
    broadcast_to,
    clip,
    concatenate,
    exp,
    log,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    permute,
    reshape,
    sqrt,
    stack,
    sum,
    tanh,
    transpose,
    where,
)
from ._creation import (
    arange,
    from_array,
    from_dlpack,
    from_numpy,
    full,
    full_like,
    ones,
    ones_like,
    rand,
    randn,
    tensor,
    zeros,
    zeros_like,
)
from ._device import (
    CudaUnavailableError,
    Device,
    DeviceList,
    DeviceType,
    cpu_device_count,
    cuda_device_count,
    cuda_is_available,
    cuda_unavailable_reason,
    device,
    device_of,
    set_cpu_device_count,
)
from ._device_kinds import DeviceKind
from ._device_kinds import register as register_device_kind
from ._dtype import bool_, float16, float32, float64, int32, int64
from ._random import Generator, default_generator, manual_seed, set_thread_generator
from ._serialization import load, save
from . import amp, functional, nn, optim

__version__ = "0.1.0"

__all__ = [
    "CudaUnavailableError",
    "Device",
    "DeviceKind",
    "DeviceList",
    "DeviceType",
    "Function",
    "Generator",
    "Tensor",
    "__version__",
    "abs",
    "amp",
    "arange",
    "autocast",
    "bool_",
    "broadcast_to",
    "clip",
    "concatenate",
    "cpu_device_count",
    "cuda_device_count",
    "cuda_is_available",
    "cuda_unavailable_reason",
    "default_generator",
    "device",
    "device_of",
    "enable_grad",
    "exp",
    "float16",
    "float32",
    "float64",
    "from_array",
    "from_dlpack",
    "from_numpy",
    "full",
    "full_like",
    "functional",
    "int32",
    "int64",
    "is_grad_enabled",
    "load",
    "log",
    "manual_seed",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "nn",
    "no_grad",
    "ones",
    "ones_like",
    "optim",
    "permute",
    "queue_callback",
    "rand",
    "randn",
    "register_device_kind",
    "reshape",
    "save",
    "set_cpu_device_count",
    "set_grad_enabled",
    "set_thread_generator",
    "sqrt",
    "stack",
    "sum",
    "tanh",
    "tensor",
    "transpose",
    "where",
    "zeros",
    "zeros_like",
]
