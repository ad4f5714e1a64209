"""A minimal ``DataLoader`` over in-memory arrays: one fancy index per array per batch.

tensorlib has no dataset abstraction; training data here is a few same-length NumPy (or CuPy)
arrays such as ``(x, y)``. The loader orders the sample indices (sequentially, by its own
seeded permutation, or by a sampler), cuts them into batches and gathers each batch with a
single indexing operation per array, so no Python loop runs per sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

import tensorlib as tl

from ._sampler import DistributedSampler, check_int

__all__ = ["DataLoader"]

_IndexArray = np.ndarray[Any, np.dtype[np.int64]]


def _as_array(where: str, i: int, a: Any) -> Any:
    """The array to index: NumPy/CuPy arrays as they are, Tensors' arrays, else ``np.asarray``."""
    if isinstance(a, tl.Tensor):
        a = a.data
    elif not (isinstance(a, np.ndarray) or type(a).__module__.startswith("cupy")):
        a = np.asarray(a)
    if a.dtype == object:
        raise TypeError(f"{where}: arrays[{i}] has dtype object, which a Tensor cannot hold")
    if a.ndim == 0:
        raise ValueError(
            f"{where}: arrays[{i}] is a 0-d array; each array needs a first (sample) axis"
        )
    return a


class DataLoader:
    """Iterate over batches of same-length arrays, yielding a tuple of Tensors per batch.

    The order of the samples in an epoch is, in this priority:

    - ``sampler`` given: the indices it yields (a :class:`DistributedSampler`, or any
      re-iterable of ints; a one-shot iterator is read once, at construction, and replayed).
    - ``shuffle=True``: ``numpy.random.default_rng(seed + epoch).permutation(n)``. The epoch is
      set with :meth:`set_epoch` (0 at first); without it every epoch repeats the same order,
      as with a :class:`DistributedSampler`, so one process and N ranks behave alike.
    - otherwise ``0, 1, ..., n - 1``.

    The loader knows its position: :attr:`batches_done` counts the batches the current epoch's
    iteration has yielded, and :meth:`state_dict`/:meth:`load_state_dict` save and restore
    ``(epoch, batches_done)``, so that a run resumed mid-epoch gets exactly the batches that
    had not been consumed, in the same order (``save_checkpoint(..., loader=loader)`` does it).

    Example:
        >>> loader = DataLoader((x, y), batch_size=32, shuffle=True)
        >>> for epoch in range(3):
        ...     loader.set_epoch(epoch)
        ...     for xb, yb in loader:
        ...         ...

    Attributes:
        arrays: the arrays, as given (NumPy/CuPy; Tensors are unwrapped to their arrays).
        batch_size: samples per batch.
        shuffle: whether the loader draws its own permutation per epoch.
        sampler: the sampler, or None.
        drop_last: drop the last batch when it is smaller than ``batch_size``.
        seed: base seed of the loader's own permutation.
        device: where the batches' Tensors are created (None: where the arrays are).
        epoch: the epoch set by :meth:`set_epoch` (or :meth:`load_state_dict`).
    """

    def __init__(
        self,
        arrays: Sequence[Any],
        batch_size: int = 1,
        shuffle: bool = False,
        sampler: Iterable[int] | None = None,
        drop_last: bool = False,
        seed: int = 0,
        device: str | tl.Device | None = None,
    ) -> None:
        """Check the arrays and options; nothing is copied.

        Args:
            arrays: a tuple or list of arrays with the same first dimension, e.g. ``(x, y)``.
            batch_size: samples per batch (per rank, when a sampler splits the data).
            shuffle: draw a seeded permutation per epoch (not with ``sampler``).
            sampler: where the indices come from (a :class:`DistributedSampler` or any
                iterable of ints in ``[0, n)``).
            drop_last: drop the last, smaller batch.
            seed: base seed of the permutation when ``shuffle``.
            device: device of the yielded Tensors (``"cpu"``, ``"cuda:N"``); None keeps
                the arrays' device.

        Raises:
            TypeError: when ``arrays`` is not a tuple/list, or an option has the wrong type.
            ValueError: for arrays of different lengths, no arrays, 0-d arrays, a non-positive
                ``batch_size``, ``shuffle`` together with ``sampler``, or a
                :class:`DistributedSampler` built for another dataset length.
        """
        where = "DataLoader"
        if not isinstance(arrays, tuple | list):
            hint = " (wrap a single array as (x,))" if hasattr(arrays, "shape") else ""
            raise TypeError(
                f"{where}: arrays must be a tuple or list of arrays such as (x, y), "
                f"got {type(arrays).__name__}{hint}"
            )
        if not arrays:
            raise ValueError(f"{where}: arrays is empty; give at least one array")
        self.arrays: tuple[Any, ...] = tuple(_as_array(where, i, a) for i, a in enumerate(arrays))
        lengths = [int(a.shape[0]) for a in self.arrays]
        if len(set(lengths)) != 1:
            raise ValueError(
                f"{where}: the arrays must have the same length (first dimension), got "
                f"lengths {lengths}"
            )
        self._n = lengths[0]
        self.batch_size = check_int(where, "batch_size", batch_size, 1)
        self.seed = check_int(where, "seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.device = tl.device(device) if device is not None else None
        self.epoch = 0
        self._done = 0  # batches the current epoch's iteration has yielded
        self._resume_at = 0  # where the next iteration starts (set by load_state_dict)
        if sampler is not None and self.shuffle:
            raise ValueError(
                f"{where}: sampler and shuffle=True are mutually exclusive; the sampler decides "
                "the order (DistributedSampler has its own shuffle option)"
            )
        if isinstance(sampler, DistributedSampler) and sampler.dataset_len != self._n:
            raise ValueError(
                f"{where}: the sampler was built for dataset_len={sampler.dataset_len} but the "
                f"arrays have {self._n} samples"
            )
        if sampler is not None and not isinstance(sampler, DistributedSampler):
            if isinstance(sampler, np.ndarray):
                sampler = self._check_indices(np.asarray(sampler))
            elif iter(sampler) is sampler:
                # A generator would be empty from the second epoch on: read it once, replay it.
                sampler = self._check_indices(np.fromiter(sampler, dtype=np.int64))
        self.sampler = sampler

    @property
    def num_samples(self) -> int:
        """Samples in the arrays."""
        return self._n

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; call it at the start of every epoch, with the same value on every rank.

        It is forwarded to the sampler (when that has ``set_epoch``) and, with ``shuffle``,
        seeds the loader's own permutation (``seed + epoch``). Another epoch than the current
        one starts at its first batch; the current one keeps a position restored by
        :meth:`load_state_dict`, so a resumed loop can call ``set_epoch`` as always.

        Raises:
            TypeError: when ``epoch`` is not an int.
            ValueError: when ``epoch`` is negative.
        """
        epoch = check_int("DataLoader.set_epoch", "epoch", epoch, 0)
        if epoch != self.epoch:
            self._done = self._resume_at = 0
        self.epoch = epoch
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)

    def _check_indices(self, idx: np.ndarray[Any, Any]) -> _IndexArray:
        if idx.ndim != 1 or not (idx.dtype.kind in "iu" or idx.size == 0):
            raise TypeError(
                f"DataLoader: the sampler must give integer indices, got an array of dtype "
                f"{idx.dtype} and shape {idx.shape}"
            )
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self._n):
            bad = idx[(idx < 0) | (idx >= self._n)]
            raise IndexError(
                f"DataLoader: the sampler gave index {int(bad[0])}, outside [0, {self._n}) "
                f"({bad.size} such indices)"
            )
        return idx

    def _order(self) -> _IndexArray | None:
        """This epoch's indices; None means ``0..n-1`` (batches are then plain slices)."""
        if self.sampler is None:
            if not self.shuffle:
                return None
            rng = np.random.default_rng(self.seed + self.epoch)
            return rng.permutation(self._n).astype(np.int64, copy=False)
        if isinstance(self.sampler, DistributedSampler):
            return self.sampler.indices()
        if isinstance(self.sampler, np.ndarray):
            return self.sampler
        return self._check_indices(np.fromiter(self.sampler, dtype=np.int64))

    def _batch(self, index: Any) -> tuple[tl.Tensor, ...]:
        out = []
        for a in self.arrays:
            if isinstance(index, np.ndarray) and not isinstance(a, np.ndarray):
                index = tl.device_of(a).xp.asarray(index)  # CuPy wants its own index arrays
            out.append(tl.tensor(a[index], device=self.device))
        return tuple(out)

    @property
    def batches_done(self) -> int:
        """Batches of the current epoch yielded so far (by the latest iteration, or restored)."""
        return self._done

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch": ..., "batches_done": ...}`` (take it between batches)."""
        return {"epoch": self.epoch, "batches_done": self._done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration skips the batches done.

        The epoch is set (and forwarded to the sampler) as by :meth:`set_epoch`; the next
        iteration starts at batch ``batches_done`` of that epoch's order, later ones at the
        first batch again. The position counts this rank's batches: at another world size it
        is the same point of the epoch when the global batch (per-rank batch times ranks) is
        the same, up to the end-of-epoch padding.

        Raises:
            TypeError: when ``state`` is not such a dict, or its values are not ints.
            ValueError: for a negative value or more batches than an epoch has.
        """
        where = "DataLoader.load_state_dict"
        if not isinstance(state, dict) or set(state) != {"epoch", "batches_done"}:
            raise TypeError(
                f"{where}: expected {{'epoch': int, 'batches_done': int}} from state_dict(), "
                f"got {state!r:.200}"
            )
        epoch = check_int(where, "epoch", state["epoch"], 0)
        done = check_int(where, "batches_done", state["batches_done"], 0)
        try:
            per_epoch: int | None = len(self)
        except TypeError:
            per_epoch = None  # a sampler without len(): the iteration just ends early
        if per_epoch is not None and done > per_epoch:
            raise ValueError(
                f"{where}: batches_done={done} but an epoch of this loader has {per_epoch} "
                f"batches (batch_size={self.batch_size}); was it saved with another batch size?"
            )
        self.set_epoch(epoch)
        self._done = self._resume_at = done

    def __iter__(self) -> Iterator[tuple[tl.Tensor, ...]]:
        """Yield one tuple of Tensors (one per array) per batch, from the restored position.

        The order is drawn and the position taken when ``iter()`` is called, not at the first
        batch.
        """
        order = self._order()
        total = self._n if order is None else len(order)
        first, self._resume_at = self._resume_at, 0
        self._done = first
        return self._batches(order, total, first)

    def _batches(
        self, order: _IndexArray | None, total: int, first: int
    ) -> Iterator[tuple[tl.Tensor, ...]]:
        bs = self.batch_size
        stop = total - total % bs if self.drop_last else total
        for start in range(first * bs, stop, bs):
            end = min(start + bs, total)
            batch = self._batch(slice(start, end) if order is None else order[start:end])
            self._done += 1  # before the yield: the loop body sees its own batch counted
            yield batch

    def __len__(self) -> int:
        """Batches per epoch.

        Raises:
            TypeError: when the sampler has no ``len()``.
        """
        if self.sampler is None:
            total = self._n
        else:
            try:
                total = len(self.sampler)  # type: ignore[arg-type]
            except TypeError:
                raise TypeError(
                    f"DataLoader: len() needs a sampler with len(); "
                    f"{type(self.sampler).__name__} has none"
                ) from None
        return total // self.batch_size if self.drop_last else -(-total // self.batch_size)

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(a.shape)) for a in self.arrays)
        return (
            f"DataLoader(arrays=[{shapes}], batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, sampler={self.sampler!r}, drop_last={self.drop_last})"
        )
