"""``ddp.engine`` with ``ddp.metrics`` at world sizes 1-4 against one process.

The evaluation runs over scikit-learn's digits set (1,797 samples, which no world size 2-4
divides) through ``idist.auto_dataloader(..., shuffle=False)``: every sample is seen exactly
once, so the accuracy equals one process's exactly and the loss up to float32 rounding of
the logits (BLAS's blocking of a matmul depends on its row count, so a sample's logits can
differ in the last bits with the batch it is in; the metric itself sums in float64). With
the padded sampler a DDP training loader uses, the same evaluation counts samples twice.
"""

from __future__ import annotations

import numpy as np
import pytest

import collectives
from tests.collectives.harness import RankPool

from . import engine_bodies as B

pytestmark = pytest.mark.timeout(120)
BODIES = "tests.ddp.engine_bodies"


@pytest.fixture(scope="module")
def alone_eval() -> dict[str, float]:
    if collectives.is_initialized():
        pytest.skip("another test left a process group in this process")
    return B.evaluate(12)


def test_evaluation_metrics_equal_one_process(
    world: RankPool, alone_eval: dict[str, float]
) -> None:
    got = world.run(f"{BODIES}:evaluate", {"batch_size": 12}, deadline=90.0)
    for rank, g in enumerate(got):
        assert g["acc"] == alone_eval["acc"], (rank, g, alone_eval)
        np.testing.assert_allclose(g["loss"], alone_eval["loss"], rtol=2e-6)
    # Every sample once: the ranks' shares add up to the set, uneven as they may be.
    assert sum(g["local_samples"] for g in got) == B.DIGITS


def test_ddp_training_under_the_engine_equals_one_process(world: RankPool) -> None:
    one = B.train(batch_size=60, epochs=2) if not collectives.is_initialized() else None
    if one is None:
        pytest.skip("another test left a process group in this process")
    got = world.run(f"{BODIES}:train", {"batch_size": 60, "epochs": 2}, deadline=90.0)
    for rank, params in enumerate(got):
        for p, q in zip(params, one, strict=True):
            np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
