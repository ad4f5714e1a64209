"""Ignite's "Process Management with Spawn" on ``ddp.idist``: ``idist.spawn`` starts the workers.

The page's code: ``idist.spawn(train_worker, args=(world_size, config), nprocs=N,
join=True)`` starts the workers, each of which says it started, joins the group with
``idist.initialize()``, trains, and leaves with ``idist.finalize()``; rank 0 logs and prints
the test accuracy. Without ``--nproc`` this process is the one worker (alone, or one of a
launcher's ranks, which the launcher's RANK and WORLD_SIZE name):

    python examples/ignite/spawn_processes.py                    # alone: this process works
    python examples/ignite/spawn_processes.py --nproc 2          # idist.spawn starts 2 workers
    python -m collectives.run --nproc-per-node 2 examples/ignite/spawn_processes.py
    python examples/ignite/spawn_processes.py --backend threads --nproc 2   # 2 worker threads

``--backend`` is the one the workers' ``idist.initialize()`` joins (none: chosen, cpu here).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ignite_common import create_datasets, create_model, log, make_parser, parse

import ddp.idist as idist
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import Events, create_supervised_evaluator, create_supervised_trainer
from ddp.metrics import Accuracy, Loss
from tensorlib import optim


def train_worker(rank: int, world_size: int, config: dict[str, Any]) -> float:
    """Worker function for each process; returns the test accuracy."""
    # One write per line: rank threads print at the same time.
    sys.stdout.write(f"Worker {rank} of {world_size} started\n")
    sys.stdout.flush()

    # Initialize backend within worker (config["backend"]: --backend, None by default)
    idist.initialize(config["backend"])
    if idist.world_size() != world_size:
        raise RuntimeError(
            f"worker {rank}: expected {world_size} ranks, the group has {idist.world_size()}"
        )

    # Training code here
    tl.manual_seed(config["seed"])  # the same initial weights at every world size
    train_set, test_set = create_datasets(config["seed"])
    model = idist.auto_model(create_model())
    optimizer = idist.auto_optim(optim.Adam(model.parameters(), lr=config["lr"]))
    train_loader = idist.auto_dataloader(
        train_set, batch_size=config["batch_size"], shuffle=True, drop_last=True
    )
    trainer = create_supervised_trainer(model, optimizer, F.cross_entropy, device=idist.device())

    @trainer.on(Events.EPOCH_COMPLETED)
    def log_epoch(engine: Any) -> None:
        log(f"epoch {engine.state.epoch}  last batch loss {engine.state.output:.4f}")

    trainer.run(train_loader, max_epochs=config["epochs"])
    test_loader = idist.auto_dataloader(test_set, batch_size=config["batch_size"], shuffle=False)
    evaluator = create_supervised_evaluator(
        model, metrics={"acc": Accuracy(), "loss": Loss(F.cross_entropy)}, device=idist.device()
    )
    metrics = evaluator.run(test_loader).metrics
    log(f"final test accuracy: {metrics['acc']:.2%}  loss: {metrics['loss']:.4f}")

    idist.finalize()
    return float(metrics["acc"])


def main(argv: list[str] | None = None) -> int:
    """Run the example as the command line asks; 0 when it ran to its end."""
    args, config = parse(make_parser(__doc__), argv)
    config["backend"] = args.backend
    if args.nproc is None:
        # No workers to spawn: this process is the worker (alone, or a launched rank).
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        train_worker(rank, world_size, config)
        return 0
    # Spawn workers (backend: what their initialize() joins; "threads" makes them threads)
    idist.spawn(
        train_worker,
        args=(args.nproc, config),  # world_size, config
        nprocs=args.nproc,
        join=True,
        backend=args.backend,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
