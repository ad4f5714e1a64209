"""Ignite's ``Checkpoint`` and ``ModelCheckpoint``: periodic state dicts, latest or best kept.

A checkpoint is one ``tensorlib.save`` file (``.npz`` with a JSON manifest, no pickle): the
``state_dict()`` of every object in ``to_save`` under its key (a single object's state dict
directly, as in Ignite). A :class:`~ddp.handlers.DiskSaver` writes it on one rank
(``save_on_rank``), atomically. :class:`Checkpoint` names the files as Ignite does
(``{prefix}_{name}_{step}.npz``, score variants), keeps the ``n_saved`` latest (or best by
score) and deletes the others, only once the new file is written: a failed save leaves the
previous checkpoints as they were.

Every rank runs the handler (and calls ``state_dict()``, which a sharded object may need on
all ranks); the handler itself communicates nothing, so no rank ever waits for another.
"""

from __future__ import annotations

import inspect
import numbers
import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import tensorlib as tl
from ddp._ddp import DistributedDataParallel
from ddp._sampler import check_int
from ddp.engine import EventEnum
from tensorlib import nn

from ._savers import EXT, BaseSaveHandler, DiskSaver, check_rank

if TYPE_CHECKING:
    from ddp.engine import Engine

__all__ = ["Checkpoint", "CheckpointEvents", "check_objects"]


class CheckpointEvents(EventEnum):
    """Events fired by :class:`Checkpoint` on the engine it runs on.

    ``SAVED_CHECKPOINT``: after a checkpoint was written (registered on first use).
    """

    SAVED_CHECKPOINT = "saved_checkpoint"


def _tree_map(fn: Callable[[Any, str], Any], x: Any, path: str) -> Any:
    """``fn(leaf, path)`` over the leaves of nested dicts, lists and tuples."""
    if isinstance(x, Mapping):
        return {k: _tree_map(fn, v, f"{path}[{k!r}]") for k, v in x.items()}
    if isinstance(x, list | tuple):
        out = [_tree_map(fn, v, f"{path}[{i}]") for i, v in enumerate(x)]
        return tuple(out) if isinstance(x, tuple) else out
    return fn(x, path)


def check_objects(where: str, objs: Mapping[str, Any], attr: str, name: str) -> None:
    def check(obj: Any, path: str) -> None:
        if not callable(getattr(obj, attr, None)):
            raise TypeError(
                f"{where}: {path} is a {type(obj).__name__}, which has no {attr}() method; "
                f"every object to checkpoint needs state_dict() and load_state_dict()"
            )

    _tree_map(check, objs, name)


def _unwrap(obj: Any) -> Any:
    """A DistributedDataParallel's module: the checkpoint holds names without ``module.``."""
    return obj.module if isinstance(obj, DistributedDataParallel) else obj


def _register_events(engine: Any) -> None:
    """Register :class:`CheckpointEvents` on ``engine`` once (Ignite's first-call rule)."""
    if not engine.has_registered_events(CheckpointEvents.SAVED_CHECKPOINT):
        engine.register_events(*CheckpointEvents)


def _accepts_metadata(handler: Callable[..., Any]) -> bool:
    if isinstance(handler, BaseSaveHandler):
        return True
    try:
        inspect.signature(handler).bind({}, "f", {})
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (a builtin): the two-argument form
        return False
    return True


class Checkpoint:
    """Save the ``state_dict()`` of objects periodically, keeping the latest or the best.

    Attach it to an engine event; each call saves ``{key: obj.state_dict()}`` for the
    objects of ``to_save`` (an engine, models, optimizers, lr schedulers, anything with
    ``state_dict``/``load_state_dict``; a ``DistributedDataParallel`` saves its module's
    state) through ``save_handler``, and removes the checkpoints beyond ``n_saved``.

    Files are named ``{filename_prefix}_{name}_{suffix}.npz`` (no prefix: ``{name}_{suffix}
    .npz``), where ``name`` is the key when ``to_save`` has one object and ``checkpoint``
    otherwise, and the suffix is, by what is given (``score_function``, ``score_name``,
    ``global_step_transform``):

    - none: ``{engine.state.iteration}``;
    - ``global_step_transform``: ``{global_step}``;
    - ``score_function``: ``{score}``, with ``global_step_transform``:
      ``{global_step}_{score}``;
    - ``score_name`` too: ``{score_name}={score}`` / ``{global_step}_{score_name}={score}``.

    The score is printed as an int, or a float with 4 decimals. ``filename_pattern``
    replaces this (fields ``{filename_prefix}``, ``{name}``, ``{score}``,
    ``{score_name}``, ``{global_step}``, ``{ext}``). A name used again overwrites its file.

    Without a score the checkpoints are ranked by global step (iteration): the ``n_saved``
    latest are kept. With one, the ``n_saved`` with the highest scores are kept, and a new
    checkpoint that would not be among them is not written at all.

    Every rank must run the handler (it does not communicate, so none waits for another);
    with a :class:`DiskSaver` (or a directory as ``save_handler``) only ``save_on_rank``
    writes and deletes. The old checkpoint is deleted only after the new one is written, so
    a failed save leaves the previous checkpoints in place and the handler's list unchanged.

    Args:
        to_save: ``{name: object}`` (values may be nested dicts/lists of objects).
        save_handler: a directory (a :class:`DiskSaver` with ``create_dir=True``,
            ``require_empty=True`` is made), a :class:`BaseSaveHandler`, or a callable
            ``fn(checkpoint, filename[, metadata])`` (which cannot delete old checkpoints).
        filename_prefix: prefix of the file names.
        score_function: ``fn(engine) -> number``; higher is better.
        score_name: the score's name in the file name; alone, it means
            ``score_function = Checkpoint.get_default_score_fn(score_name)``.
        n_saved: checkpoints kept (None: all).
        global_step_transform: ``fn(engine, event_name) -> int`` giving the global step,
            e.g. :func:`global_step_from_engine`.
        filename_pattern: a ``str.format`` pattern for the file names.
        include_self: also save this handler's :meth:`state_dict` under ``"checkpointer"``.
        greater_or_equal: a score equal to the worst kept one replaces it (default: kept
            only when strictly better).
        save_on_rank: the rank that writes.

    Raises:
        TypeError: for ``to_save`` not a dict, an object without ``state_dict``, a
            ``save_handler`` of the wrong kind, a ``global_step_transform`` that is not
            callable, ``include_self`` with an immutable ``to_save``.
        ValueError: for ``n_saved < 1``, ``include_self`` with a ``"checkpointer"`` key.

    Example:
        >>> to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
        >>> handler = Checkpoint(to_save, "/tmp/run", n_saved=2)
        >>> trainer.add_event_handler(Events.ITERATION_COMPLETED(every=1000), handler)
    """

    SAVED_CHECKPOINT = CheckpointEvents.SAVED_CHECKPOINT

    class Item(NamedTuple):
        """A kept checkpoint: its priority (score or step) and file name."""

        priority: int | float
        filename: str

    def __init__(
        self,
        to_save: Mapping[str, Any],
        save_handler: str | os.PathLike[str] | Callable[..., Any] | BaseSaveHandler,
        filename_prefix: str = "",
        score_function: Callable[[Any], int | float] | None = None,
        score_name: str | None = None,
        n_saved: int | None = 1,
        global_step_transform: Callable[[Any, Any], int] | None = None,
        filename_pattern: str | None = None,
        include_self: bool = False,
        greater_or_equal: bool = False,
        save_on_rank: int = 0,
    ) -> None:
        where = type(self).__name__
        if not isinstance(to_save, Mapping):
            raise TypeError(f"{where}: to_save must be a dict of objects, got {type(to_save)}")
        check_objects(where, to_save, "state_dict", "to_save")
        if include_self:
            if not isinstance(to_save, MutableMapping):
                raise TypeError(
                    f"{where}: with include_self=True to_save must be mutable, got {type(to_save)}"
                )
            if "checkpointer" in to_save:
                raise ValueError(
                    f"{where}: to_save cannot have the key 'checkpointer' with include_self=True "
                    "(the handler's own state goes there)"
                )
        save_on_rank = check_rank(where, save_on_rank)
        if isinstance(save_handler, str | os.PathLike):
            save_handler = DiskSaver(save_handler, create_dir=True, save_on_rank=save_on_rank)
        elif not callable(save_handler):
            raise TypeError(
                f"{where}: save_handler must be a directory (str or Path), a BaseSaveHandler or "
                f"a callable, got {type(save_handler)}"
            )
        if global_step_transform is not None and not callable(global_step_transform):
            raise TypeError(
                f"{where}: global_step_transform must be a function, "
                f"got {type(global_step_transform)}"
            )
        if score_function is not None and not callable(score_function):
            raise TypeError(f"{where}: score_function must be a function, got {score_function!r}")
        if n_saved is not None:
            n_saved = check_int(where, "n_saved", n_saved)
            if n_saved < 1:
                raise ValueError(
                    f"{where}: n_saved must be a positive integer or None, got {n_saved}"
                )
        self.to_save = to_save
        self.filename_prefix = filename_prefix
        self.save_handler = save_handler
        self.score_function = score_function
        self.score_name = score_name
        if score_name is not None and score_function is None:
            self.score_function = self.get_default_score_fn(score_name)
        self.n_saved = n_saved
        self.ext = EXT
        self.global_step_transform = global_step_transform
        self.filename_pattern = filename_pattern
        self.include_self = include_self
        self.greater_or_equal = greater_or_equal
        self.save_on_rank = save_on_rank
        self._saved: list[Checkpoint.Item] = []

    # ------------------------------------------------------------------ saving
    @property
    def last_checkpoint(self) -> str | Path | None:
        """The latest kept checkpoint: its path with a :class:`DiskSaver`, else its name."""
        if not self._saved:
            return None
        if isinstance(self.save_handler, DiskSaver):
            return self.save_handler.dirname / self._saved[-1].filename
        return self._saved[-1].filename

    def reset(self) -> None:
        """Forget the kept checkpoints (their files stay), e.g. before another ``run``."""
        self._saved = []

    def _lt_n_saved(self, saved: list[Checkpoint.Item]) -> bool:
        return self.n_saved is None or len(saved) < self.n_saved

    def _better(self, priority: int | float) -> bool:
        worst = self._saved[0].priority
        return bool(priority >= worst if self.greater_or_equal else priority > worst)

    def _get_filename_pattern(self, global_step: Any) -> str:
        if self.filename_pattern is not None:
            return self.filename_pattern
        return self.setup_filename_pattern(
            with_prefix=len(self.filename_prefix) > 0,
            with_score=self.score_function is not None,
            with_score_name=self.score_name is not None,
            with_global_step=global_step is not None,
        )

    def __call__(self, engine: Engine, *args: Any, **kwargs: Any) -> None:
        """Save a checkpoint when it ranks among the ``n_saved`` kept ones; drop the worst.

        Raises:
            ValueError: when ``score_function`` returns something that is not a number.
        """
        where = type(self).__name__
        _register_events(engine)
        global_step = None
        if self.global_step_transform is not None:
            global_step = self.global_step_transform(engine, engine.last_event_name)
        if self.score_function is not None:
            priority = self.score_function(engine)
            if not isinstance(priority, numbers.Number):
                raise ValueError(
                    f"{where}: the output of score_function should be a number, got "
                    f"{type(priority).__name__} {priority!r}"
                )
        else:
            if global_step is None:
                global_step = engine.state.iteration
            priority = global_step
        if not (self._lt_n_saved(self._saved) or self._better(priority)):
            return
        checkpoint = self._setup_checkpoint()
        name = next(iter(checkpoint)) if len(checkpoint) == 1 else "checkpoint"
        if len(checkpoint) == 1 and not self.include_self:
            checkpoint = checkpoint[name]  # a single object's state dict, as in Ignite
        text = f"{priority}" if isinstance(priority, numbers.Integral) else f"{priority:.4f}"
        filename = self._get_filename_pattern(global_step).format(
            filename_prefix=self.filename_prefix,
            ext=self.ext,
            name=name,
            score_name=self.score_name,
            score=text if self.score_function is not None else None,
            global_step=global_step,
        )
        metadata = {
            "basename": f"{self.filename_prefix}{'_' if self.filename_prefix else ''}{name}",
            "score_name": self.score_name,
            "priority": priority,
        }
        # The list as it will be once this file is written; committed only then.
        saved = list(self._saved)
        same = [i for i, item in enumerate(saved) if item.filename == filename]
        drop = None
        if same:
            saved.pop(same[0])  # the new file replaces it under the same name
        elif not self._lt_n_saved(saved):
            drop = saved.pop(0).filename
        saved.append(Checkpoint.Item(priority, filename))
        saved.sort(key=lambda item: item.priority)
        if self.include_self:
            checkpoint["checkpointer"] = {"_saved": [tuple(item) for item in saved]}
        if _accepts_metadata(self.save_handler):
            self.save_handler(checkpoint, filename, metadata)
        else:
            self.save_handler(checkpoint, filename)
        self._saved = saved
        if drop is not None and isinstance(self.save_handler, BaseSaveHandler):
            self.save_handler.remove(drop)
        engine.fire_event(CheckpointEvents.SAVED_CHECKPOINT)

    def _setup_checkpoint(self) -> dict[str, Any]:
        return dict(_tree_map(lambda obj, _: _unwrap(obj).state_dict(), self.to_save, "to_save"))

    # ------------------------------------------------------------------ loading
    @staticmethod
    def load_objects(
        to_load: Mapping[str, Any],
        checkpoint: str | os.PathLike[str] | Mapping[str, Any],
        **kwargs: Any,
    ) -> None:
        """Load states into the objects of ``to_load`` (``obj.load_state_dict(state)``).

        Args:
            to_load: ``{name: object}``, as given to ``Checkpoint`` (a
                ``DistributedDataParallel`` loads into its module).
            checkpoint: a checkpoint file's path (read with ``tensorlib.load``) or a dict of
                state dicts. With one object in ``to_load``, a file or dict holding that
                object's state dict directly (as :class:`Checkpoint` writes it) works too.
            kwargs: keyword arguments of ``nn.Module.load_state_dict`` (``strict=False``),
                given to the models only.

        Raises:
            TypeError: when ``checkpoint`` is neither a path nor a dict, or an object has no
                ``load_state_dict``.
            FileNotFoundError: when there is no file at the path.
            ValueError: when a key of ``to_load`` is missing from the checkpoint (checked for
                every key before anything is loaded).
        """
        where = "Checkpoint.load_objects"
        if not isinstance(checkpoint, Mapping | str | os.PathLike):
            raise TypeError(
                f"{where}: checkpoint must be a path or a dict of state dicts, "
                f"got {type(checkpoint)}"
            )
        check_objects(where, to_load, "load_state_dict", "to_load")
        if isinstance(checkpoint, str | os.PathLike):
            path = Path(checkpoint)
            if not path.is_file():
                raise FileNotFoundError(f"{where}: no checkpoint file at {path}")
            state: Any = tl.load(path)
        else:
            state = checkpoint
        if not isinstance(state, Mapping):
            raise ValueError(f"{where}: the checkpoint holds a {type(state).__name__}, not a dict")
        if len(to_load) == 1:
            key, obj = next(iter(to_load.items()))
            if key not in state:  # the file holds this object's state dict directly
                _load_object(obj, state, kwargs)
                return
        pairs: list[tuple[Any, Any]] = []
        _pair_up(dict(to_load), state, "to_load", pairs)
        for obj, obj_state in pairs:
            _load_object(obj, obj_state, kwargs)

    def reload_objects(
        self,
        to_load: Mapping[str, Any],
        load_kwargs: dict[str, Any] | None = None,
        **filename_components: Any,
    ) -> None:
        """Load the checkpoint this handler names by ``filename_components`` into ``to_load``.

        Args:
            to_load: ``{name: object}``.
            load_kwargs: keyword arguments of ``nn.Module.load_state_dict``.
            filename_components: ``name``, ``score``, ``global_step`` of the file name.

        Raises:
            AttributeError: when ``save_handler`` is not a :class:`DiskSaver`.
        """
        if not isinstance(self.save_handler, DiskSaver):
            raise AttributeError(
                f"Checkpoint.reload_objects: save_handler should be a DiskSaver, "
                f"got {type(self.save_handler)}"
            )
        global_step = filename_components.get("global_step")
        keys = list(self.to_save)
        name = keys[0] if len(keys) == 1 else "checkpoint"
        filename = self._get_filename_pattern(global_step).format(
            filename_prefix=self.filename_prefix,
            ext=self.ext,
            name=filename_components.get("name", name),
            score_name=self.score_name,
            score=filename_components.get("score"),
            global_step=global_step,
        )
        path = self.save_handler.dirname / filename
        Checkpoint.load_objects(to_load, path, **(load_kwargs or {}))

    # ------------------------------------------------------------------ own state
    def state_dict(self) -> dict[str, Any]:
        """``{"_saved": [(priority, filename), ...]}``: the kept checkpoints, worst first."""
        return {"_saved": [(p, f) for p, f in self._saved]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take over the kept checkpoints of :meth:`state_dict` (e.g. from a resumed run).

        Raises:
            TypeError: when ``state_dict`` is not a dict.
            ValueError: when it has no ``"_saved"`` list of ``(priority, filename)`` pairs.
        """
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}: state_dict must be a dict, got {type(state_dict)}")
        if "_saved" not in state_dict:
            raise ValueError(
                f"{where}: required state attribute '_saved' is absent in the state_dict "
                f"(keys {list(state_dict)})"
            )
        items = state_dict["_saved"]
        if not isinstance(items, list | tuple) or not all(
            isinstance(it, list | tuple) and len(it) == 2 for it in items
        ):
            raise ValueError(f"{where}: '_saved' must be a list of (priority, filename) pairs")
        self._saved = [Checkpoint.Item(_number(p), str(f)) for p, f in items]

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def get_default_score_fn(metric_name: str, score_sign: float = 1.0) -> Callable[[Any], float]:
        """``fn(engine) = score_sign * engine.state.metrics[metric_name]``.

        Args:
            metric_name: the metric's name in ``engine.state.metrics``.
            score_sign: 1.0, or -1.0 for a metric where lower is better (a loss).

        Raises:
            ValueError: for another ``score_sign``.
        """
        if score_sign not in (1.0, -1.0):
            raise ValueError("Argument score_sign should be 1 or -1")

        def wrapper(engine: Any) -> float:
            return score_sign * engine.state.metrics[metric_name]

        return wrapper

    @staticmethod
    def setup_filename_pattern(
        with_prefix: bool = True,
        with_score: bool = True,
        with_score_name: bool = True,
        with_global_step: bool = True,
    ) -> str:
        """The default file-name pattern for these parts.

        Example:
            >>> Checkpoint.setup_filename_pattern()
            '{filename_prefix}_{name}_{global_step}_{score_name}={score}.{ext}'

        Raises:
            ValueError: with neither score nor global step, or a score name without a score.
        """
        if not (with_global_step or with_score):
            raise ValueError("At least one of with_score and with_global_step should be True.")
        if with_score_name and not with_score:
            raise ValueError("If with_score_name is True, with_score should be also True")
        pattern = "{name}"
        if with_global_step:
            pattern += "_{global_step}"
        if with_score_name:
            pattern += "_{score_name}={score}"
        elif with_score:
            pattern += "_{score}"
        if with_prefix:
            pattern = "{filename_prefix}_" + pattern
        return pattern + ".{ext}"


def _number(value: Any) -> int | float:
    """A priority read back from a file: a number (a 0-d Tensor as its value)."""
    if isinstance(value, tl.Tensor):
        value = value.item()
    if not isinstance(value, numbers.Number) or isinstance(value, complex):
        raise ValueError(f"Checkpoint.load_state_dict: a priority must be a number, got {value!r}")
    return value  # type: ignore[return-value]


def _pair_up(objs: Any, state: Any, path: str, out: list[tuple[Any, Any]]) -> None:
    """(object, its state) for every leaf of ``objs``; raises before anything is loaded."""
    if isinstance(objs, dict) and isinstance(state, Mapping):
        for k, v in objs.items():
            if k not in state:
                raise ValueError(
                    f"Checkpoint.load_objects: key {k!r} of {path} is not in the checkpoint "
                    f"(it has {list(state)})"
                )
            _pair_up(v, state[k], f"{path}[{k!r}]", out)
    elif isinstance(objs, list) and isinstance(state, list | tuple):
        if len(objs) != len(state):
            raise ValueError(
                f"Checkpoint.load_objects: {path} has {len(objs)} objects, the checkpoint "
                f"{len(state)}"
            )
        for i, (v, s) in enumerate(zip(objs, state, strict=True)):
            _pair_up(v, s, f"{path}[{i}]", out)
    else:
        out.append((objs, state))


def _load_object(obj: Any, state: Any, kwargs: dict[str, Any]) -> None:
    obj = _unwrap(obj)
    if isinstance(obj, nn.Module):
        obj.load_state_dict(state, **kwargs)
    else:
        obj.load_state_dict(state)
