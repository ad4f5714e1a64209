"""``ddp.functional``: collectives with gradients, at world sizes 1, 2 and 4 (1 to 4 for the
replicated layer before a split).

Each op's forward value and gradient on every rank are compared with the same computation done
in one process (every rank's inputs rebuilt from the seed) and its central finite differences
(float64); then a model-parallel MLP (a column-split then a row-split Linear) must match the
unsplit MLP's output, loss and every gradient, and a replicated Linear before ``scatter``
trained for 20 steps must stay the same on every rank and equal the one-process model's
(tests/ddp/functional_bodies.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
OPS = [
    "all_reduce",
    "all_reduce_avg",
    "all_gather",
    "gather",
    "reduce_scatter",
    "scatter",
    "scatter_src",
]


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
        if op == "scatter_src" and rank != ws - 1:
            assert g["grad_norm"] == 0.0, label  # only the source's x feeds the slices
        else:  # a replicated x (scatter) gets every slice's gradient on every rank
            assert g["grad_norm"] > 0.1, label
        n, m = 4, 8
        want = {
            "all_gather": [n * ws, m] if axis == 0 else [n, m * ws],
            "reduce_scatter": [n // ws, m] if axis == 0 else [n, m // ws],
        }
        want["gather"], want["scatter"] = want["all_gather"], want["reduce_scatter"]
        want["scatter_src"] = want["scatter"]
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


@pytest.mark.parametrize("size", [1, 2, 3, 4], ids=lambda n: f"world{n}")
def test_a_replicated_layer_before_scatter_stays_replicated_and_matches_one_process(
    pools: Pools, size: int
) -> None:
    # Before the fix scatter's gradient went to rank 0 only (zeros elsewhere): the replicated
    # Linear of the other ranks never learned and drifted from rank 0's.
    pool = pools("serial", 1) if size == 1 else pools("cpu", size)
    got = pool.run(f"{BODIES}:replicated_then_split", {"seed": 7, "steps": 20})
    first = got[0]["shared"]

    def same(a: list[Any], b: list[Any]) -> bool:  # every parameter, bit for bit
        return all(np.array_equal(np.asarray(p), np.asarray(q)) for p, q in zip(a, b, strict=True))

    for rank, g in enumerate(got):
        label = f"world size {size}, rank {rank}"
        assert same(g["shared"], first), f"{label}: the replicated Linear differs from rank 0's"
        assert same(g["shared"], g["ref_shared"]), f"{label}: it differs from one process's"
        assert same(g["mine"], g["ref_mine"]), f"{label}: its own Linear differs from one process's"
    trained = not np.allclose(np.asarray(first[0]), np.asarray(got[0]["start"]), atol=1e-3)
    assert trained, "the replicated Linear did not train"


def test_scatter_src_must_be_a_member_rank(multi: RankPool) -> None:
    for msgs in multi.run(f"{BODIES}:scatter_src_errors"):
        not_member = f"ValueError: ddp.functional.scatter: src={multi.world_size} is not a member"
        assert not_member in msgs[0]
        assert "TypeError: ddp.functional.scatter: src must be an int rank" in msgs[1]


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
