"""axonml-distributed's README, "Gradient Synchronization", in Python.

    python examples/axon/gradient_sync.py             # the README's mock world of one
    python examples/axon/gradient_sync.py --world 4   # 4 ranks, one thread each

The README's Rust::

    let pg = ProcessGroup::mock();
    let mut gradients = vec![
        Tensor::from_vec(vec![0.1, 0.2], &[2]).unwrap(),
        Tensor::from_vec(vec![0.3, 0.4, 0.5], &[3]).unwrap(),
    ];
    sync_gradients(&mut gradients, &pg);
    let mut grad = Tensor::from_vec(vec![1.0, 2.0], &[2]).unwrap();
    sync_gradient(&mut grad, &pg);

The tensors are gradients themselves (not parameters) and are averaged in place; both
gradients of the list travel in one bucket, one all-reduce. In a world of N, rank r's
gradients are ``(r + 1)`` times the README's, so their average is ``(N + 1) / 2`` times them
on every rank. The script checks that and exits 1 when a value is wrong.
"""

from __future__ import annotations

import sys

import numpy as np
from axon_common import fmt, make_parser, run_world, say

import tensorlib as tl
from ddp.axon import ProcessGroup, sync_gradient, sync_gradients


def example(pg: ProcessGroup) -> bool:
    """The README's code on one rank; whether every value is what it should be."""
    r, n = pg.rank(), pg.world_size()
    scale = float(r + 1)  # this rank's gradients differ from the others'

    # Synchronize multiple gradients
    gradients = [
        tl.tensor([0.1, 0.2]) * scale,
        tl.tensor([0.3, 0.4, 0.5]) * scale,
    ]
    issued = sync_gradients(gradients, pg)

    # Or synchronize a single gradient
    grad = tl.tensor([1.0, 2.0]) * scale
    sync_gradient(grad, pg)

    mean = (n + 1) / 2
    say(r, f"gradients {', '.join(map(fmt, gradients))}  grad {fmt(grad)}  all-reduces {issued}")
    want = [np.array([0.1, 0.2]), np.array([0.3, 0.4, 0.5]), np.array([1.0, 2.0])]
    got = [*gradients, grad]
    return all(np.allclose(g.numpy(), w * mean, rtol=1e-6) for g, w in zip(got, want, strict=True))


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
