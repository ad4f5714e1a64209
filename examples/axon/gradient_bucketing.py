"""axonml-distributed's README, "Gradient Bucketing", in Python.

    python examples/axon/gradient_bucketing.py             # the README's mock world of one
    python examples/axon/gradient_bucketing.py --world 4   # 4 ranks, one thread each

The README's Rust::

    let mut bucket = GradientBucket::new(1000);  // 1000 element capacity
    let grad1 = Tensor::from_vec(vec![0.1, 0.2], &[2]).unwrap();
    let grad2 = Tensor::from_vec(vec![0.3, 0.4, 0.5], &[3]).unwrap();
    bucket.add(&grad1);
    bucket.add(&grad2);
    let pg = ProcessGroup::mock();
    pg.backend().all_reduce(bucket.data_mut(), ReduceOp::Average);
    let synced_grads = bucket.extract();

``data_mut()`` is the bucket's flat buffer itself, so the backend's all-reduce averages it in
place and ``extract()`` gives the averaged gradients back in their shapes. In a world of N,
rank r's gradients are ``(r + 1)`` times the README's, so the average is ``(N + 1) / 2`` times
them. The script checks that and exits 1 when a value is wrong.
"""

from __future__ import annotations

import sys

import numpy as np
from axon_common import fmt, make_parser, run_world, say

import tensorlib as tl
from ddp.axon import GradientBucket, ProcessGroup, ReduceOp


def example(pg: ProcessGroup) -> bool:
    """The README's code on one rank; whether every value is what it should be."""
    r, n = pg.rank(), pg.world_size()
    scale = float(r + 1)  # this rank's gradients differ from the others'

    # Create gradient bucket for efficient all-reduce
    bucket = GradientBucket(1000)  # 1000 element capacity

    grad1 = tl.tensor([0.1, 0.2]) * scale
    grad2 = tl.tensor([0.3, 0.4, 0.5]) * scale

    bucket.add(grad1)
    bucket.add(grad2)

    # All-reduce the flattened bucket data
    pg.backend().all_reduce(bucket.data_mut(), ReduceOp.AVERAGE)

    # Extract synchronized gradients
    synced_grads = bucket.extract()

    mean = (n + 1) / 2
    shapes = [list(g.shape) for g in synced_grads]
    say(r, f"bucket of {bucket.size()} elements  synced {', '.join(map(fmt, synced_grads))}  "
           f"shapes {shapes}")  # fmt: skip
    want = [np.array([0.1, 0.2]), np.array([0.3, 0.4, 0.5])]
    return len(synced_grads) == 2 and all(
        g.shape == w.shape and np.allclose(g.numpy(), w * mean, rtol=1e-6)
        for g, w in zip(synced_grads, want, strict=True)
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
