"""``ddp.engine``: event order, filters, terminate and resume, handler errors, custom events,
and the supervised trainer/evaluator against a hand-written loop.

Ignite's own engine is compared scenario by scenario in tests/ddp/parity/test_engine_ignite.py
(with the parity extra); these tests need nothing but the project.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

import ddp
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import (
    Engine,
    EventEnum,
    Events,
    create_supervised_evaluator,
    create_supervised_trainer,
)
from tensorlib import nn, optim

pytestmark = pytest.mark.timeout(60)


def _trace(engine: Engine, log: list[tuple[Any, ...]], *names: str) -> None:
    for name in names:
        engine.add_event_handler(
            getattr(Events, name),
            lambda e, n=name, **kw: log.append((n, e.state.epoch, e.state.iteration)),
        )


# ------------------------------------------------------------------------------ events
def test_a_run_fires_ignites_events_in_order() -> None:
    log: list[tuple[Any, ...]] = []
    e = Engine(lambda eng, b: b)
    _trace(e, log, "STARTED", "EPOCH_STARTED", "GET_BATCH_STARTED", "GET_BATCH_COMPLETED",
           "ITERATION_STARTED", "ITERATION_COMPLETED", "EPOCH_COMPLETED", "COMPLETED")  # fmt: skip
    state = e.run([10, 20], max_epochs=2)
    it = [("GET_BATCH_STARTED", 1, 0), ("GET_BATCH_COMPLETED", 1, 0), ("ITERATION_STARTED", 1, 1),
          ("ITERATION_COMPLETED", 1, 1), ("GET_BATCH_STARTED", 1, 1), ("GET_BATCH_COMPLETED", 1, 1),
          ("ITERATION_STARTED", 1, 2), ("ITERATION_COMPLETED", 1, 2)]  # fmt: skip
    second = [(n, 2, i + 2) for n, _, i in it]
    assert log == [("STARTED", 0, 0), ("EPOCH_STARTED", 1, 0), *it, ("EPOCH_COMPLETED", 1, 2),
                   ("EPOCH_STARTED", 2, 2), *second, ("EPOCH_COMPLETED", 2, 4),
                   ("COMPLETED", 2, 4)]  # fmt: skip
    assert (state.epoch, state.iteration, state.output, state.batch) == (2, 4, 20, 20)
    assert state.times["COMPLETED"] is not None and state.times["COMPLETED"] >= 0


@pytest.mark.parametrize(
    ("event", "fired"),
    [
        (Events.ITERATION_COMPLETED(every=3), [3, 6, 9]),
        (Events.ITERATION_COMPLETED(once=4), [4]),
        (Events.ITERATION_COMPLETED(once=[2, 9]), [2, 9]),
        (Events.ITERATION_COMPLETED(before=3), [1, 2]),
        (Events.ITERATION_COMPLETED(after=8), [9, 10]),
        (Events.ITERATION_COMPLETED(every=2, after=3, before=9), [4, 6, 8]),
        (Events.ITERATION_COMPLETED(event_filter=lambda e, i: i in (1, 7)), [1, 7]),
        (Events.EPOCH_COMPLETED(every=2), [4, 8]),
    ],
)
def test_filters(event: Any, fired: list[int]) -> None:
    e = Engine(lambda eng, b: b)
    got: list[int] = []
    e.add_event_handler(event, lambda eng: got.append(eng.state.iteration))
    e.run(range(2), max_epochs=5)
    assert got == fired


def test_events_list_extra_args_and_removal() -> None:
    e = Engine(lambda eng, b: b)
    got: list[Any] = []
    handle = e.add_event_handler(Events.STARTED | Events.COMPLETED, lambda eng, x: got.append(x), 7)
    e.add_event_handler(Events.EPOCH_COMPLETED, lambda: got.append("no engine"))
    e.run([0], max_epochs=1)
    assert got == [7, "no engine", 7]
    handle.remove()
    assert not e.has_event_handler(handle.handler)
    got.clear()
    e.run([0], max_epochs=1)
    assert got == ["no engine"]

    def h(engine: Engine) -> None:
        got.append("h")

    with e.add_event_handler(Events.COMPLETED, h):
        assert e.has_event_handler(h, Events.COMPLETED)
        assert not e.has_event_handler(h, Events.STARTED)
    assert not e.has_event_handler(h)
    with pytest.raises(ValueError, match="not found"):
        e.remove_event_handler(h, Events.COMPLETED)


def test_bad_handlers_and_events_are_refused() -> None:
    e = Engine(lambda eng, b: b)
    with pytest.raises(ValueError, match="takes parameters"):
        e.add_event_handler(Events.STARTED, lambda a, b, c: None)
    with pytest.raises(ValueError, match="register_events"):
        e.add_event_handler("my_event", lambda eng: None)
    with pytest.raises(ValueError, match="no counter"):
        e.add_event_handler(Events.EXCEPTION_RAISED(every=2), lambda eng, x: None)
    with pytest.raises(TypeError, match="process_function must be callable"):
        Engine(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="zero size"):
        e.run([])
    with pytest.raises(ValueError, match="mutually exclusive"):
        e.run([1], max_epochs=2, max_iters=3)


def test_custom_events_with_a_counter() -> None:
    class Backprop(EventEnum):
        BACKWARD_STARTED = "backward_started"

    def step(engine: Engine, batch: Any) -> None:
        engine.state.backward_count += 1  # type: ignore[attr-defined]
        engine.fire_event(Backprop.BACKWARD_STARTED)

    e = Engine(step)
    e.register_events(*Backprop, event_to_attr={Backprop.BACKWARD_STARTED: "backward_count"})
    seen: list[int] = []
    e.add_event_handler(
        Backprop.BACKWARD_STARTED(every=2), lambda eng: seen.append(eng.state.backward_count)
    )
    e.run(range(5), max_epochs=1)
    assert seen == [2, 4]
    assert e.last_event_name == Events.COMPLETED


# ----------------------------------------------------------------------- control, errors
def test_terminate_then_run_finishes_the_interrupted_epoch() -> None:
    batches: list[int] = []
    e = Engine(lambda eng, b: batches.append(b))
    e.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda eng: eng.terminate())
    fired: list[str] = []
    e.add_event_handler(Events.TERMINATE, lambda: fired.append("terminate"))
    e.add_event_handler(Events.COMPLETED, lambda: fired.append("completed"))
    state = e.run([0, 1, 2], max_epochs=3)
    assert (state.epoch, state.iteration, fired) == (2, 4, ["terminate", "completed"])
    e.run([0, 1, 2])
    # Every epoch's batches exactly once: the interrupted epoch goes on at its second batch.
    assert batches == [0, 1, 2] * 3
    assert (e.state.epoch, e.state.iteration) == (3, 9)


def test_terminate_epoch_and_skip_flags() -> None:
    log: list[tuple[Any, ...]] = []
    e = Engine(lambda eng, b: b)
    e.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda eng: eng.terminate_epoch())
    _trace(e, log, "TERMINATE_SINGLE_EPOCH", "EPOCH_COMPLETED", "COMPLETED")
    e.run(range(4), max_epochs=2)
    assert log == [("TERMINATE_SINGLE_EPOCH", 1, 2), ("EPOCH_COMPLETED", 1, 2),
                   ("EPOCH_COMPLETED", 2, 6), ("COMPLETED", 2, 6)]  # fmt: skip
    f = Engine(lambda eng, b: b)
    f.add_event_handler(
        Events.ITERATION_COMPLETED(once=1), lambda eng: eng.terminate(skip_completed=True)
    )
    done: list[int] = []
    f.add_event_handler(Events.COMPLETED, lambda: done.append(1))
    f.run(range(3))
    assert done == []


def test_a_handlers_exception_names_the_handler() -> None:
    e = Engine(lambda eng, b: b)

    def save_best(engine: Engine) -> None:
        raise KeyError("val_acc")

    e.add_event_handler(Events.EPOCH_COMPLETED, save_best)
    with pytest.raises(KeyError) as info:
        e.run([1], max_epochs=1)
    assert any("save_best" in n and "EPOCH_COMPLETED" in n for n in info.value.__notes__)

    caught: list[BaseException] = []
    e.add_event_handler(Events.EXCEPTION_RAISED, lambda eng, exc: caught.append(exc))
    e.run([1], max_epochs=1)  # handled: no raise
    assert isinstance(caught[0], KeyError)


def test_a_process_function_exception_names_the_iteration() -> None:
    def step(engine: Engine, batch: int) -> int:
        return 1 // batch

    with pytest.raises(ZeroDivisionError) as info:
        Engine(step).run([1, 1, 0], max_epochs=1)
    assert "process function at iteration 3 (epoch 1)" in info.value.__notes__[0]


def test_data_that_runs_dry_is_an_error_not_a_silent_end() -> None:
    once = iter(range(3))
    with pytest.raises(RuntimeError, match="can not provide batches anymore at iteration 3"):
        Engine(lambda eng, b: b).run(once, max_epochs=2, epoch_length=3)


def test_run_without_data_and_max_iters() -> None:
    got: list[Any] = []
    e = Engine(lambda eng, b: got.append(b))
    e.run(epoch_length=3, max_epochs=2)
    assert got == [None] * 6
    state = Engine(lambda eng, b: b).run(range(4), max_iters=6)
    assert (state.iteration, state.epoch, state.max_epochs) == (6, 2, None)


# ------------------------------------------------------------------- training and resume
def _data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype(np.float32), rng.integers(0, 3, n)


def _model() -> nn.Module:
    tl.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def _params(model: nn.Module) -> list[np.ndarray]:
    return [p.numpy().copy() for p in model.parameters()]


def test_trainer_equals_a_hand_written_loop() -> None:
    x, y = _data()
    model = nn.Sequential(nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    opt, ref_opt = optim.SGD(model.parameters(), lr=0.1), optim.SGD(ref.parameters(), lr=0.1)
    loader = ddp.DataLoader((x, y), batch_size=16, shuffle=True)
    create_supervised_trainer(model, opt, F.cross_entropy).run(loader, max_epochs=2)
    hand = ddp.DataLoader((x, y), batch_size=16, shuffle=True)
    for epoch in range(2):
        hand.set_epoch(epoch)  # the engine does this for data with set_epoch
        for xb, yb in hand:
            ref_opt.zero_grad()
            F.cross_entropy(ref(xb), yb).backward()
            ref_opt.step()
    for a, b in zip(_params(model), _params(ref), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gradient_accumulation_equals_the_larger_batch() -> None:
    x, y = _data(32)
    a, b = nn.Linear(8, 3), nn.Linear(8, 3)
    b.load_state_dict(a.state_dict())
    create_supervised_trainer(
        a, optim.SGD(a.parameters(), lr=0.1), F.cross_entropy, gradient_accumulation_steps=2
    ).run(ddp.DataLoader((x, y), batch_size=8), max_epochs=1)
    create_supervised_trainer(b, optim.SGD(b.parameters(), lr=0.1), F.cross_entropy).run(
        ddp.DataLoader((x, y), batch_size=16), max_epochs=1
    )
    for p, q in zip(_params(a), _params(b), strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)


def test_state_dict_resume_gives_the_uninterrupted_parameters() -> None:
    x, y = _data()

    def setup() -> tuple[nn.Module, Any, Engine, ddp.DataLoader]:
        model = _model()
        opt = optim.Adam(model.parameters(), lr=0.01)
        return (
            model,
            opt,
            create_supervised_trainer(model, opt, F.cross_entropy),
            ddp.DataLoader((x, y), batch_size=10, shuffle=True),
        )

    model, _, trainer, loader = setup()
    trainer.run(loader, max_epochs=3, seed=5)
    whole = _params(model)

    model, opt, trainer, loader = setup()
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=9), lambda e: e.terminate())
    trainer.run(loader, max_epochs=3, seed=5)
    saved = copy.deepcopy((trainer.state_dict(), model.state_dict(), opt.state_dict()))
    assert saved[0] == {"epoch_length": 7, "max_epochs": 3, "iteration": 9}

    model, opt, trainer, loader = setup()  # a new process would start here
    trainer.load_state_dict(saved[0])
    model.load_state_dict(saved[1])
    opt.load_state_dict(saved[2])
    trainer.run(loader, seed=5)
    assert trainer.state.iteration == 21
    for p, q in zip(_params(model), whole, strict=True):
        np.testing.assert_array_equal(p, q)


def test_evaluator_runs_without_gradients() -> None:
    x, y = _data(20)
    model = nn.Linear(8, 3)
    before = _params(model)
    state = create_supervised_evaluator(model).run(ddp.DataLoader((x, y), batch_size=8))
    y_pred, target = state.output
    assert y_pred.shape == (4, 3) and not y_pred.requires_grad
    np.testing.assert_array_equal(target.numpy(), y[16:])
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(_params(model), before, strict=True):
        np.testing.assert_array_equal(p, q)


def test_amp_mode_and_its_errors() -> None:
    x, y = _data(32)
    model = nn.Linear(8, 3)
    trainer = create_supervised_trainer(
        model, optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, amp_mode="amp", scaler=True
    )
    state = trainer.run(ddp.DataLoader((x, y), batch_size=8), max_epochs=1)
    assert np.isfinite(state.output)
    assert state.scaler.get_scale() > 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="amp_mode must be None or 'amp'"):
        create_supervised_trainer(model, None, F.cross_entropy, amp_mode="apex")
    with pytest.raises(ValueError, match="scaler needs amp_mode='amp'"):
        create_supervised_trainer(model, None, F.cross_entropy, scaler=True)
    with pytest.raises(ValueError, match="strictly positive"):
        create_supervised_trainer(model, None, F.cross_entropy, gradient_accumulation_steps=0)


def test_the_epoch_benchmark_trains_alike_and_prints_each_row(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks.engine_epoch import main

    assert main(["--samples", "64", "--batch", "16", "--epochs", "1", "--runs", "1"]) == 0
    out = capsys.readouterr().out  # main exits if a row trains to other parameters
    for row in ("hand loop", "create_supervised_trainer", "+ 2 handlers"):
        assert row in out, out
