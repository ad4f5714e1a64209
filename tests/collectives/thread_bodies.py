"""Test bodies for several threads of one rank issuing collectives (one group per thread).

Run in every rank of a :class:`~tests.collectives.harness.RankPool`. Two threads of each rank
issue ``iters`` same-shaped all_reduces, concurrently; thread ``t``'s input at call ``i`` holds
a value that identifies (t, i, rank), so a result summed with the other thread's data is
caught, never mistaken for a right one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

import collectives as C
from tests.collectives.bodies import _world


def _value(t: int, i: int, rank: int) -> float:
    return float((t + 1) * 100_000 + i * 10 + rank)


def _run_threads(
    groups: list[Any], iters: int, size: int, bind: bool, start_barrier: bool = True
) -> dict[str, Any]:
    """Thread ``t`` issues ``iters`` all_reduces on ``groups[t]`` (the same group for every
    thread, or one each); with ``bind`` each group is given to its thread first."""
    rank, n = _world()
    go = threading.Barrier(len(groups))
    outcome: list[dict[str, Any]] = [{} for _ in groups]

    def work(t: int) -> None:
        right = wrong = 0
        t0 = time.monotonic()
        error = None
        try:
            if start_barrier:
                go.wait(timeout=30)
            for i in range(iters):
                x = np.full(size, _value(t, i, rank), dtype=np.float64)
                groups[t].all_reduce(x)
                expected = sum(_value(t, i, r) for r in range(n))
                if np.all(x == expected):
                    right += 1
                else:
                    wrong += 1
        except Exception as exc:
            error = {
                "type": type(exc).__name__,
                "message": str(exc),
                "elapsed": time.monotonic() - t0,
            }
        outcome[t] = {"right": right, "wrong": wrong, "error": error}

    threads = [threading.Thread(target=work, args=(t,), name=f"worker-{t}") for t in range(2)]
    if bind:
        for g, th in zip(groups, threads, strict=True):
            g.bind_thread(th)
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    alive = [th.name for th in threads if th.is_alive()]
    return {"threads": outcome, "stuck": alive}


def two_threads_one_group(iters: int, size: int) -> dict[str, Any]:
    """Both threads use the default group (a misuse: it must be refused, never mix data)."""
    group = C.get_default_group()
    got = _run_threads([group, group], iters, size, bind=False)
    # The group still works from the thread that owns it (a refused call took no number).
    x = np.ones(3)
    group.all_reduce(x)
    got["after"] = float(x[0])
    return got


def two_threads_own_groups(iters: int, size: int) -> dict[str, Any]:
    """Each thread uses its own new_group (created here, in the same order on every rank)."""
    _, n = _world()
    groups = [C.new_group(list(range(n))) for _ in range(2)]
    try:
        return _run_threads(groups, iters, size, bind=True)
    finally:
        for g in groups:
            C.destroy_process_group(g)


def handoff(iters: int) -> dict[str, Any]:
    """A group created here and then used only by another thread: refused until it is given
    to that thread (bind_thread), then fine; afterwards this thread is refused."""
    rank, n = _world()
    group = C.new_group(list(range(n)))
    seen: dict[str, Any] = {}

    def other(bind: bool) -> None:
        try:
            if bind:
                group.bind_thread()
            for i in range(iters):
                x = np.full(4, float(i + rank))
                group.all_reduce(x)
                assert x[0] == sum(i + r for r in range(n)), x
            seen["ok" if bind else "unbound"] = True
        except RuntimeError as exc:
            seen["ok" if bind else "unbound"] = str(exc)

    for bind in (False, True):
        th = threading.Thread(target=other, args=(bind,), name=f"taker-{bind}")
        th.start()
        th.join(30)
    try:
        group.all_reduce(np.ones(2))
        seen["creator_after"] = True
    except RuntimeError as exc:
        seen["creator_after"] = str(exc)
    C.destroy_process_group(group)
    return seen


__all__ = ["handoff", "two_threads_one_group", "two_threads_own_groups"]
