"""A rank dying while its peers set up a group: they fail fast, naming it, and leak nothing.

Group setup (``new_group``, a collective ``alloc``, DDP's bucket allocations) waits on store
keys that every rank publishes. A rank that dies before publishing its key must not make the
others sit out the group's timeout with an error that names a key: every other rank raises a
``PeerFailureError`` naming the dead rank, its pid and the setup op, within seconds. The
group timeout is long here, so passing the time bound proves no timeout was involved.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.collectives.expect import results
from tests.collectives.harness import RankPool, leaked_segments
from tests.collectives.test_nccl import fake  # noqa: F401  (the fake CuPy and NCCL)

pytestmark = pytest.mark.timeout(120)

LONG = 30.0  # the group timeout: far above the bound below
FAST = 5.0  # every survivor's error within this many seconds of the death


def _run(
    pools: list[RankPool], n: int, step: str, victim: int, how: str
) -> tuple[RankPool, float, dict[int, Any]]:
    pool = RankPool.launch("cpu", n, timeout=LONG)
    pools.append(pool)
    t0 = time.monotonic()
    replies = pool.call(
        "setup_bodies:die_at_setup",
        {"step": step, "victim": victim, "how": how},
        deadline=LONG + 15,
        grace=None,
        uncaught=how == "raise",
    )
    took = time.monotonic() - t0
    if how == "leave":
        assert replies[victim].result == {"left": True}, replies[victim].describe()
    else:
        assert replies[victim].exited, replies[victim].describe()
    survivors = [r for r in range(n) if r != victim]
    got = results([replies[r] for r in survivors])
    return pool, took, dict(zip(survivors, got, strict=True))


@pytest.mark.parametrize(
    "n,step,victim,how",
    [
        (2, "new_group", 1, "kill"),
        (3, "new_group", 2, "exit"),
        (4, "new_group", 0, "kill"),  # rank 0 also hosts the store
        (3, "alloc", 1, "kill"),
        (2, "alloc", 0, "exit"),
        (3, "ddp", 1, "kill"),
        (3, "new_group", 1, "raise"),
        (2, "new_group", 1, "leave"),
    ],
)
def test_rank_dying_at_setup_is_named_fast(
    pools: list[RankPool], n: int, step: str, victim: int, how: str
) -> None:
    pool, took, got = _run(pools, n, step, victim, how)
    op = "alloc" if step in ("alloc", "ddp") else "new_group"
    named = {
        "raise": f"rank {victim} (pid {pool.pids[victim]}) failed: uncaught ValueError: boom",
        "leave": f"rank {victim} left the job (destroy_process_group) before this new_group",
    }.get(how, f"rank {victim} (pid {pool.pids[victim]}) is gone")
    for rank, res in got.items():
        assert res["type"] == "PeerFailureError", (rank, res)
        assert named in res["message"], (rank, res["message"])
        assert res["message"].startswith(f"[rank {rank}] {op}"), (rank, res["message"])
        assert res["elapsed"] < FAST, (rank, res)
    assert took < FAST + 3, took
    # The victim's and the survivors' segments are gone even though setup failed midway.
    for r in got:
        pool.kill(r)
    assert leaked_segments(pool.run_id) == []


def test_clean_setup_still_works(pools: list[RankPool]) -> None:
    pool = RankPool.launch("cpu", 3, timeout=LONG)
    pools.append(pool)
    assert pool.run("setup_bodies:after_setup_is_usable", {"size": 5000}) == [6.0] * 3


# ---------------------------------------------------------------------------- nccl (fake)
def _dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.usefixtures("fake")
@pytest.mark.parametrize("dead", [0, 1])
def test_nccl_setup_names_a_dead_peer(dead: int) -> None:
    """The nccl backend's setup waits (rank 1 waiting for the unique id of a dead rank 0;
    rank 0 polling ncclCommInitRankConfig while rank 1 is dead) fail fast, naming the rank.
    One real rank in this process; the peer is a rendezvous record with a dead pid."""
    from collectives._backend import GroupInfo
    from collectives._errors import PeerFailureError
    from collectives._store import TCPStore
    from collectives.backends.nccl import NcclBackend

    me = 1 - dead
    pid = _dead_pid()
    store = TCPStore("127.0.0.1", 0, is_server=True, timeout=LONG)
    try:
        store.set(f"init/rank/{me}", f"2 {os.getpid()} {platform.node()}")
        store.set(f"init/rank/{dead}", f"2 {pid} {platform.node()}")
        info = GroupInfo(
            rank=me,
            size=2,
            ranks=(0, 1),
            global_rank=me,
            name="g1-test",
            store=store,
            timeout=LONG,
        )
        t0 = time.monotonic()
        with pytest.raises(PeerFailureError) as err:
            NcclBackend(info)
        took = time.monotonic() - t0
    finally:
        store.close()
    msg = str(err.value)
    assert msg.startswith(f"[rank {me}] new_group"), msg
    assert f"rank {dead} (pid {pid}) is gone" in msg, msg
    what = "publish the NCCL unique id" if dead == 0 else "finish ncclCommInitRankConfig"
    assert what in msg, msg
    assert took < FAST, took


def test_pids_are_trusted_only_from_this_host_and_pid_namespace() -> None:
    """A rendezvous record's pid is checked only when it means the same process here: same
    node name and (when the record names one) the same pid namespace."""
    from collectives._backend import GroupInfo
    from collectives._proc import pid_namespace
    from collectives._setup_wait import SetupWatch
    from collectives._store import TCPStore

    node, ns = platform.node(), pid_namespace()
    records = {
        1: f"5 101 {node}",  # the current format: node name only
        2: f"5 102 {node} {ns}",
        3: f"5 103 {node} pid:[1]",  # another container on a host of the same name
        4: "5 104 elsewhere",
    }
    store = TCPStore("127.0.0.1", 0, is_server=True, timeout=LONG)
    try:
        for g, rec in records.items():
            store.set(f"init/rank/{g}", rec)
        info = GroupInfo(
            rank=0,
            size=5,
            ranks=(0, 1, 2, 3, 4),
            global_rank=0,
            name="g1",
            store=store,
            timeout=LONG,
        )
        assert SetupWatch(info, "new_group")._pids() == {1: 101, 2: 102}
    finally:
        store.close()


def test_a_setup_after_the_store_host_died_names_it_from_the_init_records() -> None:
    """A rank that starts a setup only after rank 0 (the store's host) died cannot read rank
    0's pid from the store any more: what init_process_group read names it."""
    from collectives import PeerFailureError, _store
    from collectives._backend import GroupInfo
    from collectives._proc import pid_namespace
    from collectives._setup_wait import SetupWatch, remember_peers
    from collectives._store import TCPStore
    from tests.collectives.test_store import SERVER_SCRIPT  # a store host, loaded by path

    host = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(os.path.dirname(_store.__file__))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        store = TCPStore("127.0.0.1", port, is_server=False, timeout=LONG)
        here = f"{platform.node()} {pid_namespace()}"
        remember_peers(store, {0: (host.pid, here), 1: (os.getpid(), here)}, 1)
        host.kill()
        host.wait(10)
        info = GroupInfo(
            rank=1, size=2, ranks=(0, 1), global_rank=1, name="g1", store=store, timeout=LONG
        )
        watch = SetupWatch(info, "new_group")
        gone = f"rank 0 \\(pid {host.pid}\\) is gone"
        with pytest.raises(PeerFailureError, match=gone), watch.guard():
            store.set("new_group/1/1", "0,1 cpu")
        store.close()
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(10)
