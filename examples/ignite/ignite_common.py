"""What the examples of Ignite's distributed page leave to the reader, shared by the scripts here.

The page's snippets use a ``model``, a ``train_loader``, an ``optimizer`` and a ``criterion``
they never define (``create_model()``, ``create_dataloader()``). Here they are scikit-learn's
8x8 digits (see ../train_mlp.py) in a one-process ``ddp.DataLoader`` (which the page's
``idist.auto_dataloader(train_loader)`` then gives each rank its share of) and a small MLP
without dropout, so that one process and N
ranks train on the same global batches from the same initial weights and reach the same
accuracy. This module also holds the scripts' common command line and the one-line exit for
a backend this machine lacks (horovod, xla-tpu, nccl without GPUs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

import ddp
import ddp.idist as idist
import tensorlib as tl
from tensorlib import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # train_mlp.py holds the split
from train_mlp import load_digits_split

__all__ = [
    "create_dataloader",
    "create_datasets",
    "create_model",
    "log",
    "make_parser",
    "parse",
    "require_backend",
]

Dataset = tuple[np.ndarray, np.ndarray]

# Backends Ignite knows that this machine may lack: what is missing, and idist's answer to
# whether it is here.
_NEEDS = {
    "horovod": ("this project has no Horovod backend", idist.has_hvd_support),
    "xla-tpu": ("this project has no XLA/TPU backend", idist.has_xla_support),
    "nccl": ("it needs CUDA GPUs with CuPy and NCCL", idist.has_nccl_support),
}


def create_model() -> nn.Module:
    """64 -> 64 -> 10 MLP (no dropout: every world size computes the same)."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def create_datasets(seed: int) -> tuple[Dataset, Dataset]:
    """``((x_train, y_train), (x_test, y_test))``: the digits, split and standardized."""
    x_train, y_train, x_test, y_test = load_digits_split(seed)
    return (x_train, y_train), (x_test, y_test)


def create_dataloader(data: Dataset, batch_size: int) -> ddp.DataLoader:
    """The training loader of one process: shuffled, the tail of each epoch dropped (so every
    world size trains on the same global batches); ``batch_size`` is the global batch."""
    return ddp.DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True)


@idist.one_rank_only()
def log(message: str) -> None:
    """Print on rank 0 only (the scripts' progress and result lines)."""
    print(message, flush=True)


def require_backend(backend: str | None, script: str) -> None:
    """Exit with one line saying what is missing when ``backend`` needs what is not here.

    Only the backends Ignite supports and this machine may lack are checked; any other
    backend goes to ``idist``, whose own error lists the usable ones.
    """
    if backend not in _NEEDS:
        return
    what, support = _NEEDS[backend]
    if support:
        return
    reason = tl.cuda_unavailable_reason() if backend == "nccl" else None
    sys.exit(
        f"{script}: backend {backend!r} is not available here: {what}"
        f"{f' ({reason})' if reason else ''}; available backends: "
        f"{', '.join(idist.available_backends())} (try --backend cpu)"
    )


def make_parser(
    doc: str, default_backend: str | None = None, epochs: int = 3, lr: float = 3e-3
) -> argparse.ArgumentParser:
    """The scripts' common options (a script adds its own before :func:`parse`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--backend",
        default=default_backend,
        help="cpu (gloo), threads, mpi, nccl, horovod, xla-tpu (default: "
        f"{default_backend or 'none: alone, or as launched'})",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to start here (default: none; alone, or a rank a launcher started)",
    )
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The parsed options and the ``config`` dict the scripts' ``training`` takes.

    Exits with one line for ``--backend threads`` without ``--nproc`` and, through
    :func:`require_backend`, for a backend this machine lacks.
    """
    args = parser.parse_args(argv)
    if args.backend == "threads" and args.nproc is None:
        parser.error("--backend threads runs its ranks as threads of this process: give --nproc N")
    require_backend(args.backend, parser.prog)
    config = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
    }
    return args, config
