"""``Engine``: Ignite's event loop, one ``_run_once_on_dataset`` plus ``_fire_event``.

A run fires STARTED, then for each epoch EPOCH_STARTED, per batch GET_BATCH_STARTED/COMPLETED
and ITERATION_STARTED/COMPLETED around ``process_function(engine, batch)``, EPOCH_COMPLETED,
and at the end COMPLETED; handlers are called with the engine (when they take it) and their
own extra arguments. ``terminate()``/``terminate_epoch()`` end the run/epoch at the next event
boundary. A second ``run`` after the first ended starts afresh; after ``terminate()`` or
``load_state_dict`` it resumes where the state says.

Differences from Ignite, each because a distributed user needs it:

- Resuming mid-epoch skips the batches the epoch had already done (Ignite restarts the data
  and shortens the epoch), so a resumed run equals an uninterrupted one; data with
  ``set_epoch`` (``ddp.DataLoader``, ``DistributedSampler``) gets ``set_epoch(epoch - 1)``
  each time an epoch's iteration starts, as Ignite's ``setup_common_training_handlers``
  does, so shuffling differs per epoch without a handler.
- An exception from a handler or the process function carries a note naming where it was
  raised (the handler and event, or the process function and iteration) when it propagates.
- ``run(..., seed=s)`` reseeds tensorlib's generator to ``s + iteration`` before each
  iteration, so random ops (dropout) replay exactly after a resume.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import tensorlib as tl

from .._data import DataLoader
from ._dispatch import ControlFlow, EventsDispatcher, note
from ._events import Events, check_signature
from ._state import State

__all__ = ["Engine"]


class _Terminate(ControlFlow):
    pass


class _TerminateEpoch(ControlFlow):
    pass


class Engine(EventsDispatcher):
    """Run ``process_function(engine, batch)`` over data for some epochs, firing events.

    Args:
        process_function: called for every batch; what it returns is ``state.output``.

    Example:
        >>> trainer = Engine(lambda engine, batch: step(batch))
        >>> @trainer.on(Events.EPOCH_COMPLETED)
        ... def log(engine): print(engine.state.epoch, engine.state.output)
        >>> trainer.run(loader, max_epochs=3)
    """

    _state_dict_all_req_keys = ("epoch_length",)
    _state_dict_one_of_opt_keys = (("iteration", "epoch"), ("max_epochs", "max_iters"))

    def __init__(self, process_function: Callable[[Engine, Any], Any]) -> None:
        if not callable(process_function):
            raise TypeError(
                f"Engine: process_function must be callable (engine, batch) -> output, got "
                f"{type(process_function).__name__}"
            )
        super().__init__()
        check_signature(process_function, "process_function", self, None)
        self._process_function = process_function
        self.should_terminate: bool | str = False
        self.should_terminate_single_epoch: bool | str = False
        self._state_dict_user_keys: list[str] = []
        self._dataloader_iter: Iterator[Any] | None = None
        self._init_iter: int | None = None

    # ------------------------------------------------------------------ control
    def terminate(self, skip_completed: bool = False) -> None:
        """End the run after the current event (TERMINATE fires, then COMPLETED unless
        ``skip_completed``); a later ``run`` resumes from here."""
        self.logger.info(
            "Terminate signaled. Engine will stop after current iteration is finished."
        )
        self.should_terminate = "skip_completed" if skip_completed else True

    def terminate_epoch(self, skip_epoch_completed: bool = False) -> None:
        """End the current epoch after the current event (TERMINATE_SINGLE_EPOCH fires, then
        EPOCH_COMPLETED unless ``skip_epoch_completed``); the run goes on with the next."""
        self.logger.info(
            "Terminate current epoch is signaled. Current epoch iteration will stop after "
            "current iteration is finished."
        )
        self.should_terminate_single_epoch = (
            "skip_epoch_completed" if skip_epoch_completed else True
        )

    def _maybe_terminate(self) -> None:
        if self.should_terminate:
            raise _Terminate()
        if self.should_terminate_single_epoch:
            raise _TerminateEpoch()

    # ------------------------------------------------------------------ state
    @property
    def state_dict_user_keys(self) -> list[str]:
        """Extra ``State`` attributes that :meth:`state_dict` saves (append names to it)."""
        return self._state_dict_user_keys

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch_length", "max_epochs" or "max_iters", "iteration", *user keys}``: what a
        checkpoint needs to resume the run."""
        keys: list[str] = [
            "epoch_length",
            "max_iters" if self.state.max_epochs is None else "max_epochs",
            "iteration",
        ]
        keys += self._state_dict_user_keys
        return {k: getattr(self.state, k) for k in keys}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set the state from :meth:`state_dict`; the next ``run`` resumes from it.

        Raises:
            ValueError: when required keys are missing or both of a pair are given.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"Argument state_dict should be a dictionary, but given {type(state_dict)}"
            )
        for k in (*self._state_dict_all_req_keys, *self._state_dict_user_keys):
            if k not in state_dict:
                raise ValueError(
                    f"Required state attribute '{k}' is absent in provided state_dict "
                    f"'{list(state_dict)}'"
                )
        for pair in self._state_dict_one_of_opt_keys:
            given = [k for k in pair if k in state_dict and state_dict[k] is not None]
            if len(given) != 1:
                raise ValueError(
                    f"state_dict should contain only one of '{pair}' keys, got {list(state_dict)}"
                )
        for k in self._state_dict_user_keys:
            setattr(self.state, k, state_dict[k])
        s = self.state
        s.epoch_length = _opt_int(state_dict["epoch_length"])
        s.max_epochs = _opt_int(state_dict.get("max_epochs"))
        s.max_iters = _opt_int(state_dict.get("max_iters"))
        if state_dict.get("iteration") is not None:
            s.iteration = int(state_dict["iteration"])
            s.epoch = 0 if s.epoch_length is None else s.iteration // s.epoch_length
        else:
            if s.epoch_length is None:
                raise ValueError(
                    "If epoch is provided in the state dict, epoch_length should not be None."
                )
            s.epoch = int(state_dict["epoch"])
            s.iteration = s.epoch_length * s.epoch
        self._init_iter = None
        self._dataloader_iter = None

    def set_data(self, data: Iterable[Any]) -> None:
        """Run on other data from the next batch on (same epoch length; e.g. a new split).

        Raises:
            TypeError: when ``data`` is not iterable.
        """
        if not isinstance(data, Iterable):
            raise TypeError(f"Argument data should be iterable, got {type(data).__name__}")
        self.state.dataloader = data
        self._dataloader_iter = iter(data)

    # ------------------------------------------------------------------ running
    def run(
        self,
        data: Iterable[Any] | None = None,
        max_epochs: int | None = None,
        epoch_length: int | None = None,
        max_iters: int | None = None,
        seed: int | None = None,
    ) -> State:
        """Run over ``data`` (or ``epoch_length`` Nones) for ``max_epochs`` epochs (or
        ``max_iters`` iterations); resume if a previous run was cut short.

        Args:
            data: an iterable of batches (re-iterated each epoch).
            max_epochs: epochs to run (1 by default for a new run).
            epoch_length: iterations per epoch (``len(data)`` by default).
            max_iters: iterations to run instead of ``max_epochs``.
            seed: reseed tensorlib's generator to ``seed + iteration`` before each iteration.

        Returns:
            The engine's state.

        Raises:
            ValueError: for empty data, both ``max_epochs`` and ``max_iters``, a ``max_epochs``
                below the epoch to resume from, or another ``epoch_length`` than the state's.
            TypeError: when ``data`` is not iterable.
        """
        if data is not None and not isinstance(data, Iterable):
            raise TypeError(f"Argument data should be iterable, got {type(data).__name__}")
        if max_epochs is not None and max_iters is not None:
            raise ValueError(
                "Arguments max_iters and max_epochs are mutually exclusive. Please provide only "
                "max_epochs or max_iters."
            )
        s = self.state
        if s.max_epochs is None or self._is_done(s):
            if epoch_length is None:
                if data is None:
                    raise ValueError("epoch_length should be provided if data is None")
                epoch_length = _length(data)
                if epoch_length is not None and epoch_length < 1:
                    raise ValueError("Input data has zero size. Please provide non-empty data")
            if max_iters is None and max_epochs is None:
                max_epochs = 1
            s.iteration = s.epoch = 0
            s.max_epochs, s.max_iters, s.epoch_length = max_epochs, max_iters, epoch_length
            self._init_iter = None
            self.logger.info(f"Engine run starting with max_epochs={max_epochs}.")
        else:
            self.logger.info(
                f"Engine run resuming from iteration {s.iteration}, epoch {s.epoch} until "
                f"{s.max_epochs} epochs"
            )
            if s.epoch_length is None and data is None:
                raise ValueError("epoch_length should be provided if data is None")
            if max_epochs is not None:
                if max_epochs < s.epoch:
                    raise ValueError(
                        "Argument max_epochs should be greater than or equal to the start "
                        f"epoch defined in the state: {max_epochs} vs {s.epoch}. Please, set "
                        "engine.state.max_epochs = None before calling engine.run() in order to "
                        "restart the training from the beginning."
                    )
                s.max_epochs = max_epochs
            if s.epoch_length:
                # A run terminated mid-epoch goes on with that epoch (Ignite starts the next).
                s.epoch = s.iteration // s.epoch_length
            if epoch_length is not None and epoch_length != s.epoch_length:
                raise ValueError(
                    "Argument epoch_length should be same as in the state, but given "
                    f"{epoch_length} vs {s.epoch_length}"
                )
        s.dataloader = data
        s.seed = seed
        self._dataloader_iter = None
        return self._internal_run()

    @staticmethod
    def _is_done(state: State) -> bool:
        if state.max_iters is not None and state.iteration >= state.max_iters:
            return True
        if (
            state.epoch_length is not None
            and state.max_epochs is not None
            and state.iteration >= state.epoch_length * state.max_epochs
        ):
            return True
        return state.max_epochs is not None and state.epoch >= state.max_epochs

    def _setup_dataloader_iter(self, skip: int = 0) -> None:
        s = self.state
        data = s.dataloader
        if data is None:
            if s.epoch_length is None:
                raise RuntimeError("Engine: no data and no epoch_length")
            self._dataloader_iter = itertools.repeat(None, s.epoch_length - skip)
            return
        epoch = max(s.epoch - 1, 0)
        if skip and isinstance(data, DataLoader):
            data.load_state_dict({"epoch": epoch, "batches_done": skip})  # no batch is built
            skip = 0
        elif callable(getattr(data, "set_epoch", None)):
            data.set_epoch(epoch)
        self._dataloader_iter = iter(data)
        for _ in itertools.islice(self._dataloader_iter, skip):
            pass

    def _internal_run(self) -> State:
        self.should_terminate = self.should_terminate_single_epoch = False
        s = self.state
        s.times = {Events.EPOCH_COMPLETED.name: 0.0, Events.COMPLETED.name: 0.0}
        try:
            start = time.perf_counter()
            try:
                self._fire_event(Events.STARTED)
                self._maybe_terminate()
                while not self._is_done(s) and not self.should_terminate:
                    s.epoch += 1
                    t0 = time.perf_counter()
                    self._fire_event(Events.EPOCH_STARTED)
                    self._maybe_terminate()
                    if self._dataloader_iter is None:
                        if self._init_iter is None:
                            self._init_iter = s.iteration % s.epoch_length if s.epoch_length else 0
                        self._setup_dataloader_iter(skip=self._init_iter)
                    self._run_once_on_dataset()
                    took = time.perf_counter() - t0
                    s.times[Events.EPOCH_COMPLETED.name] = took
                    if self.should_terminate_single_epoch != "skip_epoch_completed":
                        self._fire_event(Events.EPOCH_COMPLETED)
                        s.times[Events.EPOCH_COMPLETED.name] = time.perf_counter() - t0
                    self.should_terminate_single_epoch = False
                    self._maybe_terminate()
                    self.logger.info(
                        f"Epoch[{s.epoch}] Complete. Time taken: {_hms(time.perf_counter() - t0)}"
                    )
            except _Terminate:
                self._fire_event(Events.TERMINATE)
            s.times[Events.COMPLETED.name] = time.perf_counter() - start
            if self.should_terminate != "skip_completed":
                self._fire_event(Events.COMPLETED)
                s.times[Events.COMPLETED.name] = time.perf_counter() - start
            self.logger.info(
                f"Engine run complete. Time taken: {_hms(time.perf_counter() - start)}"
            )
        except Exception as exc:
            self._dataloader_iter = None
            self.logger.error(f"Engine run is terminating due to exception: {exc}")
            self._handle_exception(exc)
        self._dataloader_iter = None
        return s

    def _run_once_on_dataset(self) -> None:
        s = self.state
        counter = self._init_iter or 0
        self._init_iter = None
        restarted = False
        assert self._dataloader_iter is not None  # set by the caller
        try:
            while True:
                s.batch = None
                has_data = s.dataloader is not None  # data=None: no batch events, as Ignite
                try:
                    if has_data and self.last_event_name != Events.DATALOADER_STOP_ITERATION:
                        self._fire_event(Events.GET_BATCH_STARTED)
                        self._maybe_terminate()
                    s.batch = next(self._dataloader_iter)
                    s.output = None
                    if has_data:
                        self._fire_event(Events.GET_BATCH_COMPLETED)
                        self._maybe_terminate()
                    counter += 1
                    restarted = False
                except StopIteration:
                    if s.epoch_length is None:  # an iterable without len(): now we know
                        s.epoch_length = counter
                        if s.max_iters is not None:
                            s.max_epochs = -(-s.max_iters // counter)
                        break
                    if restarted:
                        target = s.max_iters or s.epoch_length * (s.max_epochs or 0)
                        if s.iteration < target:
                            raise RuntimeError(
                                f"Engine: the data can not provide batches anymore at iteration "
                                f"{s.iteration} (epoch {s.epoch}, epoch_length {s.epoch_length}):"
                                " a fresh iteration over it yields nothing"
                            ) from None
                        break
                    if has_data:
                        self._fire_event(Events.DATALOADER_STOP_ITERATION)
                        self._maybe_terminate()
                    self._setup_dataloader_iter()
                    restarted = True
                    continue
                s.iteration += 1
                self._fire_event(Events.ITERATION_STARTED)
                self._maybe_terminate()
                if s.seed is not None:
                    tl.manual_seed(s.seed + s.iteration)
                try:
                    s.output = self._process_function(self, s.batch)
                except Exception as exc:
                    note(
                        exc,
                        f"raised in the process function at iteration {s.iteration} "
                        f"(epoch {s.epoch})",
                    )
                    raise
                self._fire_event(Events.ITERATION_COMPLETED)
                self._maybe_terminate()
                if s.epoch_length is not None and counter == s.epoch_length:
                    break
                if s.max_iters is not None and s.iteration == s.max_iters:
                    self.should_terminate = True
                    raise _Terminate()
        except _TerminateEpoch:
            self._fire_event(Events.TERMINATE_SINGLE_EPOCH, iter_counter=counter)
            self._setup_dataloader_iter()
        except _Terminate:
            raise
        except Exception as exc:
            self.logger.error(f"Current run is terminating due to exception: {exc}")
            self._handle_exception(exc)

    def _handle_exception(self, exc: BaseException) -> None:
        if self._event_handlers.get(self._key(Events.EXCEPTION_RAISED)):
            self._fire_event(Events.EXCEPTION_RAISED, exc)
        else:
            raise exc


def _length(data: Iterable[Any]) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _hms(seconds: float) -> str:
    m, s = divmod(seconds, 60)
    h, m = divmod(int(m), 60)
    return f"{h:02}:{m:02}:{s:06.3f}"
