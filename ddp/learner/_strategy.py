"""``ExecutionStrategy``: where and how the learner trains (Burn's ``ExecutionStrategy``).

Three small implementations of one interface, so the model is built once, on
:meth:`ExecutionStrategy.main_device`, whatever the strategy:

* :meth:`ExecutionStrategy.single_device`: the hand-written loop on one device.
* :meth:`ExecutionStrategy.ddp`: a replica and a rank thread per device, gradients
  all-reduced by :class:`~ddp.DistributedDataParallel` on collectives' ``threads`` backend
  (bucketed, overlapped with backward), combined with the config's ``all_reduce_op``.
* :meth:`ExecutionStrategy.multi_device`: one thread, a forward/backward per device, the
  gradients combined with device-to-device copies (Burn's non-DDP multi-device path).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tensorlib import Device, nn
from tensorlib.optim import Optimizer

from ._loop import Plan
from ._outputs import EpochMetrics

__all__ = ["DdpStrategy", "ExecutionStrategy", "MultiDeviceStrategy", "SingleDeviceStrategy"]

_OPTIM_MODES = ("main_device", "sharded")
_DEFAULT_TIMEOUT_S = 300.0


def _device(value: Any, where: str) -> Device:
    try:
        return Device(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from None


def _device_list(devices: Any, where: str) -> tuple[Device, ...]:
    """``devices`` as a tuple of distinct Devices.

    Raises:
        TypeError: a single device or a non-iterable instead of a list.
        ValueError: an empty list, or a device listed twice.
    """
    if isinstance(devices, str | Device) or not isinstance(devices, Iterable):
        raise TypeError(
            f"{where}: devices must be a list of devices (tensorlib.Device.enumerate(...)), got "
            f"{devices!r}"
        )
    found = tuple(_device(d, where) for d in devices)
    if not found:
        raise ValueError(f"{where}: the device list is empty; give at least one device")
    seen: dict[Device, int] = {}
    for i, d in enumerate(found):
        if d in seen:
            raise ValueError(
                f"{where}: device {d} is listed twice (positions {seen[d]} and {i}); each "
                "device takes part once"
            )
        seen[d] = i
    return found


def _reduce_name(config: Any) -> tuple[str, float]:
    """``("mean" | "sum", timeout)`` of a DistributedConfig (or an object shaped like one).

    Raises:
        TypeError: a config without ``all_reduce_op``.
        ValueError: a reduction other than Mean or Sum, or a non-positive timeout.
    """
    if config is None:
        return "mean", _DEFAULT_TIMEOUT_S
    if not hasattr(config, "all_reduce_op"):
        raise TypeError(
            "ExecutionStrategy.ddp: config must be a collectives.distributed.DistributedConfig, "
            f"got {type(config).__name__}"
        )
    op = config.all_reduce_op
    name = str(getattr(op, "name", op)).lower()
    name = "mean" if name == "avg" else name
    if name not in ("mean", "sum"):
        raise ValueError(
            f"ExecutionStrategy.ddp: gradients are combined with ReduceOperation.Mean or Sum, "
            f"got all_reduce_op={op!r}"
        )
    timeout = getattr(config, "timeout", _DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"ExecutionStrategy.ddp: timeout must be positive, got {timeout!r}")
    return name, float(timeout)


class ExecutionStrategy:
    """Where the learner trains; make one with :meth:`single_device`, :meth:`ddp` or
    :meth:`multi_device`.

    Attributes:
        devices: the devices, the main one first.
    """

    devices: tuple[Device, ...]

    @staticmethod
    def single_device(device: str | Device = "cpu") -> SingleDeviceStrategy:
        """Train on one device, the plain loop (Burn's ``ExecutionStrategy::SingleDevice``)."""
        return SingleDeviceStrategy(device)

    @staticmethod
    def ddp(
        devices: Iterable[Any], config: Any = None, *, bucket_cap_mb: float = 25.0
    ) -> DdpStrategy:
        """A replica and a rank thread per device, gradients all-reduced by DDP (Burn's
        ``ExecutionStrategy::ddp(devices, DistributedConfig { all_reduce_op })``).

        Args:
            devices: the devices, of one kind with collectives among them (logical CPU
                devices, GPUs, or remote devices of one server); the first is the main one.
            config: a ``collectives.distributed.DistributedConfig``: ``all_reduce_op`` Mean
                (default: the replicas' gradients averaged, equal to one device on the global
                batch) or Sum (summed); ``timeout`` bounds every collective.
            bucket_cap_mb: DDP's gradient bucket size.
        """
        return DdpStrategy(devices, config, bucket_cap_mb)

    @staticmethod
    def multi_device(devices: Iterable[Any], optim: str = "main_device") -> MultiDeviceStrategy:
        """One thread, a forward/backward per device, gradients combined by copies (Burn's
        ``ExecutionStrategy::MultiDevice``); for devices without collectives among them.

        Args:
            devices: the devices; the first is the main one.
            optim: ``"main_device"`` (the optimizer steps on the main device, the parameters
                are copied to the others) or ``"sharded"`` (each device steps its shard of the
                parameters, the shards are copied to every device).
        """
        return MultiDeviceStrategy(devices, optim)

    def main_device(self) -> Device:
        """The device the model is built on and ends on."""
        return self.devices[0]

    def run(
        self, plan: Plan, model: nn.Module, optimizer: Optimizer, scheduler: Any
    ) -> tuple[list[EpochMetrics], int]:
        """Train ``model`` (on :meth:`main_device`) as ``plan`` says.

        Returns:
            The history of the completed epochs, and how many were resumed.
        """
        raise NotImplementedError

    def describe(self) -> str:
        """A short description (``ddp over cpu, cpu:1``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"ExecutionStrategy.{self.describe()}"


class SingleDeviceStrategy(ExecutionStrategy):
    """See :meth:`ExecutionStrategy.single_device`."""

    def __init__(self, device: str | Device) -> None:
        self.devices = (_device(device, "ExecutionStrategy.single_device"),)

    def run(
        self, plan: Plan, model: nn.Module, optimizer: Optimizer, scheduler: Any
    ) -> tuple[list[EpochMetrics], int]:
        from ._local import LocalWorker
        from ._loop import run_epochs

        return run_epochs(
            LocalWorker(plan, model, optimizer, scheduler, self.devices, "main_device"), plan
        )

    def describe(self) -> str:
        return f"single_device({self.devices[0]})"


class DdpStrategy(ExecutionStrategy):
    """See :meth:`ExecutionStrategy.ddp`."""

    def __init__(self, devices: Iterable[Any], config: Any, bucket_cap_mb: float) -> None:
        self.devices = _device_list(devices, "ExecutionStrategy.ddp")
        kinds = sorted({d.type for d in self.devices})
        if len(kinds) > 1:
            raise ValueError(
                f"ExecutionStrategy.ddp: the devices must be of one kind (collectives run "
                f"among devices of one kind), got {kinds} ({', '.join(map(str, self.devices))}); "
                "use ExecutionStrategy.multi_device for devices without collectives among them"
            )
        if config is None:
            config = _default_config()
        self.config = config
        self.op, self.timeout = _reduce_name(config)
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, int | float):
            raise TypeError(
                f"ExecutionStrategy.ddp: bucket_cap_mb must be a number, got {bucket_cap_mb!r}"
            )
        if not bucket_cap_mb > 0:
            raise ValueError(
                f"ExecutionStrategy.ddp: bucket_cap_mb must be positive, got {bucket_cap_mb}"
            )
        self.bucket_cap_mb = float(bucket_cap_mb)

    def run(
        self, plan: Plan, model: nn.Module, optimizer: Optimizer, scheduler: Any
    ) -> tuple[list[EpochMetrics], int]:
        from ._ddp_worker import run_ddp

        return run_ddp(
            plan, model, optimizer, scheduler, self.devices, self.op, self.timeout,
            self.bucket_cap_mb,
        )  # fmt: skip

    def describe(self) -> str:
        return f"ddp([{', '.join(map(str, self.devices))}], all_reduce_op={self.op})"


class MultiDeviceStrategy(ExecutionStrategy):
    """See :meth:`ExecutionStrategy.multi_device`."""

    def __init__(self, devices: Iterable[Any], optim: str) -> None:
        self.devices = _device_list(devices, "ExecutionStrategy.multi_device")
        if optim not in _OPTIM_MODES:
            raise ValueError(
                f"ExecutionStrategy.multi_device: optim must be one of {list(_OPTIM_MODES)}, "
                f"got {optim!r}"
            )
        self.optim = optim

    def run(
        self, plan: Plan, model: nn.Module, optimizer: Optimizer, scheduler: Any
    ) -> tuple[list[EpochMetrics], int]:
        from ._local import LocalWorker
        from ._loop import run_epochs

        worker = LocalWorker(plan, model, optimizer, scheduler, self.devices, self.optim)
        try:
            return run_epochs(worker, plan)
        finally:
            worker.finish()

    def describe(self) -> str:
        return f"multi_device([{', '.join(map(str, self.devices))}], optim={self.optim!r})"


def _default_config() -> Any:
    """``DistributedConfig()`` (Mean, 300 s), or None where collectives.distributed is absent."""
    try:
        from collectives.distributed import DistributedConfig
    except ImportError:
        return None
    return DistributedConfig()
