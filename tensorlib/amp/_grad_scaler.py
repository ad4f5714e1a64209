"""``GradScaler``: dynamic loss scaling for float16 training, with PyTorch's semantics.

Usage (as ``torch.amp.GradScaler``)::

    scaler = tl.amp.GradScaler()
    with tl.autocast(dtype=tl.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # unscales, skips the step if a gradient is inf/NaN
    scaler.update()  # backs off after a skipped step, grows after growth_interval good ones

The scale is a Python float on the host, always a float32 value (as torch's float32 scale
tensor): multiplying a loss by it is one kernel with a scalar operand on any device, and its
updates need no device work. The inf/NaN check is one reduction per gradient, combined per
device without a host sync in :meth:`GradScaler.unscale_`; :meth:`GradScaler.step` then syncs
once per device (the API promises a Python decision there, as torch's ``step`` does).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

import numpy as np

from .._device import Device
from .._dtype import float16
from .._tensor import Tensor

__all__ = ["GradScaler", "register_found_inf_reducer"]

# (the optimizer's parameters) -> None, or a function that turns this process's inf/NaN finding
# into the one every process holding other shards of those parameters agrees on.
FoundInfReducer = Callable[[list[Tensor]], Callable[[bool], bool] | None]
_FOUND_INF_REDUCERS: list[FoundInfReducer] = []


def register_found_inf_reducer(reducer: FoundInfReducer) -> None:
    """Let a layer above tensorlib make the skip decision agree across processes.

    When an optimizer's parameters are shards of tensors split over several processes
    (``ddp.fully_shard``), an inf/NaN lands in one process's shard only, and a step skipped
    there but taken elsewhere would make the replicas diverge. A reducer registered here is
    asked, at each :meth:`GradScaler.unscale_`, about the optimizer's parameters; where it
    returns a function, the scaler passes its local finding through it (a collective: every
    process of the group calls it, in :meth:`GradScaler.step` or :meth:`GradScaler.update`)
    and uses the result.

    Args:
        reducer: ``reducer(params) -> None | (found: bool) -> bool``.
    """
    if not callable(reducer):
        raise TypeError(f"register_found_inf_reducer takes a callable, got {reducer!r}")
    if reducer not in _FOUND_INF_REDUCERS:
        _FOUND_INF_REDUCERS.append(reducer)


class _OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_state() -> dict[str, Any]:
    # found_inf_per_device: device -> 0-d bool array (True: some gradient was inf/NaN);
    # found_inf: the same as one Python bool, once step() or update() synced it;
    # agree: the registered reducers' functions for this optimizer's parameters.
    return {"stage": _OptState.READY, "found_inf_per_device": {}, "found_inf": None, "agree": []}


def _f32(x: float) -> float:
    """``x`` rounded to float32 (torch keeps the scale in a float32 tensor)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


_FIX = (
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the "
    "iteration."
)


class GradScaler:
    """Scale the loss so float16 gradients do not underflow; skip steps with inf/NaN gradients.

    Args:
        device: accepted for PyTorch's signature (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or None);
            it changes nothing, since the scale is a host float usable with tensors anywhere.
        init_scale: the first scale.
        growth_factor: the scale is multiplied by it after ``growth_interval`` consecutive
            steps without inf/NaN gradients (must be > 1).
        backoff_factor: the scale is multiplied by it after a step with inf/NaN gradients
            (must be < 1).
        growth_interval: consecutive good steps between growths.
        enabled: False makes every method a pass-through (``scale`` returns its input,
            ``step`` just calls ``optimizer.step()``).

    Raises:
        ValueError: for a growth factor <= 1, a backoff factor >= 1, or an unknown device.

    Under DistributedDataParallel the decision is the same on every rank: DDP's backward
    returns with the gradients averaged over the ranks, and an inf/NaN on any rank makes that
    average inf/NaN on all of them, so every rank skips (and backs off) together.
    """

    def __init__(
        self,
        device: str | Device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if device is not None and str(device).split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"GradScaler: device must be 'cpu' or 'cuda[:N]', got {device!r}")
        self._enabled = bool(enabled)
        if self._enabled:
            if not growth_factor > 1.0:
                raise ValueError(f"The growth factor must be > 1.0, got {growth_factor}.")
            if not backoff_factor < 1.0:
                raise ValueError(f"The backoff factor must be < 1.0, got {backoff_factor}.")
        self._init_scale = float(init_scale)
        # Set by the first scale() (torch initializes lazily too; load_state_dict before it
        # changes what that first scale is).
        self._scale: float | None = None
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = 0
        self._growth_tracker: int | None = None
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(_fresh_state)

    def _check_scale(self, funcname: str) -> float:
        if self._scale is None:
            raise RuntimeError(f"Attempted {funcname} but the scale was never set. {_FIX}")
        return self._scale

    # ------------------------------------------------------------------ the training step
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor (or tensors in nested lists/tuples/iterables) by the scale.

        Returns:
            The scaled tensor(s), in the same structure (lists and tuples keep their type;
            other iterables come back as a ``map``); ``outputs`` itself when disabled.

        Raises:
            ValueError: for something that is neither a Tensor nor an iterable of them.
        """
        if not self._enabled:
            return outputs
        if self._scale is None:
            self._scale = _f32(self._init_scale)
            self._growth_tracker = self._init_growth_tracker
        scale = self._scale

        def apply_scale(val: Any) -> Any:
            if isinstance(val, Tensor):
                return val * scale
            if isinstance(val, Iterable):
                scaled = map(apply_scale, val)
                return type(val)(scaled) if isinstance(val, list | tuple) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record inf/NaN ones.

        Optional: :meth:`step` calls it when it was not called (call it yourself to clip or
        inspect unscaled gradients before ``step``). Gradients are multiplied in place by the
        float32 reciprocal of the scale, so gradients that are views (DDP's buckets) stay
        views. No host sync.

        Raises:
            RuntimeError: when called twice for one optimizer before :meth:`update`, after
                :meth:`step`, or before any :meth:`scale`.
            ValueError: for float16 gradients (keep parameters in float32; autocast casts).
        """
        if not self._enabled:
            return
        scale = self._check_scale("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is _OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # Reciprocal in float64, rounded to float32: torch's inverse scale, bit for bit.
        state["found_inf_per_device"] = _unscale_grads(optimizer, _f32(1.0 / scale))
        if _FOUND_INF_REDUCERS:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            agree = (r(params) for r in _FOUND_INF_REDUCERS)
            state["agree"] = [a for a in agree if a is not None]
        state["stage"] = _OptState.UNSCALED

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if :meth:`unscale_` was not called) and step unless a gradient is inf/NaN.

        Returns:
            What ``optimizer.step(*args, **kwargs)`` returns, or None when the step is skipped.

        Raises:
            RuntimeError: with a ``closure`` keyword, when called twice before :meth:`update`,
                before any :meth:`scale`, or when no parameter of the optimizer has a gradient.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise RuntimeError("No inf checks were recorded for this optimizer.")
        retval = None
        if not _found_inf(state):
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = _OptState.STEPPED
        return retval

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Update the scale: back off after an inf/NaN step, grow after enough good ones.

        If any optimizer found inf/NaN gradients since the last update, the scale is multiplied
        by ``backoff_factor`` and the growth tracker reset; otherwise the tracker counts the
        step, and when it reaches ``growth_interval`` the scale is multiplied by
        ``growth_factor`` (unless that overflows float32) and the tracker reset.

        Args:
            new_scale: set this scale instead (a number, or a one-element tensor that does not
                require grad); the growth tracker is left as it is.

        Raises:
            RuntimeError: before any :meth:`scale`, or when no unscale/step recorded an inf
                check since the last update (and ``new_scale`` is None).
            TypeError: for a ``new_scale`` that is not a number or a one-element tensor.
        """
        if not self._enabled:
            return
        scale = self._check_scale("update")
        if new_scale is not None:
            self._scale = _f32(_new_scale_value(new_scale))
        else:
            states = [s for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
            if not states:
                raise RuntimeError("No inf checks were recorded prior to update.")
            tracker = self._growth_tracker or 0
            if any(_found_inf(s) for s in states):
                self._scale = _f32(scale * self._backoff_factor)
                self._growth_tracker = 0
            elif tracker + 1 == self._growth_interval:
                grown = _f32(scale * self._growth_factor)
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
            else:
                self._growth_tracker = tracker + 1
        self._per_optimizer_states = defaultdict(_fresh_state)

    # ------------------------------------------------------------------ queries and settings
    def get_scale(self) -> float:
        """The current scale (``init_scale`` before the first :meth:`scale`; 1.0 if disabled)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale

    def get_growth_factor(self) -> float:
        """The growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor."""
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor."""
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval."""
        self._growth_interval = int(new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return self._growth_tracker

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False: every method passes through)."""
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and
        ``_growth_tracker`` as Python numbers (torch's keys); ``{}`` when disabled. Take it
        after :meth:`update`."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a no-op when disabled).

        Raises:
            RuntimeError: for an empty dict (saved from a disabled scaler).
            KeyError: when one of the keys is missing.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale = _f32(self._init_scale)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._growth_tracker is not None:
            self._growth_tracker = self._init_growth_tracker


def _unscale_grads(optimizer: Any, inv_scale: float) -> dict[Device, Any]:
    """Multiply every gradient by ``inv_scale`` in place; per device, whether any was inf/NaN.

    The check reads each gradient before it is multiplied (as torch's kernel does) and stays
    on the device: one 0-d array per gradient, reduced to one per device.
    """
    flags: dict[Device, list[Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.dtype == float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            data, dev = grad._data, grad._device
            with dev:  # CuPy computes on the current GPU: make it the gradient's
                flags.setdefault(dev, []).append(dev.xp.isfinite(data).all())
                if inv_scale != 1.0:
                    data *= inv_scale  # in place: DDP's bucket views stay views
    found: dict[Device, Any] = {}
    for dev, per_grad in flags.items():
        xp = dev.xp
        with dev:
            found[dev] = xp.logical_not(xp.stack([xp.asarray(f) for f in per_grad]).all())
    return found


def _found_inf(state: dict[str, Any]) -> bool:
    """Whether an optimizer's unscale found an inf/NaN gradient (one host sync per device)."""
    if state["found_inf"] is None:
        found = any(bool(f) for f in state["found_inf_per_device"].values())
        for agree in state["agree"]:
            found = bool(agree(found))
        state["found_inf"] = found
    return bool(state["found_inf"])


def _new_scale_value(new_scale: Any) -> float:
    if isinstance(new_scale, Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise TypeError(
                "new_scale must be a number or a one-element tensor that does not require "
                f"grad, got a tensor of shape {tuple(new_scale.shape)} (requires_grad="
                f"{new_scale.requires_grad})"
            )
        return float(new_scale.item())
    if isinstance(new_scale, bool) or not isinstance(new_scale, int | float):
        raise TypeError(
            f"new_scale must be a number or a one-element tensor, got {type(new_scale).__name__}"
        )
    return float(new_scale)
