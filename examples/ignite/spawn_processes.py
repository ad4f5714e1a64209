"""Ignite's "Process Management with Spawn" on ``ddp.idist``: ``idist.spawn`` starts the workers.

Every worker says it started, then trains; rank 0 logs and prints the test accuracy.
``idist.spawn`` has already joined each worker to the group when it calls it (as Ignite's
does), so the page's ``idist.initialize()`` in the worker is done in ``main`` instead, for a
process that runs the worker itself (alone, or as one of a launcher's ranks):

    python examples/ignite/spawn_processes.py                    # alone: this process works
    python examples/ignite/spawn_processes.py --nproc 2          # idist.spawn starts 2 workers
    python -m collectives.run --nproc-per-node 2 examples/ignite/spawn_processes.py
    python examples/ignite/spawn_processes.py --backend threads --nproc 2   # 2 worker threads
"""

from __future__ import annotations

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

    # Initialize backend within worker
    # seed: idist.initialize() -- idist.spawn (or main, for a lone or launched process) has
    # joined this worker to the group already; it only checks the group is the one expected.
    if idist.get_world_size() != world_size:
        raise RuntimeError(
            f"worker {rank}: expected {world_size} ranks, the group has {idist.get_world_size()}"
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

    # seed: idist.finalize() -- idist.spawn (or main) destroys the group after the worker
    return float(metrics["acc"])


def main(argv: list[str] | None = None) -> int:
    """Run the example as the command line asks; 0 when it ran to its end."""
    args, config = parse(make_parser(__doc__), argv)
    if args.nproc is None:
        # No workers to spawn: this process is the worker (alone, or a launched rank).
        idist.initialize(args.backend)
        train_worker(idist.get_rank(), idist.get_world_size(), config)
        idist.finalize()
        return 0
    # Spawn workers
    # seed: idist.spawn(train_worker, args=(4, config), nprocs=4, join=True)
    idist.spawn(
        args.backend or "cpu",
        train_worker,
        args=(args.nproc, config),  # world_size, config
        nproc_per_node=args.nproc,
        join=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
