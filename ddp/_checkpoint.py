"""Checkpoints of a training run: written by rank 0 atomically, loaded everywhere.

A checkpoint is a ``tensorlib.save`` file (``.npz`` with a JSON manifest, no pickle). Format 2
(``ddp.checkpoint/2``) holds ``{"format", "model", "optimizer", "scheduler", "scaler", "step",
"epoch", "loader", "rng", "extra"}``: what a run needs to continue as if it had never been
interrupted. ``rng`` holds every rank's random generator states (gathered to rank 0), restored
only at the same world size. Format 1 files (model, optimizer, step, extra) still load.

``tensorlib.save`` writes to a temporary file, fsyncs it, renames it and fsyncs the directory,
so the path never names a half-written file, even after a power loss (and it removes what
writers killed mid-save left); in a job of several ranks only rank 0 writes, and the other
ranks wait for it inside :func:`save_checkpoint`, so a rank that reads the checkpoint right
after saving it finds it complete. The path must be visible to every rank that loads it (one
host, or a shared filesystem).

``sharded=True`` writes a directory instead (``_sharded_checkpoint``): each rank its own
shard file, rank 0 the index last, every file as atomically; ``load_checkpoint`` recognises
the directory and reads on each rank only the ranges it needs (``_sharded_load``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import collectives
import tensorlib as tl
from tensorlib import nn, optim

from . import _rng
from ._data import DataLoader
from ._sampler import check_int
from ._sharded_checkpoint import save_sharded
from ._sharded_load import load_sharded
from .fsdp import FSDPModule, full_optim_state_dict, shard_full_optim_state_dict

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT = "ddp.checkpoint/2"
_READABLE = ("ddp.checkpoint/1", FORMAT)  # format 1: model, optimizer, step, extra
_WRITER = 0


def unwrap_model(model: Any, where: str) -> nn.Module:
    """The ``nn.Module`` whose state a checkpoint holds: a DDP wrapper's ``.module``.

    A wrapper is a ``DistributedDataParallel``, or any object that is not itself an
    ``nn.Module`` but has a ``.module`` that is one. A plain ``nn.Module`` is never unwrapped,
    even when it has a child named ``module`` (its own parameters belong in the checkpoint).

    Raises:
        TypeError: when no ``nn.Module`` is found.
    """
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        try:
            from ._ddp import DistributedDataParallel
        except ImportError:
            is_ddp = False
        else:
            is_ddp = isinstance(model, DistributedDataParallel)
        if is_ddp or not isinstance(model, nn.Module):
            return inner
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where}: model must be a tensorlib nn.Module or a DistributedDataParallel "
            f"wrapping one, got {type(model)!r}"
        )
    return model


def _check_optimizer(optimizer: Any, where: str) -> optim.Optimizer | None:
    if optimizer is not None and not isinstance(optimizer, optim.Optimizer):
        raise TypeError(
            f"{where}: optimizer must be a tensorlib.optim.Optimizer or None, "
            f"got {type(optimizer)!r}"
        )
    return optimizer


def _check_stateful(where: str, name: str, obj: Any) -> Any:
    """``obj`` when it has ``state_dict()`` and ``load_state_dict()`` (or is None)."""
    if obj is not None and not (
        callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    ):
        raise TypeError(
            f"{where}: {name} must have state_dict() and load_state_dict() (an lr_scheduler, "
            f"a tl.amp.GradScaler), got {type(obj).__name__}"
        )
    return obj


def _schedulers(where: str, scheduler: Any) -> list[Any] | None:
    """One scheduler or a list/tuple of them, as a list; None for none."""
    if scheduler is None:
        return None
    items = list(scheduler) if isinstance(scheduler, list | tuple) else [scheduler]
    return [_check_stateful(where, f"scheduler[{i}]", s) for i, s in enumerate(items)]


def _check_loader(where: str, loader: Any) -> DataLoader | None:
    if loader is not None and not isinstance(loader, DataLoader):
        raise TypeError(f"{where}: loader must be a ddp.DataLoader, got {type(loader).__name__}")
    return loader


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: optim.Optimizer | None = None,
    step: int = 0,
    extra: Any = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    epoch: int = 0,
    loader: DataLoader | None = None,
    generators: Sequence[Any] = (),
    sharded: bool = False,
) -> None:
    """Save the run's state; rank 0 writes, every rank returns once it is on disk.

    Every rank of the default group must call it (it gathers the ranks' random generator
    states and synchronizes them, like a barrier). Rank 0 writes the file with
    ``tensorlib.save`` (temporary file, fsync, rename, directory fsync) after creating missing
    parent directories; the others never touch the file and wait until rank 0 reports success
    or failure. A failed write raises on every rank: on rank 0 the original error, on the
    others a RuntimeError quoting it. Call it between steps (after ``optimizer.step()``,
    ``scheduler.step()`` and ``scaler.update()``), where :func:`load_checkpoint` will resume.

    Every rank's random generators are always saved: tensorlib's default generator, NumPy's
    legacy global one (``np.random.*``), Python's ``random``, and ``generators``.

    Args:
        path: the checkpoint file (conventionally ``.npz``).
        model: an ``nn.Module``, or a ``DistributedDataParallel`` (its ``.module``'s state is
            saved, so the checkpoint loads into a plain model too).
        optimizer: its ``state_dict()`` is saved too when given.
        step: the training step (or epoch) to resume from.
        extra: more state: any nesting of dicts, lists, tuples, numbers, strings, None,
            arrays and Tensors (what ``tensorlib.save`` stores without pickle).
        scheduler: a learning-rate scheduler, or a list of them.
        scaler: a ``tl.amp.GradScaler``.
        epoch: the epoch, returned by :func:`load_checkpoint`.
        loader: a :class:`~ddp.DataLoader` whose position (epoch, batches done) is saved:
            rank 0's, the ranks moving in lockstep.
        generators: ``numpy.random.Generator`` objects the script draws from, per rank.
        sharded: write a sharded checkpoint instead: ``path`` is a directory where every
            rank writes the pieces of the model and optimizer state it holds (its
            ``fully_shard`` rows, its ``ZeroRedundancyOptimizer`` pieces, an even slice of
            what every rank holds whole) and rank 0 then writes the index; nothing is
            gathered. It loads with :func:`load_checkpoint` at any world size.

    Raises:
        TypeError: for a wrong argument type (on every rank, before any communication), or,
            on rank 0, for ``extra`` values that cannot be saved.
        ValueError: with ``sharded=True``, on every rank, when ``path`` is a file or the
            ranks hold different state.
        OSError: on rank 0 (with ``sharded=True``: on the rank) when a file cannot be written.
        RuntimeError: on the other ranks when that write failed.
    """
    where = "save_checkpoint"
    module = unwrap_model(model, where)
    optimizer = _check_optimizer(optimizer, where)
    schedulers = _schedulers(where, scheduler)
    scaler = _check_stateful(where, "scaler", scaler)
    loader = _check_loader(where, loader)
    step = check_int(where, "step", step)
    epoch = check_int(where, "epoch", epoch)
    bits = _rng.check_generators(where, generators)
    if not isinstance(sharded, bool):
        raise TypeError(f"{where}: sharded must be True or False, got {sharded!r}")
    target = Path(os.fspath(path))
    world = collectives.get_world_size()
    # Ranks draw differently (dropout, their own noise), so every rank's states are kept.
    mine = _rng.capture(bits)
    ranks = collectives.all_gather_object(mine) if world > 1 else [mine]

    def parts() -> dict[str, Any]:  # the non-tensor parts, on the writer
        return {
            "scheduler": None if schedulers is None else [s.state_dict() for s in schedulers],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "step": step,
            "epoch": epoch,
            "loader": loader.state_dict() if loader is not None else None,
            "rng": {"world_size": world, "ranks": ranks},
            "extra": extra,
        }

    if sharded:
        save_sharded(where, target, module, optimizer, parts)
    else:
        _save_consolidated(where, target, module, optimizer, parts)


def _save_consolidated(
    where: str,
    target: Path,
    module: nn.Module,
    optimizer: optim.Optimizer | None,
    parts: Callable[[], dict[str, Any]],
) -> None:
    """The single file: the state gathered (every rank), rank 0 writes, the others wait."""
    world = collectives.get_world_size()
    model_state, optimizer_state = _gathered_state(where, module, optimizer)
    if collectives.get_rank() != _WRITER:
        error = collectives.broadcast_object(None, src=_WRITER)
        if error is not None:
            raise RuntimeError(f"{where}: rank {_WRITER} failed to write {target}: {error}")
        return
    try:
        state = {
            "format": FORMAT,
            "model": model_state,
            "optimizer": (
                optimizer_state
                if optimizer_state is not None or optimizer is None
                else optimizer.state_dict()
            ),
            **parts(),
        }
        target.parent.mkdir(parents=True, exist_ok=True)
        tl.save(state, target)
    except Exception as exc:
        if world > 1:
            collectives.broadcast_object(f"{type(exc).__name__}: {exc}", src=_WRITER)
        raise
    if world > 1:
        collectives.broadcast_object(None, src=_WRITER)


def load_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: optim.Optimizer | None = None,
    map_location: str | tl.Device | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    loader: DataLoader | None = None,
    rng: bool = False,
    generators: Sequence[Any] = (),
) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` file (or sharded directory) into the objects given,
    on this rank.

    No communication: every rank reads the file itself (call it on every rank, after the
    save, once everything is built and right before the training loop). From a sharded
    checkpoint (a directory) each rank reads only the ranges of the tensors its objects
    hold at this world size (its ``fully_shard`` rows, its ``ZeroRedundancyOptimizer``
    pieces, whole tensors for what it holds whole). Values are copied
    into the existing parameters, buffers and optimizer state, which keep their devices and
    dtypes. Everything is checked before anything is changed, so a mismatch leaves the
    objects as they were.

    Random generator states are per rank and restored only at the world size they were
    saved at: there each rank gets its own back and the run continues bit for bit. At another
    world size (or from a file without them) they are left alone, a ``RuntimeWarning`` says
    so and ``rng_restored`` is False; model, optimizer, scheduler, scaler, loader position
    and step load at any world size.

    Args:
        path: the checkpoint file, or a sharded checkpoint's directory.
        model: an ``nn.Module`` or a ``DistributedDataParallel`` wrapping one; loading is
            strict (same names and shapes; dtypes that cast float to float or integer to a
            fitting integer).
        optimizer: loaded from the checkpoint when given (the checkpoint must have one).
        map_location: where the file's arrays are staged before being copied into the model
            (None: the CPU); the returned ``extra`` Tensors stay there.
        scheduler: a scheduler or a list of them, as given to :func:`save_checkpoint`.
        scaler: a ``tl.amp.GradScaler``.
        loader: a :class:`~ddp.DataLoader`: its next iteration continues the saved epoch
            where it stopped (see ``DataLoader.load_state_dict``).
        rng: restore this rank's tensorlib, NumPy and Python random generators, and
            ``generators``.
        generators: the ``numpy.random.Generator`` objects given to :func:`save_checkpoint`,
            in the same order (only with ``rng=True``).

    Returns:
        ``{"step": int, "epoch": int, "extra": ..., "rng_restored": bool}`` (arrays in
        ``extra`` come back as Tensors).

    Raises:
        FileNotFoundError: when there is nothing at ``path``, or a directory without a
            sharded checkpoint's index (no save to it has finished).
        ValueError: when the file is not a checkpoint (not a tensorlib file, no ``model``
            entry; a sharded checkpoint's index that is malformed or names a missing or
            damaged shard file), lacks a part that was asked for (optimizer,
            scheduler, scaler, loader), or does not match the model (missing/unexpected
            names, shapes, dtypes: see ``Module.load_state_dict`` for the casts allowed) or
            another part; when the file holds an array ``tensorlib.save`` never writes
            (text, complex, object); ``generators`` without ``rng=True``.
        TypeError: for a wrong argument type.
    """
    where = "load_checkpoint"
    module = unwrap_model(model, where)
    parts: dict[str, Any] = {
        "optimizer": _check_optimizer(optimizer, where),
        "scheduler": _schedulers(where, scheduler),
        "scaler": _check_stateful(where, "scaler", scaler),
        "loader": _check_loader(where, loader),
    }
    bits = _rng.check_generators(where, generators)
    if bits and not rng:
        raise ValueError(f"{where}: generators= are restored with rng=True; pass rng=True too")
    target = Path(os.fspath(path))
    if target.is_dir():
        state, commit_model, optimizer_part = load_sharded(where, target, module, map_location)
        _check_parts_present(where, target, state, parts)
        if parts["optimizer"] is not None:
            state["optimizer"], parts["optimizer"] = optimizer_part(parts["optimizer"])
    else:
        state, commit_model = _read_consolidated(where, target, module, parts, map_location)
    rank_rng = _rank_rng(where, target, state) if rng else None
    _load_parts(where, target, state, parts, rank_rng, bits)
    commit_model()
    return {
        "step": state.get("step", 0),
        "epoch": state.get("epoch", 0),
        "extra": state.get("extra"),
        "rng_restored": rank_rng is not None,
    }


def _read_consolidated(
    where: str,
    target: Path,
    module: nn.Module,
    parts: dict[str, Any],
    map_location: str | tl.Device | None,
) -> tuple[dict[str, Any], Any]:
    """A checkpoint file's state, checked against the model and the parts asked for (a
    ``fully_shard`` run's optimizer state cut to this rank's rows), and the function that
    loads its model state."""
    state = _read(where, target, map_location)
    model_state = state["model"]
    _check_model_state(module, model_state, target)
    _check_parts_present(where, target, state, parts)
    opt = parts["optimizer"]
    if opt is not None and not hasattr(opt, "consolidate_state_dict") and _is_fully_sharded(module):
        # The file holds full-shape state (as an unsharded run's optimizer has it): keep
        # this rank's rows, at this run's world size.
        try:
            state["optimizer"] = shard_full_optim_state_dict(state["optimizer"], module, opt)
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(
                f"{where}: {target}: the optimizer state does not match this optimizer: {exc}"
            ) from exc
    return state, lambda: module.load_state_dict(model_state, strict=True)


def _check_parts_present(
    where: str, target: Path, state: dict[str, Any], parts: dict[str, Any]
) -> None:
    """Every part asked for is in the file (and as many schedulers as given)."""
    for name, obj in parts.items():
        if obj is not None and state.get(name) is None:
            raise ValueError(
                f"{where}: {target} holds no {name} state (it was saved without one); call "
                f"load_checkpoint without {name}="
            )
    if parts["scheduler"] is not None and len(parts["scheduler"]) != len(state["scheduler"]):
        raise ValueError(
            f"{where}: {target} holds {len(state['scheduler'])} scheduler state(s), "
            f"scheduler= has {len(parts['scheduler'])}"
        )


def _read(where: str, target: Path, map_location: str | tl.Device | None) -> dict[str, Any]:
    """The checkpoint's top-level dict, checked to be one this module can load."""
    if not target.is_file():
        reason = "is a directory" if target.is_dir() else "does not exist"
        raise FileNotFoundError(f"{where}: {target} {reason}; nothing to load")
    try:
        state = tl.load(target, device=map_location)
    except Exception as exc:  # not a zip/npz, or a .npz without tensorlib's manifest
        raise ValueError(
            f"{where}: {target} is not a checkpoint written by save_checkpoint "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(state, dict) or "model" not in state:
        found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{where}: {target} is not a checkpoint written by save_checkpoint: it has no "
            f"'model' entry (found {found}); a bare state dict loads with "
            "model.load_state_dict(tensorlib.load(path))"
        )
    if state.get("format") not in _READABLE:
        raise ValueError(
            f"{where}: {target} has format {state.get('format')!r}, expected one of "
            f"{list(_READABLE)}"
        )
    if not isinstance(state["model"], dict):
        raise ValueError(
            f"{where}: {target}: 'model' is {type(state['model']).__name__}, not a dict"
        )
    return state


def _rank_rng(where: str, target: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's saved generator states, or None (with a warning) when they do not apply."""
    saved = state.get("rng")
    world, rank = collectives.get_world_size(), collectives.get_rank()
    if not isinstance(saved, dict):
        reason = "holds no random generator states (saved by an older version)"
    elif saved.get("world_size") != world or len(saved.get("ranks", [])) != world:
        reason = (
            f"was saved by {saved.get('world_size')} rank(s) and this job has {world}: each "
            "rank's random streams belong to its rank"
        )
    else:
        mine: dict[str, Any] = saved["ranks"][rank]
        if mine.get("cuda_generators"):
            warnings.warn(
                f"{where}: {target}: tensorlib's CUDA generators are not saved; random draws "
                "on the GPU after this resume differ from an uninterrupted run",
                RuntimeWarning,
                stacklevel=3,
            )
        return mine
    warnings.warn(
        f"{where}: {target} {reason}, so they are not restored (the model, optimizer, "
        "scheduler, scaler, loader position and step are); the run continues with other "
        "random draws than an uninterrupted one",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _load_parts(
    where: str,
    target: Path,
    state: dict[str, Any],
    parts: dict[str, Any],
    rank_rng: dict[str, Any] | None,
    bits: list[np.random.BitGenerator],
) -> None:
    """Load every part but the model; on a failure, put back what was already loaded.

    The optimizer goes last: its ``load_state_dict`` checks everything before it changes
    anything, so it needs no undo; the others are small and are undone from snapshots.
    """
    undo: list[Any] = []  # (restore function, snapshot) pairs, in load order
    name = "scheduler"
    try:
        for sched, saved in zip(
            parts["scheduler"] or [], state.get("scheduler") or [], strict=False
        ):
            undo.append((sched.load_state_dict, sched.state_dict()))
            sched.load_state_dict(saved)
        for name in ("scaler", "loader"):
            if parts[name] is not None:
                undo.append((parts[name].load_state_dict, parts[name].state_dict()))
                parts[name].load_state_dict(state[name])
        name = "random generator"
        if rank_rng is not None:
            undo.append((lambda s: _rng.restore(where, s, bits), _rng.capture(bits)))
            _rng.restore(where, rank_rng, bits)
        name = "optimizer"
        if parts["optimizer"] is not None:
            parts["optimizer"].load_state_dict(state["optimizer"])
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        for restore, snapshot in reversed(undo):
            restore(snapshot)
        raise ValueError(
            f"{where}: {target}: the {name} state does not match this {name}: {exc}"
        ) from exc


def _check_model_state(module: nn.Module, saved: dict[str, Any], target: Path) -> None:
    """Strict-load checks (names, shapes, dtypes: ``Module.load_state_dict``'s own) done up
    front, so a failure changes nothing."""
    found = module._state_dict_mismatch(saved)
    parts = []
    if found.missing:
        parts.append(f"missing from the checkpoint: {found.missing}")
    if found.unexpected:
        parts.append(f"not in the model: {found.unexpected}")
    if found.shapes:
        parts.append(f"shape mismatch: {'; '.join(found.shapes)}")
    if found.dtypes:
        parts.append(f"dtype mismatch: {'; '.join(found.dtypes)}")
    if parts:
        raise ValueError(
            f"load_checkpoint: {target} does not match {type(module).__name__}: " + "; ".join(parts)
        )


def _gathered_state(where: str, module: Any, optimizer: Any) -> tuple[Any, Any]:
    """The model's state dict, and a fully sharded model's optimizer's (else None), with every
    rank taking part in what is sharded.

    A ``fully_shard`` model's ``state_dict()`` all-gathers its full tensors, a plain optimizer
    over its shards gives its state all-gathered into full-shape arrays
    (:func:`~ddp.fsdp.full_optim_state_dict`: the plain optimizer's format for the unsharded
    model), and a ``ZeroRedundancyOptimizer`` sends its shards to the writer first:
    collectives, so every rank runs them (rank 0 alone would wait for peers already in
    ``broadcast_object``).
    """
    consolidate = getattr(optimizer, "consolidate_state_dict", None)
    model_state = module.state_dict()
    if optimizer is None:
        return model_state, None
    if consolidate is None and _is_fully_sharded(module):
        return model_state, full_optim_state_dict(module, optimizer)
    if consolidate is not None:
        consolidate(to=_WRITER)
    return model_state, None  # the writer takes the optimizer's own state_dict()


def _is_fully_sharded(module: Any) -> bool:
    return any(isinstance(m, FSDPModule) for m in module.modules())
