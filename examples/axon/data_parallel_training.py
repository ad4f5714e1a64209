"""axonml-distributed's README, "Basic DDP Training", in Python.

    python examples/axon/data_parallel_training.py             # the README's mock world of one
    python examples/axon/data_parallel_training.py --world 4   # 4 ranks, one thread each

The README's Rust::

    let world = World::mock();  // Use mock for testing
    let model = Linear::new(10, 5);
    let mut ddp = DistributedDataParallel::new(model, world.default_group().clone());
    ddp.sync_parameters();
    ddp.train();
    for batch in data_loader.iter() {
        let output = ddp.forward(&input);
        // ... compute loss and backward ...
        ddp.sync_gradients();
        // ... optimizer step ...
    }

What the README leaves out is here: a linear regression (512 samples, 10 features, 5
targets), global batches of 64 of which each of N ranks takes every N-th row, a mean squared
error and SGD. Here ``loss.backward()`` already averages the gradients over the ranks (DDP's
buckets, overlapped with backward); ``ddp.sync_gradients()`` checks that it did and reduces
nothing twice (see docs/axon.md). Every rank starts from weights of its own, which DDP
replaces by rank 0's, so N ranks train exactly as one process on the whole batch: the final
loss is the same at every world size, up to float rounding. The script prints the loss of each
epoch and checks that the ranks end with identical weights.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
from axon_common import make_parser, run_world, say

import tensorlib as tl
from ddp.axon import (
    DistributedDataParallel,
    World,
    all_gather,
    all_reduce_mean,
    is_main_process,
)
from tensorlib.nn import Linear

SAMPLES, FEATURES, TARGETS, BATCH, EPOCHS, LR = 512, 10, 5, 64, 5, 0.1


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """The same regression problem on every rank."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    w = rng.standard_normal((FEATURES, TARGETS)).astype(np.float32)
    y = x @ w + 0.01 * rng.standard_normal((SAMPLES, TARGETS)).astype(np.float32)
    return x, y


def data_loader(rank: int, world_size: int) -> Iterator[tuple[tl.Tensor, tl.Tensor]]:
    """This rank's share (every world_size-th row) of each global batch."""
    x, y = make_data()
    for start in range(0, SAMPLES, BATCH):
        rows = slice(start + rank, start + BATCH, world_size)
        yield tl.tensor(x[rows]), tl.tensor(y[rows])


def train(world: World) -> float:
    """The README's loop on one rank; the final epoch's loss."""
    rank, n = world.rank(), world.world_size()
    model = Linear(FEATURES, TARGETS)
    rng = np.random.default_rng(100 + rank)  # each rank's own start: DDP copies rank 0's
    for p in model.parameters():
        p.data[...] = 0.1 * rng.standard_normal(p.shape)
    ddp = DistributedDataParallel(model, world.default_group())
    optimizer = tl.optim.SGD(ddp.parameters(), lr=LR)

    # Synchronize parameters from rank 0 at start of training
    ddp.sync_parameters()

    # Training loop
    ddp.train()
    loss_value = float("nan")
    for epoch in range(1, EPOCHS + 1):
        total = tl.tensor([0.0])
        for inputs, targets in data_loader(rank, n):
            output = ddp.forward(inputs)
            loss = ((output - targets) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()

            # Synchronize gradients across all processes
            ddp.sync_gradients()

            optimizer.step()
            total += loss.detach()
        all_reduce_mean(total, world.default_group())  # the mean over ranks of the sums
        loss_value = float(total.numpy()[0]) / (SAMPLES // BATCH)
        if is_main_process(world.default_group()):
            say(rank, f"epoch {epoch}/{EPOCHS}  loss {loss_value:.6f}")

    # Every rank must hold the same weights: gather them and compare.
    flat = tl.tensor(np.concatenate([p.numpy().reshape(-1) for p in model.parameters()]))
    every = all_gather(flat, world.default_group()).numpy()
    same = bool((every == every[0]).all())
    if is_main_process(world.default_group()):
        say(rank, f"weights identical on all {n} rank(s): {same}")
    if not same:
        raise RuntimeError("the ranks' weights differ after training")
    return loss_value


def main() -> int:
    args = make_parser(__doc__).parse_args()
    if args.world == 1:
        losses = [train(World.mock())]  # the README's mock world of one
    else:
        losses = run_world(args.world, lambda backend: train(World.init(backend)))
    print(f"final loss {losses[0]:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
