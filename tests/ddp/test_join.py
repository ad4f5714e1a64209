"""``ddp.join``: ranks with different numbers of batches finish together.

The defining property (docs/ddp.md): at step ``s`` the gradient is the mean, over the ranks
that had a batch at step ``s``, of their per-rank mean gradients; so training under join
equals one process that at step ``s`` trains on the concatenated batches of those ranks. And
after the block every rank holds the same parameters, buffers and optimizer state, bit for
bit, so the next epoch stays in sync. The bodies are in tests/ddp/join_bodies.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.collectives.harness import RankPool

pytestmark = pytest.mark.timeout(120)

BODIES = "tests.ddp.join_bodies"
DEADLINE = 60.0
# Relative to how far training moved the parameters: float64 rounding (the reference sums
# the ranks' losses in another order, and N/k rescales an average over N), float32, and
# float16 compression.
TOL = {"float64": 1e-12, "float32": 1e-5, "fp16": 3e-3}


def run(pool: RankPool, body: str, **kwargs: Any) -> list[Any]:
    return pool.run(f"{BODIES}:{body}", kwargs, deadline=DEADLINE)


def check_uneven(pool: RankPool, seed: int, cases: list[dict[str, Any]]) -> None:
    per_rank = run(pool, "uneven", seed=seed, cases=cases)
    for i, case in enumerate(cases):
        counts = case["counts"]
        tol = TOL["fp16" if case.get("hook") == "fp16" else case.get("dtype", "float64")]
        for epoch in ("epoch0", "epoch1"):
            label = f"{case} on {pool.label}, {epoch}"
            got = [res[i][epoch] for res in per_rank]
            for key in ("digest", "opt_digest", "sched_digest", "buffers"):
                assert len({g[key] for g in got}) == 1, f"{label}: {key} differs across ranks"
            for rank, g in enumerate(got):
                assert g["param_change"] > 1e-3, f"{label}: training did not move"
                assert g["param_diff"] <= tol * g["param_change"], (
                    f"{label}, rank {rank}: parameters differ from the reference that weights "
                    f"each step's active ranks alike by {g['param_diff']:.3g} "
                    f"(training moved them by {g['param_change']:.3g})"
                )
        # Buffers come from the lowest rank that still has data in that step.
        for rank, res in enumerate(per_rank):
            accum = case.get("accum", 1)
            expected = [
                100.0 * min(r for r, c in enumerate(counts) if c > s) + s
                for s in range(counts[rank])
                for _ in range(accum)
            ]
            expected += [float(s) for s in range(case.get("even", 2)) for _ in range(accum)]
            assert res[i]["buffer_seen"] == expected, f"{case}, rank {rank}"


UNEVEN: dict[int, list[dict[str, Any]]] = {
    2: [
        {"counts": [5, 2], "opt": "sgd"},
        {"counts": [0, 3], "opt": "adam"},  # a rank with no batch at all
    ],
    3: [
        {"counts": [20, 21, 23], "opt": "adam", "sched": True},
        {"counts": [20, 21, 23], "opt": "sgd", "dtype": "float32"},
    ],
    4: [
        {"counts": [3, 0, 5, 4], "opt": "adam"},
        # Two micro-batches a step, the first under no_sync.
        {"counts": [2, 3, 1, 3], "opt": "sgd", "accum": 2},
    ],
}


def test_uneven_batches_finish_together_and_match_the_weighted_reference(
    multi: RankPool, seed: int
) -> None:
    check_uneven(multi, seed, UNEVEN[multi.world_size])


def test_find_unused_parameters_and_fp16_compression_under_join(multi: RankPool, seed: int) -> None:
    counts = [4, 2, 5, 0][: multi.world_size]
    cases: list[dict[str, Any]] = [
        # Only rank 1 uses the branch, and it runs out first: then nobody does, and the
        # branch's grad is None on every rank (as in the reference), through the join.
        {"counts": counts, "opt": "sgd", "branch": "rank1", "find_unused": True},
        {"counts": counts, "opt": "adam", "branch": "alternate", "find_unused": True},
        {"counts": counts, "opt": "sgd", "dtype": "float32", "hook": "fp16"},
    ]
    check_uneven(multi, seed, cases)


def test_throw_on_early_termination_raises_on_every_rank(multi: RankPool, seed: int) -> None:
    counts = {2: [3, 5], 3: [4, 3, 6], 4: [5, 5, 3, 3]}[multi.world_size]
    per_rank = run(multi, "throws", seed=seed, counts=counts)
    step = min(counts)
    out = [r for r, c in enumerate(counts) if c == step]
    have = [r for r, c in enumerate(counts) if c > step]
    for rank, res in enumerate(per_rank):
        msg = res["message"]
        assert msg, f"rank {rank} did not raise"
        assert f"step {step}" in msg and "throw_on_early_termination" in msg, msg
        assert f"rank(s) {', '.join(map(str, out))} ran out of data" in msg, msg
        assert f"rank(s) {', '.join(map(str, have))} still had data" in msg, msg
    # Nothing was left pending: a normal step afterwards works, and the ranks agree.
    assert len({res["digest"] for res in per_rank}) == 1


def test_even_inputs_under_join_are_bitwise_the_same_as_without(world: RankPool, seed: int) -> None:
    # World size 1 (serial) included: there join is a no-op.
    for rank, got in enumerate(run(world, "even_with_and_without", seed=seed, steps=3)):
        assert got["join"] == got["plain"] == got["disabled"], f"rank {rank} on {world.label}"


def test_mismatched_no_sync_inside_join_raises_on_every_rank(multi: RankPool) -> None:
    for rank, res in enumerate(run(multi, "mismatched_no_sync", seed=3)):
        msg = res["message"]
        assert "step 1" in msg and "no_sync" in msg, f"rank {rank}: {msg!r}"
        assert "rank(s) 0 one under no_sync" in msg, msg


def test_a_parameter_missed_under_join_raises_on_every_rank(multi: RankPool) -> None:
    # Rank 0 has joined when the others miss the branch: it takes part in naming it.
    for rank, res in enumerate(run(multi, "unused_under_join", seed=4)):
        msg = res["message"]
        assert "branch.weight" in msg and "find_unused_parameters" in msg, f"rank {rank}: {msg!r}"
        assert f"rank {multi.world_size - 1}: [" in msg and "rank 0: [" not in msg, msg


@pytest.mark.parametrize("catch", [True, False], ids=["caught", "uncaught"])
def test_a_rank_that_raises_inside_join_fails_the_others(catch: bool) -> None:
    """The raising rank does not shadow (it propagates at once); the others fail through the
    group: a timeout when its process lives on, a peer failure when the exception ended it."""
    timeout = 3.0
    pool = RankPool.launch("cpu", 3, timeout=timeout, tag="join-raise")
    try:
        replies = pool.call(
            f"{BODIES}:raises_inside",
            {"seed": 9, "victim": 1, "at": 2, "catch": catch},
            deadline=timeout + 20.0,
            grace=None,
            uncaught=not catch,
        )
    finally:
        pool.kill_all()
    victim = replies[1]
    if catch:
        assert victim.ok and victim.result["error"] == "ValueError", victim.describe()
    else:
        assert victim.exited and victim.returncode not in (0, None), victim.describe()
    for rep in (replies[0], replies[2]):
        assert rep.ok, rep.describe()
        res = rep.result
        expected = "CollectiveTimeoutError" if catch else "PeerFailureError"
        assert res["error"] == expected, f"rank {rep.rank}: {res}"
        # Names rank 1: "rank 1 (pid ...) is gone" or "ranks [1] never arrived".
        assert re.search(r"\branks? \[?1\b", res["message"].split("] ", 1)[1]), res
        assert res["after_s"] < timeout + 10.0, f"rank {rep.rank}: {res}"


def test_join_arguments_and_world_size_1() -> None:
    import collectives
    from ddp import DistributedDataParallel, join
    from tensorlib import nn

    created = not collectives.is_initialized()
    try:
        ddp = DistributedDataParallel(nn.Linear(3, 2))
        with pytest.raises(TypeError, match="DistributedDataParallel"):
            join(nn.Linear(3, 2))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="state_dict"):
            join(ddp, optimizers=[object()])
        with ddp.join(throw_on_early_termination=True) as j:
            assert not j.enabled and ddp.reducer.join is None  # a no-op: nothing to shadow
    finally:
        if created:
            collectives.destroy_process_group()
