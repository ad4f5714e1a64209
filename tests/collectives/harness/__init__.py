"""Multi-process test harness for collectives: a pool of rank processes driven over pipes.

A :class:`RankPool` starts ``world_size`` worker processes once (``python -m
tests.collectives.harness.worker``, torchrun-style environment, a free MASTER_PORT); each joins
the process group. Tests then send commands as JSON lines (``{"fn": "module:function",
"kwargs": {...}}``) and collect one JSON reply per rank, under a hard deadline. A timeout, a dead
worker or an error reply kills the whole pool (the next user starts a fresh one) and fails the
test with every rank's reply or traceback and the tail of its stderr.
"""

from __future__ import annotations

from .cache import PoolCache, PoolSpec
from .pool import (
    REPO_ROOT,
    SHM_PREFIX,
    PoolError,
    RankPool,
    Reply,
    free_port,
    leaked_segments,
    session_run_id,
)

__all__ = [
    "REPO_ROOT",
    "SHM_PREFIX",
    "PoolCache",
    "PoolError",
    "PoolSpec",
    "RankPool",
    "Reply",
    "free_port",
    "leaked_segments",
    "session_run_id",
]
