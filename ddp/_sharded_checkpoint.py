"""Sharded checkpoints: each rank writes its own shard file, rank 0 writes the index last.

``save_checkpoint(path, ..., sharded=True)`` makes ``path`` a directory (PyTorch Distributed
Checkpoint's idea, with our own files): every rank writes, with ``tensorlib.save``
(temporary file, fsync, rename, directory fsync), the pieces of the model and optimizer state
it holds, under a name unique to this save; once every rank's file is durable (a gather of
their outcomes, the barrier), rank 0 writes ``index.npz`` (``_checkpoint_index``: each
tensor's full shape, dtype and which file holds which flat element range, plus the
non-tensor parts) the same atomic way, and only then removes the files of earlier saves. A
save that dies before the index's rename leaves the previous index, whose files are still
there: the previous checkpoint loads as it was, and the next save removes the orphans.

What a rank writes, per tensor: a ``fully_shard`` shard's real rows (padding dropped); a
``ZeroRedundancyOptimizer`` piece's flat range; a tensor every rank holds whole (a DDP or
ZeRO-1 model's parameters, a plain optimizer's state under DDP) an even flat slice of it, so
the ranks share the writing; buffers rank 0 alone, whole (the ranks' buffers may differ, and
rank 0's is what the consolidated checkpoint holds).

``load_checkpoint`` of such a directory reads on each rank only the ranges its own state needs
at the current world size: its rows of each shard, its ZeRO-1 pieces, or whole tensors for
replicated state, from whichever chunks overlap them. No communication: every rank checks the
same index against the same model, so a mismatch raises alike on every rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import collectives
import tensorlib as tl
from tensorlib import Tensor, nn, optim

from ._checkpoint_index import (
    FORMAT,
    INDEX,
    merge_chunks,
    model_key,
    optimizer_key,
)
from .fsdp._param import layout_of_shard
from .fsdp._unit import shard_of
from .zero import ZeroRedundancyOptimizer

__all__ = ["PARTS", "model_entries", "rows_of", "save_sharded", "shard_places"]

_WRITER = 0
_SHARD = re.compile(r"shard-([0-9a-f]{12})-[0-9]{5,}\.npz")
# tensorlib.save's temporary files for a shard (``.tmp-{name, _ for -}-...``): a killed writer's.
_SHARD_TEMP = re.compile(r"\.tmp-shard_([0-9a-f]{12})_[0-9]{5,}\.npz-.*\.npz")
PARTS = ("scheduler", "scaler", "step", "epoch", "loader", "rng", "extra")


# ---------------------------------------------------------------------------- what a rank holds
def shard_places(module: nn.Module) -> dict[int, tuple[Any, Any]]:
    """``id(shard Parameter)`` -> (unit, layout), for every ``fully_shard`` shard of ``module``."""
    out: dict[int, tuple[Any, Any]] = {}
    for _, mod in module.named_modules():
        for attr in mod._parameters:
            entry = shard_of(mod, attr)
            if entry is not None:
                out[id(entry[1].shard)] = entry
    return out


def model_entries(
    module: nn.Module, shards: dict[int, tuple[Any, Any]]
) -> Iterator[tuple[str, Tensor, bool, tuple[Any, Any] | None]]:
    """(state name, tensor, is a buffer, shard place or None), as ``Module.state_dict`` names
    them (full names; a shard's tensor is this rank's rows)."""
    for mname, mod in module.named_modules():
        for table, is_buffer in ((mod._parameters, False), (mod._buffers, True)):
            for name, t in table.items():
                if t is not None:
                    place = None if is_buffer else shards.get(id(t))
                    yield (f"{mname}.{name}" if mname else name), t, is_buffer, place


def _host(a: Any) -> np.ndarray[Any, Any]:
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, Tensor):
        return a.numpy()
    return np.asarray(a.get())  # CuPy (or another device's) array


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, np.generic)


def _scalar(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def rows_of(place: tuple[Any, Any]) -> tuple[int, int, int]:
    """This rank's real rows ``[a, b)`` of a shard's full parameter, and a row's elements."""
    unit, sp = place
    r, d0 = unit.group.rank, sp.shape[0]
    return min(r * sp.rows, d0), min((r + 1) * sp.rows, d0), math.prod(sp.shape[1:])


class _Pieces:
    """The tensors a rank declares (full shape, dtype) and the chunks it writes of them."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.arrays: list[np.ndarray[Any, Any]] = []
        self.tensors: list[list[Any]] = []
        self.chunks: list[list[Any]] = []

    def add(self, key: str, shape: tuple[int, ...], data: Any, lo: int, hi: int) -> None:
        """Declare tensor ``key`` and write ``data`` (its flat elements ``[lo, hi)``)."""
        arr = _host(data).reshape(-1)
        self.tensors.append([key, [int(d) for d in shape], str(np.dtype(arr.dtype))])
        if lo < hi:
            self.chunks.append([key, len(self.arrays), int(lo), int(hi)])
            self.arrays.append(arr)

    def rows(self, key: str, place: tuple[Any, Any], shard: Any) -> None:
        """This rank's real rows of a shard-shaped array (padding rows left out)."""
        a, b, row = rows_of(place)
        self.add(key, place[1].shape, _host(shard)[: max(0, b - a)], a * row, max(a, b) * row)

    def split(self, key: str, whole: Any) -> None:
        """This rank's even flat slice of a tensor every rank holds whole."""
        arr = _host(whole)
        total = int(arr.size)
        step = -(-total // self.world)
        lo = min(self.rank * step, total)
        hi = min(lo + step, total)
        self.add(key, tuple(arr.shape), arr.reshape(-1)[lo:hi], lo, hi)

    def whole(self, key: str, whole: Any) -> None:
        """All of a tensor, from the writer rank only (declared by every rank)."""
        arr = _host(whole)
        hi = int(arr.size) if self.rank == _WRITER else 0
        self.add(key, tuple(arr.shape), arr.reshape(-1)[:hi], 0, hi)


def _local_state(
    module: nn.Module, optimizer: optim.Optimizer | None, rank: int, world: int
) -> tuple[dict[str, Any], list[np.ndarray[Any, Any]]]:
    """This rank's metadata (tensors, chunks, model names, optimizer skeleton) and arrays."""
    out = _Pieces(rank, world)
    shards = shard_places(module)
    names = []
    for name, t, is_buffer, place in model_entries(module, shards):
        names.append(name)
        if place is not None:
            out.rows(model_key(name), place, t.data)
        elif is_buffer:
            out.whole(model_key(name), t)
        else:
            out.split(model_key(name), t)
    skeleton: list[list[Any]] = []
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        _zero_pieces(out, optimizer, skeleton)
    elif optimizer is not None:
        _plain_pieces(out, optimizer, shards, skeleton)
    meta = {"tensors": out.tensors, "chunks": out.chunks, "model": names, "state": skeleton}
    return meta, out.arrays


def _ordered_params(optimizer: optim.Optimizer) -> list[Tensor]:
    """The parameters as ``Optimizer.state_dict`` numbers them (first occurrence)."""
    seen: dict[int, Tensor] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _plain_pieces(
    out: _Pieces, optimizer: optim.Optimizer, shards: dict[int, Any], skeleton: list[list[Any]]
) -> None:
    """A plain optimizer's state: a shard's rows for arrays of a shard's shape, else slices."""
    params = _ordered_params(optimizer)
    for i, entry in optimizer.state_dict()["state"].items():
        p = params[int(i)]
        place = shards.get(id(p))
        if place is None and layout_of_shard(p) is not None:
            raise ValueError(
                f"the optimizer steps a fully_shard shard (parameter {i}) that is not one of "
                "the model's; pass the model the optimizer's parameters came from"
            )
        for name, v in entry.items():
            if not _is_array(v):
                skeleton.append([int(i), name, "scalar", _scalar(v)])
                continue
            key = optimizer_key(int(i), name)
            if place is not None and tuple(v.shape) == tuple(place[1].shard.shape):
                out.rows(key, place, v)
            else:
                out.split(key, v)
            skeleton.append([int(i), name, "tensor", key])


def _zero_pieces(out: _Pieces, opt: ZeroRedundancyOptimizer, skeleton: list[list[Any]]) -> None:
    """ZeRO-1: each piece's state arrays are the flat range ``[lo, hi)`` of its parameter."""
    for index, lo, hi, shape, state in opt.local_pieces():
        for name, v in state.items():
            if not (_is_array(v) and v.ndim > 0):
                skeleton.append([index, name, "scalar", _scalar(v)])
                continue
            key = optimizer_key(index, name)
            out.add(key, shape, v, lo, hi)
            skeleton.append([index, name, "tensor", key])


def _param_groups(optimizer: optim.Optimizer) -> list[dict[str, Any]]:
    """The groups in the plain optimizer's ``state_dict`` format (indexes over all groups)."""
    groups, at = [], 0
    for g in optimizer.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = list(range(at, at + len(g["params"])))
        at += len(g["params"])
        groups.append(entry)
    return groups


# ---------------------------------------------------------------------------- saving
def _describe(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc)]


def _raise_reported(where: str, what: str, reported: list[str]) -> None:
    """Raise, on a rank that did not fail, what another rank reported: a ValueError stays one
    (a mismatch is every rank's), anything else becomes a RuntimeError quoting it."""
    kind, message = reported
    if kind == "ValueError":
        raise ValueError(message)  # it names where already
    raise RuntimeError(f"{where}: {what}: {kind}: {message}")


def save_sharded(
    where: str,
    target: Path,
    module: nn.Module,
    optimizer: optim.Optimizer | None,
    parts: Callable[[], dict[str, Any]],
) -> None:
    """Write a sharded checkpoint directory (see the module's docstring); every rank calls it.

    Args:
        where: the caller's name, for messages.
        target: the directory.
        module: the model (unwrapped).
        optimizer: a plain optimizer, a ``ZeroRedundancyOptimizer`` or None.
        parts: gives the non-tensor parts (``PARTS``), called on rank 0 only.

    Raises:
        ValueError: on every rank, when ``target`` is a file, or the ranks hold different
            state (tensors of different shapes, or elements no rank holds).
        OSError: on the rank whose write failed; RuntimeError on the others.
    """
    world, rank = collectives.get_world_size(), collectives.get_rank()
    save_id, error = secrets.token_hex(6), None
    if rank == _WRITER:
        try:
            if target.exists() and not target.is_dir():
                raise ValueError(
                    f"{where}: {target} is a file (a consolidated checkpoint?); a sharded "
                    "checkpoint is a directory: pass another path, or sharded=False"
                )
            target.mkdir(parents=True, exist_ok=True)
        except Exception as exc:
            error = exc
    head: list[Any] = [save_id, None if error is None else _describe(error)]
    save_id, reported = collectives.broadcast_object(head, src=_WRITER) if world > 1 else head
    if error is not None:
        raise error
    if reported is not None:
        _raise_reported(where, f"rank {_WRITER} could not prepare {target}", reported)
    meta, mine = _write_shard(where, target, save_id, module, optimizer, rank, world)
    every = collectives.all_gather_object(meta) if world > 1 else [meta]
    failed = [(r, m["error"]) for r, m in enumerate(every) if m.get("error") is not None]
    if failed:
        if rank == _WRITER:
            _remove(target, [m["file"] for m in every if m.get("error") is None])
        if mine is not None:
            raise mine
        r, reported = failed[0]
        _raise_reported(where, f"rank {r} failed to write its shard in {target}", reported)
    if rank != _WRITER:
        reported = collectives.broadcast_object(None, src=_WRITER)
        if reported is not None:
            _raise_reported(where, f"rank {_WRITER} failed to write {target / INDEX}", reported)
        return
    try:
        try:
            index = _index(every, optimizer, parts())
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        write_index(target, index)
    except Exception as exc:
        if world > 1:
            collectives.broadcast_object(_describe(exc), src=_WRITER)
        _remove(target, [m["file"] for m in every])
        raise
    _sweep(target, keep=save_id)
    if world > 1:
        collectives.broadcast_object(None, src=_WRITER)


def _write_shard(
    where: str,
    target: Path,
    save_id: str,
    module: nn.Module,
    optimizer: optim.Optimizer | None,
    rank: int,
    world: int,
) -> tuple[dict[str, Any], Exception | None]:
    """Write this rank's file; its metadata (with ``"error"`` set on a failure) and the error."""
    name = f"shard-{save_id}-{rank:05d}.npz"
    try:
        try:
            meta, arrays = _local_state(module, optimizer, rank, world)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        tl.save(arrays, target / name)
    except Exception as exc:
        return {"file": name, "error": _describe(exc)}, exc
    return {**meta, "file": name, "error": None}, None


def _index(
    every: list[dict[str, Any]], optimizer: optim.Optimizer | None, parts: dict[str, Any]
) -> dict[str, Any]:
    """The index, from every rank's metadata (rank order) and rank 0's own objects."""
    opt_state: dict[int, list[list[Any]]] = {}
    for meta in every:
        for i, name, kind, value in meta["state"]:
            entry = opt_state.setdefault(int(i), [])
            if all(e[0] != name for e in entry):
                entry.append([name, kind, value])
    opt = None
    if optimizer is not None:
        opt = {"state": dict(sorted(opt_state.items())), "param_groups": _param_groups(optimizer)}
    return {
        "format": FORMAT,
        "world_size": len(every),
        "files": [m["file"] for m in every],
        "tensors": merge_chunks(every),
        "model": every[0]["model"],
        "optimizer": opt,
        **{k: parts.get(k) for k in PARTS},
    }


def write_index(target: Path, index: dict[str, Any]) -> None:
    """Replace the directory's index, atomically (after it, the new save is the checkpoint)."""
    tl.save(index, target / INDEX)


def _remove(target: Path, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(target / name)


def _sweep(target: Path, keep: str) -> None:
    """Remove the shard files (and killed writers' temporary shard files) of every save but
    ``keep``: earlier checkpoints, and saves that died before writing their index."""
    with contextlib.suppress(OSError), os.scandir(target) as entries:
        for entry in entries:
            m = _SHARD.fullmatch(entry.name) or _SHARD_TEMP.fullmatch(entry.name)
            if m is not None and m.group(1) != keep:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
