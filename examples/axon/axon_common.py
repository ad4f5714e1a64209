"""What the axonml-distributed README's examples leave to the reader, shared by the scripts here.

The README runs each example in a mock world of one (``World::mock()``,
``ProcessGroup::mock()``), where every collective returns the rank's own values. Each script
here runs that, as written, and with ``--world N`` runs the same code on every rank of a mock
world of N: ``MockBackend.create_world(N)`` and one thread a rank, as axonml simulates
several processes, so the collectives really combine N ranks' values.
"""

from __future__ import annotations

import argparse
import threading
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ddp.axon import MockBackend, Tensor

__all__ = ["fmt", "make_parser", "run_world", "say"]

T = TypeVar("T")
_PRINT = threading.Lock()


def make_parser(doc: str | None, default_world: int = 1) -> argparse.ArgumentParser:
    """The scripts' command line: ``--world N`` (ranks of the mock world)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--world",
        type=int,
        default=default_world,
        help=f"ranks of the mock world, one thread each (default {default_world})",
    )
    return parser


def fmt(tensor: Tensor) -> str:
    """A tensor's values as ``[0.1, 0.2]`` (4 significant digits)."""
    return np.array2string(
        tensor.numpy(), separator=", ", formatter={"float_kind": lambda v: f"{v:.4g}"}
    )


def say(rank: int, message: str) -> None:
    """Print one line as ``rank R: message`` (whole lines, whatever the threads do)."""
    with _PRINT:
        print(f"rank {rank}: {message}", flush=True)


def run_world(n: int, fn: Callable[[MockBackend], T], timeout: float = 60.0) -> list[T]:
    """Run ``fn(backend)`` for every rank of a fresh mock world of ``n``, one thread each.

    A rank that raises ends its backend with the error, so ranks waiting for it in a
    collective fail at once, naming it, instead of waiting for the timeout.

    Returns:
        Every rank's result, in rank order.

    Raises:
        RuntimeError: when a rank raised (with its traceback).
    """
    results: list[Any] = [None] * n
    errors: list[tuple[int, str]] = []

    def rank_main(backend: MockBackend) -> None:
        try:
            with backend:  # leaving ends the rank: peers waiting for it fail at once
                results[backend.rank()] = fn(backend)
        except BaseException:
            errors.append((backend.rank(), traceback.format_exc()))

    threads = [
        threading.Thread(target=rank_main, args=(b,), name=f"rank-{b.rank()}")
        for b in MockBackend.create_world(n, timeout=timeout)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        rank, text = errors[0]  # the first to fail: the others name it
        raise RuntimeError(f"rank {rank} of the mock world failed:\n{text}")
    return results
