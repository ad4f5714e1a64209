"""``fully_shard``'s mixed-precision policy, gradient accumulation without sync, and the
``GradScaler`` over shards: what a user of FSDP2's ``MixedPrecisionPolicy``,
``set_requires_gradient_sync`` and ``torch.amp.GradScaler`` relies on. Bodies in
tests/ddp/fsdp_mp_bodies.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool
from tests.ddp.conftest import Pools

pytestmark = pytest.mark.timeout(180)

BODIES = "tests.ddp.fsdp_mp_bodies"


def run(pool: RankPool | ThreadsPool, body: str, **kwargs: Any) -> list[Any]:
    return pool.run(f"{BODIES}:{body}", kwargs, deadline=120.0)


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_float16_gather_float32_reduce_equals_the_hand_made_mixed_precision_step(
    world: RankPool, reshard: bool
) -> None:
    # The reference computes each rank's gradient with a float16 copy of the float32 master
    # weights, casts it to float32, averages over the ranks and steps the master: the same
    # arithmetic in the same order, so the sharded run equals it exactly.
    for rank, res in enumerate(run(world, "mixed_precision", seed=5, steps=8, reshard=reshard)):
        where = f"rank {rank} on {world.label}"
        assert res["moved"] > 1e-2, f"{where}: training barely moved the parameters"
        assert res["rel"] == 0.0, f"{where}: {res['rel']} from the reference"
        assert res["gathered"] == "float16" and res["input"] == "float16", (where, res)
        assert res["send_dtypes"] == ["float16"], f"{where}: all-gathers {res['send_dtypes']}"
        assert res["shard_dtypes"] == ["float32"] == res["grad_dtypes"], (where, res)
        assert set(res["dtypes"].values()) == {"float32"}, f"{where}: state_dict {res}"


@pytest.mark.parametrize("api", ["ctx", "set"])
@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_accumulating_without_sync_equals_ddp_no_sync(
    pools: Pools, reshard: bool, api: str
) -> None:
    pool = pools("cpu", 3)
    for rank, res in enumerate(
        run(pool, "no_sync", seed=2, steps=4, reshard=reshard, accum=3, api=api)
    ):
        where = f"rank {rank} on {pool.label}"
        assert res["moved"] > 1e-2, f"{where}: training barely moved the parameters"
        assert res["diff"] <= 1e-12, f"{where}: {res['diff']} from DDP's no_sync"
        assert res["pending"], f"{where}: a shard's .grad changed inside no_sync"
        assert all(res["left"]), f"{where}: an accumulated gradient was left behind"


@pytest.mark.parametrize("backend", ["cpu", "threads"])
def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(
    pools: Pools, backend: str
) -> None:
    pool = pools("cpu", 2) if backend == "cpu" else ThreadsPool(2, timeout=30.0, tag="mp")
    for rank, res in enumerate(run(pool, "scaler_skips_together", seed=4)):
        moved = [s["moved"] for s in res["steps"]]
        scales = [s["scale"] for s in res["steps"]]
        assert moved == [True, False, True], f"rank {rank}: stepped {moved}"
        assert scales == [1024.0, 512.0, 512.0], f"rank {rank}: scales {scales}"


def test_stats_count_the_collectives_the_prefetches_and_the_bytes(multi: RankPool) -> None:
    # Bytes as a ring sends them: (N - 1) shard-sized chunks per all-gather and per
    # reduce-scatter. ZeRO-2 sends 2 (N - 1) S elements a step, what DDP's ring all-reduce of
    # the N S (padded) elements sends; ZeRO-3 gathers again in backward: 1.5x; float16
    # gathers halve the all-gathers' part.
    n = multi.world_size
    for rank, res in enumerate(run(multi, "stats", seed=3, steps=3)):
        where = f"rank {rank} on {multi.label}"
        units = res["zero3"]["units"]
        assert units == 3, where
        for name, gathers in (("zero3", 2 * units), ("zero2", units), ("zero3-fp16", 2 * units)):
            s = res[name]["elements"]
            first, *later = res[name]["seen"]
            # Each unit gathers its shard gathers / units times and reduce-scatters it once.
            if name == "zero3-fp16":
                expected = (n - 1) * s * (2 * gathers // units + 4)
            else:
                expected = (n - 1) * s * 8 * (gathers // units + 1)
            # The first forward knows no order yet: only backward prefetches (ZeRO-3).
            assert first[:3] == [gathers, gathers // 2 - 1 if name != "zero2" else 0, units], (
                where,
                name,
                first,
            )
            for got in later:
                # Every gather but the first of forward (and of backward) was prefetched.
                assert got == [gathers, gathers - gathers // units, units, expected], (
                    where,
                    name,
                    got,
                )
            assert first[3] == expected, (where, name, first)
        zero2 = res["zero2"]["seen"][-1][3]
        assert zero2 == 2 * (n - 1) * res["zero2"]["elements"] * 8, where
        assert res["zero3"]["seen"][-1][3] * 2 == zero2 * 3, where


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-gather"])
def test_peak_during_a_step_is_bounded_by_a_few_units_under_zero3_not_by_the_model(
    multi: RankPool, fp16: bool
) -> None:
    n = multi.world_size
    got: dict[tuple[int, bool], Any] = {}
    for blocks in (4, 8):
        for reshard in (True, False):
            res = run(multi, "peak", seed=1, blocks=blocks, reshard=reshard, fp16=fp16)[0]
            assert res["live_after"] == 0, f"{res}: something stayed gathered after the step"
            got[blocks, reshard] = res
    z3 = got[8, True]
    # The bound docs/ddp.md states, in the largest unit's sizes: the unit computing and the
    # root (used at both ends) gathered, backward's full gradient of the unit, the next
    # unit's all-gather buffers, and one reduce-scatter's buffers (the one in flight).
    s_r = z3["grad"] // n
    bound = 3 * z3["full"] + (n + 1) * z3["shard"] + (n + 1) * s_r
    assert z3["peaks"][-1] <= bound, (z3, bound)
    assert z3["peaks"][-1] == got[4, True]["peaks"][-1], "ZeRO-3's peak grew with the model"
    # ZeRO-2 keeps every unit gathered from forward to backward: its peak grows with the model.
    grown = got[8, False]["peaks"][-1] - got[4, False]["peaks"][-1]
    assert grown >= got[8, False]["model_full"] - got[4, False]["model_full"], got
