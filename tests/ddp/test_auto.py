"""``auto_dataloader``, ``auto_model``, ``auto_optim`` and ``one_rank_only``.

Single-process tests cover world size 1 and, with the collectives functions patched, the
branches of a larger world; multi-process tests run real ranks (module-level rank functions,
hard time limits).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collectives
import tensorlib as tl
from ddp import _auto
from ddp._auto import auto_dataloader, auto_model, auto_optim, default_device, one_rank_only
from ddp._data import DataLoader
from ddp._ddp import DistributedDataParallel
from ddp._sampler import DistributedSampler
from tensorlib import nn, optim
from tests.collectives.harness import RankPool
from tests.helpers import DEVICES


def arrays(n: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    return np.arange(2 * n, dtype=np.float32).reshape(n, 2), np.arange(n, dtype=np.int64)


def batch_ids(loader: DataLoader) -> list[list[int]]:
    return [yb.tolist() for _, yb in loader]


class FakeWorld:
    """Patches the collectives functions the helpers ask, to act as one rank of a world."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, size: int, rank: int) -> None:
        self.barriers = 0
        monkeypatch.setattr(collectives, "get_world_size", lambda group=None: size)
        monkeypatch.setattr(collectives, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(collectives, "barrier", self._barrier)

    def _barrier(self, group: Any = None, async_op: bool = False) -> None:
        self.barriers += 1


class FakeDDP(nn.Module):
    """Stands in for DistributedDataParallel: the same keyword options, no communication."""

    def __init__(
        self, module: nn.Module, process_group: Any = None, bucket_cap_mb: float = 25.0
    ) -> None:
        super().__init__()
        self.module = module
        self.bucket_cap_mb = bucket_cap_mb


# ---------------------------------------------------------------------- auto_dataloader
def test_auto_dataloader_world_size_one() -> None:
    loader = auto_dataloader(arrays(10), batch_size=4, seed=2)
    assert isinstance(loader, DataLoader)
    assert loader.sampler is None and loader.shuffle and loader.batch_size == 4
    assert (
        list(itertools.chain.from_iterable(batch_ids(loader)))
        == np.random.default_rng(2).permutation(10).tolist()
    )
    plain = auto_dataloader(arrays(10), batch_size=3, shuffle=False, drop_last=True)
    assert batch_ids(plain) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        auto_dataloader(arrays(3), batch_size=0)


def test_auto_dataloader_splits_batch_and_data(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeWorld(monkeypatch, size=4, rank=3)
    loader = auto_dataloader(arrays(10), batch_size=8, seed=1, drop_last=True)
    assert loader.batch_size == 2
    assert isinstance(loader.sampler, DistributedSampler)
    assert (loader.sampler.num_replicas, loader.sampler.rank, loader.sampler.seed) == (4, 3, 1)
    assert loader.sampler.drop_last and loader.sampler.shuffle
    assert len(loader) == 1  # 10 -> 8 samples (2 per rank) -> one batch of 2 per rank
    with pytest.raises(ValueError, match=r"batch_size=6 .* world size 4; use 4 or 8"):
        auto_dataloader(arrays(10), batch_size=6)
    with pytest.raises(ValueError, match=r"use 4 \(any multiple of 4\)"):
        auto_dataloader(arrays(10), batch_size=3)
    with pytest.raises(ValueError, match="same length"):
        auto_dataloader((np.zeros(3), np.zeros(2)), batch_size=4)


DIGITS = 1797  # scikit-learn's digits: not a multiple of 2, 3 or 4
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4


def ids(n: int) -> tuple[np.ndarray[Any, Any]]:
    return (np.arange(n, dtype=np.int64),)


def rank_batches(loader: DataLoader) -> list[list[int]]:
    return [b.tolist() for (b,) in loader]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_uneven_shards_see_every_sample_once_in_the_one_process_batches(
    monkeypatch: pytest.MonkeyPatch, world: int, shuffle: bool
) -> None:
    """Each rank's loader of an N-rank world (faked): together the ranks see each of the 1797
    samples once, ranks have different numbers of samples and batches (a last partial batch,
    possibly none), and global batch k is the one-process loader's batch k."""
    single = auto_dataloader(ids(DIGITS), GLOBAL_BATCH, shuffle=shuffle, seed=4)
    single.set_epoch(1)
    expected = rank_batches(single)
    per_rank = []
    for rank in range(world):
        FakeWorld(monkeypatch, size=world, rank=rank)
        loader = auto_dataloader(
            ids(DIGITS), GLOBAL_BATCH, shuffle=shuffle, seed=4, even_shards=False
        )
        loader.set_epoch(1)
        per_rank.append(rank_batches(loader))
        share = len(range(rank, DIGITS, world))
        if world > 1:
            assert isinstance(loader.sampler, DistributedSampler)
            assert len(loader.sampler) == share and not loader.sampler.even_shards
        assert len(loader) == len(per_rank[-1]) == -(-share // (GLOBAL_BATCH // world))
    flat = [i for batches in per_rank for b in batches for i in b]
    assert len(flat) == DIGITS and sorted(flat) == list(range(DIGITS))
    for k, batch in enumerate(expected):
        union = [i for batches in per_rank if k < len(batches) for i in batches[k]]
        assert sorted(union) == sorted(batch), f"global batch {k}"


@pytest.mark.parametrize(
    ("kwargs", "even"),
    [
        ({"shuffle": True}, True),  # a training loader
        ({"shuffle": False}, False),  # an evaluation loader
        ({"shuffle": False, "drop_last": True}, True),  # dropping the tail: training
        ({"shuffle": False, "even_shards": True}, True),  # padded, as PyTorch and Ignite
        ({"shuffle": True, "even_shards": False}, False),  # shuffled, every sample once
    ],
)
def test_auto_dataloader_picks_the_sharding(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], even: bool
) -> None:
    FakeWorld(monkeypatch, size=4, rank=3)
    loader = auto_dataloader(ids(DIGITS), GLOBAL_BATCH, **kwargs)
    assert isinstance(loader.sampler, DistributedSampler)
    assert loader.sampler.even_shards is even
    # Rank 3 of 4 gets 449 samples unpadded (1797 = 4 * 449 + 1), 450 padded, 449 truncated.
    want = 449 if not even or kwargs.get("drop_last") else 450
    assert len(loader.sampler) == want


def test_idist_auto_dataloader_picks_the_sharding(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddp import idist

    FakeWorld(monkeypatch, size=4, rank=0)
    evaluation = idist.auto_dataloader(ids(DIGITS), batch_size=GLOBAL_BATCH)  # shuffle=False
    training = idist.auto_dataloader(ids(DIGITS), batch_size=GLOBAL_BATCH, shuffle=True)
    padded = idist.auto_dataloader(ids(DIGITS), batch_size=GLOBAL_BATCH, even_shards=True)
    samplers = [ld.sampler for ld in (evaluation, training, padded)]
    assert all(isinstance(s, DistributedSampler) for s in samplers)
    assert [getattr(s, "even_shards", None) for s in samplers] == [False, True, True]
    assert [len(s) for s in samplers if isinstance(s, DistributedSampler)] == [450] * 3
    FakeWorld(monkeypatch, size=4, rank=1)
    rank1 = idist.auto_dataloader(ids(DIGITS), batch_size=GLOBAL_BATCH).sampler
    assert isinstance(rank1, DistributedSampler) and len(rank1) == 449  # no padding
    own = DistributedSampler(DIGITS, 4, 1, even_shards=False)
    with pytest.raises(ValueError, match="pass even_shards or sampler, not both"):
        idist.auto_dataloader(ids(DIGITS), sampler=own, even_shards=False)
    assert idist.auto_dataloader(ids(DIGITS), sampler=own, batch_size=3).sampler is own
    with pytest.raises(ValueError, match="even_shards=False asks for every sample exactly once"):
        idist.auto_dataloader(ids(DIGITS), batch_size=4, drop_last=True, even_shards=False)


@pytest.mark.parametrize("world", [1, 4])
def test_even_shards_argument_errors(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """Checked at every world size, so a script fails alone as it would launched."""
    FakeWorld(monkeypatch, size=world, rank=0)
    with pytest.raises(ValueError, match=r"even_shards=False .* drop_last=True .* evaluation"):
        auto_dataloader(ids(10), 4, drop_last=True, even_shards=False)
    with pytest.raises(TypeError, match=r"even_shards must be True .* got 'yes'"):
        auto_dataloader(ids(10), 4, even_shards="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- auto_model / optim
def test_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    if not collectives.is_initialized():
        assert default_device() is None
    monkeypatch.setattr(collectives, "is_initialized", lambda: True)
    monkeypatch.setattr(collectives, "get_backend", lambda group=None: "cpu")
    assert default_device() is None
    monkeypatch.setattr(collectives, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(collectives, "get_local_rank", lambda: 3)
    monkeypatch.setattr(tl, "cuda_device_count", lambda: 2)
    assert default_device() == "cuda:1"
    monkeypatch.setattr(tl, "cuda_device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="nccl but no CUDA GPU is visible"):
        default_device()


def test_auto_model_world_size_one() -> None:
    model = nn.Linear(3, 2)
    assert auto_model(model) is model
    assert all(p.device == tl.device("cpu") for p in model.parameters())
    assert auto_model(model, device="cpu") is model
    with pytest.raises(TypeError, match=r"must be a tensorlib nn\.Module"):
        auto_model(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_auto_model_moves_to_device(device: str) -> None:
    model = nn.Linear(3, 2)
    weight = model.weight
    assert auto_model(model, device=device) is model
    assert model.weight is weight  # moved in place: an optimizer made earlier stays valid
    assert all(p.device == tl.device(device) for p in model.parameters())
    # No device and no nccl backend: the model stays where the user put it.
    assert auto_model(model) is model
    assert all(p.device == tl.device(device) for p in model.parameters())


def test_auto_model_wraps_and_checks_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_auto, "_ddp_class", lambda: FakeDDP)
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="bad DistributedDataParallel options"):
        auto_model(model, bucket_cap=1)  # misspelled: caught at world size 1 too
    with pytest.raises(ValueError, match="already wrapped"):
        auto_model(FakeDDP(model))
    assert auto_model(model, bucket_cap_mb=1) is model  # world size 1: options unused
    FakeWorld(monkeypatch, size=2, rank=0)
    wrapped = auto_model(model, bucket_cap_mb=1)
    assert isinstance(wrapped, FakeDDP) and wrapped.module is model
    assert wrapped.bucket_cap_mb == 1

    class Group:
        size = 1

    # A group of one rank given as process_group: nothing to average over.
    assert auto_model(model, process_group=Group()) is model


def test_auto_model_checks_options_against_the_real_ddp_at_world_size_one() -> None:
    # (Replaces a test of a fallback for a DistributedDataParallel that cannot be imported:
    # `import ddp` imports it, so that fallback could never run and was removed.)
    assert _auto._ddp_class() is DistributedDataParallel
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="bad DistributedDataParallel options"):
        auto_model(model, anything=1)
    assert auto_model(model, bucket_cap_mb=1, find_unused_parameters=True) is model


def test_auto_optim() -> None:
    model = nn.Linear(2, 2)
    opt = optim.SGD(model.parameters(), lr=0.1)
    assert auto_optim(opt) is opt
    with pytest.raises(TypeError, match=r"tensorlib\.optim\.Optimizer"):
        auto_optim(object())  # type: ignore[arg-type]


# ---------------------------------------------------------------------- one_rank_only
def test_one_rank_only_world_size_one() -> None:
    calls: list[int] = []

    @one_rank_only()
    def work(x: int, *, y: int = 0) -> int:
        """Docstring kept."""
        calls.append(x)
        return x + y

    assert work(2, y=3) == 5 and calls == [2]
    assert work.__name__ == "work" and work.__doc__ == "Docstring kept."

    @one_rank_only(rank=1)
    def nowhere() -> None:
        pass

    with pytest.raises(ValueError, match="rank 1 does not exist at world size 1"):
        nowhere()
    with pytest.raises(ValueError, match="rank must be >= 0"):
        one_rank_only(rank=-1)
    with pytest.raises(TypeError, match="rank must be an int"):
        one_rank_only(rank="0")  # type: ignore[arg-type]


@pytest.mark.parametrize("me", [0, 1, 2])
@pytest.mark.parametrize("with_barrier", [True, False])
def test_one_rank_only_branches(
    monkeypatch: pytest.MonkeyPatch, me: int, with_barrier: bool
) -> None:
    world = FakeWorld(monkeypatch, size=3, rank=me)
    calls: list[int] = []

    @one_rank_only(rank=1, with_barrier=with_barrier)
    def work() -> str:
        calls.append(me)
        return "done"

    assert work() == ("done" if me == 1 else None)
    assert calls == ([me] if me == 1 else [])
    assert world.barriers == int(with_barrier)


# ---------------------------------------------------------------------- multi-process
@pytest.fixture
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPT_ALLOW_SHARED_GPU", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)


def dataloader_rank(rank: int, n: int, batch: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for drop_last in (False, True):
        loader = auto_dataloader(arrays(n), batch, seed=seed, drop_last=drop_last)
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append(batch_ids(loader))
        out[str(drop_last)] = {"batch_size": loader.batch_size, "len": len(loader), "ids": epochs}
    try:
        auto_dataloader(arrays(n), batch + 1)
    except ValueError as exc:
        out["error"] = str(exc)
    collectives.barrier()  # see test_sampler.sampler_rank: keep the store host alive
    return out


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_clean_env")
def test_auto_dataloader_across_ranks() -> None:
    n, batch, seed, world = 11, 4, 3, 2
    results = collectives.spawn(dataloader_rank, args=(n, batch, seed), nprocs=world, backend="cpu")
    assert results is not None
    for r in results:
        assert "must be divisible by the world size 2" in r["error"]
    for drop_last in (False, True):
        single = auto_dataloader(arrays(n), batch, seed=seed, drop_last=drop_last)
        per_rank = [r[str(drop_last)] for r in results]
        assert {p["batch_size"] for p in per_rank} == {batch // world}
        assert {p["len"] for p in per_rank} == {len(single)}
        for epoch in range(2):
            single.set_epoch(epoch)
            expected = batch_ids(single)
            got = [p["ids"][epoch] for p in per_rank]
            assert all(len(g) == len(expected) for g in got)
            # Global batch k (the union of the ranks' batch k) is the one-process batch k, but
            # the last when the sampler padded (11 samples on 2 ranks: one repeated sample).
            full = len(expected) if drop_last else len(expected) - 1
            for k in range(full):
                assert sorted(got[0][k] + got[1][k]) == sorted(expected[k])
            if not drop_last:
                tail = got[0][-1] + got[1][-1]
                assert set(tail) >= set(expected[-1]) and len(tail) == 4
            if drop_last:
                assert sum(len(b) for b in expected) == 8


def eval_loader_rank(n: int, batch: int) -> dict[str, Any]:
    """A rank of a pool (tests/ddp/conftest.py): its ``idist.auto_dataloader`` batches per
    mode, and the number of samples all ranks saw (an all-reduce after the loop)."""
    from ddp import idist

    modes: dict[str, dict[str, Any]] = {
        "eval": {},  # shuffle=False: Ignite's evaluation loader
        "eval_shuffled": {"shuffle": True, "even_shards": False},
        "train": {"shuffle": True},
    }
    out: dict[str, Any] = {}
    for name, kwargs in modes.items():
        loader = idist.auto_dataloader(ids(n), batch_size=batch, seed=2, **kwargs)
        loader.set_epoch(1)
        got = rank_batches(loader)
        seen = idist.all_reduce(sum(len(b) for b in got))
        out[name] = {"batches": got, "len": len(loader), "seen": seen}
    return out


@pytest.mark.timeout(90)
def test_eval_loaders_see_every_sample_once_on_real_ranks(world: RankPool) -> None:
    """At 1, 2, 3 and 4 ranks (serial, then cpu rank processes) over 1797 samples."""
    n, size = DIGITS, world.world_size
    got = world.run(
        "tests.ddp.test_auto:eval_loader_rank", {"n": n, "batch": GLOBAL_BATCH}, deadline=60.0
    )
    per_rank = GLOBAL_BATCH // size
    for mode in ("eval", "eval_shuffled"):
        flat = [i for g in got for b in g[mode]["batches"] for i in b]
        assert len(flat) == n and sorted(flat) == list(range(n)), mode
        assert [g[mode]["seen"] for g in got] == [n] * size
        shares = [len(range(r, n, size)) for r in range(size)]
        assert [g[mode]["len"] for g in got] == [-(-s // per_rank) for s in shares]
    # Training keeps even (padded) shards: every rank runs the same number of steps.
    padded = -(-n // size)
    assert {g["train"]["len"] for g in got} == {-(-padded // per_rank)}
    flat = [i for g in got for b in g["train"]["batches"] for i in b]
    assert len(flat) == padded * size and set(flat) == set(range(n))
    assert [g["train"]["seen"] for g in got] == [padded * size] * size


def one_rank_rank(rank: int, directory: str) -> list[Any]:
    root = Path(directory)

    @one_rank_only()
    def slow_write() -> str:
        time.sleep(0.3)
        (root / "a").write_text("done")
        return "written"

    first = slow_write()
    seen = (root / "a").read_text() if (root / "a").exists() else None  # after the barrier

    @one_rank_only(rank=1, with_barrier=False)
    def wait_for_rank0() -> int:
        # Rank 0 writes "b" only once its own call has returned: a barrier here would deadlock.
        deadline = time.monotonic() + 20
        while not (root / "b").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 waited at a barrier that should not be there")
            time.sleep(0.01)
        return rank

    second = wait_for_rank0()
    if rank == 0:
        (root / "b").write_text("go")

    @one_rank_only(rank=2)
    def nowhere() -> None:
        pass

    try:
        nowhere()
        error = None
    except ValueError as exc:
        error = str(exc)
    collectives.barrier()
    return [first, seen, second, error]


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_clean_env")
def test_one_rank_only_across_ranks(tmp_path: Path) -> None:
    results = collectives.spawn(one_rank_rank, args=(str(tmp_path),), nprocs=2, backend="cpu")
    assert results is not None
    assert [r[:3] for r in results] == [["written", "done", None], [None, "done", 1]]
    assert all("rank 2 does not exist at world size 2" in r[3] for r in results)


def auto_model_rank(rank: int) -> dict[str, Any]:
    from ddp._ddp import DistributedDataParallel

    tl.manual_seed(100 + rank)  # different initial weights: DDP must broadcast rank 0's
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    initial = [p.tolist() for p in model.parameters()]
    wrapped = auto_model(model, bucket_cap_mb=1)
    opt = auto_optim(optim.SGD(wrapped.parameters(), lr=0.1))
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2)
    y = (x[:, :1] * x[:, 1:]).astype(np.float32)
    loader = auto_dataloader((x, y), batch_size=4, seed=0)
    after_wrap = [p.tolist() for p in model.parameters()]
    for epoch in range(2):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = ((wrapped(xb) - yb) ** 2).mean()
            loss.backward()
            opt.step()
    return {
        "wrapped": isinstance(wrapped, DistributedDataParallel),
        "same_module": wrapped.module is model,
        "initial": initial,
        "after_wrap": after_wrap,
        "trained": [p.tolist() for p in model.parameters()],
    }


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_clean_env")
def test_auto_model_across_ranks() -> None:
    results = collectives.spawn(auto_model_rank, nprocs=2, backend="cpu")
    assert results is not None
    r0, r1 = results
    assert r0["wrapped"] and r1["wrapped"] and r0["same_module"] and r1["same_module"]
    assert r0["initial"] != r1["initial"]
    assert r0["after_wrap"] == r1["after_wrap"] == r0["initial"]  # rank 0's weights everywhere
    assert r0["trained"] == r1["trained"] != r0["initial"]  # bit-identical after training
