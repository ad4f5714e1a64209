"""Burn's "Distributed Tensor Operations" example: all_reduce over a device list, one thread.

    python examples/burn/all_reduce.py                # 4 logical CPU devices
    python examples/burn/all_reduce.py --devices 8
    python examples/burn/all_reduce.py --cuda         # every GPU (untested without one)

The page's Rust, line for line::

    let devices = Device::enumerate(DeviceType::Cuda).into_vec();
    let _context = DistributedContext::init(devices.clone(), DistributedConfig { .. Mean });
    let local_tensors = devices.iter().map(compute_local_value).collect();
    let collectives = local_tensors.into_iter().map(|t| all_reduce(t, Sum, devices.clone()));
    let reduced = collectives.into_iter().map(CollectiveTensor::resolve).collect();

Here the context lives for the ``with`` block (Burn: until ``_context`` is dropped). Device i
contributes a 2x3 tensor full of ``i + 1``, so the sum over N devices is ``N (N + 1) / 2``
everywhere and the mean ``(N + 1) / 2``; the script checks both and exits 1 if they are wrong.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import tensorlib as tl
from collectives.distributed import (
    CollectiveTensor,
    DistributedConfig,
    DistributedContext,
    ReduceOperation,
    all_reduce,
)
from tensorlib import Device, DeviceType, Tensor

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--devices", type=int, default=4, help="logical CPU devices (default 4)")
parser.add_argument("--cuda", action="store_true", help="every visible GPU instead (untested)")
args = parser.parse_args()
if args.devices < 1:
    parser.error(f"--devices must be at least 1, got {args.devices}")


# Logical CPU devices stand in for GPUs: distinct devices on host memory (as JAX's host
# platform device count); TENSORLIB_CPU_DEVICES=N in the environment does the same.
tl.set_cpu_device_count(args.devices)
devices = Device.enumerate(DeviceType.Cuda if args.cuda else DeviceType.Cpu).into_vec()
if not devices:
    sys.exit("no device of that type here (--cuda needs a GPU and CuPy: pip install .[cuda12])")
n = len(devices)
print(f"devices: {', '.join(str(d) for d in devices)}")


def compute_local_value(device: Device) -> Tensor:
    """This device's contribution: a 2x3 tensor of ``index + 1``, created on the device."""
    return tl.full((2, 3), float(devices.index(device) + 1), device=device)


with DistributedContext(devices, DistributedConfig(all_reduce_op=ReduceOperation.Mean)):
    # Every participant submits its local tensor with the same device list; all from this
    # one thread: all_reduce returns at once, the reduction runs once the last device is in.
    local_tensors: list[Tensor] = [compute_local_value(d) for d in devices]
    collectives: list[CollectiveTensor] = [
        all_reduce(tensor, ReduceOperation.Sum, devices) for tensor in local_tensors
    ]
    reduced: list[Tensor] = [c.resolve() for c in collectives]

    # No op: the config's all_reduce_op (Mean) applies. Submit every device, then resolve:
    # resolving device 0 before the others are in would wait for ever, so it is an error.
    pending = [all_reduce(tensor, devices=devices) for tensor in local_tensors]
    means = [p.resolve() for p in pending]

ok = True
for device, tensor, mean in zip(devices, reduced, means, strict=True):
    # Each result stays on its input's device (Burn: the same).
    ok &= tensor.device == device and mean.device == device
    ok &= bool(np.all(tensor.numpy() == n * (n + 1) / 2) and np.all(mean.numpy() == (n + 1) / 2))
    print(
        f"{device}: sum {tensor.numpy()[0, 0]:g}  mean {mean.numpy()[0, 0]:g}  on {tensor.device}"
    )
print(f"all_reduce over {n} device(s): sum {n * (n + 1) // 2} and mean {(n + 1) / 2:g} expected")
print("reduced values correct" if ok else "reduced values WRONG")
sys.exit(0 if ok else 1)
