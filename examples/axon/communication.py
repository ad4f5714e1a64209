"""axonml-distributed's README, "Communication Primitives", in Python.

    python examples/axon/communication.py             # the README's mock world of one
    python examples/axon/communication.py --world 4   # 4 ranks, one thread each

The README's Rust::

    let pg = ProcessGroup::mock();
    let mut tensor = Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3]).unwrap();
    all_reduce_sum(&mut tensor, &pg);
    all_reduce_mean(&mut tensor, &pg);
    broadcast(&mut tensor, &pg);
    let gathered = all_gather(&tensor, &pg);
    barrier(&pg);
    let my_rank = rank(&pg);
    let total_processes = world_size(&pg);
    let is_main = is_main_process(&pg);

In a world of N, rank r starts from ``(r + 1) * [1, 2, 3]`` (in a world of one that is the
README's tensor): the sum is ``N (N + 1) / 2 * [1, 2, 3]`` on every rank, the mean of equal
values leaves it so, and so does the broadcast from rank 0. The script checks each value and
exits 1 when one is wrong.
"""

from __future__ import annotations

import sys

import numpy as np
from axon_common import fmt, make_parser, run_world, say

import tensorlib as tl
from ddp.axon import (
    ProcessGroup,
    all_gather,
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    broadcast,
    is_main_process,
    rank,
    world_size,
)


def example(pg: ProcessGroup) -> bool:
    """The README's code on one rank; whether every value is what it should be."""
    r, n = pg.rank(), pg.world_size()
    # All-reduce operations
    tensor = tl.tensor([1.0, 2.0, 3.0]) * float(r + 1)  # this rank's values
    all_reduce_sum(tensor, pg)
    summed = tensor.numpy().copy()
    all_reduce_mean(tensor, pg)

    # Broadcast from rank 0
    broadcast(tensor, pg)

    # All-gather across processes
    gathered = all_gather(tensor, pg)

    # Barrier synchronization
    barrier(pg)

    # Query process information
    my_rank = rank(pg)
    total_processes = world_size(pg)
    is_main = is_main_process(pg)

    want = n * (n + 1) / 2 * np.array([1.0, 2.0, 3.0], dtype=np.float32)
    say(my_rank, f"sum {fmt(tl.tensor(summed))}  after mean and broadcast {fmt(tensor)}")
    say(my_rank, f"gathered shape {list(gathered.shape)}  rank {my_rank} of {total_processes}"
                 f"  main {is_main}")  # fmt: skip
    return bool(
        np.array_equal(summed, want)
        and np.array_equal(tensor.numpy(), want)
        and gathered.shape == (n, 3)
        and np.array_equal(gathered.numpy(), np.stack([want] * n))
        and (my_rank, total_processes, is_main) == (r, n, r == 0)
    )


def main() -> int:
    args = make_parser(__doc__).parse_args()
    if args.world == 1:
        ok = [example(ProcessGroup.mock())]  # the README's world of one
    else:
        ok = run_world(args.world, lambda backend: example(ProcessGroup(backend)))
    print("all values correct" if all(ok) else "WRONG VALUES", flush=True)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
