"""``ShardStats``: what a ``fully_shard`` model's last step communicated and waited for."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Ledger", "ShardStats"]


@dataclass
class ShardStats:
    """Counted from the outermost sharded module's forward to the end of the backward after it
    (``model.stats``; reset when that module's next forward starts), over every unit under it.

    Whether the communication hides behind compute is what the wait times say: a prefetched
    all-gather that finished while the previous unit computed costs no wait, and a
    reduce-scatter that finished while the units below ran their backward costs none at the
    end of ``backward()``.

    Attributes:
        all_gathers: all-gathers used (forward, and again in backward under ZeRO-3).
        prefetched: of those, how many a prefetch had started before the unit asked.
        reduce_scatters: gradient reduce-scatters (none for backwards without gradient sync).
        gather_wait_s: seconds forward and backward spent blocked on all-gathers (a gather
            that was not prefetched counts whole).
        reduce_wait_s: seconds the end of ``backward()`` spent waiting for reduce-scatters.
        bytes_sent: bytes this rank sent, counted as a ring sends them ((N - 1) chunks of its
            shard's size per all-gather and per reduce-scatter), in the dtypes sent (float16
            all-gathers under a mixed-precision policy).
        peak_bytes: the most bytes held at once beyond the shards and their ``.grad`` (see
            :class:`Ledger`): the step's extra memory for parameters and gradients.
    """

    all_gathers: int = 0
    prefetched: int = 0
    reduce_scatters: int = 0
    gather_wait_s: float = 0.0
    reduce_wait_s: float = 0.0
    bytes_sent: int = 0
    peak_bytes: int = 0

    @property
    def wait_s(self) -> float:
        """All the seconds spent waiting for communication."""
        return self.gather_wait_s + self.reduce_wait_s


class Ledger:
    """The bytes a model's units hold beyond their shards and the shards' ``.grad``: gathered
    full parameters, all-gather and reduce-scatter buffers, backward's full gradients while a
    unit copies them out, gradients accumulated without sync. ``live`` now; the most since the
    step began goes to the step's :attr:`ShardStats.peak_bytes`.

    Only the main thread's hooks and callbacks change it (the communication thread does not).
    """

    def __init__(self) -> None:
        self.live = 0
        self.stats = ShardStats()

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.stats.peak_bytes:
            self.stats.peak_bytes = self.live

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes

    def new_step(self) -> ShardStats:
        """Start a step's stats, its peak counted from what is held now."""
        self.stats = ShardStats(peak_bytes=self.live)
        return self.stats
