"""The optimizer state of a ``fully_shard`` model, full and sharded (FSDP1's
``FSDP.full_optim_state_dict`` / ``FSDP.shard_full_optim_state_dict``).

A plain optimizer over a sharded model's ``parameters()`` holds, for each shard, state arrays
of the shard's shape (``(ceil(d0 / N), ...)``, padding rows included). The full form is that
optimizer's own ``state_dict()`` with every such array replaced by the full parameter's rows
(all-gathered over the unit's group, padding dropped), so it is exactly what the same
optimizer over the unsharded model would hold: it loads into an unsharded run, and back into
a sharded one at any world size, each rank keeping its rows. Scalars (``step``) and any other
value are kept as they are. Parameters are numbered as ``Optimizer.state_dict`` numbers them
(by their order in ``param_groups``), which sharding does not change.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorlib import optim
from tensorlib.nn import Module

from ._param import ShardedParam, layout_of_shard
from ._unit import Unit

__all__ = ["full_optim_state_dict", "shard_full_optim_state_dict"]


def full_optim_state_dict(model: Module, optimizer: optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each shard's state arrays gathered into full ones.

    A collective: every rank of the model's groups calls it, with the same model and an
    optimizer built the same way; every rank gets the full state dict. A state value is
    gathered when it is an array of its shard's shape (every per-element state of the
    tensorlib optimizers: Adam/AdamW moments, SGD momentum); one all-gather per unit and
    dtype.

    Args:
        model: the module given to ``fully_shard`` (the root).
        optimizer: a tensorlib optimizer over (some of) ``model.parameters()``.

    Returns:
        ``{"state": {index: {name: array or number}}, "param_groups": [...]}`` in the
        format of ``Optimizer.state_dict``, for the full (unsharded) parameters.

    Raises:
        ValueError: on every rank, when the ranks' optimizers hold different state (names,
            shapes, dtypes) for a unit's shards; on this rank, when the optimizer steps a
            shard of another sharded model.
    """
    sd = optimizer.state_dict()
    index = _shard_index(model, optimizer, "full_optim_state_dict")
    by_unit: dict[int, tuple[Unit, list[tuple[int, ShardedParam]]]] = {}
    for i, (unit, sp) in index.items():
        by_unit.setdefault(id(unit), (unit, []))[1].append((i, sp))
    # Units in the optimizer's order of their shards: the same on every rank.
    for unit, members in by_unit.values():
        entries = [
            (i, sp, k)
            for i, sp in members
            for k, v in sorted(sd["state"].get(i, {}).items())
            if _is_array(v) and tuple(v.shape) == tuple(sp.shard.shape)
        ]
        _check_same(unit, sd["state"], entries)
        for dtype in sorted({str(sd["state"][i][k].dtype) for i, _, k in entries}):
            part = [(i, sp, k) for i, sp, k in entries if str(sd["state"][i][k].dtype) == dtype]
            flat = np.concatenate([np.asarray(sd["state"][i][k]).reshape(-1) for i, _, k in part])
            ranks = unit.group.all_gather(flat)  # (N, S), rank-major
            off, world = 0, unit.group.size
            for i, sp, k in part:
                n = sp.shard_numel
                rows = ranks[:, off : off + n].reshape((sp.rows * world, *sp.shape[1:]))
                sd["state"][i][k] = np.ascontiguousarray(rows[: sp.shape[0]])
                off += n
    return sd


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any], model: Module, optimizer: optim.Optimizer
) -> dict[str, Any]:
    """This rank's part of a :func:`full_optim_state_dict`, for ``optimizer.load_state_dict``.

    No communication: each state array of a shard's full parameter shape becomes this rank's
    rows of it (zero padding rows added), at this model's world size, whatever the world size
    it was gathered at. The input is not changed.

    Args:
        full_optim_state_dict: a full optimizer state dict (from :func:`full_optim_state_dict`
            or from a plain optimizer over the unsharded model, built the same way).
        model: the module given to ``fully_shard`` (the root).
        optimizer: the optimizer over its shards that will load the result.

    Returns:
        The state dict to pass to ``optimizer.load_state_dict``.

    Raises:
        ValueError: when it is not an optimizer state dict, or a shard's state array has
            neither the full parameter's shape nor is a scalar.
    """
    where = "shard_full_optim_state_dict"
    if not isinstance(full_optim_state_dict, dict) or not isinstance(
        full_optim_state_dict.get("state"), dict
    ):
        raise ValueError(f"{where}: expected an optimizer state dict with a 'state' dict")
    index = _shard_index(model, optimizer, where)
    state: dict[Any, Any] = {}
    for key, entry in full_optim_state_dict["state"].items():
        place = index.get(int(key))
        if place is None or not isinstance(entry, dict):
            state[key] = entry
            continue
        unit, sp = place
        r = unit.group.rank
        mine: dict[str, Any] = {}
        for k, v in entry.items():
            if not _is_array(v) or np.ndim(v) == 0:
                mine[k] = v
                continue
            if tuple(v.shape) != sp.shape:
                raise ValueError(
                    f"{where}: state {k!r} of parameter {key} ({sp.name!r}) has shape "
                    f"{tuple(v.shape)}, expected the full parameter's {sp.shape}"
                )
            arr = v.numpy() if hasattr(v, "numpy") else np.asarray(v)
            rows = np.zeros(sp.shard.shape, dtype=arr.dtype)
            got = arr[r * sp.rows : (r + 1) * sp.rows]
            rows[: got.shape[0]] = got
            mine[k] = rows
        state[key] = mine
    return {**full_optim_state_dict, "state": state}


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype")


def _shard_index(
    model: Module, optimizer: optim.Optimizer, where: str
) -> dict[int, tuple[Unit, ShardedParam]]:
    """``Optimizer.state_dict``'s index -> unit and layout, for the optimizer's shards."""
    units: dict[int, tuple[Unit, ShardedParam]] = {}
    for mod in model.modules():
        unit = mod.__dict__.get("_fsdp_unit")
        if unit is not None:
            for sp in unit.params:
                units[id(sp.shard)] = (unit, sp)
    out: dict[int, tuple[Unit, ShardedParam]] = {}
    seen: dict[int, int] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            i = seen.setdefault(id(p), len(seen))
            place = units.get(id(p))
            if place is not None:
                out[i] = place
            elif layout_of_shard(p) is not None:
                raise ValueError(
                    f"{where}: the optimizer steps a fully_shard shard (parameter {i}) that "
                    f"is not one of this {type(model).__name__}'s; pass the root module the "
                    f"optimizer's parameters came from"
                )
    return out


def _check_same(
    unit: Unit, state: dict[Any, Any], entries: list[tuple[int, ShardedParam, str]]
) -> None:
    """Every rank raises alike when the ranks would gather different state (a hang else)."""
    if unit.group.size == 1:
        return
    mine = [[i, k, str(state[i][k].dtype)] for i, _, k in entries]
    every = unit.group.all_gather_object(mine)
    if all(e == every[0] for e in every):
        return
    diff = [f"rank {unit.group.ranks[r]}: {e}" for r, e in enumerate(every) if e != every[0]]
    raise ValueError(
        f"full_optim_state_dict({unit.label}): the ranks' optimizers hold different state for "
        f"the unit's shards (every rank must step the same parameters with the same "
        f"optimizer); rank {unit.group.ranks[0]} has {every[0]} (index, name, dtype), "
        + "; ".join(diff)
    )
