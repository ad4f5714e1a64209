"""Ignite's "Multi-GPU Training with DDP" on ``ddp.idist`` and ``ddp.engine``.

The page spawns one process per GPU with ``torch.multiprocessing.spawn(training,
args=(config,), nprocs=nprocs)``; here ``idist.spawn``, which has the same signature, does
that, and each worker joins the group itself (``idist.initialize("nccl")``) and leaves it
(``idist.finalize()``), as on the page. The backend is nccl, with one rank per visible GPU
unless ``--nproc`` says otherwise; without GPUs (or without the cuda extra) the script says
so in one line and exits 1. The same code runs on CPU ranks:

    python examples/ignite/multi_gpu_ddp.py                       # nccl, one rank per GPU
    python examples/ignite/multi_gpu_ddp.py --backend cpu         # alone (world size 1)
    python examples/ignite/multi_gpu_ddp.py --backend cpu --nproc 2   # idist.spawn starts 2
    python -m collectives.run --nproc-per-node 2 examples/ignite/multi_gpu_ddp.py --backend cpu
    python examples/ignite/multi_gpu_ddp.py --backend threads --nproc 2   # 2 rank threads

Rank 0 logs the loss every ``--log-every`` iterations (the page's ``every=100`` is more
than a few epochs of the digits) and the test accuracy at the end.
"""

from __future__ import annotations

import os
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
    """Every rank's training (the page's ``training(local_rank, config)``)."""
    # Initialize distributed backend ("nccl" on the page; here --backend's)
    idist.initialize(config["backend"])
    log(f"world size {idist.get_world_size()} ({idist.backend() or 'serial'} backend)")

    # Setup model and data
    tl.manual_seed(config["seed"])  # the same initial weights at every world size
    model = create_model()
    model = idist.auto_model(model)

    train_set, test_set = create_datasets(config["seed"])
    train_loader = create_dataloader(train_set, config["batch_size"])
    train_loader = idist.auto_dataloader(train_loader)

    # The page has lr=0.01 and no momentum, too slow for a few epochs of the digits.
    optimizer: optim.Optimizer = optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    optimizer = idist.auto_optim(optimizer)
    criterion = F.cross_entropy

    # Create trainer
    trainer = create_supervised_trainer(model, optimizer, criterion, device=idist.device())

    # Add logging only on rank 0
    @trainer.on(Events.ITERATION_COMPLETED(every=config["log_every"]))
    @idist.one_rank_only()
    def log_training(engine: Any) -> None:
        print(
            f"Rank {idist.rank()}: Iteration {engine.state.iteration}, "
            f"Loss: {engine.state.output:.4f}",
            flush=True,
        )

    # Run training
    trainer.run(train_loader, max_epochs=config["epochs"])

    test_loader = idist.auto_dataloader(test_set, batch_size=config["batch_size"], shuffle=False)
    evaluator = create_supervised_evaluator(
        model, metrics={"acc": Accuracy(), "loss": Loss(F.cross_entropy)}, device=idist.device()
    )
    metrics = evaluator.run(test_loader).metrics
    log(f"final test accuracy: {metrics['acc']:.2%}  loss: {metrics['loss']:.4f}")
    # Finalize
    idist.finalize()
    return float(metrics["acc"])


def main(argv: list[str] | None = None) -> int:
    """Run the example as the command line asks; 0 when it ran to its end."""
    parser = make_parser(__doc__, default_backend="nccl", lr=0.05)
    parser.add_argument("--log-every", type=int, default=10, help="iterations between logs")
    args, config = parse(parser, argv)
    config["log_every"] = args.log_every
    config["backend"] = args.backend
    nprocs = args.nproc
    if nprocs is None and args.backend == "nccl" and "WORLD_SIZE" not in os.environ:
        # One rank per GPU, unless a launcher started this process (it is one of its ranks).
        nprocs = tl.cuda_device_count()  # seed: torch.cuda.device_count()
    if nprocs is None:
        # Alone, or one of a launcher's ranks: this process is the worker.
        training(int(os.environ.get("LOCAL_RANK", 0)), config)
        return 0
    # The page's mp.spawn(training, args=(config,), nprocs=nprocs); backend: what the
    # workers' initialize() joins anyway, and "threads" makes them rank threads.
    idist.spawn(training, args=(config,), nprocs=nprocs, backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
