"""``ddp.handlers``: Ignite's EarlyStopping, Timer, TerminateOnNan and ProgressBar on
``ddp.engine`` (checkpoints: tests/ddp/test_checkpoint_handlers.py).
"""

from __future__ import annotations

import io
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from ddp.engine import Engine, Events
from ddp.handlers import (
    EarlyStopping,
    ProgressBar,
    TerminateOnNan,
    Timer,
    _timer,
)
from tensorlib import nn

from .conftest import Pools

pytestmark = pytest.mark.timeout(120)
BODIES = "tests.ddp.handlers_bodies"
ROOT = Path(__file__).resolve().parents[2]


def _trainer() -> Engine:
    return Engine(lambda engine, batch: None)


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def _weights(model: nn.Module) -> dict[str, np.ndarray[Any, Any]]:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- EarlyStopping
class _Stoppable:
    def __init__(self) -> None:
        self.stopped = 0

    def terminate(self) -> None:
        self.stopped += 1


def _feed(handler: EarlyStopping, trainer: _Stoppable, scores: list[float]) -> list[int]:
    """The trainer's stop count after each score."""
    it = iter(scores)
    handler.score_function = lambda engine: next(it)
    out = []
    for _ in scores:
        handler(None)
        out.append(trainer.stopped)
    return out


def test_early_stopping_patience() -> None:
    t = _Stoppable()
    h = EarlyStopping(patience=2, score_function=lambda e: 0.0, trainer=t)
    # best 0.5 at first; 0.4 and 0.45 do not improve: stop at the second of them.
    assert _feed(h, t, [0.5, 0.4, 0.45]) == [0, 0, 1]
    t = _Stoppable()
    h = EarlyStopping(2, lambda e: 0.0, t)
    # An improvement restarts the count.
    assert _feed(h, t, [0.5, 0.4, 0.6, 0.5, 0.55, 0.7]) == [0, 0, 0, 0, 1, 1]


def test_early_stopping_min_delta() -> None:
    t = _Stoppable()
    h = EarlyStopping(patience=2, score_function=lambda e: 0.0, trainer=t, min_delta=0.1)
    # +0.05 is no improvement; the best follows it (0.55), +0.2 from there is one.
    assert _feed(h, t, [0.5, 0.55, 0.75, 0.8, 0.85]) == [0, 0, 0, 0, 1]
    assert (h.counter, h.best_score) == (2, 0.85)


def test_early_stopping_cumulative_delta() -> None:
    """Ignite's cases: small gains add up with cumulative_delta, not without."""
    t = _Stoppable()
    h = EarlyStopping(2, lambda e: 0.0, t, min_delta=0.4, cumulative_delta=True)
    assert _feed(h, t, [0.0, 0.3, 0.6]) == [0, 0, 0]
    assert (h.counter, h.best_score) == (0, 0.6)
    t = _Stoppable()
    h = EarlyStopping(2, lambda e: 0.0, t, min_delta=0.4, cumulative_delta=False)
    assert _feed(h, t, [0.0, 0.3, 0.6]) == [0, 0, 1]


def test_early_stopping_stops_a_real_trainer_and_its_state_round_trips() -> None:
    trainer = _trainer()
    evaluator = _trainer()
    scores = iter([0.3, 0.5, 0.5, 0.4, 0.9, 1.0])
    h = EarlyStopping(2, lambda e: next(scores), trainer)
    evaluator.add_event_handler(Events.COMPLETED, h)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run([0]))
    trainer.run([0, 1], max_epochs=6)
    assert trainer.state.epoch == 4 and trainer.state.iteration == 8
    state = h.state_dict()
    assert state == {"counter": 2, "best_score": 0.5}
    h2 = EarlyStopping(2, lambda e: 0.0, trainer)
    h2.load_state_dict(state)
    assert (h2.counter, h2.best_score) == (2, 0.5)
    h2.reset()
    assert (h2.counter, h2.best_score) == (0, None)
    with pytest.raises(ValueError, match="'best_score' is absent"):
        h2.load_state_dict({"counter": 1})


def test_early_stopping_argument_errors() -> None:
    with pytest.raises(ValueError, match="patience should be a positive integer"):
        EarlyStopping(0, lambda e: 0.0, _Stoppable())
    with pytest.raises(ValueError, match="min_delta should not be a negative"):
        EarlyStopping(1, lambda e: 0.0, _Stoppable(), min_delta=-0.1)
    with pytest.raises(TypeError, match="score_function should be a function"):
        EarlyStopping(1, 0.5, _Stoppable())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trainer should be an Engine"):
        EarlyStopping(1, lambda e: 0.0, object())


# ---------------------------------------------------------------------- Timer
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(_timer, "perf_counter", c)
    return c


def test_timer_pause_resume_and_average(clock: _Clock) -> None:
    t = Timer(average=True)
    clock.now += 2.0
    assert t.value() == 2.0  # running: the stretch so far
    t.pause()
    clock.now += 5.0  # paused: not counted
    t.pause()
    assert t.value() == 2.0 and t.total == 2.0 and not t.running
    t.resume()
    clock.now += 1.0
    t.resume()  # already running: the stretch goes on
    clock.now += 1.0
    t.step()
    t.step()
    assert t.value() == 2.0  # (2 + 2) / 2 steps
    t.reset()
    assert (t.value(), t.step_count, t.running) == (0.0, 0.0, True)


def test_timer_attached_to_an_engine(clock: _Clock) -> None:
    def work(engine: Engine, batch: Any) -> None:
        clock.now += 1.0  # each iteration's processing takes 1 s

    trainer = Engine(work)
    per_iteration = Timer(average=True).attach(
        trainer,
        start=Events.EPOCH_STARTED,
        resume=Events.ITERATION_STARTED,
        pause=Events.ITERATION_COMPLETED,
        step=Events.ITERATION_COMPLETED,
    )
    whole = Timer().attach(trainer)
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: setattr(clock, "now", clock.now + 0.25)
    )
    trainer.run([0, 1, 2, 3], max_epochs=2)
    assert per_iteration.value() == 1.0 and per_iteration.step_count == 4  # the last epoch's
    assert whole.value() == 10.0  # 8 iterations of 1.25 s, paused at COMPLETED
    clock.now += 3.0
    assert whole.value() == 10.0


# ---------------------------------------------------------------------- TerminateOnNan
@pytest.mark.parametrize(
    ("output", "stops"),
    [
        (1.0, False),
        (float("nan"), True),
        (float("-inf"), True),
        (3, False),
        (np.float32(np.inf), True),
        (np.array([1.0, 2.0]), False),
        (np.array([[1.0, np.nan]]), True),
        (np.arange(3), False),
        (tl.tensor(np.array([1.0, 2.0], np.float32)), False),
        (tl.tensor(np.array([1.0, np.inf], np.float32)), True),
        (tl.tensor(np.array(np.nan, np.float32)), True),
        ((1.0, [2.0, np.array([3.0])], {"a": "text"}), False),
        ((1.0, [2.0, {"deep": tl.tensor(np.array([np.nan], np.float32))}]), True),
        ({"loss": 0.5, "y_pred": tl.tensor(np.full((2, 2), np.inf, np.float32))}, True),
    ],
)
def test_terminate_on_nan_kinds(output: Any, stops: bool) -> None:
    trainer = Engine(lambda e, b: output)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    trainer.run([0, 1, 2], max_epochs=2)
    assert trainer.state.iteration == (1 if stops else 6)


def test_terminate_on_nan_stops_at_the_bad_iteration_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trainer = Engine(lambda e, b: (float("nan") if b == 3 else 1.0, b))
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, TerminateOnNan(output_transform=lambda o: o[0])
    )
    with caplog.at_level(logging.WARNING, logger="ddp.handlers.TerminateOnNan"):
        trainer.run(list(range(10)))
    assert trainer.state.iteration == 4
    assert "TerminateOnNan: Output 'nan' contains NaN or Inf. Stop training" in caplog.text


def test_terminate_on_nan_refuses_outputs_it_cannot_check() -> None:
    trainer = Engine(lambda e, b: None)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    with pytest.raises(TypeError, match=r"the output is a NoneType.*output_transform"):
        trainer.run([0])
    trainer = Engine(lambda e, b: {"x": [object()]})
    trainer.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    with pytest.raises(TypeError, match=r"the output\['x'\]\[0\] is a object"):
        trainer.run([0])


# ---------------------------------------------------------------------- ProgressBar
def test_progress_bar_output(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = Engine(lambda e, b: {"loss": 0.5 * b, "parts": [1, 2]})
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: e.state.metrics.update(acc=0.25)
    )
    bar = ProgressBar(persist=True)
    bar.attach(trainer, metric_names=["acc"], output_transform=lambda o: o)
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED, lambda e: bar.log_message(f"epoch {e.state.epoch} done")
    )
    trainer.run([1, 2, 3], max_epochs=2)
    out, err = capsys.readouterr()
    assert "Epoch [1/2]: [3/3] 100%" in err and "Epoch [2/2]: [3/3] 100%" in err
    assert "acc=0.25, loss=1.5, parts_0=1, parts_1=2" in err
    assert out == "epoch 1 done\nepoch 2 done\n"  # tqdm.write, to stdout as in Ignite
    assert bar.pbar is None  # closed at EPOCH_COMPLETED

    evaluator = Engine(lambda e, b: b)
    ProgressBar(desc="Eval", persist=True).attach(evaluator, output_transform=lambda o: o)
    evaluator.run([7, 8])
    err = capsys.readouterr().err
    assert "Eval: [2/2] 100%" in err and "output=8" in err

    file = io.StringIO()
    quiet = Engine(lambda e, b: None)
    ProgressBar(file=file, persist=True).attach(
        quiet, event_name=Events.ITERATION_COMPLETED(every=2)
    )
    quiet.run([0, 1, 2, 3])
    assert "Iteration: [4/4] 100%" in file.getvalue() and capsys.readouterr().err == ""


def test_progress_bar_argument_errors() -> None:
    bar, trainer = ProgressBar(), _trainer()
    with pytest.raises(ValueError, match="Closing Event should not be a filtered event"):
        bar.attach(trainer, closing_event_name=Events.EPOCH_COMPLETED(every=2))
    with pytest.raises(ValueError, match="should be called before closing event"):
        bar.attach(
            trainer,
            event_name=Events.EPOCH_COMPLETED,
            closing_event_name=Events.ITERATION_COMPLETED,
        )
    with pytest.raises(ValueError, match="is not one of"):
        bar.attach(trainer, event_name=Events.EXCEPTION_RAISED)
    with pytest.raises(TypeError, match="metric_names should be either a list or equal 'all'"):
        bar.attach(trainer, metric_names="acc")


def test_progress_bar_without_tqdm_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.autonotebook", None)
    with pytest.raises(ImportError, match="pip install tqdm"):
        ProgressBar()


# ---------------------------------------------------------------------- several ranks
@pytest.mark.timeout(90)
def test_a_nan_on_one_rank_stops_every_rank_at_that_iteration(pools: Pools) -> None:
    got = pools("cpu", 2).run(f"{BODIES}:nan_on_one_rank", {}, deadline=60.0)
    assert got == [[1, 2, 3], [1, 2, 3]]


@pytest.mark.timeout(90)
def test_progress_bar_shows_on_rank_0_only(pools: Pools) -> None:
    got = pools("cpu", 2).run(f"{BODIES}:progress_rank", {}, deadline=60.0)
    r0, r1 = got
    assert "Epoch [2/2]: [4/4] 100%" in r0["stderr"] and "loss=4" in r0["stderr"]
    assert r0["stdout"] == "all done\n" and r0["handlers"]  # log_message: tqdm.write's stdout
    assert r1["stderr"] == r1["stdout"] == "" and not r1["handlers"]
