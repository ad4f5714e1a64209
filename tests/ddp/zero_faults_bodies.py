"""Rank bodies for test_zero_faults.py: one rank SIGKILLs itself in the middle of a sharded
training step (``fully_shard``'s forward all-gather or backward reduce-scatter, or
``ZeroRedundancyOptimizer``'s all-gather in ``step()``); the survivors report what their
step raised, how long after the step began, and what their next collective raised.

The victim kills itself right after it has issued the collective (each is asynchronous here,
on the group's communication thread), so it dies with that collective in flight; its peers
fail in that collective, or in the step's next one when the victim's communication thread had
already sent its part (either way, later collectives of the step need the dead rank).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
from ddp import DistributedDataParallel, ZeroRedundancyOptimizer
from ddp.fsdp import _unit
from ddp.zero import _optimizer
from tests.ddp import fsdp_bodies as FB
from tests.ddp import zero_bodies as ZB

# Steps trained before the one in which the victim dies (so the prefetch schedule is set).
CLEAN_STEPS = 2


def _kill_after(original: Callable[..., Any], calls_before: int) -> Callable[..., Any]:
    """``original`` (a method), except that call number ``calls_before`` (counted from 0)
    issues the collective asynchronously and then SIGKILLs this process."""
    count = [0]

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        n = count[0]
        count[0] += 1
        if n != calls_before:
            return original(self, *args, **kwargs)
        if "async_op" in kwargs:
            kwargs["async_op"] = True
        original(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL cannot be caught

    return wrapper


def _outcome(exc: BaseException, t0: float) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "classes": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "elapsed": time.monotonic() - t0,
    }


def _after_failure(t0: float, exc: BaseException) -> dict[str, Any]:
    """The step's error, then what the next collective on the group raised."""
    out = _outcome(exc, t0)
    t1 = time.monotonic()
    try:
        C.all_reduce(np.ones(8))
        out["next"] = {"type": None}
    except Exception as nxt:
        out["next"] = _outcome(nxt, t1)
    return out


def fsdp_dies(seed: int, victim: int, phase: str, reshard: bool) -> dict[str, Any]:
    """Train a ``fully_shard`` model; at step ``CLEAN_STEPS`` the victim dies in the
    forward all-gather (``phase="all_gather"``, of the second unit to gather) or in the
    backward reduce-scatter (``phase="reduce_scatter"``, of the first unit to finish)."""
    rank = C.get_rank()
    model = FB._shard(FB.Model(seed), reshard)
    opt = tl.optim.AdamW(model.parameters(), lr=0.01)

    def step(s: int) -> None:
        opt.zero_grad()
        tokens, y = FB._batch(seed, s, rank)
        ((model(tokens) - y) ** 2).mean().backward()
        opt.step()

    for s in range(CLEAN_STEPS):
        step(s)
    if rank == victim:
        if phase == "all_gather":
            _unit.Unit._all_gather = _kill_after(_unit.Unit._all_gather, 1)  # type: ignore[method-assign]
        elif phase == "reduce_scatter":
            _unit.Unit.reduce_scatter_grad = _kill_after(  # type: ignore[method-assign]
                _unit.Unit.reduce_scatter_grad, 0
            )
        else:
            raise ValueError(f"phase must be 'all_gather' or 'reduce_scatter', got {phase!r}")
    t0 = time.monotonic()
    try:
        step(CLEAN_STEPS)
    except Exception as exc:
        return _after_failure(t0, exc)
    return {"type": None, "elapsed": time.monotonic() - t0}


def zero_dies(seed: int, victim: int) -> dict[str, Any]:
    """DDP with ZeRO-1 over AdamW; at step ``CLEAN_STEPS`` the victim dies in ``step()``'s
    all-gather of the updated parameters (its first bucket)."""
    tokens = ZB._tokens(seed, CLEAN_STEPS + 1)
    model = DistributedDataParallel(ZB.TinyLM(seed))
    opt = ZeroRedundancyOptimizer(model.parameters(), tl.optim.AdamW, bucket_cap_mb=0.0004, lr=0.02)
    for s in range(CLEAN_STEPS):
        opt.zero_grad()
        ZB._loss(model, ZB._my_rows(tokens[s])).backward()
        opt.step()
    opt.zero_grad()
    ZB._loss(model, ZB._my_rows(tokens[CLEAN_STEPS])).backward()
    if C.get_rank() == victim:
        cls = _optimizer.ZeroRedundancyOptimizer
        cls._launch = _kill_after(cls._launch, 0)  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        opt.step()
    except Exception as exc:
        return _after_failure(t0, exc)
    return {"type": None, "elapsed": time.monotonic() - t0}
