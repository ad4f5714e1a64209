"""Ignite's ``ModelCheckpoint``: a :class:`~ddp.handlers.Checkpoint` to a directory whose
objects are given when it is attached (``add_event_handler(event, handler, to_save)``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._checkpoint import Checkpoint, check_objects
from ._savers import DiskSaver

if TYPE_CHECKING:
    from ddp.engine import Engine

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(Checkpoint):
    """A :class:`Checkpoint` to disk whose objects are given at attach time.

    ``handler = ModelCheckpoint(dirname, prefix, n_saved=2)`` then
    ``trainer.add_event_handler(Events.EPOCH_COMPLETED, handler, {"model": model})``.

    Args:
        dirname: the directory of the checkpoints.
        filename_prefix: prefix of the file names.
        score_function, score_name, n_saved, global_step_transform, filename_pattern,
            include_self, greater_or_equal, save_on_rank: as for :class:`Checkpoint`.
        atomic, require_empty, create_dir: as for :class:`DiskSaver`.
    """

    def __init__(
        self,
        dirname: str | os.PathLike[str],
        filename_prefix: str = "",
        score_function: Callable[[Any], int | float] | None = None,
        score_name: str | None = None,
        n_saved: int | None = 1,
        atomic: bool = True,
        require_empty: bool = True,
        create_dir: bool = True,
        global_step_transform: Callable[[Any, Any], int] | None = None,
        filename_pattern: str | None = None,
        include_self: bool = False,
        greater_or_equal: bool = False,
        save_on_rank: int = 0,
    ) -> None:
        disk_saver = DiskSaver(
            dirname,
            atomic=atomic,
            create_dir=create_dir,
            require_empty=require_empty,
            save_on_rank=save_on_rank,
        )
        super().__init__(
            to_save={},
            save_handler=disk_saver,
            filename_prefix=filename_prefix,
            score_function=score_function,
            score_name=score_name,
            n_saved=n_saved,
            global_step_transform=global_step_transform,
            filename_pattern=filename_pattern,
            include_self=include_self,
            greater_or_equal=greater_or_equal,
            save_on_rank=save_on_rank,
        )

    @property
    def last_checkpoint(self) -> Path | None:
        """The path of the latest kept checkpoint."""
        if not self._saved:
            return None
        if not isinstance(self.save_handler, DiskSaver):
            raise RuntimeError(
                "ModelCheckpoint: save_handler should be the DiskSaver it was built with, "
                f"got {type(self.save_handler)}"
            )
        return self.save_handler.dirname / self._saved[-1].filename

    def __call__(self, engine: Engine, to_save: Mapping[str, Any]) -> None:
        """Save ``to_save`` as :class:`Checkpoint` does.

        Raises:
            RuntimeError: when ``to_save`` is empty.
            TypeError: for an object without ``state_dict``.
        """
        if len(to_save) == 0:
            raise RuntimeError("ModelCheckpoint: no objects to checkpoint found (to_save is empty)")
        check_objects("ModelCheckpoint", to_save, "state_dict", "to_save")
        if self.include_self and "checkpointer" in to_save:
            raise ValueError(
                "ModelCheckpoint: to_save cannot have the key 'checkpointer' with "
                "include_self=True (the handler's own state goes there)"
            )
        self.to_save = to_save
        super().__call__(engine)
