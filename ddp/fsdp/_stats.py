"""``ShardStats``: what a ``fully_shard`` model's last step communicated and waited for."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardStats"]


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
    """

    all_gathers: int = 0
    prefetched: int = 0
    reduce_scatters: int = 0
    gather_wait_s: float = 0.0
    reduce_wait_s: float = 0.0
    bytes_sent: int = 0

    @property
    def wait_s(self) -> float:
        """All the seconds spent waiting for communication."""
        return self.gather_wait_s + self.reduce_wait_s
