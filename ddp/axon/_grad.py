"""axonml's ``GradientBucket``, ``GradSyncStrategy`` and ``GradientSynchronizer``.

Both stand on the package's one bucketing (``ddp/_buckets.py``), the one DDP's reducer and
:func:`ddp.sync_gradients` use: a :class:`GradientBucket` is one
:class:`~ddp._buckets.FlatBucket` whose buffer it fills itself; a :class:`GradientSynchronizer`
plans its buckets and reduces them with ``ddp._sync.reduce_tensors``.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

import tensorlib as tl
from tensorlib import Tensor

from .._buckets import FlatBucket
from .._sync import reduce_tensors, resolve_group
from ._group import ProcessGroup

__all__ = ["GradSyncStrategy", "GradientBucket", "GradientSynchronizer"]


def _count(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return int(value)


class GradientBucket:
    """Gradients flattened into one buffer of at most ``capacity`` elements, to all-reduce
    them in one call (axonml's ``GradientBucket``).

    Every tensor added must have the first one's dtype and device. :meth:`add` copies the
    tensor's values in (later changes to the tensor do not reach the bucket), :meth:`data_mut`
    is the flat buffer itself (a collective may reduce it in place), :meth:`extract` gives new
    tensors in the added shapes.

    Args:
        capacity: the most elements the bucket holds.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = _count(capacity, "GradientBucket(capacity)", 1)
        self._layout: FlatBucket | None = None

    @property
    def capacity(self) -> int:
        """The most elements the bucket holds."""
        return self._capacity

    def add(self, tensor: Any) -> bool:
        """Copy ``tensor`` (a Tensor or NumPy array) into the bucket.

        Returns:
            True; False when it would take the bucket past its capacity (then nothing was
            added, as in axonml: start another bucket).

        Raises:
            TypeError: when it is not a tensor, or its dtype or device differs from the first
                tensor's.
        """
        if isinstance(tensor, Tensor):
            arr, device = tensor.data, tensor.device
        elif isinstance(tensor, np.ndarray):
            arr, device = tensor, tl.device("cpu")
        else:
            raise TypeError(f"GradientBucket.add: expected a Tensor, got {type(tensor).__name__}")
        layout = self._layout
        if layout is None:
            layout = self._layout = FlatBucket(arr.dtype, device)
        elif arr.dtype != layout.dtype or device != layout.device:
            raise TypeError(
                f"GradientBucket.add: the bucket holds {layout.dtype} on {layout.device}, got "
                f"{arr.dtype} on {device}; use one bucket per dtype and device"
            )
        if layout.numel + arr.size > self._capacity:
            return False
        self._reserve(layout, layout.numel + arr.size)
        offset = layout.add(arr.shape)
        layout.buffer[offset : offset + arr.size] = arr.reshape(-1)
        return True

    def _reserve(self, layout: FlatBucket, numel: int) -> None:
        """Grow the buffer to hold ``numel`` elements (doubling, up to the capacity)."""
        have = 0 if layout.buffer is None else int(layout.buffer.size)
        if numel <= have:
            return
        xp = layout.device.xp
        grown = xp.empty(min(self._capacity, max(numel, 2 * have, 1024)), dtype=layout.dtype)
        if have:
            grown[: layout.numel] = layout.buffer[: layout.numel]
        layout.buffer = grown

    def data(self) -> Any:
        """The flattened values, in the order added (a view of the buffer)."""
        layout = self._layout
        if layout is None:
            return np.zeros(0, dtype=np.float32)
        return layout.buffer[: layout.numel]

    def data_mut(self) -> Any:
        """The flat buffer to reduce in place, e.g. ``pg.backend().all_reduce(bucket.data_mut(),
        ReduceOp.AVERAGE)``; :meth:`extract` then reads the result."""
        return self.data()

    def extract(self) -> list[Tensor]:
        """New tensors holding the bucket's values, in the shapes and order added."""
        layout = self._layout
        if layout is None:
            return []
        return [tl.from_array(c.copy(), layout.device) for c in layout.chunks()]

    def size(self) -> int:
        """Elements in the bucket."""
        return 0 if self._layout is None else self._layout.numel

    def is_empty(self) -> bool:
        """Whether nothing was added."""
        return self.size() == 0

    def is_full(self) -> bool:
        """Whether the bucket holds ``capacity`` elements."""
        return self.size() >= self._capacity

    def clear(self) -> None:
        """Empty the bucket (it then takes any dtype again)."""
        self._layout = None

    def __repr__(self) -> str:
        return f"<GradientBucket {self.size()}/{self._capacity} elements>"


class GradSyncStrategy(enum.Enum):
    """When :class:`GradientSynchronizer` communicates (axonml's ``GradSyncStrategy``).

    ``Synchronous``: ``sync_all`` averages every added gradient. ``Overlapped``: the same here,
    as in axonml's ``sync_all`` (overlapping communication with backward is what
    :class:`ddp.DistributedDataParallel` does). ``NoSync``: ``sync_all`` communicates nothing
    and says so by returning 0 (for debugging, as axonml's).
    """

    SYNCHRONOUS = "synchronous"
    OVERLAPPED = "overlapped"
    NO_SYNC = "no_sync"
    # axonml's spelling: aliases of the members above.
    Synchronous = "synchronous"
    Overlapped = "overlapped"
    NoSync = "no_sync"


class GradientSynchronizer:
    """Average gradients handed over one by one, in buckets of ``bucket_size`` elements
    (axonml's ``GradientSynchronizer``).

    :meth:`prepare` declares how many gradients there are, :meth:`add_gradient` gives
    gradient ``i`` (the tensor itself is kept, not a copy), :meth:`sync_all` averages every
    added gradient over the group, in place, one all-reduce per bucket. Every rank adds the
    same gradients (indexes, shapes, dtypes): the buckets depend on them.

    Args:
        strategy: see :class:`GradSyncStrategy`.
        bucket_size: the most elements in one bucket (25M: about 100 MB of float32).
    """

    def __init__(
        self,
        strategy: GradSyncStrategy = GradSyncStrategy.Synchronous,
        bucket_size: int = 25_000_000,
    ) -> None:
        if not isinstance(strategy, GradSyncStrategy):
            raise TypeError(f"strategy must be a GradSyncStrategy, got {strategy!r}")
        self._strategy = strategy
        self._bucket_size = _count(bucket_size, "bucket_size", 1)
        self._slots: list[Tensor | None] = []

    def strategy(self) -> GradSyncStrategy:
        """The strategy given."""
        return self._strategy

    @property
    def bucket_size(self) -> int:
        """The most elements in one bucket."""
        return self._bucket_size

    def prepare(self, num_params: int) -> None:
        """Make room for ``num_params`` gradients (dropping any added before)."""
        self._slots = [None] * _count(num_params, "prepare(num_params)", 0)

    def add_gradient(self, index: int, grad: Tensor) -> None:
        """Hand over gradient ``index`` (``sync_all`` averages this tensor in place).

        Raises:
            IndexError: when ``index`` is not below ``prepare``'s count.
            TypeError: when ``grad`` is not a Tensor.
        """
        if not isinstance(grad, Tensor):
            raise TypeError(f"add_gradient: expected a Tensor, got {type(grad).__name__}")
        n = len(self._slots)
        if (
            isinstance(index, bool)
            or not isinstance(index, int | np.integer)
            or not (0 <= index < n)
        ):
            raise IndexError(
                f"add_gradient: index {index!r} is out of range: prepare({n}) made room for "
                f"gradients 0..{n - 1}" + (" (call prepare(n) first)" if n == 0 else "")
            )
        self._slots[int(index)] = grad

    def gradients(self) -> list[Tensor | None]:
        """The gradients added, by index (None where none was)."""
        return list(self._slots)

    def sync_all(self, process_group: ProcessGroup) -> int:
        """Average every added gradient over the group's ranks, in place.

        Returns:
            The number of all-reduces issued: one per bucket; 0 with ``NoSync`` or in a world
            of one, where each rank's values already are the average.
        """
        if not isinstance(process_group, ProcessGroup):
            raise TypeError(
                f"sync_all: expected a ddp.axon.ProcessGroup, got {type(process_group).__name__}"
            )
        if self._strategy is GradSyncStrategy.NoSync:
            return 0
        added = [g for g in self._slots if g is not None]
        pg = resolve_group(process_group.group, "GradientSynchronizer.sync_all")
        if pg is None:
            return 0
        return reduce_tensors(pg, added, "avg", self._bucket_size, unit="elements")

    def clear(self) -> None:
        """Forget the gradients added (``prepare``'s count stays)."""
        self._slots = [None] * len(self._slots)

    def __repr__(self) -> str:
        added = sum(g is not None for g in self._slots)
        return (
            f"<GradientSynchronizer {self._strategy.name} bucket_size={self._bucket_size} "
            f"{added}/{len(self._slots)} gradients>"
        )
