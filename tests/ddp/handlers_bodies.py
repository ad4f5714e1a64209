"""Rank bodies and a training run for the ``ddp.handlers`` tests (tests/ddp/test_handlers.py).

``training_run`` builds the same small regression run (engine, model, SGD with momentum, a
step lr scheduler, a shuffling ``ddp.DataLoader``) in any process; ``resume_in_new_process``
is what a restarted job does: it loads a checkpoint into fresh objects and finishes the run.
The rank bodies run on every rank of a pool (tests/ddp/conftest.py).
"""

from __future__ import annotations

import io
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np

import ddp
import ddp.idist as idist
import tensorlib as tl
from ddp.engine import Engine, Events
from ddp.handlers import Checkpoint, DiskSaver, ProgressBar
from tensorlib import nn, optim

MAX_EPOCHS = 3
EPOCH_LENGTH = 5  # 23 samples in batches of 5


def training_run(init_seed: int) -> dict[str, Any]:
    """A fresh run; ``init_seed`` seeds the model's initial weights."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((23, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], dtype=np.float32) + 0.1).astype(np.float32)
    tl.manual_seed(init_seed)
    model = nn.Linear(3, 1)
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    loader = ddp.DataLoader((x, y), batch_size=5, shuffle=True, seed=11)

    def step(engine: Engine, batch: Any) -> float:
        xb, yb = batch
        opt.zero_grad()
        loss = ((model(xb) - yb) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step()
        return float(loss.item())

    trainer = Engine(step)
    seen: list[list[float]] = []  # the batches, to show both runs saw the same order
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.batch[0].numpy()[:, 0].tolist())
    )
    return {
        "trainer": trainer,
        "model": model,
        "optimizer": opt,
        "lr_scheduler": sched,
        "loader": loader,
        "seen": seen,
    }


def params(model: nn.Module) -> dict[str, np.ndarray[Any, Any]]:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def resume_in_new_process(checkpoint: str, out: str) -> None:
    """Load ``checkpoint`` into a fresh run, finish it, save the final weights to ``out``."""
    run = training_run(init_seed=1234)  # other weights: only the checkpoint can set them
    to_load = {k: run[k] for k in ("trainer", "model", "optimizer", "lr_scheduler")}
    Checkpoint.load_objects(to_load, checkpoint)
    run["trainer"].run(run["loader"], max_epochs=MAX_EPOCHS)
    tl.save(
        {
            "params": run["model"].state_dict(),
            "iteration": run["trainer"].state.iteration,
            "seen": run["seen"],
        },
        out,
    )


# ---------------------------------------------------------------------- rank bodies
def _forbidden_save(obj: Any, path: Any) -> None:
    raise AssertionError(f"rank {idist.get_rank()} called tensorlib.save({path})")


def rank_writes(directory: str, save_on_rank: int) -> dict[str, Any]:
    """Every rank runs a trainer with a Checkpoint; only ``save_on_rank`` may call tl.save.

    The model is a DistributedDataParallel (its module's names are saved). Returns the
    files the rank sees after a barrier and what loading the last checkpoint gives.
    """
    rank = idist.get_rank()
    root = Path(directory) / f"writer{save_on_rank}"
    real_save = tl.save
    if rank != save_on_rank:
        tl.save = _forbidden_save
    try:
        tl.manual_seed(5)
        model = ddp.DistributedDataParallel(nn.Linear(2, 2))
        trainer = Engine(lambda e, b: None)
        handler = Checkpoint(
            {"model": model, "trainer": trainer}, str(root), n_saved=2, save_on_rank=save_on_rank
        )
        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2), handler)
        trainer.run([0, 1, 2], max_epochs=3)
    finally:
        tl.save = real_save
    idist.barrier()  # the files are on disk once the writer got here
    files = sorted(os.listdir(root))
    fresh = nn.Linear(2, 2)
    fresh_trainer = Engine(lambda e, b: None)
    last = handler.last_checkpoint
    if last is None:
        raise AssertionError(f"rank {rank}: the handler kept no checkpoint")
    Checkpoint.load_objects({"model": fresh, "trainer": fresh_trainer}, last)
    same = all(
        np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(
            fresh.state_dict().values(), model.module.state_dict().values(), strict=True
        )
    )
    idist.barrier()  # nobody leaves before every rank has read the files
    return {
        "files": files,
        "last": str(last),
        "loaded_equal": same,
        "iteration": fresh_trainer.state.iteration,
    }


def bad_writer_rank(directory: str) -> str:
    """save_on_rank beyond the world: every rank raises the same error, so none waits."""
    handler = Checkpoint({"m": nn.Linear(1, 1)}, DiskSaver(directory, save_on_rank=5))
    trainer = Engine(lambda e, b: None)
    trainer.add_event_handler(Events.COMPLETED, handler)
    try:
        trainer.run([0])
    except ValueError as exc:
        return str(exc)
    raise AssertionError("no error for save_on_rank beyond the world size")


def progress_rank() -> dict[str, Any]:
    """Run an engine with a ProgressBar (the bar on stderr, log_message on stdout); return
    what each rank printed."""
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        bar = ProgressBar(persist=True)
        trainer = Engine(lambda e, b: float(b))
        bar.attach(trainer, output_transform=lambda out: {"loss": out})
        trainer.add_event_handler(Events.COMPLETED, lambda e: bar.log_message("all done"))
        trainer.run([1, 2, 3, 4], max_epochs=2)
    return {
        "rank": idist.get_rank(),
        "stderr": err.getvalue(),
        "stdout": out.getvalue(),
        "handlers": trainer.has_event_handler(bar._close),
    }


def nan_on_one_rank() -> list[int]:
    """Rank 1's output turns NaN at iteration 3, rank 0's never; the iterations each ran."""
    from ddp.handlers import TerminateOnNan

    ran: list[int] = []

    def step(engine: Engine, batch: Any) -> float:
        ran.append(engine.state.iteration)
        bad = idist.get_rank() == 1 and engine.state.iteration >= 3
        return float("nan") if bad else 1.0

    trainer = Engine(step)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    trainer.run(range(4), max_epochs=2)
    return ran


if __name__ == "__main__":  # python -m tests.ddp.handlers_bodies CHECKPOINT OUT
    resume_in_new_process(sys.argv[1], sys.argv[2])
