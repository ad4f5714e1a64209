"""The Optimizer base: parameter groups, per-parameter state, state_dict round trips."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .._device_guard import DeviceGuard
from .._serialization import state_cast_error
from .._tensor import Tensor, _clear_grads

__all__ = ["Optimizer"]


class Optimizer:
    """Base class: holds ``param_groups`` (dicts with ``params`` and hyper-parameters).

    Subclasses define ``defaults`` and ``step()``. Per-parameter state lives in ``self.state``
    keyed by the parameter; its arrays are on the parameter's device.
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self.state: dict[Tensor, dict[str, Any]] = {}
        self.param_groups: list[dict[str, Any]] = []
        items = list(params)
        if not items:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        groups = items if isinstance(items[0], dict) else [{"params": items}]
        for g in groups:
            self.add_param_group(g)

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a group of parameters with its own hyper-parameters."""
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("a parameter group must be a dict with a 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer params must be Tensors, got {type(p).__name__}")
            if not p.requires_grad:
                raise ValueError("optimizer got a tensor that does not require grad")
            if not p.is_leaf:
                raise ValueError("optimizer can only optimize leaf tensors")
            if id(p) in seen:
                raise ValueError("a parameter appears in more than one parameter group")
            seen.add(id(p))
        full = dict(self.defaults)
        full.update(group)
        full["params"] = params
        for key, value in full.items():
            if key != "params" and value is _REQUIRED:
                raise ValueError(f"{type(self).__name__}: parameter group needs {key!r}")
        self.param_groups.append(full)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter (to None by default)."""
        _clear_grads((p for g in self.param_groups for p in g["params"]), set_to_none)

    def step(self) -> None:
        """Update every parameter that has a gradient."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {name: array or number}}, "param_groups": [...]}``.

        Parameters are referred to by their index in the order of ``param_groups``, as in
        PyTorch, so the dict can be saved with ``tensorlib.save`` and loaded into a fresh model.
        """
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = ids
            groups.append(entry)
        state = {}
        with DeviceGuard() as guard:  # CuPy copies onto the current GPU: make it p's
            for g in self.param_groups:
                for p in g["params"]:
                    if p in self.state:
                        guard.use(p._device)
                        # Copy the arrays: `step` is an int copied by value, so live arrays
                        # would pair step t with moments that later steps update in place.
                        state[index[id(p)]] = {
                            k: v.copy() if hasattr(v, "shape") and hasattr(v, "copy") else v
                            for k, v in self.state[p].items()
                        }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (arrays move to each parameter's device and dtype).

        Everything is checked before anything changes. A state array's dtype follows the
        rule of ``Module.load_state_dict``: float16/float32/float64 cast to the parameter's
        float dtype; an integer, bool, text, complex or object array is refused.

        Raises:
            ValueError: if the groups, or a state array's shape or dtype, do not match this
                optimizer's parameters (naming the parameter's index, the state's name and
                both dtypes).
        """
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("optimizer state_dict must have 'state' and 'param_groups'")
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state_dict has {len(groups)} parameter groups, this optimizer "
                f"has {len(self.param_groups)}"
            )
        by_index: dict[int, Tensor] = {}
        for saved, own in zip(groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(own["params"]):
                raise ValueError(
                    f"optimizer state_dict group has {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(own['params'])}"
                )
            for i, p in zip(saved["params"], own["params"], strict=True):
                by_index[int(i)] = p
        new_state: dict[Tensor, dict[str, Any]] = {}
        for raw_key, entry in state_dict["state"].items():
            key = int(raw_key)
            if key not in by_index:
                raise ValueError(f"optimizer state_dict has state for unknown parameter {key}")
            p = by_index[key]
            new_state[p] = _state_on(p, key, entry)
        for saved, own in zip(groups, self.param_groups, strict=True):
            for k, v in saved.items():
                if k != "params":
                    own[k] = tuple(v) if isinstance(v, list) else v
        self.state = new_state


def _state_on(p: Tensor, key: int, entry: dict[str, Any]) -> dict[str, Any]:
    """One parameter's saved state with its arrays copied onto ``p``'s device and dtype.

    Raises:
        ValueError: for an array whose shape is not the parameter's, or whose dtype does not
            cast to the parameter's (``state_cast_error``'s rule).
    """
    converted: dict[str, Any] = {}
    with DeviceGuard() as guard:
        guard.use(p._device)  # CuPy copies onto the current GPU: make it p's
        for name, value in entry.items():
            if (
                isinstance(value, Tensor)
                or hasattr(value, "__array_interface__")
                or hasattr(value, "__cuda_array_interface__")
            ):
                shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
                if shape and shape != p.shape:
                    raise ValueError(
                        f"optimizer state {name!r} of parameter {key} has shape {shape}, "
                        f"the parameter has {p.shape}"
                    )
                problem = state_cast_error(value, p.dtype)
                if problem is not None:
                    raise ValueError(
                        f"optimizer state {name!r} of parameter {key}: dtype mismatch: {problem}"
                    )
                arr = value if isinstance(value, Tensor) else Tensor(value)
                converted[name] = arr.detach().to(p.device, dtype=p.dtype)._data.copy()
            else:
                converted[name] = value
    return converted


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()
