"""axonml-distributed's README, "Custom Synchronization Strategy", in Python.

    python examples/axon/sync_strategy.py             # the README's mock world of one
    python examples/axon/sync_strategy.py --world 4   # 4 ranks, one thread each

The README's Rust::

    let mut sync = GradientSynchronizer::new(
        GradSyncStrategy::Synchronous,
        25_000_000  // ~100MB bucket size for f32
    );
    sync.prepare(10);  // 10 parameters
    let grad = Tensor::from_vec(vec![1.0, 2.0], &[2]).unwrap();
    sync.add_gradient(0, &grad);
    let pg = ProcessGroup::mock();
    sync.sync_all(&pg);
    sync.clear();

``add_gradient(i, grad)`` keeps the tensor itself, and ``sync_all`` averages every gradient
added, in place, one all-reduce per bucket of at most ``bucket_size`` elements. In a world of
N, rank r's gradient is ``(r + 1) * [1, 2]``, so after ``sync_all`` it is ``(N + 1) / 2 *
[1, 2]`` on every rank. The script checks that and exits 1 when a value is wrong.
"""

from __future__ import annotations

import sys

import numpy as np
from axon_common import fmt, make_parser, run_world, say

import tensorlib as tl
from ddp.axon import GradientSynchronizer, GradSyncStrategy, ProcessGroup


def example(pg: ProcessGroup) -> bool:
    """The README's code on one rank; whether the value is what it should be."""
    r, n = pg.rank(), pg.world_size()
    sync = GradientSynchronizer(
        GradSyncStrategy.Synchronous,
        25_000_000,  # ~100MB bucket size for f32
    )

    sync.prepare(10)  # 10 parameters

    # Add gradients during backward pass
    grad = tl.tensor([1.0, 2.0]) * float(r + 1)  # this rank's gradient
    sync.add_gradient(0, grad)

    # Synchronize all buckets
    issued = sync.sync_all(pg)
    say(r, f"grad after sync_all {fmt(grad)}  all-reduces {issued}")

    sync.clear()
    return bool(np.allclose(grad.numpy(), (n + 1) / 2 * np.array([1.0, 2.0]), rtol=1e-6))


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
