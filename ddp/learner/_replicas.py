"""Copies of the user's model, optimizer and scheduler on other devices, and back again.

The learner is given one model, one optimizer and maybe one scheduler, built on the main
device. A strategy with several devices needs a model replica per device (:func:`replicate`),
an optimizer per device over that replica's parameters, or over a shard of them
(:func:`optimizer_over`), and in DDP a scheduler per rank thread (:func:`clone_scheduler`),
since each rank steps its own. When training ends the main replica's state is copied back
into the user's objects (:func:`gather_optimizer` and ``load_state_dict``), so the result is
the objects the user built, trained.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tensorlib as tl
from tensorlib import Device, Tensor, nn, optim

__all__ = [
    "clone_scheduler",
    "copy_state",
    "gather_optimizer",
    "optimizer_over",
    "replicate",
    "sync_hyper",
    "tensors_of",
]


def tensors_of(model: nn.Module) -> list[Tensor]:
    """The model's parameters then buffers, in registration order (each once)."""
    return [*model.parameters(), *model.buffers()]


def _copy_to(t: Tensor, device: Device) -> Tensor:
    """A copy of ``t``'s values on ``device`` (a new array even on the same device)."""
    moved = t.detach().to(device)
    if moved.data is t.data:
        moved = tl.from_array(t.data.copy(), device)
    return moved


def replicate(model: nn.Module, device: Device) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are new tensors on ``device``.

    The module tree is deep-copied with every parameter and buffer replaced by a copy on
    ``device`` (so nothing is copied twice, and a tensor shared by two layers stays shared).

    Raises:
        TypeError: when the model cannot be deep-copied (it holds a lock, a file, ...).
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(_copy_to(p, device), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = _copy_to(b, device)
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise TypeError(
            f"the model {type(model).__name__} cannot be replicated onto {device} for this "
            f"strategy: copy.deepcopy failed ({type(exc).__name__}: {exc}); keep non-copyable "
            "objects (locks, files, connections) out of the model"
        ) from exc


def copy_state(src: Sequence[Tensor], dst: Sequence[Tensor]) -> None:
    """``dst[i] <- src[i]`` in place, moving across devices where they differ."""
    with tl.no_grad():
        for s, d in zip(src, dst, strict=True):
            d.copy_(s)


def _moved_state(state: dict[str, Any], src: Device, dst: Device) -> dict[str, Any]:
    """An optimizer's per-parameter state with its arrays copied from ``src`` to ``dst``."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            out[name] = _copy_to(tl.from_array(value, src), dst).data
        else:
            out[name] = value
    return out


def optimizer_over(
    optimizer: optim.Optimizer,
    mapping: Mapping[int, Tensor],
    keep: Iterable[int] | None = None,
) -> optim.Optimizer:
    """An optimizer of ``optimizer``'s class and hyper-parameters over other parameters.

    Args:
        optimizer: the user's optimizer.
        mapping: ``id(user parameter) -> the parameter standing for it`` (a replica's).
        keep: the ids of the user parameters to include (a shard); None: all of them.

    Returns:
        A shallow copy of ``optimizer`` with its parameter groups (same order and
        hyper-parameters, only kept parameters) and per-parameter state (copied to each
        new parameter's device) over the mapped parameters.
    """
    wanted = None if keep is None else set(keep)
    new = copy.copy(optimizer)
    new.defaults = dict(optimizer.defaults)
    new.param_groups = [
        {
            **group,
            "params": [
                mapping[id(p)] for p in group["params"] if wanted is None or id(p) in wanted
            ],
        }
        for group in optimizer.param_groups
    ]
    new.state = {
        mapping[id(p)]: _moved_state(st, p.device, mapping[id(p)].device)
        for p, st in optimizer.state.items()
        if id(p) in mapping and (wanted is None or id(p) in wanted)
    }
    return new


def sync_hyper(source: optim.Optimizer, target: optim.Optimizer) -> None:
    """Copy ``source``'s group hyper-parameters (``lr``, set by a scheduler) to ``target``."""
    for s, t in zip(source.param_groups, target.param_groups, strict=True):
        for key, value in s.items():
            if key != "params":
                t[key] = value


def gather_optimizer(
    optimizer: optim.Optimizer, parts: Sequence[optim.Optimizer], back: Mapping[int, Tensor]
) -> None:
    """Make ``optimizer``'s state the union of ``parts``' states, on its own parameters.

    Args:
        optimizer: the user's optimizer (its state is replaced).
        parts: the optimizers made by :func:`optimizer_over` (one, or one per shard).
        back: ``id(replica parameter) -> user parameter``.
    """
    state: dict[Tensor, dict[str, Any]] = {}
    for part in parts:
        for p, st in part.state.items():
            user = back[id(p)]
            state[user] = _moved_state(st, p.device, user.device)
    optimizer.state = state


def clone_scheduler(scheduler: Any, optimizer: optim.Optimizer, target: optim.Optimizer) -> Any:
    """A copy of ``scheduler`` (nested ones too) that steps ``target`` instead of
    ``optimizer``; None stays None.

    Raises:
        TypeError: when the scheduler cannot be deep-copied.
    """
    if scheduler is None:
        return None
    try:
        return copy.deepcopy(scheduler, {id(optimizer): target})
    except Exception as exc:
        raise TypeError(
            f"the lr_scheduler {type(scheduler).__name__} cannot be copied for each DDP rank "
            f"(copy.deepcopy failed: {type(exc).__name__}: {exc})"
        ) from exc
