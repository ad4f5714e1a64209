"""DistributedDataParallel correctness, on real rank processes (cpu backend) and world size 1.

The defining property: N ranks with per-rank batch B end with the same parameters as one
process with batch N*B over the same samples (also with the N ranks as threads of one process,
``backend="threads"``). The bodies (tests/ddp/ddp_bodies.py) run in the
long-lived rank processes of the collectives test harness (one pool per world size, reused by
every test), train with DDP and, in the same process, the single-process reference, and return
differences, digests and what DDP reported; these tests assert on them. World size 1 runs the
same bodies on the serial backend. Every pool call has a deadline and every test a timeout, so
a hang is a failure.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

from tests.collectives.harness import REPO_ROOT, RankPool
from tests.collectives.threads_pool import ThreadsPool
from tests.ddp.conftest import Pools
from tests.helpers import run_to_end

pytestmark = pytest.mark.timeout(120)

BODIES = "tests.ddp.ddp_bodies"
DEADLINE = 60.0


def run(pool: RankPool | ThreadsPool, body: str, **kwargs: Any) -> list[Any]:
    """Run ``body`` on every rank; one result per rank (rank order)."""
    return pool.run(f"{BODIES}:{body}", kwargs, deadline=DEADLINE)


# Tolerances on max |difference| relative to the reference's scale (largest |grad|, largest
# parameter change): float64 agrees to rounding, float32 to its precision; fp16 compression
# rounds every gradient to ~3 significant digits.
TOL = {"float64": 1e-12, "float32": 1e-5, "fp16": 3e-3}


def check_case(label: str, case: dict[str, Any], got: dict[str, Any]) -> None:
    """One rank's summary of one case: equal to the reference, buckets launched in order."""
    tol = TOL["fp16" if case.get("hook") == "fp16" else case.get("dtype", "float64")]
    if case.get("variant") == "mixed":
        tol = TOL["float32"]
    assert got["grad_diff"] <= tol * got["grad_scale"], (
        f"{label}: gradients differ from the single-process reference by "
        f"{got['grad_diff']:.3g} (largest gradient {got['grad_scale']:.3g})"
    )
    assert got["param_diff"] <= tol * got["param_change"], (
        f"{label}: parameters differ from the single-process reference by "
        f"{got['param_diff']:.3g} (training moved them by {got['param_change']:.3g})"
    )
    assert got["param_change"] > 1e-3, f"{label}: training did not move the parameters"
    expected_order = list(range(got["buckets"]))
    assert all(order == expected_order for order in got["launch_orders"]), (
        f"{label}: buckets launched in order {got['launch_orders']}"
    )


def equivalence(
    pool: RankPool | ThreadsPool, seed: int, cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Run ``cases``; check every rank against the reference and the ranks against each other.

    Returns rank 0's summaries (for case-specific assertions)."""
    per_rank = run(pool, "equivalence", seed=seed, cases=cases)
    for i, case in enumerate(cases):
        label = f"case {case} on {pool.label}"
        digests = {res[i]["digest"] for res in per_rank}
        assert len(digests) == 1, f"{label}: parameters differ across ranks"
        for rank, res in enumerate(per_rank):
            check_case(f"{label}, rank {rank}", case, res[i])
    return list(per_rank[0])


# ---------------------------------------------------------------------------- equivalence
def test_sgd_and_adam_match_one_process_on_the_global_batch(world: RankPool, seed: int) -> None:
    cases: list[dict[str, Any]] = [
        {"opt": "sgd", "dtype": "float64", "steps": 4},
        {"opt": "adam", "dtype": "float64", "steps": 4},
        {"opt": "sgd", "dtype": "float32", "steps": 4},
        {"opt": "adam", "dtype": "float32", "steps": 4},
        # zero_grad(set_to_none=False) keeps the grads (bucket views) and zeroes them in place.
        {"opt": "sgd", "dtype": "float64", "steps": 3, "set_to_none": False},
        {"opt": "adam", "dtype": "float64", "steps": 3, "set_to_none": False},
        # Longer training, one bucket per parameter: the ranks stay bit-identical throughout.
        {
            "opt": "adam",
            "dtype": "float32",
            "steps": 20,
            "depth": 5,
            "bucket_cap_mb": 1e-6,
            "first_bucket_mb": 1e-6,
        },
    ]
    equivalence(world, seed, cases)


def test_rank_threads_match_one_process_on_the_global_batch(
    threads_world: ThreadsPool, seed: int
) -> None:
    """N rank threads (threads backend, NumPy engine), unchanged DDP: float64 to 1e-12."""
    tiny = {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}
    cases: list[dict[str, Any]] = [
        {"opt": "sgd", "dtype": "float64", "steps": 4},
        {"opt": "adam", "dtype": "float64", "steps": 4, "depth": 4, **tiny},
        {"opt": "adam", "dtype": "float64", "accum": 2, "steps": 3, "hook": "record"},
        {"opt": "sgd", "dtype": "float64", "branch": "rank0", "find_unused": True, "steps": 3},
    ]
    equivalence(threads_world, seed, cases)


def test_frozen_tied_and_mixed_dtype_parameters(world: RankPool, seed: int) -> None:
    tiny = {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}
    cases: list[dict[str, Any]] = [
        # requires_grad=False: not bucketed, never gets a gradient, still broadcast at start.
        {"opt": "adam", "variant": "frozen"},
        {"opt": "sgd", "variant": "frozen", **tiny},
        # A layer used twice: its gradient (summed over both uses) is reduced once.
        {"opt": "sgd", "variant": "tied", "depth": 4},
        {"opt": "adam", "variant": "tied", "depth": 4, "accum": 2, **tiny},
        # float32 layers and a float64 parameter: one set of buckets per dtype.
        {"opt": "sgd", "variant": "mixed", "dtype": "float32"},
        {"opt": "adam", "variant": "mixed", "dtype": "float32", "hook": "record", **tiny},
        # A parameter whose array is a transposed view: rank 0's values still reach every rank.
        {"opt": "sgd", "variant": "strided"},
    ]
    got = equivalence(world, seed, cases)
    for summary in got[:2]:
        assert all(none == ["layers.0.weight"] for none in summary["none_after"]), summary
    assert got[4]["buckets"] == 2  # one float64 bucket, one float32 bucket
    assert got[5]["buckets"] == got[5]["params"]
    assert got[5]["not_views"] == []


def test_no_sync_accumulation_matches_the_combined_batch(world: RankPool, seed: int) -> None:
    # Two micro-batches per step, the first under no_sync, each loss scaled by 1/2: the
    # synchronized backward averages the accumulated sums, which is the gradient of the mean
    # loss over all 2*N*B samples of the step in one process.
    cases: list[dict[str, Any]] = [
        {"opt": "sgd", "accum": 2, "steps": 3},
        {"opt": "adam", "accum": 2, "steps": 3},
        {"opt": "sgd", "accum": 2, "steps": 3, "set_to_none": False},
        {"opt": "adam", "accum": 3, "steps": 3, "bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6},
        {"opt": "sgd", "accum": 3, "steps": 2, "hook": "record", "first_bucket_mb": 1e-6},
    ]
    got = equivalence(world, seed, cases)
    # Under no_sync nothing is communicated: the hook ran for one backward per step only.
    n = got[-1]["buckets"]
    assert n == 2 and got[-1]["hook_calls"] == [[0, 1]] * 2, got[-1]


def test_fp16_compress_hook_matches_within_half_precision(world: RankPool, seed: int) -> None:
    cases: list[dict[str, Any]] = [
        {"opt": "sgd", "dtype": "float32", "hook": "fp16"},
        {"opt": "adam", "dtype": "float32", "hook": "fp16"},
        {
            "opt": "sgd",
            "dtype": "float64",
            "hook": "fp16",
            "bucket_cap_mb": 1e-6,
            "first_bucket_mb": 1e-6,
        },
    ]
    equivalence(world, seed, cases)


def test_find_unused_parameters(world: RankPool, seed: int) -> None:
    cases: list[dict[str, Any]] = [
        # The branch runs on rank 0 only: the others contribute zeros, it is averaged over all.
        {"opt": "sgd", "branch": "rank0", "find_unused": True, "steps": 3},
        # The branch runs on odd steps on every rank, on even steps nowhere: then its grad stays
        # None (as without DDP), so the optimizer skips it.
        {"opt": "adam", "branch": "odd_steps", "find_unused": True, "steps": 4},
        {
            "opt": "sgd",
            "branch": "odd_steps",
            "find_unused": True,
            "steps": 4,
            "bucket_cap_mb": 1e-6,
            "first_bucket_mb": 1e-6,
        },
        # The branch runs only in the no_sync micro-batch: what was accumulated there counts.
        {"opt": "sgd", "branch": "nosync_only", "find_unused": True, "accum": 2, "steps": 3},
    ]
    got = equivalence(world, seed, cases)
    branch = ["branch.bias", "branch.weight"]
    assert got[0]["none_after"] == [[]] * 3
    assert got[1]["none_after"] == [branch, [], branch, []]
    assert got[2]["none_after"] == [branch, [], branch, []]
    assert got[3]["none_after"] == [[]] * 3


def test_bucketing_every_layer_its_own_bucket_or_one_bucket(world: RankPool, seed: int) -> None:
    tiny = {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}
    single = {"bucket_cap_mb": 100.0, "first_bucket_mb": 100.0}
    cases: list[dict[str, Any]] = [
        {"opt": "sgd", "depth": 5, "hook": "record", **tiny},
        {"opt": "adam", "depth": 5, "hook": "record", **tiny},
        {"opt": "sgd", "depth": 5, "hook": "record", **single},
        # Caps of 300 B for the first bucket and 1100 B for the others.
        {
            "opt": "sgd",
            "depth": 5,
            "hook": "record",
            "first_bucket_mb": 300 / 2**20,
            "bucket_cap_mb": 1100 / 2**20,
        },
    ]
    got = equivalence(world, seed, cases)
    assert got[0]["buckets"] == got[0]["params"] == 10
    assert got[1]["buckets"] == 10
    assert got[2]["buckets"] == 1
    # Filled greedily in reverse parameter order (float64; widths 6-8-8-8-8-3): the first
    # bucket takes the last layer (24 + 192 B) and the next bias (64 B) = 280 <= 300; the next
    # one weight, bias, weight (512 + 64 + 512 = 1088 <= 1100); the last the remaining four.
    assert got[3]["bucket_sizes"] == [280, 1088, 1024], got[3]["bucket_sizes"]
    for summary in got:
        n = summary["buckets"]
        # The hook saw every bucket once, in order, and only the last one is flagged last.
        assert summary["hook_calls"] == [list(range(n))] * 3
        assert summary["hook_lasts"] == [[i == n - 1 for i in range(n)]] * 3
        # Every .grad was a view into its bucket when the bucket was communicated.
        assert summary["not_views"] == []


def test_ddp_on_subgroups(multi: RankPool, seed: int) -> None:
    """Even and odd ranks each train their own DDP over a ``new_group`` (a group of one runs
    on the serial backend): each matches its group's reference; the groups stay apart."""
    cases: list[dict[str, Any]] = [
        {"opt": "sgd", "accum": 2},
        {"opt": "adam", "hook": "record", "bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6},
    ]
    per_rank = run(multi, "subgroups", seed=seed, cases=cases)
    for i, case in enumerate(cases):
        by_group: dict[tuple[int, ...], set[str]] = {}
        for rank, res in enumerate(per_rank):
            got = res[i]
            assert got["group"] == [r for r in range(multi.world_size) if r % 2 == rank % 2]
            check_case(f"{case} on rank {rank} of group {got['group']}", case, got)
            by_group.setdefault(tuple(got["group"]), set()).add(got["digest"])
        assert all(len(d) == 1 for d in by_group.values()), by_group
        assert len(set().union(*by_group.values())) == len(by_group)


def test_plain_script_without_launcher_is_world_size_1() -> None:
    """No launcher, no init_process_group: the same DDP code runs as world size 1."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher + ("PMI", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    code = (
        "import json; from tests.ddp.ddp_bodies import no_launcher; "
        "print(json.dumps(no_launcher()))"
    )
    proc = run_to_end([sys.executable, "-c", code], env, 60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["backend"], out["world"]) == ("serial", 1)
    for case, got in zip([{"opt": "sgd"}, {"opt": "adam"}], out["results"], strict=True):
        check_case(f"{case} without a launcher", case, got)


# ---------------------------------------------------------------------------- overlap
def test_communication_starts_during_backward(world: RankPool, seed: int) -> None:
    per_rank = run(world, "overlap", seed=seed, depth=6, steps=3)
    for rank, res in enumerate(per_rank):
        assert res["buckets"] == 12
        for step, s in enumerate(res["steps"]):
            where = f"rank {rank}, step {step}: {s}"
            assert s["launch_order"] == list(range(12)), where
            # Launched from gradient hooks, while earlier layers' gradients were still pending.
            assert s["launched_in_backward"] >= 1, where
            assert s["ready_at_launch"][0] < s["num_params"] == 12, where
    assert len({res["digest"] for res in per_rank}) == 1, "parameters differ across ranks"


# ---------------------------------------------------------------------------- hooks, buffers
def test_custom_comm_hook_called_once_per_bucket_in_order(world: RankPool, seed: int) -> None:
    for res in run(world, "custom_hook", seed=seed):
        n = res["buckets"]
        assert n == 8
        expected = [[i, i == n - 1, 1] for i in range(n)]
        assert res["seen"] == [expected, expected]
        assert res["grad_diff"] <= 1e-12


def test_buffers_broadcast_from_rank0_before_forward(world: RankPool) -> None:
    for rank, res in enumerate(run(world, "buffers", seed=1)):
        on, off = res["True"], res["False"]
        # Two buffers (one contiguous, one a transposed view), each filled with one value.
        assert on["construction"] == [[10.0]] * 2, f"rank {rank}: {res}"
        assert on["after_forward"] == [[20.0]] * 2, f"rank {rank}: {res}"
        assert off["construction"] == [[10.0]] * 2, f"rank {rank}: {res}"  # always at start
        assert off["after_forward"] == [[20.0 + rank]] * 2, f"rank {rank}: {res}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["cpu", "threads"])
def test_no_grad_forward_over_uneven_batch_counts_issues_no_collectives(
    pools: Pools, backend: str
) -> None:
    """An evaluator over unpadded shards: 5 samples in batches of 2 on 2 ranks give rank 0
    two batches (3 samples) and rank 1 one batch (2 samples). Forwards under no_grad must not
    broadcast buffers (but the first, which follows a training step), else rank 0's extra
    forward pairs with rank 1's metric all-reduce and the ranks hang or mix up data."""
    pool = pools("cpu", 2) if backend == "cpu" else ThreadsPool(2, timeout=20.0, tag="ddp")
    got = pool.run(f"{BODIES}:eval_uneven", {"seed": 3, "n": 5}, deadline=30.0)
    assert [g["batches"] for g in got] == [2, 1]
    for rank, g in enumerate(got):
        # Every sample once: the metric summed over the ranks is one process's.
        assert g["count"] == 5, g
        assert g["sum_sq"] == pytest.approx(g["ref_sq"], rel=1e-12), g
        # The first eval forward follows a training step: rank 0's buffers; then none.
        assert g["seen"] == [20.0] + [30.0 + rank] * (len(g["seen"]) - 1), g
        assert g["after_train"] == 30.0 + rank, g  # PyTorch: no broadcast after an eval
    assert got[0]["digest"] == got[1]["digest"], "parameters differ after the second step"


# ---------------------------------------------------------------------------- errors
MISMATCHES = {
    "shape": ["'layers.1.weight'", "(8, 8)", "(9, 8)"],
    "extra": ["'branch.weight'", "'branch.bias'"],
    "missing": ["'branch.weight'", "'branch.bias'"],
    "dtype": ["'layers.0.weight'", "float32", "float64"],
    "frozen": ["'layers.0.weight'", "requires_grad=False"],
    "order": ["order"],
    # Options that change which collectives DDP issues: without the check, ranks would wait
    # for each other's bucket allocations until the group's timeout.
    "bucket": ["'bucket_cap_mb'", "25.0", "1e-06"],
    "find_unused": ["'find_unused_parameters'", "True", "False"],
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_model_mismatch_is_a_value_error_on_every_rank(multi: RankPool, kind: str) -> None:
    for odd in (multi.world_size - 1, 0):
        other = odd or 1  # a rank that differs from rank 0, or rank 0 from
        messages = run(multi, "mismatch", seed=3, kind=kind, odd=odd)
        for rank, msg in enumerate(messages):
            assert msg, f"rank {rank} built DistributedDataParallel despite a {kind} mismatch"
            # Named in the text itself, not only in the "[rank r]" prefix.
            text = msg.split("] ", 1)[1]
            assert "rank 0" in text and f"rank {other}" in text, msg
            for name in MISMATCHES[kind]:
                assert name in text, msg


def test_unused_parameter_without_flag_raises_on_every_rank(world: RankPool) -> None:
    users = [-1] if world.world_size == 1 else [-1, 0]
    for user in users:
        for rank, messages in enumerate(run(world, "unused_without_flag", seed=4, user=user)):
            assert len(messages) == 2
            for msg in messages:
                assert msg, f"rank {rank}: no error for an unused parameter (user {user})"
                assert "branch.weight" in msg and "branch.bias" in msg, msg
                assert "find_unused_parameters" in msg, msg
                if user == 0:  # the ranks that missed it are named, the one that used it not
                    assert f"rank {world.world_size - 1}: [" in msg, msg
                    assert "rank 0: [" not in msg, msg


@pytest.mark.parametrize(("world_size", "victim"), [(2, 1), (3, 1), (4, 0)])
def test_rank_killed_mid_backward_fails_the_others_fast(
    pools: Pools, world_size: int, victim: int
) -> None:
    """Last: it breaks its pool. Rank 0 hosts the store; its death must be noticed as well."""
    pool = pools("cpu", world_size)
    try:
        replies = pool.call(
            f"{BODIES}:die_mid_step",
            {"seed": 5, "victim": victim, "step_to_die": 2},
            deadline=DEADLINE,
            grace=None,
        )
    finally:
        pool.kill_all()  # the pool lost a rank; the fixture starts a fresh one if needed
    dead = replies[victim]
    assert dead.exited and dead.returncode == -9, dead.describe()
    for rep in replies:
        if rep.rank == victim:
            continue
        assert rep.ok, rep.describe()
        res = rep.result
        assert res["error"] == "PeerFailureError", f"rank {rep.rank}: {res}"
        # Within seconds, far from the group's 20 s timeout.
        assert res["after_s"] < 10.0, f"rank {rep.rank}: {res}"
        assert f"rank {victim}" in res["message"].split("] ", 1)[1], res


def test_wrapping_a_module_twice_is_refused() -> None:
    import collectives
    from ddp import DistributedDataParallel
    from tensorlib import nn

    created = not collectives.is_initialized()
    try:
        model = nn.Linear(3, 2)
        DistributedDataParallel(model)
        with pytest.raises(ValueError, match="already wrapped"):
            DistributedDataParallel(model)
    finally:
        if created:
            collectives.destroy_process_group()
