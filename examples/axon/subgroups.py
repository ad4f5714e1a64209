"""axonml-distributed's README, "Process Subgroups", in Python.

    python examples/axon/subgroups.py             # the README's mock world of one
    python examples/axon/subgroups.py --world 4   # 4 ranks, one thread each

The README's Rust::

    let world = World::mock();
    // Create a subgroup with specific ranks
    let subgroup = world.new_group(vec![0, 1]);
    assert!(subgroup.contains(0));
    assert_eq!(subgroup.size(), 2);

In the README's world of one, rank 1 does not exist: the group still answers ``contains`` and
``size``, and its collectives would raise, naming the missing rank (axonml's would run over
the world of one instead). With ``--world N`` (N >= 2) every rank makes the group, members or
not, and its two members all-reduce their ranks: ``0 + 1`` on both; the others do not take
part. The script checks that and exits 1 when something is wrong.
"""

from __future__ import annotations

import sys

from axon_common import make_parser, run_world, say

import tensorlib as tl
from ddp.axon import MockBackend, World, all_reduce_sum


def readme() -> None:
    """The README's code, as written."""
    world = World.mock()

    # Create a subgroup with specific ranks
    subgroup = world.new_group([0, 1])
    assert subgroup.contains(0)
    assert subgroup.size() == 2
    print(f"subgroup ranks {subgroup.ranks()}  size {subgroup.size()}  contains(0) "
          f"{subgroup.contains(0)}  in a world of {world.world_size()}", flush=True)  # fmt: skip
    try:
        subgroup.barrier()
    except ValueError as e:
        print(f"its collectives need rank 1: {e}", flush=True)


def rank_main(backend: MockBackend) -> float | None:
    """One rank of a world of N: every rank makes the group, its members all-reduce."""
    world = World.init(backend)
    subgroup = world.new_group([0, 1])
    assert subgroup.contains(0) and subgroup.size() == 2
    if not subgroup.contains(world.rank()):
        say(world.rank(), "not in the subgroup [0, 1]")
        return None
    x = tl.tensor([float(world.rank())])
    all_reduce_sum(x, subgroup)
    say(world.rank(), f"in the subgroup [0, 1]: sum of its ranks {float(x.numpy()[0]):g}")
    return float(x.numpy()[0])


def main() -> int:
    args = make_parser(__doc__).parse_args()
    if args.world == 1:
        readme()
        return 0
    got = run_world(args.world, rank_main)
    ok = got == [1.0, 1.0] + [None] * (args.world - 2)
    print("all values correct" if ok else "WRONG VALUES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
