"""``ddp.functional``: collectives with gradients, at world sizes 1, 2 and 4.

Each op's forward value and gradient on every rank are compared with the same computation done
in one process (every rank's inputs rebuilt from the seed) and its central finite differences
(float64); then a model-parallel MLP (a column-split then a row-split Linear) must match the
unsplit MLP's output, loss and every gradient (tests/ddp/functional_bodies.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import collectives
import ddp.functional as F
import tensorlib as tl
from tests.collectives.harness import RankPool

from .conftest import Pools

pytestmark = pytest.mark.timeout(120)

WORLDS = [("serial", 1), ("cpu", 2), ("cpu", 4)]
BODIES = "tests.ddp.functional_bodies"
OPS = ["all_reduce", "all_reduce_avg", "all_gather", "gather", "reduce_scatter", "scatter"]


@pytest.fixture(params=WORLDS, ids=lambda w: f"{w[0]}{w[1]}")
def world(request: pytest.FixtureRequest, pools: Pools) -> RankPool:
    return pools(*request.param)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("op", OPS)
def test_gradient_matches_finite_differences(
    world: RankPool, seed: int, op: str, axis: int
) -> None:
    if op.startswith("all_reduce") and axis == 1:
        pytest.skip("all_reduce has no axis")
    got = world.run(f"{BODIES}:op_gradient", {"op": op, "axis": axis, "seed": seed})
    ws = world.world_size
    for rank, g in enumerate(got):
        label = f"{op}(axis={axis}) on {world.label}, rank {rank}"
        assert g["value_err"] < 1e-12, f"{label}: output differs by {g['value_err']:.3g}"
        # Central differences of a smooth float64 objective: ~1e-9 off at eps=1e-6.
        assert g["grad_err"] < 1e-6, f"{label}: gradient differs by {g['grad_err']:.3g}"
        if op == "scatter" and rank != 0:
            assert g["grad_norm"] == 0.0, label  # only the source's x feeds the slices
        else:
            assert g["grad_norm"] > 0.1, label
        n, m = 4, 8
        want = {
            "all_gather": [n * ws, m] if axis == 0 else [n, m * ws],
            "reduce_scatter": [n // ws, m] if axis == 0 else [n, m // ws],
        }
        want["gather"], want["scatter"] = want["all_gather"], want["reduce_scatter"]
        assert g["shape"] == want.get(op, [n, m]), label


@pytest.mark.parametrize("variant", ["all_reduce", "reduce_scatter"])
def test_model_parallel_mlp_matches_the_unsplit_model(
    world: RankPool, seed: int, variant: str
) -> None:
    got = world.run(f"{BODIES}:mlp", {"seed": seed, "variant": variant})
    for rank, g in enumerate(got):
        tol = 1e-12 * max(1.0, g["scale"])
        bad = {k: v for k, v in g.items() if k != "scale" and v > tol}
        assert not bad, (
            f"{variant} on {world.label}, rank {rank}: differs from the whole MLP: {bad}"
        )


def test_argument_errors_at_every_world_size(world: RankPool) -> None:
    ws = world.world_size
    got = world.run(f"{BODIES}:errors_case")
    for msgs in got:
        assert "op must be 'sum' or 'avg'" in msgs[0]
        assert "axis 2 is out of range" in msgs[1]
        assert "op must be 'sum' or 'avg'" in msgs[2]
        assert len(msgs) == (3 if ws == 1 else 5)
        if ws > 1:
            assert all(f"group size {ws} does not divide" in m for m in msgs[3:]), msgs


@pytest.fixture
def alone() -> Iterator[None]:
    if collectives.is_initialized():
        pytest.skip("another test left a process group in this process")
    yield
    assert not collectives.is_initialized()


def test_outside_any_group_every_op_is_the_identity(alone: None) -> None:
    x = tl.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    for fn in (F.all_reduce, F.all_gather, F.gather, F.reduce_scatter, F.scatter):
        assert fn(x) is x
    with pytest.raises(ValueError, match="op must be 'sum' or 'avg'"):
        F.all_reduce(x, op="min")
