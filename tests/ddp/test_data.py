"""``DataLoader`` over arrays: order, batching, samplers, epochs, devices and errors."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from ddp._data import DataLoader
from ddp._sampler import DistributedSampler
from tests.helpers import DEVICES


def data(n: int = 10) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(n, dtype=np.int64) * 10
    return x, y


def rows(loader: DataLoader) -> list[list[int]]:
    """Each batch's sample indices, read back from y (= 10 * index)."""
    return [(yb.numpy() // 10).tolist() for _, yb in loader]


def flat(batches: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(batches))


def test_sequential_batches_and_len() -> None:
    x, y = data(10)
    loader = DataLoader((x, y), batch_size=4)
    batches = list(loader)
    assert len(loader) == len(batches) == 3
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    xb, yb = batches[1]
    assert isinstance(xb, tl.Tensor) and isinstance(yb, tl.Tensor)
    assert xb.dtype == tl.float32 and yb.dtype == tl.int64
    assert xb.device == tl.device("cpu") and not xb.requires_grad
    np.testing.assert_array_equal(xb.numpy(), x[4:8])
    np.testing.assert_array_equal(yb.numpy(), y[4:8])
    # The batches are copies: writing to one does not change the dataset.
    xb.data[...] = -1
    assert x.min() == 0


def test_drop_last() -> None:
    loader = DataLoader(list(data(10)), batch_size=4, drop_last=True)
    assert len(loader) == 2
    assert rows(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(DataLoader(data(3), batch_size=4, drop_last=True)) == 0
    assert list(DataLoader(data(3), batch_size=4, drop_last=True)) == []
    assert len(DataLoader(data(8), batch_size=4, drop_last=True)) == 2


def test_shuffle_is_seeded_by_seed_plus_epoch() -> None:
    loader = DataLoader(data(10), batch_size=3, shuffle=True, seed=4)
    first = rows(loader)
    assert first == rows(loader)  # same epoch, same order
    assert flat(first) == np.random.default_rng(4).permutation(10).tolist()
    loader.set_epoch(2)
    assert flat(rows(loader)) == np.random.default_rng(6).permutation(10).tolist()
    assert rows(loader) != first
    assert loader.epoch == 2


def test_distributed_sampler_and_set_epoch_forwarding() -> None:
    x, y = data(10)
    sampler = DistributedSampler(10, num_replicas=2, rank=1, seed=3)
    loader = DataLoader((x, y), batch_size=2, sampler=sampler)
    assert len(loader) == 3
    assert flat(rows(loader)) == list(sampler)
    loader.set_epoch(5)
    assert sampler.epoch == 5
    assert flat(rows(loader)) == list(sampler)
    assert flat(rows(loader)) == np.random.default_rng(8).permutation(10)[1::2].tolist()


def test_generic_samplers() -> None:
    x, y = data(6)
    assert rows(DataLoader((x, y), batch_size=2, sampler=[5, 0, 3])) == [[5, 0], [3]]
    assert rows(DataLoader((x, y), batch_size=2, sampler=range(4, 0, -1))) == [[4, 3], [2, 1]]
    assert rows(DataLoader((x, y), batch_size=5, sampler=np.array([1, 1, 2]))) == [[1, 1, 2]]
    # A one-shot iterator is read once and replayed every epoch.
    loader = DataLoader((x, y), batch_size=2, sampler=(i for i in [2, 4, 1]))
    assert rows(loader) == rows(loader) == [[2, 4], [1]]
    assert len(loader) == 2
    loader.set_epoch(1)  # no set_epoch on the sampler: only the loader's epoch changes


def test_sampler_without_len() -> None:
    class Indices:
        def __iter__(self) -> Any:
            return iter([3, 2])

    loader = DataLoader(data(4), batch_size=1, sampler=Indices())
    assert rows(loader) == [[3], [2]]
    with pytest.raises(TypeError, match="sampler with len"):
        len(loader)


def test_bad_indices_from_sampler() -> None:
    with pytest.raises(IndexError, match=r"index 6, outside \[0, 6\)"):
        DataLoader(data(6), sampler=iter([0, 6]))
    with pytest.raises(IndexError, match="index -1"):
        DataLoader(data(6), sampler=np.array([-1, 2]))
    with pytest.raises(TypeError, match="integer indices"):
        DataLoader(data(6), sampler=np.array([0.5]))
    loader = DataLoader(data(6), sampler=[1, 7])
    with pytest.raises(IndexError, match="index 7"):
        list(loader)
    with pytest.raises(ValueError, match="dataset_len=7"):
        DataLoader(data(6), sampler=DistributedSampler(7, 1, 0))


def test_one_index_per_array_per_batch() -> None:
    calls: list[Any] = []

    class Counting(np.ndarray):
        def __getitem__(self, key: Any) -> Any:
            calls.append(key)
            return np.asarray(super().__getitem__(key))

    x = np.arange(1000, dtype=np.float32).reshape(500, 2).view(Counting)
    y = np.arange(500, dtype=np.int64).view(Counting)
    for loader in (
        DataLoader((x, y), batch_size=100, shuffle=True),
        DataLoader((x, y), batch_size=100),
    ):
        calls.clear()
        batches = list(loader)
        assert len(batches) == 5 and len(calls) == 10  # no per-sample indexing
    assert all(isinstance(k, slice) for k in calls)  # sequential order: plain slices


def test_accepts_lists_and_tensors_and_keeps_dtypes() -> None:
    y = [0, 1, 2]
    x = tl.tensor(np.ones((3, 2), dtype=np.float64))
    xb, yb = next(iter(DataLoader([x, y], batch_size=3)))
    assert xb.dtype == tl.float64 and yb.dtype == tl.int64
    assert yb.tolist() == [0, 1, 2]
    (bb,) = next(iter(DataLoader((np.array([True, False]),), batch_size=2)))
    assert bb.dtype == tl.bool_


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((np.zeros(3),), {}, TypeError, r"wrap a single array as \(x,\)"),
        (({"x": 1},), {}, TypeError, "tuple or list"),
        (((),), {}, ValueError, "arrays is empty"),
        (((np.zeros(3), np.zeros(4)),), {}, ValueError, r"lengths \[3, 4\]"),
        (((np.zeros(3), np.float32(1)),), {}, ValueError, r"arrays\[1\] is a 0-d array"),
        (((np.array([object()]),),), {}, TypeError, "dtype object"),
        (((np.zeros(3),),), {"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        (((np.zeros(3),),), {"batch_size": 2.0}, TypeError, "batch_size must be an int"),
        (((np.zeros(3),),), {"seed": -1}, ValueError, "seed must be >= 0"),
        (((np.zeros(3),),), {"shuffle": True, "sampler": [0]}, ValueError, "mutually exclusive"),
        (((np.zeros(3),),), {"device": "tpu"}, ValueError, "unknown device"),
    ],
)
def test_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        DataLoader(*args, **kwargs)


def test_bad_epoch() -> None:
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        DataLoader(data(3)).set_epoch(-1)


def test_empty_dataset() -> None:
    loader = DataLoader(data(0), batch_size=4, shuffle=True)
    assert len(loader) == 0 and list(loader) == []
    assert "batch_size=4" in repr(loader)


@pytest.mark.parametrize("device", DEVICES)
def test_batches_on_device(device: str) -> None:
    x, y = data(5)
    loader = DataLoader((x, y), batch_size=2, shuffle=True, device=device)
    out = list(loader)
    assert all(t.device == tl.device(device) for b in out for t in b)
    got = np.concatenate([b[1].numpy() for b in out]) // 10
    assert sorted(got.tolist()) == list(range(5))
    # Arrays already on the device are indexed there (a device index array for fancy indexing).
    on_dev = (tl.tensor(x, device=device), tl.tensor(y, device=device))
    again = list(DataLoader(on_dev, batch_size=2, shuffle=True))
    assert all(t.device == tl.device(device) for b in again for t in b)
    np.testing.assert_array_equal(
        np.concatenate([b[1].numpy() for b in again]), np.concatenate([b[1].numpy() for b in out])
    )


def _loaders(kind: str) -> DataLoader:
    x, y = data(11)
    if kind == "shuffle":
        return DataLoader((x, y), batch_size=3, shuffle=True, seed=5)
    if kind == "sequential-drop-last":
        return DataLoader((x, y), batch_size=3, drop_last=True)
    world, rank = (3, 2) if kind == "sampler-3-ranks" else (2, 0)
    sampler = DistributedSampler(11, num_replicas=world, rank=rank, seed=9)
    return DataLoader((x, y), batch_size=2, sampler=sampler)


@pytest.mark.parametrize(
    "kind", ["shuffle", "sequential-drop-last", "sampler-2-ranks", "sampler-3-ranks"]
)
@pytest.mark.parametrize("epoch", [0, 3])
def test_resume_at_every_position_gives_the_rest_of_the_epoch(kind: str, epoch: int) -> None:
    """Stop after k batches (k = 0 .. the whole epoch), restore the position into a new loader:
    it yields exactly the batches not yet consumed, in order, and the next epoch in full."""
    whole = _loaders(kind)
    whole.set_epoch(epoch)
    expected = rows(whole)
    whole.set_epoch(epoch + 1)
    next_epoch = rows(whole)
    for k in range(len(expected) + 1):
        first = _loaders(kind)
        first.set_epoch(epoch)
        it = iter(first)
        consumed = [(next(it)[1].numpy() // 10).tolist() for _ in range(k)]
        assert first.batches_done == k
        state = first.state_dict()
        assert state == {"epoch": epoch, "batches_done": k}

        resumed = _loaders(kind)
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)  # what a resumed loop does: the position is kept
        assert consumed + rows(resumed) == expected, (kind, epoch, k)
        assert resumed.batches_done == len(expected)
        assert rows(resumed) == expected  # the position applies to one iteration only
        resumed.set_epoch(epoch + 1)
        assert rows(resumed) == next_epoch


def test_another_epoch_drops_a_restored_position() -> None:
    loader = _loaders("shuffle")
    loader.load_state_dict({"epoch": 2, "batches_done": 3})
    assert loader.epoch == 2 and loader.batches_done == 3
    loader.set_epoch(4)
    assert loader.batches_done == 0 and len(rows(loader)) == 4
    sampler = DistributedSampler(11, num_replicas=2, rank=1)
    DataLoader(data(11), batch_size=2, sampler=sampler).load_state_dict(
        {"epoch": 6, "batches_done": 1}
    )
    assert sampler.epoch == 6  # forwarded as by set_epoch


def test_bad_positions() -> None:
    loader = _loaders("shuffle")  # 4 batches an epoch
    with pytest.raises(ValueError, match="batches_done=5 but an epoch of this loader has 4"):
        loader.load_state_dict({"epoch": 0, "batches_done": 5})
    with pytest.raises(TypeError, match="expected"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="batches_done must be >= 0"):
        loader.load_state_dict({"epoch": 0, "batches_done": -1})
    assert loader.state_dict() == {"epoch": 0, "batches_done": 0}  # unchanged
