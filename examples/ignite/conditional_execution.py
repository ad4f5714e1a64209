"""Ignite's "Conditional Execution" on ``ddp.idist``: code that runs on one rank only.

``@idist.one_rank_only(rank=0)`` saves the checkpoint (rank 0 writes the file once, whatever
the world size); ``@idist.one_rank_only(rank=0, with_barrier=True)`` logs the metrics after
each epoch, every rank waiting until rank 0 has; and a plain rank test prints a line on the
master process only. The training around them is the page's basic setup:

    python examples/ignite/conditional_execution.py                 # alone (world size 1)
    python examples/ignite/conditional_execution.py --nproc 2       # idist.Parallel spawns 2
    python -m collectives.run --nproc-per-node 2 examples/ignite/conditional_execution.py
    python examples/ignite/conditional_execution.py --backend threads --nproc 2   # 2 threads

``--checkpoint`` is where the model's state dict goes (default ``checkpoint.pth`` here, as on
the page; tensorlib's own format, read back with ``tensorlib.load``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ignite_common import create_datasets, create_model, make_parser, parse

import ddp.idist as idist
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import Engine, Events, create_supervised_evaluator, create_supervised_trainer
from ddp.metrics import Accuracy, Loss
from tensorlib import optim


def training(local_rank: int, config: dict[str, Any]) -> float:
    """Every rank's training; returns the test accuracy."""
    tl.manual_seed(config["seed"])  # the same initial weights at every world size
    train_set, test_set = create_datasets(config["seed"])
    model = idist.auto_model(create_model())
    optimizer = idist.auto_optim(optim.Adam(model.parameters(), lr=config["lr"]))
    train_loader = idist.auto_dataloader(
        train_set, batch_size=config["batch_size"], shuffle=True, drop_last=True
    )
    test_loader = idist.auto_dataloader(test_set, batch_size=config["batch_size"], shuffle=False)
    trainer = create_supervised_trainer(model, optimizer, F.cross_entropy, device=idist.device())
    evaluator = create_supervised_evaluator(
        model, metrics={"acc": Accuracy(), "loss": Loss(F.cross_entropy)}, device=idist.device()
    )
    metrics: dict[str, Any] = {}

    # Execute only on rank 0
    @idist.one_rank_only(rank=0)
    def save_checkpoint() -> None:
        tl.save(model.state_dict(), config["checkpoint"])  # seed: torch.save(...)
        print(f"saved checkpoint to {config['checkpoint']}", flush=True)

    # Execute on rank 0 with barrier
    @idist.one_rank_only(rank=0, with_barrier=True)
    def log_metrics() -> None:
        print(f"Epoch completed, metrics: {metrics}", flush=True)

    @trainer.on(Events.EPOCH_COMPLETED)
    def evaluate(engine: Engine) -> None:
        # Every rank evaluates its share (the metrics sum over the ranks), one rank logs.
        metrics.update(evaluator.run(test_loader).metrics)
        metrics["epoch"] = engine.state.epoch
        log_metrics()

    trainer.add_event_handler(Events.COMPLETED, lambda _: save_checkpoint())

    # Manual rank checking
    if idist.rank() == 0:
        print("This runs only on the master process", flush=True)

    trainer.run(train_loader, max_epochs=config["epochs"])
    if idist.rank() == 0:
        print(f"final test accuracy: {metrics['acc']:.2%}  loss: {metrics['loss']:.4f}")
    return float(metrics["acc"])


def main(argv: list[str] | None = None) -> int:
    """Run the example as the command line asks; 0 when it ran to its end."""
    parser = make_parser(__doc__)
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoint.pth"))
    args, config = parse(parser, argv)
    config["checkpoint"] = str(args.checkpoint)
    backend = args.backend or ("cpu" if args.nproc is not None else None)
    # Alone, launched (the group is the launcher's) or spawning --nproc ranks.
    with idist.Parallel(backend=backend, nproc_per_node=args.nproc) as parallel:
        parallel.run(training, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
