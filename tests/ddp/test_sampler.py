"""``DistributedSampler``: PyTorch's semantics, argument errors, and the ranks' agreement.

The single-process tests compare with a line-by-line transcription of PyTorch's
``DistributedSampler.__iter__`` (with NumPy's permutation in place of ``torch.randperm``). The
multi-process test runs real ranks (module-level rank functions, hard time limits).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import collectives
from ddp._sampler import DistributedSampler


def reference(
    n: int, replicas: int, rank: int, shuffle: bool, seed: int, epoch: int, drop_last: bool
) -> list[int]:
    """PyTorch's DistributedSampler (torch/utils/data/distributed.py), transcribed."""
    if drop_last and n % replicas != 0:
        num_samples = math.ceil((n - replicas) / replicas)
    else:
        num_samples = math.ceil(n / replicas)
    total_size = num_samples * replicas
    if shuffle:
        indices = np.random.default_rng(seed + epoch).permutation(n).tolist()
    else:
        indices = list(range(n))
    if not drop_last:
        padding_size = total_size - len(indices)
        if padding_size <= len(indices):
            indices += indices[:padding_size]
        else:
            indices += (indices * math.ceil(padding_size / len(indices)))[:padding_size]
    else:
        indices = indices[:total_size]
    assert len(indices) == total_size
    indices = indices[rank:total_size:replicas]
    assert len(indices) == num_samples
    return indices


@given(
    n=st.integers(0, 40),
    replicas=st.integers(1, 7),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
    drop_last=st.booleans(),
)
def test_matches_pytorch_reference(
    n: int, replicas: int, shuffle: bool, seed: int, epoch: int, drop_last: bool
) -> None:
    for rank in range(replicas):
        s = DistributedSampler(n, replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        got = list(s)
        assert got == reference(n, replicas, rank, shuffle, seed, epoch, drop_last)
        assert len(s) == len(got) == s.num_samples
        assert s.total_size == s.num_samples * replicas
        assert all(type(i) is int for i in got)


def test_known_values_pad_and_truncate() -> None:
    padded = [list(DistributedSampler(10, 3, r, shuffle=False)) for r in range(3)]
    assert padded == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    truncated = [
        list(DistributedSampler(10, 3, r, shuffle=False, drop_last=True)) for r in range(3)
    ]
    assert truncated == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    # Fewer samples than ranks: the order repeats from its start as often as needed.
    assert [list(DistributedSampler(2, 5, r, shuffle=False)) for r in range(5)] == [
        [0],
        [1],
        [0],
        [1],
        [0],
    ]
    assert [len(DistributedSampler(2, 5, r, drop_last=True)) for r in range(5)] == [0] * 5
    assert list(DistributedSampler(0, 2, 1)) == []


@given(
    n=st.integers(0, 50),
    replicas=st.integers(1, 6),
    seed=st.integers(0, 1000),
    drop_last=st.booleans(),
)
def test_ranks_disjoint_and_covering(n: int, replicas: int, seed: int, drop_last: bool) -> None:
    shards = [
        DistributedSampler(n, replicas, r, shuffle=True, seed=seed, drop_last=drop_last).indices()
        for r in range(replicas)
    ]
    flat = np.concatenate(shards)
    assert len({len(s) for s in shards}) == 1  # equal shares: every rank runs as many steps
    if drop_last or n % replicas == 0:
        assert len(set(flat.tolist())) == len(flat)  # disjoint
        assert len(flat) == n - n % replicas
    if not drop_last:
        assert set(flat.tolist()) == set(range(n))  # covering
    # Interleaving the ranks' shares gives back the global order.
    interleaved = np.stack(shards, axis=1).reshape(-1) if n else flat
    order = DistributedSampler(n, replicas, 0, seed=seed, drop_last=drop_last).global_order()
    k = min(len(interleaved), n)
    assert interleaved[:k].tolist() == order[:k].tolist()


def test_set_epoch_reshuffles_deterministically() -> None:
    s = DistributedSampler(100, 2, 1, seed=7)
    first = list(s)
    assert list(s) == first  # same epoch, same order
    s.set_epoch(1)
    second = list(s)
    assert second != first
    assert sorted(second) != second  # shuffled
    s.set_epoch(0)
    assert list(s) == first
    other = DistributedSampler(100, 2, 1, seed=8)
    assert list(other) != first
    assert list(DistributedSampler(100, 2, 1, shuffle=False)) == list(range(1, 100, 2))


def test_defaults_come_from_collectives() -> None:
    if collectives.is_initialized():
        pytest.skip("a process group is initialized in this test process")
    s = DistributedSampler(5)
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last, s.epoch) == (
        1,
        0,
        True,
        0,
        False,
        0,
    )
    assert sorted(s) == list(range(5))
    assert "dataset_len=5" in repr(s)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dataset_len": -1}, ValueError, "dataset_len must be >= 0"),
        ({"dataset_len": 3.0}, TypeError, "dataset_len must be an int"),
        ({"dataset_len": True}, TypeError, "dataset_len must be an int"),
        ({"dataset_len": 4, "num_replicas": 0, "rank": 0}, ValueError, "num_replicas"),
        ({"dataset_len": 4, "num_replicas": 2, "rank": 2}, ValueError, r"interval \[0, 1\]"),
        ({"dataset_len": 4, "num_replicas": 2, "rank": -1}, ValueError, "invalid rank -1"),
        ({"dataset_len": 4, "num_replicas": 1, "rank": "0"}, TypeError, "rank must be an int"),
        ({"dataset_len": 4, "seed": -3}, ValueError, "seed must be >= 0"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DistributedSampler(**kwargs)


def test_bad_epoch() -> None:
    s = DistributedSampler(4, 1, 0)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        s.set_epoch(-1)
    with pytest.raises(TypeError, match="epoch must be an int"):
        s.set_epoch(1.5)  # type: ignore[arg-type]
    s.set_epoch(np.int64(3))  # type: ignore[arg-type]
    assert s.epoch == 3


# ---------------------------------------------------------------------- uneven shards
DIGITS = 1797  # scikit-learn's digits: not a multiple of 2, 3 or 4


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_uneven_shards_see_every_sample_exactly_once(replicas: int, shuffle: bool) -> None:
    for epoch in (0, 1):
        shards = []
        for rank in range(replicas):
            s = DistributedSampler(
                DIGITS, replicas, rank, shuffle=shuffle, seed=9, even_shards=False
            )
            s.set_epoch(epoch)
            shards.append(s.indices())
            assert len(s) == s.num_samples == len(shards[-1]) == len(list(s))
            assert s.total_size == DIGITS
        flat = np.concatenate(shards)
        assert len(flat) == DIGITS and sorted(flat.tolist()) == list(range(DIGITS))
        # The first 1797 % N ranks have one sample more.
        expected = [DIGITS // replicas + (r < DIGITS % replicas) for r in range(replicas)]
        assert [len(sh) for sh in shards] == expected
        # Rank r has positions r, r + N, ... of the same global order as the padded sampler.
        order = DistributedSampler(DIGITS, replicas, 0, shuffle=shuffle, seed=9)
        order.set_epoch(epoch)
        for rank, sh in enumerate(shards):
            assert sh.tolist() == order.global_order()[rank::replicas].tolist()
        if shuffle:
            assert flat.tolist() != sorted(flat.tolist())


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_padded_default_unchanged_for_shuffle(replicas: int) -> None:
    """Even shards stay PyTorch's: ``ceil(1797 / N)`` each, the start of the order repeated."""
    shards = [list(DistributedSampler(DIGITS, replicas, r, seed=9)) for r in range(replicas)]
    assert shards == [reference(DIGITS, replicas, r, True, 9, 0, False) for r in range(replicas)]
    assert {len(sh) for sh in shards} == {math.ceil(DIGITS / replicas)}
    flat = [i for sh in shards for i in sh]
    assert set(flat) == set(range(DIGITS))
    assert len(flat) - DIGITS == (-DIGITS) % replicas  # that many samples seen twice
    assert DistributedSampler(DIGITS, replicas, 0).even_shards


@given(n=st.integers(0, 40), replicas=st.integers(1, 7), seed=st.integers(0, 1000))
def test_uneven_shards_disjoint_and_covering(n: int, replicas: int, seed: int) -> None:
    samplers = [
        DistributedSampler(n, replicas, r, seed=seed, even_shards=False) for r in range(replicas)
    ]
    shards = [s.indices() for s in samplers]
    flat = np.concatenate(shards)
    assert sorted(flat.tolist()) == list(range(n))
    assert [len(s) for s in samplers] == [len(range(r, n, replicas)) for r in range(replicas)]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_uneven_shards_known_values_and_errors() -> None:
    uneven = [
        list(DistributedSampler(10, 3, r, shuffle=False, even_shards=False)) for r in range(3)
    ]
    assert uneven == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    # Fewer samples than ranks: the last ranks get nothing (nothing is repeated).
    few = [list(DistributedSampler(2, 5, r, shuffle=False, even_shards=False)) for r in range(5)]
    assert few == [[0], [1], [], [], []]
    assert "even_shards=False" in repr(DistributedSampler(4, 2, 0, even_shards=False))
    with pytest.raises(ValueError, match=r"drop_last=True truncates .* even_shards=False"):
        DistributedSampler(10, 3, 0, drop_last=True, even_shards=False)
    with pytest.raises(TypeError, match="even_shards must be a bool, got 'no'"):
        DistributedSampler(10, 3, 0, even_shards="no")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- multi-process
@pytest.fixture
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The ranks' own launcher variables come from spawn; none may leak in from outside.
    monkeypatch.setenv("DPT_ALLOW_SHARED_GPU", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)


def sampler_rank(rank: int, n: int, seed: int) -> dict[str, Any]:
    s = DistributedSampler(n, seed=seed)  # num_replicas and rank from the group
    out: dict[str, Any] = {"rank": s.rank, "replicas": s.num_replicas, "epochs": []}
    for epoch in range(3):
        s.set_epoch(epoch)
        out["epochs"].append(list(s))
    # No communication above: without this barrier rank 0 could finish and close the store
    # it hosts while another rank is still inside init_process_group (it then fails with
    # "lost the connection to the store").
    collectives.barrier()
    return out


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_clean_env")
def test_ranks_agree_across_processes() -> None:
    n, seed, world = 11, 5, 3
    results = collectives.spawn(sampler_rank, args=(n, seed), nprocs=world, backend="cpu")
    assert results is not None
    assert [(r["rank"], r["replicas"]) for r in results] == [(i, world) for i in range(world)]
    orders = []
    for epoch in range(3):
        shards = [r["epochs"][epoch] for r in results]
        assert {len(s) for s in shards} == {4}
        assert set().union(*shards) == set(range(n))
        # Every rank drew the same permutation: interleaving the shards gives it back.
        interleaved = [shards[j % world][j // world] for j in range(n)]
        expected = np.random.default_rng(seed + epoch).permutation(n).tolist()
        assert interleaved == expected
        orders.append(interleaved)
    assert orders[0] != orders[1] != orders[2]


@pytest.mark.parametrize(("n", "replicas"), [(10, 4), (11, 3), (5, 8), (12, 4)])
def test_padding_repeats_the_start_on_the_last_ranks(n: int, replicas: int) -> None:
    """What the docstring promises: the first ``total_size - n`` indices of the epoch's order
    are seen twice, by the ranks ``n % replicas`` and up (each rank's last index)."""
    samplers = [DistributedSampler(n, replicas, r, seed=4) for r in range(replicas)]
    order = samplers[0].global_order().tolist()
    shares = [list(s) for s in samplers]
    extra = samplers[0].total_size - n
    assert 0 <= extra <= n  # (smaller datasets repeat their order several times)
    counts = np.bincount(np.concatenate(shares), minlength=n)
    assert sorted(np.flatnonzero(counts > 1).tolist()) == sorted(order[:extra])
    assert [shares[r][-1] for r in range(n % replicas, replicas) if extra] == order[:extra]
