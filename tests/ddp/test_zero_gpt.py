"""The issue's check of ZeRO on the transformer example's own model: 50 AdamW steps of
examples/train_transformer_ddp.py's CharGPT (small, float64) under ZeRO-1
(``ZeroRedundancyOptimizer``), ZeRO-2 and ZeRO-3 (``fully_shard`` per block and at the root)
give DDP's parameters, bit for bit, at N = 1..4 on the cpu backend and on threads: every stage
averages each gradient with one reduction over the ranks in rank order (DDP's all-reduce,
fully_shard's reduce-scatter) and AdamW's update is elementwise, so stepping a shard rounds as
stepping the whole. Bodies in tests/ddp/zero_gpt_bodies.py."""

from __future__ import annotations

import pytest

from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool

pytestmark = pytest.mark.timeout(240)


def _check(pool: RankPool | ThreadsPool) -> None:
    got = pool.run("tests.ddp.zero_gpt_bodies:fifty_steps", {"seed": 4, "steps": 50}, deadline=200)
    for rank, res in enumerate(got):
        assert res["moved"] > 1e-2, f"rank {rank}: training barely moved the parameters"
        for stage in ("zero1", "zero2", "zero3"):
            r = res[stage]
            where = f"{stage}, rank {rank} of {pool.world_size} ({pool.label})"
            assert r["keys"], f"{where}: state_dict keys differ from DDP's"
            assert r["max_diff"] <= 1e-12, f"{where}: {r['max_diff']:.3g} from DDP"
            assert r["bitwise"], f"{where}: not bitwise DDP's ({r['max_diff']:.3g})"


def test_fifty_adamw_steps_of_the_example_gpt_equal_ddp(world: RankPool) -> None:
    _check(world)


def test_fifty_adamw_steps_of_the_example_gpt_equal_ddp_on_threads() -> None:
    _check(ThreadsPool(2, timeout=120.0, tag="gpt"))
