"""Loading a sharded checkpoint (``_sharded_checkpoint``) on one rank, at any world size.

Each rank reads only what its own objects hold at the current world size: a ``fully_shard``
shard's rows (``ceil(d0 / N)`` of them, zero padding rows added), a ``ZeroRedundancyOptimizer``
piece's flat range of each state array, and whole tensors for what it holds whole (a plain
model's parameters and buffers, a plain optimizer's state over them). Everything is read and
checked before anything is changed, and nothing is communicated: the index and the model are
the same on every rank, so a mismatch raises the same error on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import tensorlib as tl
from tensorlib import Tensor, nn, optim

from ._checkpoint_index import INDEX, ShardReader, check_index, model_key
from ._param_groups import match_param_groups
from ._sharded_checkpoint import PARTS, model_entries, rows_of, shard_places
from .zero import ZeroRedundancyOptimizer

__all__ = ["load_sharded"]

_KINDS = {"f": "float", "i": "integer", "u": "integer", "b": "bool"}


def load_sharded(
    where: str, target: Path, module: nn.Module, map_location: str | tl.Device | None
) -> tuple[dict[str, Any], Callable[[], None], Callable[[Any], tuple[Any, Any]]]:
    """Read this rank's part of a sharded checkpoint, checked, changing nothing yet.

    Returns:
        ``(state, commit_model, optimizer_part)``: the non-tensor parts (and ``"optimizer"``,
        the index's optimizer entry or None); a function that copies the model's values in;
        and ``optimizer_part(opt)``, which reads this rank's optimizer state for ``opt`` and
        gives ``(state for X.load_state_dict, X)``.

    Raises:
        FileNotFoundError: when the directory has no index (no save to it has finished).
        ValueError: when the index is not complete, a file it names is missing or damaged,
            or the model does not match (names, shapes, dtypes).
    """
    index_path = target / INDEX
    if not index_path.is_file():
        # As for a missing file: no save to this directory has finished, nothing to load.
        raise FileNotFoundError(
            f"{where}: {target} is a directory without {INDEX}: not a complete sharded "
            "checkpoint (no save to it has finished); nothing to load"
        )
    try:
        index = tl.load(index_path, device=map_location)
    except Exception as exc:
        raise ValueError(
            f"{where}: {index_path} is not a sharded checkpoint's index ({type(exc).__name__}: "
            f"{exc})"
        ) from exc
    check_index(where, target, index)
    with ShardReader(target, index) as reader:
        commit = _model_values(where, target, module, index, reader)
    state = {k: index.get(k) for k in PARTS}
    state["optimizer"] = index.get("optimizer")

    def optimizer_part(opt: Any) -> tuple[Any, Any]:
        try:
            with ShardReader(target, index) as reader:
                if isinstance(opt, ZeroRedundancyOptimizer):
                    return _zero_state(opt, state["optimizer"], reader)
                return _plain_state(opt, state["optimizer"], shard_places(module), reader), opt
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{where}: {target}: the optimizer state does not match this optimizer: {exc}"
            ) from exc

    return state, commit, optimizer_part


# ---------------------------------------------------------------------------- the model
def _cast_problem(saved: np.dtype[Any], own: np.dtype[Any], values: Any = None) -> str | None:
    """Why values of dtype ``saved`` may not load into a tensor of dtype ``own`` (the rule of
    ``Module.load_state_dict``: float among floats, integers that fit, bool to bool)."""
    if saved == own:
        return None
    src, dst = _KINDS.get(saved.kind), _KINDS.get(own.kind)
    head = f"checkpoint {saved} vs model {own}"
    if src != dst:
        return f"{head} ({src} values do not load into {dst} tensors)"
    if src == "integer" and values is not None and values.size and not np.can_cast(saved, own):
        info = np.iinfo(own)
        lo, hi = int(values.min()), int(values.max())
        if lo < info.min or hi > info.max:
            return f"{head} (values {lo}..{hi} do not fit in {own})"
    return None


def _model_values(
    where: str, target: Path, module: nn.Module, index: dict[str, Any], reader: ShardReader
) -> Callable[[], None]:
    """Read and check this rank's model values; return the function that copies them in."""
    shards = shard_places(module)
    own = list(model_entries(module, shards))
    saved = set(index["model"])
    names = {name for name, *_ in own}
    problems: dict[str, list[str]] = {"shape mismatch": [], "dtype mismatch": []}
    values: dict[str, np.ndarray[Any, Any]] = {}
    for name, t, _, place in own:
        if name not in saved:
            continue
        key = model_key(name)
        full = tuple(place[1].shape) if place is not None else tuple(t.shape)
        if reader.shape(key) != full:
            problems["shape mismatch"].append(
                f"{name}: checkpoint {reader.shape(key)} vs model {full}"
            )
            continue
        problem = _cast_problem(reader.dtype(key), np.dtype(t.dtype))
        if problem is None:
            values[name] = _read_own(reader, key, full, place)
            problem = _cast_problem(reader.dtype(key), np.dtype(t.dtype), values[name])
        if problem is not None:
            problems["dtype mismatch"].append(f"{name}: {problem}")
    found = [
        f"missing from the checkpoint: {[n for n, *_ in own if n not in saved]}"
        if names - saved
        else "",
        f"not in the model: {[n for n in index['model'] if n not in names]}"
        if saved - names
        else "",
        *[f"{what}: {'; '.join(items)}" for what, items in problems.items() if items],
    ]
    if any(found):
        raise ValueError(
            f"{where}: {target} does not match {type(module).__name__}: "
            + "; ".join(f for f in found if f)
        )
    tensors = {name: t for name, t, _, _ in own}

    def commit() -> None:
        if not shards:
            module.load_state_dict(values, strict=True)  # the plain path, devices included
            return
        # A fully_shard module's load_state_dict takes full tensors: write the shards.
        for name, value in values.items():
            _copy_into(tensors[name], value)

    return commit


def _read_own(
    reader: ShardReader, key: str, full: tuple[int, ...], place: tuple[Any, Any] | None
) -> np.ndarray[Any, Any]:
    """This rank's part of tensor ``key`` (full shape ``full``): its rows of a shard, padded
    with zero rows to the shard's shape, or the whole tensor."""
    if place is None:
        return reader.read(key, 0, math.prod(full)).reshape(full)
    a, b, row = rows_of(place)
    out = np.zeros(place[1].shard.shape, dtype=reader.dtype(key))
    if b > a:
        out.reshape(-1)[: (b - a) * row] = reader.read(key, a * row, b * row)
    return out


def _copy_into(t: Tensor, value: np.ndarray[Any, Any]) -> None:
    """Copy ``value`` into ``t``'s array in place (cast to its dtype, on its device)."""
    if t.device.type == "cpu":
        t.data[...] = value
        return
    src = Tensor(value, dtype=t.dtype, device=t.device)
    with t.device:  # CuPy copies on the current GPU
        t.data[...] = src.data


# ---------------------------------------------------------------------------- the optimizer
def _check_shape(
    reader: ShardReader, key: str, name: str, i: int, expected: tuple[int, ...]
) -> None:
    shape = reader.shape(key)
    if shape not in (expected, ()):
        raise ValueError(
            f"optimizer state {name!r} of parameter {i} has shape {shape}, the parameter has "
            f"{expected}"
        )


def _plain_state(
    opt: optim.Optimizer, entry: dict[str, Any], shards: dict[int, Any], reader: ShardReader
) -> dict[str, Any]:
    """A plain optimizer's ``load_state_dict`` input: shards' rows or whole arrays."""
    by_index = match_param_groups(entry["param_groups"], opt.param_groups)
    params = [p for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for i, items in entry["state"].items():
        if int(i) not in by_index:
            raise ValueError(f"the checkpoint has state for unknown parameter {i}")
        p = params[by_index[int(i)]]
        place = shards.get(id(p))
        full = tuple(place[1].shape) if place is not None else tuple(p.shape)
        mine: dict[str, Any] = {}
        for name, kind, value in items:
            if kind != "tensor":
                mine[name] = value
                continue
            _check_shape(reader, value, name, int(i), full)
            whole = reader.shape(value) != full
            mine[name] = _read_own(reader, value, reader.shape(value), None if whole else place)
        state[int(i)] = mine
    return {"state": state, "param_groups": entry["param_groups"]}


def _piece_of(reader: ShardReader, key: str, lo: int, hi: int) -> Any:
    """Elements ``[lo, hi)`` of a state array; a 0-d one is the number it holds (as ZeRO-1
    keeps it)."""
    if reader.shape(key) == ():
        return reader.read(key, 0, 1)[0].item()
    return reader.read(key, lo, hi)


class _ZeroLoad:
    """Loads this rank's pieces' state into a ``ZeroRedundancyOptimizer`` (its
    ``load_local_state``), in the ``(state, X)`` form the other parts load in."""

    def __init__(self, opt: ZeroRedundancyOptimizer, groups: list[dict[str, Any]]) -> None:
        self.opt, self.groups = opt, groups

    def load_state_dict(self, per_piece: list[dict[str, Any] | None]) -> None:
        self.opt.load_local_state(per_piece, self.groups)


def _zero_state(
    opt: ZeroRedundancyOptimizer, entry: dict[str, Any], reader: ShardReader
) -> tuple[list[dict[str, Any] | None], _ZeroLoad]:
    """The state of this rank's pieces (flat ranges of each state array)."""
    groups = entry["param_groups"]
    by_index = match_param_groups(groups, opt.param_groups)
    saved_of = {own: saved for saved, own in by_index.items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, items in entry["state"].items():
        if int(i) not in by_index:
            raise ValueError(f"the checkpoint has state for unknown parameter {i}")
        for name, kind, value in items:
            if kind == "tensor":
                _check_shape(reader, value, name, int(i), tuple(params[by_index[int(i)]].shape))
    per_piece: list[dict[str, Any] | None] = []
    for index, lo, hi, _, _ in opt.local_pieces():
        items = entry["state"].get(saved_of[index])
        per_piece.append(
            None
            if items is None
            else {
                name: _piece_of(reader, value, lo, hi) if kind == "tensor" else value
                for name, kind, value in items
            }
        )
    return per_piece, _ZeroLoad(opt, groups)
