"""``ddp.fully_shard`` (ZeRO-3, and ZeRO-2 with ``reshard_after_forward=False``).

What a user relies on: training a model sharded per block and at the root gives DDP's
parameters (gathered with ``state_dict()``), here bit for bit on every backend and world
size: both average gradients with one AVG reduction over the ranks in rank order (all-reduce
for DDP, reduce-scatter here) and the optimizer's arithmetic is elementwise, so a shard's
update is the same numbers as the matching rows of DDP's. The bodies are in
tests/ddp/fsdp_bodies.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool
from tests.ddp.conftest import Pools

pytestmark = pytest.mark.timeout(180)

BODIES = "tests.ddp.fsdp_bodies"
DEADLINE = 120.0


def run(pool: RankPool | ThreadsPool, body: str, **kwargs: Any) -> list[Any]:
    return pool.run(f"{BODIES}:{body}", kwargs, deadline=DEADLINE)


def check_same_as_ddp(
    pool: RankPool | ThreadsPool, seed: int, reshard: bool, steps: int = 50, accum: int = 1
) -> None:
    replies = run(pool, "same_as_ddp", seed=seed, steps=steps, reshard=reshard, accum=accum)
    for rank, res in enumerate(replies):
        where = f"rank {rank} on {pool.label}, reshard_after_forward={reshard}"
        assert all(res["shapes"].values()), f"{where}: state_dict shapes {res['shapes']}"
        assert res["moved"] > 1e-2, f"{where}: training barely moved the parameters"
        assert max(res["diffs"].values()) <= 1e-12, f"{where}: {res['diffs']}"
        if accum == 1:
            assert res["bitwise"] and res["losses_equal"], f"{where}: not bitwise: {res}"


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_fifty_adamw_steps_equal_ddp_bitwise(world: RankPool, seed: int, reshard: bool) -> None:
    check_same_as_ddp(world, seed, reshard)


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_fifty_adamw_steps_equal_ddp_on_threads(seed: int, reshard: bool) -> None:
    check_same_as_ddp(ThreadsPool(2, timeout=20.0, tag="fsdp"), seed, reshard)


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_gradients_accumulate_over_micro_batches_as_under_ddp(
    multi: RankPool, seed: int, reshard: bool
) -> None:
    # To 1e-12, not bitwise: DDP all-reduces the accumulated .grad (the earlier micro-batches'
    # average, the same on every rank, plus this rank's new gradient), so it averages that
    # average again and rounds differently; a shard adds each micro-batch's reduce-scattered
    # average to its .grad, which is exactly what the sum of averages is.
    check_same_as_ddp(multi, seed, reshard, steps=10, accum=3)


def test_local_shards_are_one_nth_padded_and_hold_the_gradient_shard(
    world: RankPool, seed: int
) -> None:
    for rank, res in enumerate(run(world, "shards", seed=seed)):
        n = res["world"]
        full = res["full_shapes"]
        for name, shape in res["local_shapes"].items():
            rows = -(-full[name][0] // n)  # ceil: padded where N does not divide dim 0
            assert shape == [rows, *full[name][1:]], f"rank {rank}: {name} {shape} of {full}"
        assert res["grad_shapes"] == {k: res["local_shapes"][k] for k in res["param_names"]}
        # 1/N of the bytes, plus at most one padding row per parameter.
        assert res["local_bytes"] * n >= res["full_bytes"]
        assert res["local_bytes"] <= res["full_bytes"] / n + 8 * 15 * 10, res
        assert full["embed.weight"] == [7, 6] and full["blocks.0.up.weight"] == [10, 6]


def test_load_state_dict_takes_full_tensors(multi: RankPool, seed: int) -> None:
    assert all(res["equal"] for res in run(multi, "load_full", seed=seed))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("wider", "'up.weight': rank 0 has [[10, 6], 'float64'], rank 1 has [[11, 6]"),
        ("missing", "rank 1 lacks 'norm.bias' (rank 0 has it)"),
        ("option", "'reshard_after_forward': rank 0 has [[], 'True'], rank 1 has [[], 'False']"),
    ],
)
def test_different_models_raise_on_every_rank(
    multi: RankPool, seed: int, kind: str, expected: str
) -> None:
    for rank, res in enumerate(run(multi, "mismatch", seed=seed, kind=kind)):
        msg = res["message"]
        assert msg is not None, f"rank {rank}: no error"
        assert expected in msg and "fully_shard(Block)" in msg, msg


def test_parameters_are_freed_after_forward_only_under_zero3(seed: int) -> None:
    for res in run(ThreadsPool(2, timeout=20.0, tag="fsdp"), "memory_freed", seed=seed):
        # Blocks, then the root; every unit is freed once backward is done with it.
        assert res["true"] == {
            "after_forward": [False] * 3,
            "after_backward": [False] * 3,
            "zeros_after_forward": [True] * 3,
        }
        assert res["false"] == {
            "after_forward": [True] * 3,
            "after_backward": [False] * 3,
            "zeros_after_forward": [False] * 3,
        }


def test_backward_that_skips_the_units_output_raises_instead_of_using_freed_parameters(
    multi: RankPool, seed: int
) -> None:
    for rank, res in enumerate(run(multi, "bypassed_output", seed=seed)):
        msg = res["message"]
        assert msg is not None and "after they were freed" in msg, f"rank {rank}: {msg!r}"


def test_a_forward_under_no_grad_equals_the_plain_model_and_frees_everything(
    world: RankPool, seed: int
) -> None:
    for res in run(world, "no_grad_forward", seed=seed):
        assert res == {"equal": True, "gathered": [False] * 3}


def test_what_fully_shard_refuses_is_named(pools: Pools) -> None:
    (res,) = run(pools("serial", 1), "argument_errors")
    assert res["mixed"].startswith("ValueError") and "different dtypes" in res["mixed"]
    assert "'s' is a scalar" in res["scalar"]
    assert "already sharded" in res["twice"]
    assert res["not a module"].startswith("TypeError: fully_shard takes a tensorlib nn.Module")


def test_the_next_units_all_gather_is_prefetched_in_forward_and_backward(
    multi: RankPool, seed: int
) -> None:
    # From the second forward on (the order is the first one's), each block's all-gather was
    # started while the unit before it computed; under ZeRO-3 also each block's regather in
    # every backward (the root's comes first: nothing runs before it to overlap with).
    for res in run(multi, "prefetch_hits", seed=seed, steps=3):
        assert res == {"true": [5, 5, 0], "false": [2, 2, 0]}, res


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_a_unit_called_twice_in_one_forward_gets_both_uses_gradients(
    world: RankPool, seed: int, reshard: bool
) -> None:
    assert max(run(world, "unit_called_twice", seed=seed, reshard=reshard)) <= 1e-12


@pytest.mark.parametrize(
    ("reshard", "norm_type"),
    [(True, 2.0), (False, 2.0), (True, float("inf")), (True, 1.0)],
    ids=["zero3-l2", "zero2-l2", "zero3-inf", "zero3-l1"],
)
def test_clip_grad_norm_of_shards_is_the_global_norm_and_trains_as_ddp_clipped(
    world: RankPool, seed: int, reshard: bool, norm_type: float
) -> None:
    # ddp.clip_grad_norm_ over a fully_shard model's shards against DDP with tensorlib's
    # plain clip: the same norm on every rank, and the same training, to 1e-12 (not bitwise:
    # the global norm sums the squares in another order, so the clip factor differs in the
    # last bits).
    max_norm = {2.0: 0.3, float("inf"): 0.1, 1.0: 2.0}[norm_type]
    replies = run(
        world,
        "clip_same_as_ddp",
        seed=seed,
        steps=20,
        reshard=reshard,
        max_norm=max_norm,
        norm_type=norm_type,
    )
    for rank, res in enumerate(replies):
        where = f"rank {rank} on {world.label}"
        assert res["clipped_steps"] >= 5, f"{where}: the clip rarely acted: {res}"
        assert res["norm_rel_diff"] <= 1e-12, f"{where}: {res}"
        assert res["param_diff"] <= 1e-12, f"{where}: {res}"
        assert res["last_norm"] == replies[0]["last_norm"], f"{where}: ranks disagree"
        if res["world"] > 1 and norm_type == 2.0:
            # The plain clip over this rank's shards sees only a part of the gradient.
            assert res["local_norm_of_shards"] < res["global_norm"], f"{where}: {res}"


def test_clip_grad_norm_of_shards_is_the_global_norm_on_threads(seed: int) -> None:
    pool = ThreadsPool(3, timeout=20.0, tag="fsdp")
    replies = run(
        pool, "clip_same_as_ddp", seed=seed, steps=10, reshard=True, max_norm=0.3, norm_type=2.0
    )
    for rank, res in enumerate(replies):
        assert res["clipped_steps"] >= 3, f"rank {rank}: the clip rarely acted: {res}"
        assert res["norm_rel_diff"] <= 1e-12 and res["param_diff"] <= 1e-12, f"rank {rank}: {res}"
        assert res["local_norm_of_shards"] < res["global_norm"], f"rank {rank}: {res}"


def test_clip_grad_norm_is_the_plain_one_without_shards_and_a_nan_stops_every_rank(
    multi: RankPool, seed: int
) -> None:
    for rank, res in enumerate(run(multi, "clip_edge_cases", seed=seed)):
        assert res["plain_when_unsharded"], f"rank {rank}: {res}"
        # Only rank 0's shard holds the nan; the global norm is nan on every rank.
        assert res["nonfinite"] is not None and "non-finite (nan)" in res["nonfinite"], res
