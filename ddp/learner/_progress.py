"""Progress of a run: a tqdm bar over each epoch's batches where tqdm is installed, and one
line of figures per epoch (through ``tqdm.write`` then, so the bar is not broken); nothing
when quiet."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

from ._outputs import EpochMetrics

__all__ = ["Progress"]


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # optional: plain lines without it
        return None
    return tqdm


class Progress:
    """Shows the main worker's progress.

    Args:
        enabled: False for a quiet run.
        num_epochs: the run's epochs (for ``epoch 3/10``).
    """

    def __init__(self, enabled: bool, num_epochs: int) -> None:
        self.enabled = enabled
        self.num_epochs = num_epochs
        self._tqdm = _tqdm() if enabled else None

    def batches(self, batches: Iterable[Any], epoch: int, phase: str) -> Iterator[Any]:
        """``batches``, behind a bar named ``epoch E/N phase`` when there is one."""
        if self._tqdm is None:
            yield from batches
            return
        try:
            total: int | None = len(batches)  # type: ignore[arg-type]
        except TypeError:
            total = None
        desc = f"epoch {epoch + 1}/{self.num_epochs} {phase}"
        bar = self._tqdm(batches, total=total, desc=desc, leave=False, file=sys.stderr)
        try:
            yield from bar
        finally:
            bar.close()

    def epoch_done(self, metrics: EpochMetrics) -> None:
        """Print the epoch's line."""
        if not self.enabled:
            return
        line = metrics.describe(self.num_epochs)
        if self._tqdm is not None:
            self._tqdm.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def note(self, text: str) -> None:
        """Print a line about the run (a resume)."""
        if self.enabled:
            print(text, flush=True)
