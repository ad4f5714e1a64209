"""Checkpoints of model, optimizer and step: written by rank 0 atomically, loaded everywhere.

A checkpoint is a ``tensorlib.save`` file (``.npz`` with a JSON manifest, no pickle) holding
``{"format", "model", "optimizer", "step", "extra"}``. ``tensorlib.save`` writes to a temporary
file, fsyncs it, renames it and fsyncs the directory, so the path never names a half-written
file, even after a power loss (and it removes what writers killed mid-save left); in a job of
several ranks only rank 0 writes, and the other ranks wait for it inside
:func:`save_checkpoint`, so a rank that reads the checkpoint right after saving it finds it
complete. The path must be visible to every rank that loads it (one host, or a shared
filesystem).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import collectives
import tensorlib as tl
from tensorlib import nn, optim

from ._sampler import check_int

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT = "ddp.checkpoint/1"
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


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: optim.Optimizer | None = None,
    step: int = 0,
    extra: Any = None,
) -> None:
    """Save model, optimizer and step; rank 0 writes, every rank returns once it is on disk.

    Every rank of the default group must call it (it synchronizes them, like a barrier). Rank
    0 writes the file with ``tensorlib.save`` (temporary file, fsync, rename, directory fsync)
    after creating missing parent directories; the others never touch the file and wait until
    rank 0 reports success or failure. A failed write raises on every rank: on rank 0 the
    original error, on the others a RuntimeError quoting it.

    Args:
        path: the checkpoint file (conventionally ``.npz``).
        model: an ``nn.Module``, or a ``DistributedDataParallel`` (its ``.module``'s state is
            saved, so the checkpoint loads into a plain model too).
        optimizer: its ``state_dict()`` is saved too when given.
        step: the training step (or epoch) to resume from.
        extra: more state: any nesting of dicts, lists, tuples, numbers, strings, None,
            arrays and Tensors (what ``tensorlib.save`` stores without pickle).

    Raises:
        TypeError: for a wrong ``model``/``optimizer``/``step`` type (on every rank, before
            any communication), or, on rank 0, for ``extra`` values that cannot be saved.
        OSError: on rank 0 when the file cannot be written.
        RuntimeError: on the other ranks when rank 0 failed to write.
    """
    where = "save_checkpoint"
    module = unwrap_model(model, where)
    optimizer = _check_optimizer(optimizer, where)
    step = check_int(where, "step", step)
    target = Path(os.fspath(path))
    world = collectives.get_world_size()
    if collectives.get_rank() != _WRITER:
        error = collectives.broadcast_object(None, src=_WRITER)
        if error is not None:
            raise RuntimeError(f"{where}: rank {_WRITER} failed to write {target}: {error}")
        return
    try:
        state = {
            "format": FORMAT,
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "step": step,
            "extra": extra,
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
) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` file into ``model`` (and ``optimizer``) on this rank.

    No communication: every rank reads the file itself (call it on every rank, after the
    save). Values are copied into the existing parameters, buffers and optimizer state, which
    keep their devices and dtypes. Everything is checked before anything is changed, so a
    mismatch leaves the model and optimizer as they were.

    Args:
        path: the checkpoint file.
        model: an ``nn.Module`` or a ``DistributedDataParallel`` wrapping one; loading is
            strict (same names and shapes).
        optimizer: loaded from the checkpoint when given (the checkpoint must have one).
        map_location: where the file's arrays are staged before being copied into the model
            (None: the CPU); the returned ``extra`` Tensors stay there.

    Returns:
        ``{"step": int, "extra": ...}`` as saved (arrays in ``extra`` come back as Tensors).

    Raises:
        FileNotFoundError: when there is no file at ``path``.
        ValueError: when the file is not a checkpoint (not a tensorlib file, no ``model``
            entry), has no optimizer state but ``optimizer`` was given, or does not match the
            model (missing/unexpected names, shapes) or the optimizer.
        TypeError: for a wrong ``model``/``optimizer`` type.
    """
    where = "load_checkpoint"
    module = unwrap_model(model, where)
    optimizer = _check_optimizer(optimizer, where)
    target = Path(os.fspath(path))
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
    if state.get("format") != FORMAT:
        raise ValueError(
            f"{where}: {target} has format {state.get('format')!r}, expected {FORMAT!r}"
        )
    model_state = state["model"]
    if not isinstance(model_state, dict):
        raise ValueError(f"{where}: {target}: 'model' is {type(model_state).__name__}, not a dict")
    _check_model_state(module, model_state, target)
    if optimizer is not None:
        if state.get("optimizer") is None:
            raise ValueError(
                f"{where}: {target} holds no optimizer state (it was saved without an "
                "optimizer); call load_checkpoint without optimizer="
            )
        try:
            # Checks every group and shape before changing anything.
            optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(
                f"{where}: {target}: the optimizer state does not match this optimizer: {exc}"
            ) from exc
    module.load_state_dict(model_state, strict=True)
    return {"step": state.get("step", 0), "extra": state.get("extra")}


def _check_model_state(module: nn.Module, saved: dict[str, Any], target: Path) -> None:
    """Strict-load checks (names, shapes) done up front, so a failure changes nothing."""
    own = module.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [
        f"{k}: checkpoint {tuple(getattr(saved[k], 'shape', ()))} vs model {t.shape}"
        for k, t in own.items()
        if k in saved and tuple(getattr(saved[k], "shape", ())) != tuple(t.shape)
    ]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        parts.append(f"not in the model: {unexpected}")
    if shapes:
        parts.append(f"shape mismatch: {'; '.join(shapes)}")
    raise ValueError(
        f"load_checkpoint: {target} does not match {type(module).__name__}: " + "; ".join(parts)
    )
