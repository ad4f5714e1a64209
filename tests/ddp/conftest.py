"""Fixtures of the DDP tests: live rank pools per (backend, world size), and per-test seeds."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import pytest

from tests.collectives.harness import RankPool, leaked_segments
from tests.collectives.threads_pool import ThreadsPool

WORLDS = [("serial", 1), ("cpu", 2), ("cpu", 3), ("cpu", 4)]
MULTI = [w for w in WORLDS if w[1] > 1]

Pools = Callable[[str, int], RankPool]


@pytest.fixture(scope="module")
def pools() -> Iterator[Pools]:
    """One live pool per (backend, world size) for the whole module; a broken one is replaced.
    At the end every pool is closed and none may leave a shared-memory segment behind."""
    live: dict[tuple[str, int], RankPool] = {}
    made: list[RankPool] = []

    def get(backend: str, world: int) -> RankPool:
        pool = live.get((backend, world))
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = RankPool.launch(backend, world, timeout=20.0, tag="ddp")
            live[(backend, world)] = pool
            made.append(pool)
        return pool

    yield get
    for pool in made:
        pool.close()
    leaked = [name for pool in made for name in leaked_segments(pool.run_id)]
    assert not leaked, f"shared-memory segments left behind: {leaked}"


@pytest.fixture(params=WORLDS, ids=lambda w: f"{w[0]}{w[1]}")
def world(request: pytest.FixtureRequest, pools: Pools) -> RankPool:
    return pools(*request.param)


@pytest.fixture(params=MULTI, ids=lambda w: f"{w[0]}{w[1]}")
def multi(request: pytest.FixtureRequest, pools: Pools) -> RankPool:
    return pools(*request.param)


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda n: f"threads{n}")
def threads_world(request: pytest.FixtureRequest) -> ThreadsPool:
    """N rank threads of this process (``spawn(backend="threads")`` per call), on the CPU."""
    return ThreadsPool(int(request.param), timeout=20.0, tag="ddp")


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """Differs between tests, stable between runs."""
    return zlib.crc32(request.node.nodeid.encode()) & 0xFFFFFF
