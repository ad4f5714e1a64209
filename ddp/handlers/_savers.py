"""Where :class:`~ddp.handlers.Checkpoint` puts checkpoints: ``BaseSaveHandler`` and
``DiskSaver``, which writes ``tensorlib.save`` files on one rank.

``tensorlib.save`` writes to a temporary file in the target's directory, fsyncs it, renames it
over the target and fsyncs the directory: the checkpoint's name never shows a half-written
file, even after a crash, and a failed write leaves the previous file of that name.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tensorlib as tl
from ddp import idist
from ddp._sampler import check_int

__all__ = ["EXT", "BaseSaveHandler", "DiskSaver", "check_rank"]

EXT = "npz"  # tensorlib.save's format; Ignite's files are torch.save's ``.pt``


class BaseSaveHandler(ABC):
    """Where :class:`Checkpoint` puts its checkpoints: ``__call__`` saves, ``remove`` deletes.

    Both are called on every rank; an implementation decides which rank acts (a shared
    filesystem wants one writer) and must not wait for the other ranks there, unless every
    rank runs the same handler at the same events.
    """

    @abstractmethod
    def __call__(
        self,
        checkpoint: Mapping[str, Any],
        filename: str,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Save ``checkpoint`` under ``filename``.

        Args:
            checkpoint: the state dicts to save.
            filename: the file's name (no directory).
            metadata: ``{"basename", "score_name", "priority"}``: the prefix and object name
                (``best_model``), the score's name, and the checkpoint's priority.
        """

    @abstractmethod
    def remove(self, filename: str) -> None:
        """Delete the checkpoint saved under ``filename``."""


def check_rank(where: str, save_on_rank: Any) -> int:
    """``save_on_rank`` as an int >= 0 (TypeError/ValueError otherwise)."""
    return check_int(where, "save_on_rank", save_on_rank, 0)


def _check_writer_exists(where: str, save_on_rank: int) -> None:
    """Raise on every rank when no rank would write (the check needs the live world size)."""
    world = idist.get_world_size()
    if save_on_rank >= world:
        raise ValueError(
            f"{where}: save_on_rank={save_on_rank} but the world has {world} rank(s) "
            f"(0..{world - 1}); no rank would write the checkpoint"
        )


class DiskSaver(BaseSaveHandler):
    """Save checkpoints as ``tensorlib.save`` files in ``dirname``, on rank ``save_on_rank``.

    Args:
        dirname: the directory of the checkpoints (``~`` expanded). It must be visible to
            every rank that loads them (one host, or a shared filesystem).
        atomic: accepted for Ignite's signature. ``tensorlib.save`` always writes
            atomically (temporary file in ``dirname``, fsync, rename, directory fsync), so
            ``False`` writes the same way: it never leaves a damaged file either.
        create_dir: create ``dirname`` (and its parents) when missing.
        require_empty: refuse a ``dirname`` that already holds ``.npz`` files (checkpoints
            of another run would be mixed with this one's and might be overwritten).
        save_on_rank: the rank that writes and deletes; the others do nothing.

    Raises:
        ValueError: (on the writing rank) when ``dirname`` is missing and ``create_dir`` is
            False, is not a directory, or holds ``.npz`` files and ``require_empty`` is True.
        TypeError: when ``save_on_rank`` is not an int.
    """

    def __init__(
        self,
        dirname: str | os.PathLike[str],
        atomic: bool = True,
        create_dir: bool = True,
        require_empty: bool = True,
        save_on_rank: int = 0,
    ) -> None:
        self.dirname = Path(dirname).expanduser()
        self._atomic = bool(atomic)
        self.save_on_rank = check_rank("DiskSaver", save_on_rank)
        if idist.get_rank() == self.save_on_rank:
            self._check_and_setup(self.dirname, create_dir, require_empty)

    @staticmethod
    def _check_and_setup(dirname: Path, create_dir: bool, require_empty: bool) -> None:
        if create_dir:
            dirname.mkdir(parents=True, exist_ok=True)
        if not dirname.is_dir():
            what = "is not a directory" if dirname.exists() else "is not found"
            raise ValueError(f"DiskSaver: directory path '{dirname}' {what}")
        if require_empty:
            # tensorlib.save's temporary files (".tmp-...npz") are not checkpoints.
            matched = sorted(
                name
                for name in os.listdir(dirname)
                if name.endswith(f".{EXT}") and not name.startswith(".tmp-")
            )
            if matched:
                raise ValueError(
                    f"DiskSaver: files {matched} with extension '.{EXT}' are already present "
                    f"in the directory {dirname}. If you want to use this directory anyway, "
                    "pass `require_empty=False`."
                )

    def __call__(
        self,
        checkpoint: Mapping[str, Any],
        filename: str,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Write ``checkpoint`` to ``dirname/filename`` on ``save_on_rank``; elsewhere nothing.

        Raises:
            ValueError: (every rank) when ``save_on_rank`` is not a rank of this world.
            TypeError: (writing rank) for values ``tensorlib.save`` cannot store.
            OSError: (writing rank) when the file cannot be written; a previous file of that
                name is kept.
        """
        _check_writer_exists("DiskSaver", self.save_on_rank)
        if idist.get_rank() == self.save_on_rank:
            tl.save(dict(checkpoint), self.dirname / filename)

    def remove(self, filename: str) -> None:
        """Delete ``dirname/filename`` on ``save_on_rank`` (already gone: nothing to do)."""
        if idist.get_rank() == self.save_on_rank:
            (self.dirname / filename).unlink(missing_ok=True)
