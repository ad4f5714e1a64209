"""``DistributedSampler``: each rank's share of a dataset's indices, as in PyTorch.

Every rank computes the same global order (a permutation seeded by ``seed + epoch``, or
``0..n-1``), pads it by repeating its start so it divides evenly (or truncates it with
``drop_last``), and takes every ``num_replicas``-th index starting at its rank. No
communication is needed: the ranks agree because they share the seed.

With ``even_shards=False`` the order is neither padded nor truncated: the shares differ in
length by at most one and together hold every index exactly once (for evaluation, where a
padded duplicate would be counted twice by a metric summed over the ranks).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import numpy as np

import collectives

__all__ = ["DistributedSampler"]


def check_int(where: str, name: str, value: Any, minimum: int | None = None) -> int:
    """Return ``value`` as an int, or raise a clear error naming the argument.

    Accepts Python and NumPy integers; rejects bools, floats and anything else.

    Raises:
        TypeError: when ``value`` is not an integer.
        ValueError: when it is below ``minimum``.
    """
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{where}: {name} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{where}: {name} must be an int, got {type(value).__name__} {value!r}"
        ) from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {number}")
    return number


class DistributedSampler:
    """Yield this rank's indices of a dataset of ``dataset_len`` samples (PyTorch semantics).

    - ``shuffle=True``: the global order is ``numpy.random.default_rng(seed + epoch)
      .permutation(dataset_len)``; ``shuffle=False``: ``0, 1, ..., dataset_len - 1``.
    - ``drop_last=False`` (padding): the order is extended by repeating it from its start up
      to a multiple of ``num_replicas``, so every rank gets ``ceil(dataset_len / num_replicas)``
      indices. The first ``total_size - dataset_len`` indices of the epoch's order are seen
      twice in that epoch (by the ranks ``dataset_len % num_replicas`` and up); the sum of a
      metric over all ranks therefore counts them twice. With 10 samples on 4 ranks the order
      ``o0 .. o9`` becomes ``o0 .. o9, o0, o1``: ranks 2 and 3 get ``o0`` and ``o1`` again.
    - ``drop_last=True``: the tail is dropped down to a multiple of ``num_replicas`` (the
      last ``dataset_len % num_replicas`` indices of the epoch's order, a different set each
      epoch when shuffling); every rank gets ``dataset_len // num_replicas`` indices and the
      ranks' indices are disjoint.
    - ``even_shards=False`` (no padding, no truncation): rank ``r`` gets
      ``len(range(r, dataset_len, num_replicas))`` indices, so the first
      ``dataset_len % num_replicas`` ranks have one more than the others (and with fewer
      samples than ranks, the last ranks have none). The ranks' indices are disjoint and
      together are the whole dataset, every index exactly once, so a metric summed over the
      ranks equals one process's. Ranks may then run different numbers of batches, so a
      loop over them must not issue collectives per batch (that is for evaluation: a DDP
      forward under ``tensorlib.no_grad()`` issues none but a buffer broadcast at the first
      one, see :class:`~ddp.DistributedDataParallel`); training needs even shards, or
      :func:`ddp.join`.
    - Rank ``r`` takes positions ``r, r + num_replicas, r + 2 * num_replicas, ...``, so
      interleaving the ranks' indices gives back the global order.

    Call :meth:`set_epoch` at the start of every epoch: without it every epoch repeats the
    same order (as with PyTorch's sampler). The sampler has no position of its own: the order
    is a function of ``(seed, epoch)``, and the :class:`~ddp.DataLoader` that batches it
    records how many batches of the epoch it has yielded (``DataLoader.state_dict``), which is
    what a checkpoint saves to resume mid-epoch.

    Example:
        >>> sampler = DistributedSampler(10, num_replicas=3, rank=1, shuffle=False)
        >>> list(sampler)
        [1, 4, 7, 0]
        >>> list(DistributedSampler(10, num_replicas=3, rank=1, shuffle=False, even_shards=False))
        [1, 4, 7]

    Attributes:
        dataset_len: number of samples in the dataset.
        num_replicas: number of ranks sharing the dataset.
        rank: this rank.
        shuffle: whether the global order is a seeded permutation.
        seed: base seed, the same on every rank.
        drop_last: truncate instead of pad.
        even_shards: every rank gets the same number of indices (padded or truncated); False
            gives every index exactly once.
        epoch: the epoch set by :meth:`set_epoch` (0 at first).
        num_samples: indices of this rank per epoch.
        total_size: indices of all ranks together per epoch: ``num_samples * num_replicas``
            with even shards, ``dataset_len`` without.
    """

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        even_shards: bool = True,
    ) -> None:
        """Describe this rank's share; nothing is drawn until iteration.

        Args:
            dataset_len: number of samples (``len(dataset)``).
            num_replicas: number of ranks; None asks ``collectives.get_world_size()`` (1 when
                no process group was initialized).
            rank: this rank; None asks ``collectives.get_rank()`` (0 when not initialized).
            shuffle: draw a new permutation per epoch (seeded by ``seed + epoch``).
            seed: base seed; must be the same on every rank.
            drop_last: drop the tail that does not divide evenly instead of padding.
            even_shards: give every rank the same number of indices (PyTorch's sampler);
                False: neither pad nor truncate, so every index is seen exactly once and the
                first ``dataset_len % num_replicas`` ranks have one index more.

        Raises:
            TypeError: when an argument that must be an int is not one, or ``even_shards``
                is not a bool.
            ValueError: for a negative length or seed, ``num_replicas < 1``, a rank outside
                ``[0, num_replicas - 1]``, or ``drop_last=True`` with ``even_shards=False``.
        """
        where = "DistributedSampler"
        self.dataset_len = check_int(where, "dataset_len", dataset_len, 0)
        if num_replicas is None:
            num_replicas = collectives.get_world_size()
        self.num_replicas = check_int(where, "num_replicas", num_replicas, 1)
        if rank is None:
            rank = collectives.get_rank()
        self.rank = check_int(where, "rank", rank)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"{where}: invalid rank {self.rank}, rank should be in the interval "
                f"[0, {self.num_replicas - 1}] for num_replicas={self.num_replicas}"
            )
        # NumPy's generators take non-negative seeds only.
        self.seed = check_int(where, "seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if not isinstance(even_shards, bool | np.bool_):
            raise TypeError(f"{where}: even_shards must be a bool, got {even_shards!r}")
        self.even_shards = bool(even_shards)
        if self.drop_last and not self.even_shards:
            raise ValueError(
                f"{where}: drop_last=True truncates the data to equal shards, but "
                "even_shards=False asks for every sample exactly once (shards differing by "
                "at most one); pass drop_last=False to see every sample, or even_shards=True"
            )
        self.epoch = 0
        n, r = self.dataset_len, self.num_replicas
        if self.drop_last:
            self.num_samples = n // r
            self.total_size = self.num_samples * r
        elif self.even_shards:
            self.num_samples = -(-n // r)  # ceil
            self.total_size = self.num_samples * r
        else:
            self.num_samples = len(range(self.rank, n, r))
            self.total_size = n

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the next permutation (``seed + epoch``).

        Call it with the same value on every rank at the start of every epoch.

        Raises:
            TypeError: when ``epoch`` is not an int.
            ValueError: when ``epoch`` is negative.
        """
        self.epoch = check_int("DistributedSampler.set_epoch", "epoch", epoch, 0)

    def global_order(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The epoch's order of all ``dataset_len`` indices, before padding and splitting.

        The same with and without ``even_shards``: only what is done at its end differs.
        """
        if self.shuffle:
            rng = np.random.default_rng(self.seed + self.epoch)
            return rng.permutation(self.dataset_len).astype(np.int64, copy=False)
        return np.arange(self.dataset_len, dtype=np.int64)

    def indices(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """This rank's indices for the current epoch, as an int64 array of ``num_samples``."""
        order = self.global_order()
        if self.drop_last:
            order = order[: self.total_size]
        elif self.total_size > len(order):  # even shards only: total_size is n otherwise
            # Repeat the order from its start (several times when the dataset is smaller than
            # the padding), exactly as PyTorch pads.
            order = np.resize(order, self.total_size)
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices as Python ints."""
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        """This rank's indices per epoch (``num_samples``); ranks differ by at most one
        without ``even_shards``."""
        return self.num_samples

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(dataset_len={self.dataset_len}, num_replicas="
            f"{self.num_replicas}, rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, even_shards={self.even_shards}, epoch={self.epoch})"
        )
