"""Ignite's "Horovod Training" on ``ddp.idist`` and ``ddp.engine``.

The page's snippet initializes the ``horovod`` backend, which this project does not have:
run as is, the script says so in one line and exits 1. With ``--backend`` the same code runs
on this project's backends, where ``auto_optim`` returns the optimizer unchanged (DDP averages
the gradients in ``backward()``, the job Horovod's ``DistributedOptimizer`` does):

    python examples/ignite/horovod_training.py                   # horovod: not available here
    python examples/ignite/horovod_training.py --backend cpu     # alone (world size 1)
    python examples/ignite/horovod_training.py --backend cpu --nproc 2   # idist.Parallel
    python -m collectives.run --nproc-per-node 2 examples/ignite/horovod_training.py --backend cpu
    python examples/ignite/horovod_training.py --backend threads --nproc 2   # 2 rank threads
"""

from __future__ import annotations

import sys
from typing import Any

from ignite_common import (
    create_dataloader,
    create_datasets,
    create_model,
    log,
    make_parser,
    parse,
)

import ddp.idist as idist
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import Events, create_supervised_evaluator, create_supervised_trainer
from ddp.metrics import Accuracy, Loss
from tensorlib import optim


def training(local_rank: int, config: dict[str, Any]) -> float:
    """The page's snippet after ``initialize``, on every rank; returns the test accuracy."""
    tl.manual_seed(config["seed"])  # the same initial weights at every world size
    model = create_model()
    optimizer: optim.Optimizer = optim.Adam(model.parameters(), lr=config["lr"])
    criterion = F.cross_entropy
    train_set, test_set = create_datasets(config["seed"])

    # Auto-configure components
    model = idist.auto_model(model)
    optimizer = idist.auto_optim(optimizer)  # Horovod would wrap it; DDP needs no wrapper
    train_loader = create_dataloader(train_set, config["batch_size"])
    train_loader = idist.auto_dataloader(train_loader)

    # Broadcast initial parameters (auto_model's DDP broadcasts rank 0's weights already)
    idist.all_reduce(tl.tensor(0.0))  # Dummy reduce to ensure initialization

    # Create trainer
    trainer = create_supervised_trainer(model, optimizer, criterion, device=idist.device())

    @trainer.on(Events.EPOCH_COMPLETED)
    def log_epoch(engine: Any) -> None:
        log(f"epoch {engine.state.epoch}  last batch loss {engine.state.output:.4f}")

    log(f"world size {idist.get_world_size()} ({idist.backend() or 'serial'} backend)")
    # Run training
    trainer.run(train_loader, max_epochs=config["epochs"])

    test_loader = idist.auto_dataloader(test_set, batch_size=config["batch_size"], shuffle=False)
    evaluator = create_supervised_evaluator(
        model, metrics={"acc": Accuracy(), "loss": Loss(F.cross_entropy)}, device=idist.device()
    )
    metrics = evaluator.run(test_loader).metrics
    log(f"final test accuracy: {metrics['acc']:.2%}  loss: {metrics['loss']:.4f}")
    return float(metrics["acc"])


def main(argv: list[str] | None = None) -> int:
    """Run the example as the command line asks; 0 when it ran to its end."""
    args, config = parse(make_parser(__doc__, default_backend="horovod"), argv)
    if args.nproc is not None:
        # Spawn the ranks here: idist.Parallel initializes each one's group and finalizes it.
        with idist.Parallel(backend=args.backend, nproc_per_node=args.nproc) as parallel:
            parallel.run(training, config)
        return 0
    # Initialize Horovod backend (or --backend's: alone, a world of one; launched, its ranks)
    idist.initialize(args.backend)
    training(idist.get_local_rank(), config)
    # Finalize
    idist.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
