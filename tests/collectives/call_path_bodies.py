"""Test bodies for the per-call path: the checks a repeated call still gets, and the switch
interval while async work is in flight. Run in every rank of a RankPool."""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

import collectives as C
from tests.collectives.bodies import _world


def repeated_calls_keep_their_checks(size: int) -> dict[str, Any]:
    """After a checked call of one dtype/shape/op, calls of that same dtype, shape and op
    with an array that is not contiguous or not writable, or a bad op, still fail with the
    first call's messages; the group stays usable and the results stay right."""
    rank, n = _world()
    x = np.full(size, rank + 1, dtype=np.float32)
    C.all_reduce(x)
    errors: dict[str, str] = {}
    strided = np.zeros(2 * size, dtype=np.float32)[::2]
    frozen = np.zeros(size, dtype=np.float32)
    frozen.flags.writeable = False
    for name, arg, op in (("strided", strided, "sum"), ("frozen", frozen, "sum"),
                          ("op", np.zeros(size, np.float32), "nope")):  # fmt: skip
        try:
            C.all_reduce(arg, op)
            errors[name] = "no error"
        except (TypeError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    y = np.full(size, rank + 1, dtype=np.float32)
    C.all_reduce(y)  # the refused calls took no sequence number and broke nothing
    return {"x": x.tolist(), "y": y.tolist(), "errors": errors, "expect": n * (n + 1) / 2}


def switch_interval_during_async(delay: float, size: int) -> dict[str, Any]:
    """Rank 0 issues an async all_reduce that rank 1 joins ``delay`` s later: while it is in
    flight the switch interval is short; after it the user's own value is back."""
    rank, _n = _world()
    before = 0.004
    sys.setswitchinterval(before)
    x = np.ones(size, dtype=np.float32)
    if rank != 0:
        time.sleep(delay)
    w = C.all_reduce(x, async_op=True)
    during = sys.getswitchinterval()
    w.wait()
    C.get_default_group().synchronize()
    after = sys.getswitchinterval()
    return {"during": during, "after": after, "before": before, "sum": float(x[0])}
