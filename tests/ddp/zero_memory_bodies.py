"""Rank bodies for test_zero_memory.py: one float32 model trained one AdamW step under DDP,
ZeRO-1, ZeRO-2 and ZeRO-3 (the model, the stages and the byte counter are the benchmark's,
benchmarks/zero_memory.py, so that the test checks what the benchmark reports)."""

from __future__ import annotations

from typing import Any

import collectives as C
from benchmarks.zero_memory import (
    STAGES,
    TrafficCounter,
    build,
    num_params,
    train_step,
)
from ddp import memory_stats

# Widths divisible by 4 except the 5-row head, whose shards are padded at N = 2 and 4.
WIDTH, BLOCKS, ROWS = 64, 3, 8


def by_stage(seed: int, mp: bool = False) -> dict[str, Any]:
    """For every stage: memory_stats after one step, the full parameters still gathered at
    the end of the second step's forward, and the bytes (and calls) the second step sends
    (with ``mp``: the benchmark's mixed precision, float16 autocast and gathers)."""
    out: dict[str, Any] = {"P": num_params(WIDTH, BLOCKS), "world": C.get_world_size()}
    for stage in STAGES:
        model, opt = build(stage, WIDTH, BLOCKS, seed, mp=mp)
        train_step(model, opt, WIDTH, ROWS, 0, mp)
        mem = memory_stats(model, opt)
        counter = TrafficCounter()
        with counter.counting():
            held = train_step(model, opt, WIDTH, ROWS, 1, mp)
        out[stage] = {
            "memory": mem,
            "held": held,
            "sent": counter.sent,
            "calls": counter.calls,
            "total": counter.total,
            "after_second": memory_stats(model, opt),
        }
    return out
