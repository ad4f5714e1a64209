"""``ddp.handlers``' checkpoints: Ignite's Checkpoint, ModelCheckpoint and DiskSaver on
``ddp.engine``.

The file names and the kept files follow Ignite's table and rotation rules (the cases of
Ignite's tests/ignite/handlers/test_checkpoint.py, ported); writes are atomic and happen on
one rank (2 ranks of a pool, tests/ddp/handlers_bodies.py); a run saved mid-epoch and resumed
in a new process ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib._serialization as serialization
from ddp.engine import Engine, Events
from ddp.handlers import (
    BaseSaveHandler,
    Checkpoint,
    CheckpointEvents,
    DiskSaver,
    EarlyStopping,
    ModelCheckpoint,
    global_step_from_engine,
)
from tensorlib import nn, optim

from . import handlers_bodies as B
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


# ---------------------------------------------------------------------- file names
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "model_6.npz"),
        ({"filename_prefix": "best"}, "best_model_6.npz"),
        ({"score_function": lambda e: 0.8123456}, "model_0.8123.npz"),
        ({"score_function": lambda e: 7}, "model_7.npz"),
        ({"score_name": "acc"}, "model_acc=0.5000.npz"),
        ({"score_function": lambda e: 0.5, "score_name": "val"}, "model_val=0.5000.npz"),
        ({"global_step_transform": lambda e, ev: 42}, "model_42.npz"),
        (
            {"score_function": lambda e: 0.5, "global_step_transform": lambda e, ev: 3},
            "model_3_0.5000.npz",
        ),
        (
            {"score_name": "acc", "global_step_transform": lambda e, ev: 3, "filename_prefix": "p"},
            "p_model_3_acc=0.5000.npz",
        ),
        (
            {
                "filename_pattern": "{global_step}-{name}.{ext}",
                "global_step_transform": lambda e, ev: 9,
            },
            "9-model.npz",
        ),
    ],
)
def test_file_names_follow_ignites_table(
    tmp_path: Path, kwargs: dict[str, Any], expected: str
) -> None:
    trainer = _trainer()
    trainer.state.metrics["acc"] = 0.5
    handler = Checkpoint({"model": nn.Linear(2, 2)}, tmp_path, **kwargs)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=6), handler)
    trainer.run([0, 1, 2], max_epochs=2)
    assert _names(tmp_path) == [expected]
    assert handler.last_checkpoint == tmp_path / expected


def test_several_objects_make_one_checkpoint_file(tmp_path: Path) -> None:
    trainer = _trainer()
    model = nn.Linear(2, 2)
    handler = Checkpoint({"model": model, "trainer": trainer}, DiskSaver(tmp_path))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run([0, 1, 2], max_epochs=2)
    assert _names(tmp_path) == ["checkpoint_6.npz"]
    saved = tl.load(tmp_path / "checkpoint_6.npz")
    assert set(saved) == {"model", "trainer"}
    assert saved["trainer"] == {"epoch_length": 3, "max_epochs": 2, "iteration": 6}
    assert np.array_equal(saved["model"]["weight"].numpy(), model.weight.numpy())


def test_global_step_from_another_engine_names_evaluator_checkpoints(tmp_path: Path) -> None:
    trainer, evaluator = _trainer(), _trainer()
    scores = iter([0.1, 0.3, 0.2])
    handler = Checkpoint(
        {"model": nn.Linear(1, 1)},
        tmp_path,
        filename_prefix="best",
        score_function=lambda e: next(scores),
        score_name="acc",
        n_saved=2,
        global_step_transform=global_step_from_engine(trainer),
    )
    evaluator.add_event_handler(Events.COMPLETED, handler)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run([0]))
    trainer.run([0, 1], max_epochs=3)
    assert _names(tmp_path) == ["best_model_2_acc=0.3000.npz", "best_model_3_acc=0.2000.npz"]
    # An event without a counter falls back to the trainer's epoch (or another attribute).
    step = global_step_from_engine(trainer, fallback_attr="iteration")
    assert step(evaluator, Events.EXCEPTION_RAISED) == 6
    assert global_step_from_engine(trainer, Events.ITERATION_COMPLETED)(evaluator, "x") == 6


# ---------------------------------------------------------------------- rotation, best
def test_n_saved_keeps_the_latest_and_deletes_older_files(tmp_path: Path) -> None:
    trainer = _trainer()
    handler = Checkpoint({"model": nn.Linear(1, 1)}, tmp_path, n_saved=2)
    seen: list[list[str]] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2), handler)
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED(every=2), lambda e: seen.append(_names(tmp_path))
    )
    trainer.run([0, 1, 2, 3, 4], max_epochs=2)
    assert seen == [
        ["model_2.npz"],
        ["model_2.npz", "model_4.npz"],
        ["model_4.npz", "model_6.npz"],
        ["model_6.npz", "model_8.npz"],
        ["model_10.npz", "model_8.npz"],
    ]
    assert [item.filename for item in handler._saved] == ["model_8.npz", "model_10.npz"]


def test_n_saved_none_keeps_everything_and_zero_is_refused(tmp_path: Path) -> None:
    trainer = _trainer()
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED, Checkpoint({"m": nn.Linear(1, 1)}, tmp_path, n_saved=None)
    )
    trainer.run([0, 1], max_epochs=4)
    assert _names(tmp_path) == ["m_2.npz", "m_4.npz", "m_6.npz", "m_8.npz"]
    with pytest.raises(ValueError, match="n_saved must be a positive integer or None"):
        Checkpoint({"m": nn.Linear(1, 1)}, lambda c, f: None, n_saved=0)


@pytest.mark.parametrize(
    ("greater_or_equal", "expected"),
    [
        (False, ["model_acc=0.9000.npz", "model_acc=0.9500.npz"]),
        (True, ["model_acc=0.9000.npz", "model_acc=0.9500.npz"]),
    ],
)
def test_score_keeps_the_best_and_skips_worse_ones(
    tmp_path: Path, greater_or_equal: bool, expected: list[str]
) -> None:
    scores = iter([0.5, 0.9, 0.3, 0.95, 0.9])
    writes: list[str] = []
    real = DiskSaver.__call__

    def counting(self: DiskSaver, checkpoint: Any, filename: str, metadata: Any = None) -> None:
        writes.append(filename)
        real(self, checkpoint, filename, metadata)

    saver = DiskSaver(tmp_path)
    saver.__class__ = type("CountingSaver", (DiskSaver,), {"__call__": counting})
    trainer = _trainer()
    handler = Checkpoint(
        {"model": nn.Linear(1, 1)},
        saver,
        score_function=lambda e: next(scores),
        score_name="acc",
        n_saved=2,
        greater_or_equal=greater_or_equal,
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run([0], max_epochs=5)
    assert _names(tmp_path) == expected
    # 0.3 never beat the kept ones, so it was never written; an equal 0.9 only with >=.
    third = ["model_acc=0.9000.npz"] if greater_or_equal else []
    assert writes == [
        "model_acc=0.5000.npz",
        "model_acc=0.9000.npz",
        "model_acc=0.9500.npz",
        *third,
    ]
    assert handler.last_checkpoint == tmp_path / "model_acc=0.9500.npz"


def test_score_function_must_return_a_number(tmp_path: Path) -> None:
    def text(engine: Engine) -> Any:
        return "x"

    trainer = _trainer()
    trainer.add_event_handler(
        Events.COMPLETED, Checkpoint({"m": nn.Linear(1, 1)}, tmp_path, score_function=text)
    )
    with pytest.raises(ValueError, match="score_function should be a number"):
        trainer.run([0])


def test_same_name_overwrites_in_place(tmp_path: Path) -> None:
    trainer = _trainer()
    model = nn.Linear(1, 1)
    handler = Checkpoint({"model": model}, tmp_path, filename_pattern="last.{ext}", n_saved=1)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)

    def change(engine: Engine) -> None:
        with tl.no_grad():
            model.weight.numpy()[...] += 1.0  # numpy() shares the parameter's memory

    trainer.add_event_handler(Events.EPOCH_COMPLETED, change)
    trainer.run([0], max_epochs=3)
    assert _names(tmp_path) == ["last.npz"]
    assert tl.load(tmp_path / "last.npz")["weight"].numpy() == pytest.approx(
        model.weight.numpy() - 1.0
    )
    assert len(handler._saved) == 1


def test_custom_save_handlers(tmp_path: Path) -> None:
    """A plain callable (2 or 3 arguments) gets the checkpoint; a BaseSaveHandler also
    deletes, and gets the metadata."""
    plain: list[str] = []
    trainer = _trainer()
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED,
        Checkpoint({"m": nn.Linear(1, 1)}, lambda ckpt, name: plain.append(name), n_saved=1),
    )

    class Memory(BaseSaveHandler):
        def __init__(self) -> None:
            self.files: dict[str, Any] = {}
            self.meta: list[Any] = []

        def __call__(self, checkpoint: Any, filename: str, metadata: Any = None) -> None:
            self.files[filename] = checkpoint
            self.meta.append(metadata)

        def remove(self, filename: str) -> None:
            del self.files[filename]

    memory = Memory()
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED,
        Checkpoint(
            {"m": nn.Linear(1, 1)}, memory, filename_prefix="run", score_name="acc", n_saved=1
        ),
    )
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED, lambda e: e.state.metrics.update(acc=e.state.epoch)
    )
    trainer.state.metrics["acc"] = 0
    trainer.run([0], max_epochs=3)
    assert plain == ["m_1.npz", "m_2.npz", "m_3.npz"]  # nothing to delete them with
    # score_name alone scores with 1.0 * metrics["acc"]: a float, printed with 4 decimals.
    assert list(memory.files) == ["run_m_acc=2.0000.npz"]
    assert memory.meta[-1] == {"basename": "run_m", "score_name": "acc", "priority": 2.0}
    with pytest.raises(TypeError, match="save_handler must be a directory"):
        Checkpoint({"m": nn.Linear(1, 1)}, 3)  # type: ignore[arg-type]


def test_saved_checkpoint_event_fires_after_each_save(tmp_path: Path) -> None:
    trainer = _trainer()
    trainer.register_events(*CheckpointEvents)
    seen: list[list[str]] = []
    trainer.add_event_handler(Checkpoint.SAVED_CHECKPOINT, lambda e: seen.append(_names(tmp_path)))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint({"m": nn.Linear(1, 1)}, tmp_path))
    trainer.run([0], max_epochs=2)
    assert seen == [["m_1.npz"], ["m_2.npz"]]


# ---------------------------------------------------------------------- atomic writes
def test_a_new_file_appears_only_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the bytes are written, the checkpoint's name does not exist yet."""
    during: list[list[str]] = []
    real = np.savez

    def watching(file: Any, *args: Any, **kwargs: Any) -> None:
        during.append(_names(tmp_path))
        real(file, *args, **kwargs)

    monkeypatch.setattr(serialization.np, "savez", watching)
    trainer = _trainer()
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint({"m": nn.Linear(1, 1)}, tmp_path))
    trainer.run([0], max_epochs=2)
    assert len(during) == 2
    assert "m_1.npz" not in during[0] and all(n.startswith(".tmp-") for n in during[0])
    assert "m_2.npz" not in during[1] and "m_1.npz" in during[1]
    assert _names(tmp_path) == ["m_2.npz"]


@pytest.mark.parametrize("pattern", [None, "last.{ext}"])
def test_a_failed_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str | None
) -> None:
    model = nn.Linear(2, 1)
    trainer = _trainer()
    handler = Checkpoint({"model": model}, tmp_path, n_saved=1, filename_pattern=pattern)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run([0], max_epochs=1)
    first = handler.last_checkpoint
    assert first is not None
    before = _weights(model)
    real = np.savez

    def dying(file: Any, *args: Any, **kwargs: Any) -> None:
        real(file, *args, **kwargs)
        file.truncate(10)  # half the bytes on disk, then the writer dies
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serialization.np, "savez", dying)
    model.weight.numpy()[...] = 7.0
    with pytest.raises(OSError, match="No space left"):
        trainer.run([0], max_epochs=2)
    monkeypatch.undo()
    assert _names(tmp_path) == [Path(first).name]  # no temporary file, the old one kept
    assert handler.last_checkpoint == first and len(handler._saved) == 1
    fresh = nn.Linear(2, 1)
    Checkpoint.load_objects({"model": fresh}, first)
    assert all(np.array_equal(_weights(fresh)[k], v) for k, v in before.items())


def test_disk_saver_directory_checks(tmp_path: Path) -> None:
    (tmp_path / "old.npz").write_bytes(b"x")
    (tmp_path / ".tmp-left-by-a-dead-writer.npz").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"\['old.npz'\].*require_empty=False"):
        DiskSaver(tmp_path)
    DiskSaver(tmp_path, require_empty=False)
    with pytest.raises(ValueError, match="is not found"):
        DiskSaver(tmp_path / "missing", create_dir=False)
    DiskSaver(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    saver = DiskSaver(tmp_path / "c", atomic=False)
    saver({"x": np.arange(3)}, "f.npz")
    saver.remove("f.npz")
    saver.remove("f.npz")  # gone already: nothing to do
    assert _names(tmp_path / "c") == []


# ---------------------------------------------------------------------- ModelCheckpoint
def test_model_checkpoint_as_in_ignites_example(tmp_path: Path) -> None:
    handler = ModelCheckpoint(tmp_path, "myprefix", n_saved=2, create_dir=True, require_empty=False)
    trainer = _trainer()
    model = nn.Linear(3, 3)
    trainer.add_event_handler(Events.EPOCH_COMPLETED(every=2), handler, {"mymodel": model})
    trainer.run([0, 1, 2, 3, 4], max_epochs=6)
    assert _names(tmp_path) == ["myprefix_mymodel_20.npz", "myprefix_mymodel_30.npz"]
    assert handler.last_checkpoint == tmp_path / "myprefix_mymodel_30.npz"
    with pytest.raises(ValueError, match="already present"):
        ModelCheckpoint(tmp_path, "again")
    other = _trainer()
    other.add_event_handler(Events.COMPLETED, ModelCheckpoint(tmp_path / "x"), {})
    with pytest.raises(RuntimeError, match="no objects to checkpoint"):
        other.run([0])


# ---------------------------------------------------------------------- loading
def test_load_objects_round_trip(tmp_path: Path) -> None:
    tl.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = optim.Adam(model.parameters(), lr=0.1)
    sched = optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def train(engine: Engine, batch: Any) -> None:
        opt.zero_grad()
        model(tl.tensor(np.ones((4, 3), np.float32))).sum().backward()
        opt.step()
        sched.step()

    trainer = Engine(train)
    stopper = EarlyStopping(3, lambda e: 1.0, trainer)
    stopper.counter, stopper.best_score = 2, 0.75
    to_save = {
        "model": model,
        "optimizer": opt,
        "lr_scheduler": sched,
        "trainer": trainer,
        "stop": stopper,
    }
    handler = Checkpoint(to_save, tmp_path, include_self=True)
    trainer.add_event_handler(Events.COMPLETED, handler)
    trainer.run([0, 1, 2], max_epochs=2)
    path = handler.last_checkpoint
    assert path == tmp_path / "checkpoint_6.npz"

    tl.manual_seed(1)
    model2 = nn.Linear(3, 2)
    opt2 = optim.Adam(model2.parameters(), lr=0.1)
    sched2 = optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    trainer2 = Engine(lambda e, b: None)
    stopper2 = EarlyStopping(3, lambda e: 1.0, trainer2)
    handler2 = Checkpoint({"model": model2}, tmp_path / "other")
    to_load = {
        "model": model2,
        "optimizer": opt2,
        "lr_scheduler": sched2,
        "trainer": trainer2,
        "stop": stopper2,
        "checkpointer": handler2,
    }
    Checkpoint.load_objects(to_load, path)
    assert all(np.array_equal(_weights(model2)[k], v) for k, v in _weights(model).items())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(0.1 / 64)
    assert sched2.state_dict() == sched.state_dict()
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(np.array_equal(np.asarray(a[i]["exp_avg"]), np.asarray(b[i]["exp_avg"])) for i in a)
    assert (trainer2.state.iteration, trainer2.state.epoch, trainer2.state.max_epochs) == (6, 2, 2)
    assert (stopper2.counter, stopper2.best_score) == (2, 0.75)
    assert handler2._saved == [Checkpoint.Item(6, "checkpoint_6.npz")]
    # From a dict too; a single object from its bare state dict.
    model3 = nn.Linear(3, 2)
    Checkpoint.load_objects({"model": model3}, {"model": model.state_dict()})
    assert np.array_equal(model3.weight.numpy(), model.weight.numpy())
    Checkpoint.load_objects(
        {"net": model3}, {"weight": np.zeros((2, 3), np.float32), "bias": np.ones(2, np.float32)}
    )
    assert model3.weight.numpy().sum() == 0 and model3.bias.numpy().sum() == 2


def test_load_objects_errors_change_nothing(tmp_path: Path) -> None:
    model, opt_model = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = optim.SGD(opt_model.parameters(), lr=0.1)
    before = _weights(model)
    with pytest.raises(ValueError, match="key 'optimizer' of to_load is not in the checkpoint"):
        Checkpoint.load_objects(
            {"model": model, "optimizer": opt}, {"model": {"weight": np.zeros((2, 2))}}
        )
    assert all(np.array_equal(_weights(model)[k], v) for k, v in before.items())
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        Checkpoint.load_objects({"model": model}, tmp_path / "nope.npz")
    with pytest.raises(TypeError, match="checkpoint must be a path or a dict"):
        Checkpoint.load_objects({"model": model}, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no load_state_dict"):
        Checkpoint.load_objects({"model": object()}, {})
    with pytest.raises(TypeError, match="has no state_dict"):
        Checkpoint({"model": object()}, tmp_path)
    # strict=False reaches the model: a partial state loads.
    Checkpoint.load_objects(
        {"model": model}, {"model": {"bias": np.zeros(2, np.float32)}}, strict=False
    )
    assert model.bias.numpy().sum() == 0


def test_reload_objects_by_file_name_parts(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    handler = ModelCheckpoint(tmp_path, "pre", n_saved=None)
    trainer = _trainer()
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler, {"weights": model})
    trainer.run([0, 1], max_epochs=2)
    fresh = nn.Linear(2, 2)
    handler.reload_objects({"weights": fresh}, global_step=4, name="weights")
    assert np.array_equal(fresh.weight.numpy(), model.weight.numpy())


def test_checkpointer_state_dict_round_trip(tmp_path: Path) -> None:
    handler = Checkpoint({"m": nn.Linear(1, 1)}, tmp_path, n_saved=2)
    trainer = _trainer()
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run([0], max_epochs=3)
    state = handler.state_dict()
    assert state == {"_saved": [(2, "m_2.npz"), (3, "m_3.npz")]}
    other = Checkpoint({"m": nn.Linear(1, 1)}, lambda c, f: None)
    other.load_state_dict(state)
    assert other._saved == handler._saved
    with pytest.raises(ValueError, match="'_saved' is absent"):
        other.load_state_dict({})
    # A resumed handler goes on rotating the files the first one left.
    resumed = Checkpoint(
        {"m": nn.Linear(1, 1)}, DiskSaver(tmp_path, require_empty=False), n_saved=2
    )
    resumed.load_state_dict(state)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, resumed)
    trainer.remove_event_handler(handler, Events.EPOCH_COMPLETED)
    trainer.run([0], max_epochs=4)
    assert _names(tmp_path) == ["m_3.npz", "m_4.npz"]


def test_include_self_with_one_object_keeps_ignites_name_and_a_loadable_file(
    tmp_path: Path,
) -> None:
    model = nn.Linear(2, 1)
    handler = Checkpoint({"model": model}, tmp_path, include_self=True, n_saved=2)
    trainer = _trainer()
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run([0, 1], max_epochs=2)
    assert _names(tmp_path) == ["model_2.npz", "model_4.npz"]
    saved = tl.load(tmp_path / "model_4.npz")
    assert set(saved) == {"model", "checkpointer"}  # the model's own names stay clean
    assert saved["checkpointer"] == {"_saved": [(2, "model_2.npz"), (4, "model_4.npz")]}
    fresh = nn.Linear(2, 1)
    Checkpoint.load_objects({"model": fresh}, tmp_path / "model_4.npz")
    assert np.array_equal(fresh.weight.numpy(), model.weight.numpy())


# ---------------------------------------------------------------------- exact resume
@pytest.mark.timeout(60)
def test_a_run_resumed_in_a_new_process_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    full = B.training_run(init_seed=0)
    full["trainer"].run(full["loader"], max_epochs=B.MAX_EPOCHS)

    cut = B.training_run(init_seed=0)
    trainer = cut["trainer"]
    to_save = {k: cut[k] for k in ("trainer", "model", "optimizer", "lr_scheduler")}
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=7), Checkpoint(to_save, tmp_path))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=7), lambda e: e.terminate())
    trainer.run(cut["loader"], max_epochs=B.MAX_EPOCHS)
    assert trainer.state.iteration == 7 and _names(tmp_path) == ["checkpoint_7.npz"]

    out = tmp_path / "resumed.npz"
    subprocess.run(
        [sys.executable, "-m", BODIES, str(tmp_path / "checkpoint_7.npz"), str(out)],
        cwd=ROOT,
        check=True,
        timeout=50,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    resumed = tl.load(out)
    total = B.MAX_EPOCHS * B.EPOCH_LENGTH
    assert resumed["iteration"] == total
    # The resumed process saw the uninterrupted run's batches 8..15, in its order.
    assert [list(s) for s in resumed["seen"]] == full["seen"][7:]
    for k, v in _weights(full["model"]).items():
        assert np.array_equal(resumed["params"][k].numpy(), v), k


# ---------------------------------------------------------------------- several ranks
@pytest.mark.timeout(90)
@pytest.mark.parametrize("save_on_rank", [0, 1])
def test_only_one_rank_writes_at_two_ranks(tmp_path: Path, pools: Pools, save_on_rank: int) -> None:
    pool = pools("cpu", 2)
    got = pool.run(
        f"{BODIES}:rank_writes",
        {"directory": str(tmp_path), "save_on_rank": save_on_rank},
        deadline=60.0,
    )
    for g in got:  # the other rank never called tensorlib.save (it would have raised)
        assert g["files"] == ["checkpoint_6.npz", "checkpoint_8.npz"]
        assert g["last"] == str(tmp_path / f"writer{save_on_rank}" / "checkpoint_8.npz")
        assert g["loaded_equal"] and g["iteration"] == 8


@pytest.mark.timeout(90)
def test_a_writer_rank_outside_the_world_fails_on_every_rank(tmp_path: Path, pools: Pools) -> None:
    got = pools("cpu", 2).run(
        f"{BODIES}:bad_writer_rank", {"directory": str(tmp_path)}, deadline=60.0
    )
    assert got[0] == got[1]
    assert "save_on_rank=5 but the world has 2 rank(s)" in got[0]
