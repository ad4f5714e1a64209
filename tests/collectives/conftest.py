"""Fixtures for the multi-process collectives tests: cached rank pools and a /dev/shm leak check.

Pools are keyed by :class:`PoolSpec` and live for the whole session (starting a rank costs
~0.3 s); one that failed is replaced on next use. At the end of the session every pool is shut
down and no shared-memory segment of this session may be left in /dev/shm.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.collectives.harness import PoolCache, RankPool, leaked_segments, session_run_id

# The shared checks of the bodies' results fail with pytest's detailed assertion messages.
pytest.register_assert_rewrite("tests.collectives.expect")


@pytest.fixture(scope="session")
def shm_leak_check() -> Iterator[None]:
    """Fail the session loudly if any /dev/shm segment created by its pools survives.

    Every pool gives its ranks a DPT_RUN_ID with this session's prefix, which segment names
    carry; segments of other jobs on the machine (other sessions, the launcher's own test
    jobs, which sweep theirs) are not looked at.
    """
    yield
    deadline = time.monotonic() + 5
    left = leaked_segments()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)  # a worker may still be exiting
        left = leaked_segments()
    if left:
        for name in left:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
        pytest.fail(
            f"{len(left)} shared-memory segment(s) of this test session "
            f"(DPT_RUN_ID prefix {session_run_id()!r}) were left in /dev/shm (now removed): "
            f"{left}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def pool_cache(shm_leak_check: None) -> Iterator[PoolCache]:
    """The session's cached pools (shut down before the leak check runs)."""
    cache = PoolCache()
    yield cache
    cache.close()


@pytest.fixture(autouse=True)
def _collectives_session(shm_leak_check: None) -> None:
    """Every test of this directory takes part in the end-of-session leak check."""


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A seed that differs between tests and is stable between runs."""
    import zlib

    return zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF


@pytest.fixture
def pools() -> Iterator[list[RankPool]]:
    """Dedicated pools of a test: killed at the end and checked for leaked segments."""
    made: list[RankPool] = []
    yield made
    for p in made:
        p.kill_all()
    leaked = [name for p in made for name in leaked_segments(p.run_id)]
    assert not leaked, f"shared-memory segments left behind: {leaked}"
