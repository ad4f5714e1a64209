"""``ddp.ZeroRedundancyOptimizer`` (ZeRO-1) and ``ddp.memory_stats`` at world sizes 1 to 4.

The bodies (tests/ddp/zero_bodies.py) run on every rank of a live pool: serial x1, cpu x2,
x3, x4, and rank threads of this process (threads x2, x4). What a user relies on:

* DDP with ZeRO-1 over AdamW, Adam (amsgrad) or SGD (Nesterov momentum) gives *bitwise* the
  parameters DDP with the plain optimizer gives (50 steps, float64, a StepLR schedule): the
  updates are elementwise, so stepping slices of the parameters rounds exactly as stepping
  them whole, and the all-gather only copies the owners' values;
* its state consolidates on one rank in the plain optimizer's format, and loads at another
  world size (saved at 4, resumed at 2 and 3) or into a plain optimizer, continuing as the
  uninterrupted run (to 1e-10: the uninterrupted run here is one process on the global
  batch, whose loss sums the batch in another order than the ranks' averaged means);
* each rank holds 1/N of the optimizer state (within the padding of one shard);
* ranks passing different parameters or options get an error on every rank, not a hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import collectives
import tensorlib as tl
from ddp import DistributedDataParallel, ZeroRedundancyOptimizer, memory_stats
from tensorlib import optim
from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool

from . import zero_bodies as B
from .conftest import Pools

Pool = RankPool | ThreadsPool

pytestmark = pytest.mark.timeout(180)

WORLDS = [("serial", 1), ("cpu", 2), ("cpu", 3), ("cpu", 4), ("threads", 2), ("threads", 4)]
BODIES = "tests.ddp.zero_bodies"


@pytest.fixture(params=WORLDS, ids=lambda w: f"{w[0]}{w[1]}")
def world(request: pytest.FixtureRequest, pools: Pools) -> Pool:
    backend, size = request.param
    if backend == "threads":
        return ThreadsPool(size, timeout=20.0, tag="zero")
    return pools(backend, size)


def _run(world: Pool, body: str, **kwargs: Any) -> list[Any]:
    return world.run(f"{BODIES}:{body}", kwargs, deadline=120.0)


@pytest.mark.parametrize(
    ("opt", "cap", "split", "late", "mixed"),
    [
        ("adamw", 0.0004, False, False, False),  # ~50 elements a bucket: several all-gathers
        ("adamw", 25.0, True, False, True),  # one bucket a dtype; two groups; float64 + float32
        ("adam_amsgrad", 0.0004, False, False, False),
        ("sgd", 0.0004, True, True, False),  # a third group joins at step 10 (add_param_group)
    ],
    ids=["adamw-buckets", "adamw-groups-mixed", "amsgrad", "sgd-nesterov-late-group"],
)
def test_same_parameters_as_ddp(
    world: Pool, opt: str, cap: float, split: bool, late: bool, mixed: bool
) -> None:
    got = _run(
        world,
        "same_as_ddp",
        seed=11,
        opt=opt,
        steps=50,
        bucket_cap_mb=cap,
        split=split,
        late=late,
        mixed=mixed,
    )
    n = world.world_size
    for r, g in enumerate(got):
        assert g["bitwise"], f"rank {r} of {n}: ZeRO-1 differs from DDP by {g['max_diff']:.3g}"
    assert len({g["digest"] for g in got}) == 1, "ranks ended with different parameters"
    # Every element is owned by exactly one rank, and the shares are even within N - 1.
    shards = [g["shard_elements"] for g in got]
    if not late:
        assert sum(shards) == got[0]["total"]
        assert max(shards) - min(shards) <= (n - 1) * (2 if mixed else 1), shards  # per dtype
    if n > 1 and cap < 1:
        assert got[0]["buckets"] > 1, "the small cap should give several all-gather buckets"


def test_consolidate_on_the_last_rank(world: Pool) -> None:
    got = _run(world, "consolidate_last", seed=7, steps=12)
    last = got[-1]
    assert last["same"], "the consolidated state is not the plain SGD's state dict"
    assert last["entries"] == 11  # every parameter has its momentum buffer


def test_resume_at_another_world_size(pools: Pools, tmp_path: Path) -> None:
    path = str(tmp_path / "zero.npz")
    saved = pools("cpu", 4).run(f"{BODIES}:save_zero", {"seed": 5, "steps": 6, "path": path})
    assert saved[0]["keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert "consolidate_state_dict" in saved[0]["refusal_before"]
    for r in (1, 2, 3):
        assert "no consolidated state on this rank" in saved[r]["refusal_other"]
    for n in (2, 3):
        got = pools("cpu", n).run(
            f"{BODIES}:resume_zero", {"seed": 5, "steps": 6, "more": 6, "path": path}
        )
        for r, g in enumerate(got):
            assert g["zero"]["max_diff"] < 1e-10, f"N={n} rank {r}: {g['zero']}"
        assert got[0]["plain"]["max_diff"] < 1e-10, f"plain AdamW from the dict: {got[0]['plain']}"


@pytest.mark.parametrize("n", [2, 4])
def test_optimizer_memory_is_one_nth(pools: Pools, n: int) -> None:
    got = pools("cpu", n).run(f"{BODIES}:memory", {"seed": 3})
    for r, g in enumerate(got):
        total = g["total"]
        assert g["plain"] == {
            "parameters": 8 * total,
            "gradients": 8 * total,
            "optimizer": 16 * total,
        }
        # DDP: the same, with the gradients in its flat bucket, whose shared-memory segment
        # the cpu backend rounds up to whole pages (what the rank really maps).
        assert g["ddp"]["parameters"] == g["plain"]["parameters"]
        assert g["ddp"]["optimizer"] == g["plain"]["optimizer"]
        assert 0 <= g["ddp"]["gradients"] - g["plain"]["gradients"] < 4096, (r, g)
        # ZeRO-1: two Adam moments of this rank's share, 16 bytes an element.
        want = g["ddp"]["optimizer"] / n
        assert abs(g["zero"]["optimizer"] - want) <= 0.05 * want + 16 * (n - 1), (r, g)
        assert g["zero"]["parameters"] == g["ddp"]["parameters"]
        assert g["zero"]["gradients"] == g["ddp"]["gradients"]


@pytest.mark.parametrize("kind", ["shape", "count", "option", "late"])
def test_mismatch_is_an_error_on_every_rank(pools: Pools, kind: str) -> None:
    got = pools("cpu", 2).run(f"{BODIES}:mismatch", {"seed": 2, "kind": kind})
    for r, msg in enumerate(got):
        assert "differ across ranks" in msg, f"rank {r}: {msg}"
        assert "rank 1" in msg, msg
    if kind == "count":
        assert "rank 1 passes 12 parameters, rank 0 11" in got[0], got[0]
    if kind == "shape":
        assert "shape (15, 6)" in got[0] and "shape (14, 6)" in got[0], got[0]
    if kind == "late":
        assert "parameter group 1 of 6 parameters" in got[0], got[0]
    if kind == "option":
        assert "'lr': '0.5'" in got[1], got[1]


def test_state_dict_loads_into_plain_optimizer_in_process() -> None:
    """World of one (nothing initialized): the state dict is the plain optimizer's, and a
    plain optimizer's dict loads into ZeRO-1 (the same numbers either way)."""
    if collectives.is_initialized() and collectives.get_world_size() > 1:
        pytest.skip("a process group of several ranks is initialized in this process")
    tokens = B._tokens(4, 8)
    a, b = B.TinyLM(4), B.TinyLM(4)
    za = ZeroRedundancyOptimizer(a.parameters(), optim.AdamW, lr=0.02)
    pb = optim.AdamW(b.parameters(), lr=0.02)
    B._train(a, za, tokens, 0, 4, local=False)
    B._train(b, pb, tokens, 0, 4, local=False)
    za.consolidate_state_dict()
    sd = za.state_dict()
    plain = pb.state_dict()
    assert sd["param_groups"] == plain["param_groups"]
    for i, entry in plain["state"].items():
        for k, v in entry.items():
            assert (sd["state"][i][k] == v).all() if hasattr(v, "shape") else sd["state"][i][k] == v
    za.load_state_dict(plain)  # and the other way round
    B._train(a, za, tokens, 4, 8, local=False)
    B._train(b, pb, tokens, 4, 8, local=False)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert (p.numpy() == q.numpy()).all()
    with pytest.raises(RuntimeError, match="1 step"):
        za.consolidate_state_dict()
        B._train(a, za, tokens, 0, 1, local=False)
        za.state_dict()
    with pytest.raises(ValueError, match="shape"):
        bad = {
            "state": {0: {"exp_avg": tl.zeros(3).numpy()}},
            "param_groups": plain["param_groups"],
        }
        za.load_state_dict(bad)


def test_memory_stats_counts_views_once() -> None:
    """A parameter that views another's memory is counted once, as the whole buffer."""
    model = B.TinyLM(1)
    before = memory_stats(model)
    assert before == {
        "parameters": 8 * sum(p.size for p in model.parameters()),
        "gradients": 0,
        "optimizer": 0,
    }
    flat = tl.zeros(1000, dtype="float64").numpy()
    for p, start in zip(model.parameters(), range(0, 1000, 100), strict=False):
        p.data = flat[start : start + p.size].reshape(p.shape) if p.size <= 100 else p.data
    shared = [p for p in model.parameters() if p.data.base is not None]
    rest = sum(p.size for p in model.parameters() if p.data.base is None)
    assert shared, "some parameters should now view the flat buffer"
    assert memory_stats(model)["parameters"] == 8 * 1000 + 8 * rest


def test_ddp_wrapped_memory_stats_before_backward() -> None:
    """DDP's gradient buckets exist before the first backward: they are counted."""
    if collectives.is_initialized() and collectives.get_world_size() > 1:
        pytest.skip("a process group of several ranks is initialized in this process")
    model = DistributedDataParallel(B.TinyLM(1))
    total = sum(p.size for p in model.parameters())
    assert memory_stats(model)["gradients"] == 8 * total
