"""Clipping, the gradient scaler, autocast and a schedule under DDP: every rank decides alike.

A script clips and unscales after ``backward()`` returned, so it works on the averaged
gradients: every rank computes the same total norm, finds the same inf/NaN and skips the same
steps, even when only one rank's batch produced the inf (tests/ddp/essentials_bodies.py). And
the run matches one process doing the same on the global batch.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool

pytestmark = pytest.mark.timeout(120)

BODY = "tests.ddp.essentials_bodies:essentials"
# Relative to the reference's largest parameter: float32 rounding; float16 matmuls under
# autocast round each product to ~3 significant digits, differently on a shard and the union.
TOL = {False: 1e-5, True: 3e-3}


def _same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def _expected_scales(steps: int, inf_steps: set[int], init: float, interval: int) -> list[float]:
    # PyTorch's rule: halve on a nonfinite step (and restart the count), double after
    # `interval` finite steps in a row.
    scales, scale, good = [], init, 0
    for step in range(steps):
        if step in inf_steps:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == interval:
                scale, good = scale * 2.0, 0
        scales.append(scale)
    return scales


def _run(world: RankPool | ThreadsPool, seed: int, case: dict[str, Any]) -> dict[str, Any]:
    per_rank = world.run(BODY, {"seed": seed, "case": case}, deadline=60.0)
    first = per_rank[0]
    for rank, got in enumerate(per_rank):
        label = f"{case} on {world.label}, rank {rank}"
        assert got["digest"] == first["digest"], f"{label}: parameters differ across ranks"
        # The averaged gradients are identical bit for bit, so are their norms and decisions.
        assert _same(got["norm"], first["norm"]), f"{label}: ranks clipped differently"
        assert got["skip"] == first["skip"], f"{label}: ranks skipped different steps"
        assert got["scale"] == first["scale"] and got["lr"] == first["lr"], label
        assert got["param_diff"] <= TOL[case.get("amp", False)] * got["param_scale"], (
            f"{label}: parameters differ from the one-process reference by {got['param_diff']:.3g}"
        )
    return first


@pytest.mark.parametrize("amp", [False, True], ids=["float32", "autocast"])
@pytest.mark.parametrize("accum", [1, 2])
def test_an_inf_on_one_rank_skips_that_step_on_every_rank(
    world: RankPool, seed: int, amp: bool, accum: int
) -> None:
    steps, inf_steps = 9, {2, 3, 6}
    case = {
        "steps": steps,
        "amp": amp,
        "accum": accum,
        "inf_steps": sorted(inf_steps),
        "inf_rank": 1,  # the last rank at world size 2, a middle one at 3 and 4
        "max_norm": 0.05,
    }
    got = _run(world, seed, case)
    assert [i for i, s in enumerate(got["skip"]) if s] == sorted(inf_steps), got["skip"]
    assert got["scale"] == _expected_scales(steps, inf_steps, 2.0**8, 2)
    finite = [n for i, n in enumerate(got["norm"]) if i not in inf_steps]
    assert all(math.isfinite(n) for n in finite), got["norm"]
    # The norms are the averaged gradient's: the reference's on the global batch.
    ref = [n for i, n in enumerate(got["ref_norm"]) if i not in inf_steps]
    assert finite == pytest.approx(ref, rel=TOL[amp] * 10), (finite, ref)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the inf, here
def test_an_inf_on_one_rank_thread_skips_that_step_on_every_rank(
    threads_world: ThreadsPool, seed: int
) -> None:
    """The same on rank threads: autocast and the scaler's state are per thread."""
    case = {"steps": 5, "amp": True, "inf_steps": [2], "inf_rank": 1, "max_norm": 0.05}
    got = _run(threads_world, seed, case)
    assert [i for i, s in enumerate(got["skip"]) if s] == [2], got["skip"]


def test_clipping_and_the_schedule_match_one_process(world: RankPool, seed: int) -> None:
    steps = 8
    case = {"steps": steps, "opt": "sgd", "max_norm": 0.05, "dtype": "float64"}
    got = _run(world, seed, case)
    assert not any(got["skip"])
    assert max(got["norm"]) > 0.05, "max_norm too large: nothing was clipped"
    # Warm-up from a quarter of the rate over 3 steps, then a cosine down to 0 over the rest.
    lr = [0.1 * (0.25 + 0.75 * min(s + 1, 3) / 3) for s in range(3)]
    lr += [0.05 * (1 + math.cos(math.pi * (s + 1) / 5)) for s in range(steps - 3)]
    assert got["lr"][:3] == pytest.approx(lr[:3], rel=1e-12)
    assert got["lr"][3:] == pytest.approx(lr[3:], rel=1e-9, abs=1e-15)
