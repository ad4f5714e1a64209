"""axonml-distributed's README, "Multi-Backend Setup", in Python.

    python examples/axon/multi_backend.py             # the README's 4 backends
    python examples/axon/multi_backend.py --world 8

The README's Rust::

    // Create multiple mock backends (simulates multi-process)
    let backends = MockBackend::create_world(4);
    // Each process creates its ProcessGroup
    for backend in backends {
        let pg = ProcessGroup::new(Arc::new(backend));
        println!("Rank {} of {}", pg.rank(), pg.world_size());
    }

The backends are connected: a collective waits until every rank called it. The README's loop
makes the groups one after the other and only asks each its rank; then, as a simulated
process would, each backend runs in a thread of its own and all-reduces its rank, which gives
``0 + 1 + ... + (N - 1)`` on every rank. The script checks that and exits 1 when it is wrong.
"""

from __future__ import annotations

import sys
import threading

from axon_common import make_parser, say

import tensorlib as tl
from ddp.axon import MockBackend, ProcessGroup, all_reduce_sum


def main() -> int:
    args = make_parser(__doc__, default_world=4).parse_args()

    # Create multiple mock backends (simulates multi-process)
    backends = MockBackend.create_world(args.world)

    # Each process creates its ProcessGroup
    groups = []
    for backend in backends:
        pg = ProcessGroup(backend)
        print(f"Rank {pg.rank()} of {pg.world_size()}", flush=True)
        groups.append(pg)

    # Each simulated process in a thread of its own: its collectives meet the others'.
    sums = [0.0] * len(groups)

    def process(pg: ProcessGroup, backend: MockBackend) -> None:
        with backend:  # the rank ends with its thread; peers waiting for it fail at once
            x = tl.tensor([float(pg.rank())])
            all_reduce_sum(x, pg)
            sums[pg.rank()] = float(x.numpy()[0])
            say(pg.rank(), f"sum of the ranks {sums[pg.rank()]:g}")

    threads = [
        threading.Thread(target=process, args=(pg, backend))
        for pg, backend in zip(groups, backends, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = len(groups)
    ok = sums == [n * (n - 1) / 2] * n
    print("all values correct" if ok else "WRONG VALUES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
