"""Burn's ``all_reduce(tensor, op, devices)`` and the ``CollectiveTensor`` it returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tensorlib import Device, Tensor, from_array

from .._errors import CollectiveError
from ._config import ReduceOperation, reduce_op_of
from ._context import DistributedContext, _Call, context_of

__all__ = ["CollectiveTensor", "all_reduce"]

_OP = "all_reduce"


class CollectiveTensor:
    """The pending result of one device's :func:`all_reduce` (Burn's ``CollectiveTensor``).

    The collective may still be running (or waiting for other devices' submissions):
    :meth:`resolve` waits for it and returns a regular tensor on the input's device.
    """

    __slots__ = ("_call", "_context", "_device", "_index", "_result")

    def __init__(
        self, context: DistributedContext, call: _Call, index: int, device: Device | None = None
    ) -> None:
        self._context = context
        self._call = call
        self._index = index
        self._device = context.devices[index] if device is None else device
        self._result: Tensor | None = None

    @property
    def device(self) -> Device:
        """The device of the input, where the result will be."""
        return self._device

    @property
    def seq(self) -> int:
        """The call's number in its context (every device's k-th call is call ``#k``)."""
        return self._call.seq

    def is_resolved(self) -> bool:
        """Whether :meth:`resolve` would return without waiting (never waits itself)."""
        if self._result is not None:
            return True
        completion = self._call.completion
        return completion is not None and completion.done()

    def resolve(self, timeout: float | None = None) -> Tensor:
        """Wait for the collective and return its result, a regular tensor on this device.

        Args:
            timeout: seconds to wait for the other devices' submissions and the reduction;
                None: the context's ``DistributedConfig.timeout``.

        Raises:
            CollectiveError: the devices of this call that have not submitted it could only be
                submitted by this thread (it would wait for ever: submit every device's call
                first, then resolve); the call failed; or the context was closed first.
            CollectiveMismatchError: the devices' calls disagree (shape, dtype, op or order).
            CollectiveTimeoutError: a device did not submit the call within the timeout.
        """
        if self._result is None:
            out = self._context.wait(self._call, self._index, _OP, timeout)
            self._result = from_array(out, self._device)
        return self._result

    def assume_resolved(self) -> Tensor:
        """The result without waiting for the reduction to finish (Burn's unsafe form).

        For code that arranges synchronization itself: on a GPU the output may still be
        being written (work queued later on the device's current stream sees it complete;
        other streams do not). On logical CPU devices the result is complete once every device
        has submitted.

        Raises:
            CollectiveError: some device has not submitted this call yet (there is no result
                to return), or the call failed.
        """
        if self._result is not None:
            return self._result
        call = self._call
        if call.failure is not None:
            return self.resolve(0)  # raises the call's error, named for this device
        if call.completion is None:
            if not call.arrays:  # every device submitted; the launch is under way
                return self.resolve()
            devices = self._context.devices
            missing = [str(d) for d, a in zip(devices, call.arrays, strict=True) if a is None]
            raise self._context.error(
                CollectiveError,
                self._index,
                _OP,
                call.seq,
                f"assume_resolved() before device(s) {', '.join(missing)} submitted this call: "
                "there is no result yet; submit every device's call first",
            )
        self._result = from_array(call.completion.outputs[self._index], self._device)
        return self._result

    def __repr__(self) -> str:
        state = "resolved" if self.is_resolved() else "pending"
        return f"CollectiveTensor(all_reduce #{self.seq} on {self._device}, {state})"


def all_reduce(
    tensor: Tensor,
    op: ReduceOperation | str | None = None,
    devices: Iterable[Any] | None = None,
) -> CollectiveTensor:
    """Submit ``tensor``'s device's part of an all-reduce over the open context's devices.

    Burn's ``all_reduce(tensor, op, devices)``: returns at once; the result (every device's
    tensors combined with ``op``, in the context's device order) is on ``tensor``'s device
    once :meth:`CollectiveTensor.resolve` returns. ``tensor`` is read, not written, and must
    not be written until then. The result does not track gradients.

    Args:
        tensor: this device's tensor; its device must be one of the context's.
        op: the reduction (``ReduceOperation.Sum``, ``Mean``, ``Prod``, ``Min``, ``Max``, or
            their names); None: the context's ``DistributedConfig.all_reduce_op``.
        devices: the context's device list (any order); None: the open context that has
            ``tensor``'s device.

    Raises:
        TypeError: ``tensor`` is not a tensorlib Tensor.
        ValueError: ``op`` names no reduction.
        CollectiveError: no open context has these devices, the tensor's device is not one
            of them, the context is closed or broken, or the engine lacks ``op``.
        CollectiveMismatchError: this call disagrees with another device's call of the same
            number (shape, dtype, op or order).
    """
    if type(tensor) is not Tensor and not isinstance(tensor, Tensor):
        raise TypeError(
            f"all_reduce: expected a tensorlib Tensor on one of the context's devices, got "
            f"{type(tensor).__name__}"
        )
    device = tensor._device
    context, index = context_of(devices, device, _OP)
    if type(op) is ReduceOperation:
        reduction = op
    else:
        reduction = context.default_op if op is None else reduce_op_of(op)
    call = context.submit(index, tensor.data, reduction, _OP)
    return CollectiveTensor(context, call, index, device)
