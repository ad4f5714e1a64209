"""An Ignite-style training script on ``ddp.idist``: the same code alone, launched or spawned.

It is written the way PyTorch Ignite's ``idist`` scripts are (``idist.Parallel``,
``auto_model``/``auto_optim``/``auto_dataloader``, ``one_rank_only`` logging, ``all_reduce``
of the metrics), with tensorlib in place of torch:

    python examples/train_ignite_style.py                  # one process (world size 1)
    python examples/train_ignite_style.py --nproc 2        # Parallel spawns 2 CPU ranks
    python -m collectives.run --nproc-per-node 2 examples/train_ignite_style.py
    mpiexec -n 2 python examples/train_ignite_style.py --backend mpi

``--batch-size`` is the global batch (each of N ranks takes 1/N of it, from a distributed
sampler), the model has no dropout and the tail of each epoch is dropped, so every world size
trains on the same global batches and reaches the same accuracy up to float rounding.
The digits data ships with scikit-learn (see train_mlp.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

import ddp.idist as idist
import tensorlib as tl
import tensorlib.functional as F
from tensorlib import nn, optim

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_mlp.py holds the data split
from train_mlp import load_digits_split


@idist.one_rank_only()
def log(message: str) -> None:
    """Printed by rank 0 only."""
    print(message, flush=True)


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy on the whole of (x, y): each rank scores its own share, the counts are summed."""
    share = np.array_split(np.arange(len(x)), idist.get_world_size())[idist.get_rank()]
    correct = 0
    if len(share):
        with tl.no_grad():
            logits = model(tl.tensor(x[share]))
        correct = int((logits.argmax(axis=1).numpy() == y[share]).sum())
    return idist.all_reduce(correct) / len(y)


def training(local_rank: int, config: dict[str, Any]) -> float:
    """Every rank's loop (Ignite's ``training(local_rank, config)``); returns the accuracy."""
    tl.manual_seed(config["seed"])  # the same initial weights everywhere (DDP broadcasts too)
    x_train, y_train, x_test, y_test = load_digits_split(config["seed"])
    train_loader = idist.auto_dataloader(
        (x_train, y_train),
        batch_size=config["batch_size"],
        shuffle=True,
        drop_last=True,  # the same global batches at every world size
        num_workers=2,  # as Ignite scripts pass it; there are no loader processes here
    )
    model = idist.auto_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = idist.auto_optim(optim.Adam(model.parameters(), lr=config["lr"]))
    log(
        f"world size {idist.get_world_size()} ({idist.backend() or 'serial'} backend), "
        f"{len(train_loader)} steps per epoch of {config['batch_size']} samples"
    )
    acc = 0.0
    for epoch in range(1, config["epochs"] + 1):
        train_loader.set_epoch(epoch)
        total, batches = 0.0, 0
        for xb, yb in train_loader:
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, batches = total + loss.item(), batches + 1
        mean_loss = idist.all_reduce(total / batches) / idist.get_world_size()
        acc = accuracy(model, x_test, y_test)
        log(f"epoch {epoch}  train loss {mean_loss:.4f}  test acc {acc:.2%}")
    log(f"final test accuracy: {acc:.2%}")
    return acc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend", default=None, help="cpu (gloo), mpi, nccl; None: alone or the launcher's"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to spawn (needs a backend; cpu if none given)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
    }
    backend = args.backend or ("cpu" if args.nproc else None)
    with idist.Parallel(backend=backend, nproc_per_node=args.nproc) as parallel:
        parallel.run(training, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
