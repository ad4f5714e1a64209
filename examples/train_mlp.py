"""Train an MLP on scikit-learn's 8x8 handwritten digits with tensorlib, in one process.

    python examples/train_mlp.py                 # CPU, 30 epochs, ~97% test accuracy
    python examples/train_mlp.py --device cuda   # the same on a GPU (needs the cuda extra)

The digits (1,797 images, 10 classes) ship inside scikit-learn, so no download is needed.
The split, the initialization and the batch order all derive from ``--seed``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

import tensorlib as tl
import tensorlib.functional as F
from tensorlib import nn, optim


def load_digits_split(seed: int, test_fraction: float = 0.2) -> tuple[np.ndarray, ...]:
    """Return standardized (x_train, y_train, x_test, y_test) float32/int64 arrays."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # the examples extra brings it
        raise SystemExit(
            "this example needs scikit-learn for its dataset: pip install -e '.[examples]'"
        ) from exc
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    n_test = int(len(x) * test_fraction)
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    # Standardize with training statistics only (pixels that are always 0 keep std 1).
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def make_model(hidden: int, device: str) -> nn.Module:
    """64 -> hidden -> hidden -> 10 MLP with ReLU and a little dropout."""
    return nn.Sequential(
        nn.Linear(64, hidden, device=device),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, hidden, device=device),
        nn.ReLU(),
        nn.Linear(hidden, 10, device=device),
    )


def _progress(it: Iterable[Any], total: int, desc: str, enabled: bool) -> Iterator[Any]:
    """tqdm when installed (to stderr), else a plain in-place bar."""
    if not enabled:
        yield from it
        return
    try:
        from tqdm import tqdm
    except ImportError:
        for i, item in enumerate(it, 1):
            filled = int(30 * i / total)
            print(
                f"\r{desc} [{'#' * filled}{'.' * (30 - filled)}] {i}/{total}",
                end="",
                file=sys.stderr,
                flush=True,
            )
            yield item
        print(file=sys.stderr)
        return
    yield from tqdm(it, total=total, desc=desc, leave=False, file=sys.stderr)


@tl.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, device: str) -> tuple[float, float]:
    """Return (mean loss, accuracy) on (x, y)."""
    model.eval()
    logits = model(tl.tensor(x, device=device))
    loss = F.cross_entropy(logits, tl.tensor(y, device=device)).item()
    acc = float((logits.argmax(axis=1).numpy() == y).mean())
    model.train()
    return float(loss), acc


def train(
    epochs: int = 30,
    batch_size: int = 64,
    lr: float = 3e-3,
    hidden: int = 128,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = True,
    log: bool = True,
) -> float:
    """Train and return the final test accuracy."""
    tl.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_digits_split(seed)
    model = make_model(hidden, device)
    opt = optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    rng = np.random.default_rng(seed + 1)
    steps = (len(x_train) + batch_size - 1) // batch_size
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_train))
        total = 0.0
        batches = (order[i : i + batch_size] for i in range(0, len(order), batch_size))
        for idx in _progress(batches, steps, f"epoch {epoch}/{epochs}", progress):
            xb = tl.tensor(x_train[idx], device=device)
            yb = tl.tensor(y_train[idx], device=device)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        if log:
            test_loss, test_acc = evaluate(model, x_test, y_test, device)
            print(
                f"epoch {epoch:3d}  train loss {total / len(x_train):.4f}  "
                f"test loss {test_loss:.4f}  test acc {test_acc:.2%}",
                flush=True,
            )
    _, acc = evaluate(model, x_test, y_test, device)
    if log:
        took = time.perf_counter() - start
        print(f"final test accuracy: {acc:.2%} ({len(y_test)} images, {took:.1f} s, {device})")
    return acc


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else args.device
    train(
        args.epochs,
        args.batch_size,
        args.lr,
        args.hidden,
        args.seed,
        device,
        progress=not args.no_progress,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
