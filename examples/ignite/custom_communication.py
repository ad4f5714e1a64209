"""Ignite's "Custom Communication" on ``ddp.idist``: data parallelism by hand.

The page's snippet broadcasts the parameters from rank 0, all-reduces and averages the
gradients, and gathers the loss from every rank. Here it is the whole of data parallelism:
the model is not wrapped in DDP, each rank starts from different random weights (the
broadcast makes them rank 0's), and an ``Engine`` step averages the gradients itself, so
every world size trains as one process on the global batch. At the end rank 0 checks that
the replicas are identical and prints the test accuracy:

    python examples/ignite/custom_communication.py                  # alone (world size 1)
    python examples/ignite/custom_communication.py --nproc 2        # idist.Parallel spawns 2
    python -m collectives.run --nproc-per-node 2 examples/ignite/custom_communication.py
    python examples/ignite/custom_communication.py --backend threads --nproc 2   # 2 threads
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from ignite_common import create_datasets, create_model, log, make_parser, parse

import ddp.idist as idist
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import Engine, Events, create_supervised_evaluator
from ddp.metrics import Accuracy, Loss
from tensorlib import nn, optim


def replicas_identical(model: nn.Module) -> bool:
    """Whether every rank holds exactly the same parameters (max and min of each agree)."""
    flat = np.concatenate([p.data.ravel() for p in model.parameters()]).astype(np.float64)
    return bool(np.array_equal(idist.all_reduce(flat.copy(), "MAX"), idist.all_reduce(flat, "MIN")))


def training(local_rank: int, config: dict[str, Any]) -> float:
    """Every rank's training; returns the test accuracy."""
    # Different initial weights on every rank: the broadcast below is what makes them equal.
    tl.manual_seed(config["seed"] + idist.get_rank())
    model = create_model()  # not DDP: this script does the communication itself
    optimizer: optim.Optimizer = optim.Adam(model.parameters(), lr=config["lr"])
    train_set, test_set = create_datasets(config["seed"])
    train_loader = idist.auto_dataloader(
        train_set, batch_size=config["batch_size"], shuffle=True, drop_last=True
    )
    log(f"world size {idist.get_world_size()} ({idist.backend() or 'serial'} backend)")

    # Check if distributed
    if idist.world_size() > 1:
        # Broadcast model parameters from rank 0
        for param in model.parameters():
            idist.broadcast(param.data, src=0)

    def train_step(engine: Engine, batch: Any) -> float:
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if idist.world_size() > 1:
            # All-reduce gradients (every rank's batch has the same size: the mean of the
            # ranks' means is the global batch's mean)
            for param in model.parameters():
                if param.grad is not None:
                    idist.all_reduce(param.grad.data)
                    param.grad.data /= idist.world_size()
        optimizer.step()

        # Gather loss from all processes
        local_loss = tl.tensor(loss.item())
        all_losses = idist.all_gather(local_loss)  # shape (world_size,), as Ignite's
        avg_loss = all_losses.mean()  # seed: torch.mean(torch.stack(all_losses))
        return avg_loss.item()

    trainer = Engine(train_step)

    @trainer.on(Events.EPOCH_COMPLETED)
    def log_epoch(engine: Engine) -> None:
        log(f"epoch {engine.state.epoch}  last batch loss (all ranks) {engine.state.output:.4f}")

    trainer.run(train_loader, max_epochs=config["epochs"])
    log(f"replicas identical: {replicas_identical(model)}")

    test_loader = idist.auto_dataloader(test_set, batch_size=config["batch_size"], shuffle=False)
    evaluator = create_supervised_evaluator(
        model, metrics={"acc": Accuracy(), "loss": Loss(F.cross_entropy)}
    )
    metrics = evaluator.run(test_loader).metrics
    log(f"final test accuracy: {metrics['acc']:.2%}  loss: {metrics['loss']:.4f}")
    return float(metrics["acc"])


def main(argv: list[str] | None = None) -> int:
    """Run the example as the command line asks; 0 when it ran to its end."""
    args, config = parse(make_parser(__doc__), argv)
    backend = args.backend or ("cpu" if args.nproc is not None else None)
    # Alone, launched (the group is the launcher's) or spawning --nproc ranks.
    with idist.Parallel(backend=backend, nproc_per_node=args.nproc) as parallel:
        parallel.run(training, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
