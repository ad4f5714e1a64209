"""Joining and leaving the job's store, and agreeing on a new group's members.

**Joining** (:func:`rendezvous`). Rank 0 hosts the store; every rank claims its rank, says
``WORLD_SIZE pid host`` under ``init/rank/<r>`` and waits for all. After
``destroy_process_group`` a script may call ``init_process_group`` again on the same port
while rank 0 still closes the old store (it lingers for the others to leave). A rank that
connected to that old store would find its own claim there ("two processes claim RANK=1") or
lose the connection when it closes. So a client first asks whether the store already holds
``init/rank/<me>`` with *its own* pid and host: only a store this process joined before does
(a fresh one has no keys yet; another process's entry is a real duplicate), and then it
disconnects and retries until rank 0's new store is up. Rank 0 retries binding a port its
previous store used for a moment, should the old listener still hold it.

**Leaving** (:func:`leave`). Every store call on the way out gets a short deadline of its
own (:data:`LEAVE_DEADLINE`), never the group's timeout: a store host that is frozen
(SIGSTOP), unreachable or gone must not hold a rank's exit for another timeout. Rank 0 then
lingers, briefly, until every rank said it left, so that a fast rank 0 cannot close the store
under a slower rank's setup; it stops waiting for ranks on this host whose process is gone,
and waits only :data:`FAILED_LINGER` when this rank failed (its peers fail too).

**new_group** (:func:`agree_on_members`). Every rank of the job publishes the member list it
passed (sorted) and the backend; when all have arrived one counter tells whether all agree
(four store requests on the happy path, no extra wait), else every rank raises at once,
naming which ranks passed which list.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._env import EnvConfig
from ._errors import CollectiveMismatchError, collective_error, where
from ._proc import pid_alive, pid_namespace
from ._setup_wait import SetupWatch

__all__ = [
    "FAILED_LINGER",
    "LEAVE_DEADLINE",
    "STORE_LINGER",
    "Peers",
    "agree_on_members",
    "bound_store",
    "leave",
    "rendezvous",
]

# Seconds any store call on the way out may take (a healthy store answers in milliseconds).
LEAVE_DEADLINE = 2.0
# Rank 0 waits at most this long for the others to leave (healthy run; capped by the timeout).
STORE_LINGER = 10.0
# ... and at most this long when this rank failed: its peers are failing too.
FAILED_LINGER = 2.0
# How long rank 0 retries binding the port its previous store listened on.
_REBIND_WINDOW = 5.0
_RETRY_PAUSE = 0.02
# Longest single attempt to connect to the store at init (see _connect).
_CONNECT_ATTEMPT = 2.0

# Global rank -> (pid, "host pid-namespace") of every rank, as each said at init.
Peers = dict[int, tuple[int, str]]

# (host, port) -> time.monotonic() when this process closed the store server it hosted there.
_released: dict[tuple[str, int], float] = {}


# ---------------------------------------------------------------------- joining
def rendezvous(env: EnvConfig, timeout: float) -> tuple[Any, Peers]:
    """Connect to (rank 0: host) the store and check every rank joined with the same size.

    Returns:
        The store and every rank's (pid, host).

    Raises:
        TimeoutError: some ranks did not join within ``timeout`` (the message names them).
        ValueError: two processes claim this rank, or the ranks disagree on WORLD_SIZE.
    """
    store = _open_store(env, timeout)
    try:
        claimed = store.add(f"init/rank/{env.rank}/claims", 1)
        if claimed != 1:
            raise ValueError(
                f"two processes claim RANK={env.rank} (check RANK / the launcher's settings)"
            )
        store.set(f"init/rank/{env.rank}", _identity(env))
        keys = [f"init/rank/{r}" for r in range(env.world_size)]
        try:
            store.wait(keys, timeout)
        except Exception as exc:
            missing = [r for r in range(env.world_size) if not store.check([f"init/rank/{r}"])]
            raise TimeoutError(
                f"{where(env.rank, 'init_process_group')}: ranks {missing} did not join within "
                f"{timeout:.0f} s (WORLD_SIZE={env.world_size}, store "
                f"{env.master_addr}:{env.master_port})"
            ) from exc
        sizes, peers = {}, {}
        for r in range(env.world_size):
            size, pid, host = store.get(f"init/rank/{r}").decode().split(" ", 2)
            sizes[r], peers[r] = int(size), (int(pid), host)
        bad = {r: s for r, s in sizes.items() if s != env.world_size}
        if bad:
            raise ValueError(
                f"{where(env.rank, 'init_process_group')}: ranks disagree on WORLD_SIZE: this rank "
                f"has {env.world_size}, ranks {sorted(bad)} have {sorted(set(bad.values()))}"
            )
    except BaseException:
        release(store)
        raise
    return store, peers


def _where_am_i() -> str:
    return f"{platform.node()} {pid_namespace()}"


def _identity(env: EnvConfig) -> str:
    # A pid names one process only within one pid namespace: peers on the same host name but
    # in another container must not judge this pid (backends/_setup_wait.py reads the field).
    return f"{env.world_size} {os.getpid()} {_where_am_i()}"


def _open_store(env: EnvConfig, timeout: float) -> Any:
    """Rank 0: a new store server. Others: a client of rank 0's *current* store, not of one
    this process joined before (see the module docstring)."""
    from ._store import StoreError, TCPStore

    deadline = time.monotonic() + timeout
    addr, port = env.master_addr, env.master_port
    if env.rank == 0:
        closed_at = _released.pop((addr, port), None)
        rebind_until = min(deadline, closed_at + _REBIND_WINDOW) if closed_at is not None else 0.0
        while True:
            try:
                return TCPStore(addr, port, is_server=True, timeout=timeout)
            except StoreError as exc:
                # Our previous store's listener may still be closing (its loop thread).
                if "already in use" not in str(exc) or time.monotonic() >= rebind_until:
                    raise
            time.sleep(_RETRY_PAUSE)
    me = f"init/rank/{env.rank}"
    mine = _identity(env).split(" ", 1)[1]
    while True:
        store = _connect(addr, port, timeout, deadline)
        try:
            if not store.check([me]):
                return store
            if store.get(me, timeout=LEAVE_DEADLINE).decode().split(" ", 1)[1] != mine:
                return store  # another process's entry: the claim reports the duplicate
            # Our previous store, which rank 0 is closing: wait on it until it closes (one
            # connection to it, not a stream of them, each of which could hit its last moment).
            store.wait(["world/closed"], max(0.05, deadline - time.monotonic()))
        except StoreError:
            pass  # the old store closed under us: rank 0 is starting the new one
        except BaseException:
            store.close()
            raise
        store.close()
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{where(env.rank, 'init_process_group')}: the store at {addr}:{port} is still "
                f"the one this process joined before (rank 0 did not start a new one within "
                f"{timeout:.0f} s: did rank 0 call init_process_group again?)"
            )


def _connect(addr: str, port: int, timeout: float, deadline: float) -> Any:
    """A client of the store at ``addr:port``, trying until ``deadline`` in attempts of at
    most :data:`_CONNECT_ATTEMPT` seconds each.

    Short attempts, because a connection made while a listener closes can stay half-open
    (the kernel completed it but no server will ever greet it; Linux does so about once in
    thousands of connects): such an attempt costs seconds, not the whole timeout.
    """
    from ._store import StoreTimeoutError, TCPStore

    start = time.monotonic()
    while True:
        attempt = max(0.05, min(_CONNECT_ATTEMPT, deadline - time.monotonic()))
        try:
            return TCPStore(addr, port, is_server=False, timeout=timeout, connect_timeout=attempt)
        except StoreTimeoutError as exc:
            if time.monotonic() < deadline:
                continue
            raise StoreTimeoutError(
                f"store at {addr}:{port} unreachable: tried for "
                f"{time.monotonic() - start:.1f} s; last error: {exc}"
            ) from exc


# ---------------------------------------------------------------------- leaving
def bound_store(store: Any) -> None:
    """From now on every call of ``store`` (and every reconnect) waits at most
    :data:`LEAVE_DEADLINE` unless given a timeout of its own: the rank is leaving."""
    store.timeout = min(store.timeout, LEAVE_DEADLINE)
    store.connect_timeout = min(store.connect_timeout, LEAVE_DEADLINE)


def reachable(store: Any, rank: int) -> bool:
    """Whether the store host answers within :data:`LEAVE_DEADLINE` (rank 0 hosts it: yes)."""
    if rank == 0:
        return True
    return _bounded(lambda: store.check([f"world/left/{rank}"]), LEAVE_DEADLINE)


def leave(store: Any, env: EnvConfig, timeout: float, peers: Peers | None, failed: bool) -> None:
    """Say this rank is done with the store; rank 0, which hosts it, lingers a little for all.

    Every call is bounded (see the module docstring); the store is not closed here.
    """
    key = f"world/left/{env.rank}"
    if env.rank != 0:
        _bounded(lambda: store.set(key, b"1"), LEAVE_DEADLINE)
        return
    linger = min(FAILED_LINGER if failed else STORE_LINGER, timeout)
    _bounded(lambda: _linger(store, env, linger, peers or {}), linger + LEAVE_DEADLINE)


def _linger(store: Any, env: EnvConfig, linger: float, peers: Peers) -> None:
    store.set(f"world/left/{env.rank}", b"1")
    deadline = time.monotonic() + linger
    waiting = set(range(1, env.world_size))
    here = _where_am_i()  # as the records say it: host name and pid namespace
    while waiting:
        try:
            store.wait([f"world/left/{r}" for r in sorted(waiting)], min(0.2, linger))
            return
        except TimeoutError:
            pass
        waiting = {
            r
            for r in waiting
            if not store.check([f"world/left/{r}"])
            # A rank on this host whose process is gone will never say it left.
            and not (r in peers and peers[r][1] == here and not pid_alive(peers[r][0]))
        }
        if time.monotonic() >= deadline:
            return


def release(store: Any) -> None:
    """Close ``store``; remember the port when this process hosted the server there."""
    address = store.server_address if store.is_server else None
    store.close()
    if address is not None:
        _released[(store.host, store.port)] = time.monotonic()


def _bounded(call: Callable[[], Any], deadline: float) -> bool:
    """Run ``call`` on a daemon thread for at most ``deadline`` seconds; whether it returned
    without an error in time. (Closing the store afterwards wakes a thread still blocked.)"""
    ok: list[bool] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            call()
            ok.append(True)

    thread = threading.Thread(target=run, name="dpt-store-leave", daemon=True)
    thread.start()
    thread.join(deadline)
    return bool(ok)


# ---------------------------------------------------------------------- new_group
def agree_on_members(
    watch: SetupWatch,
    counter: int,
    members: Sequence[int],
    backend: str,
    timeout: float,
) -> None:
    """Check that every rank of the job passed the same members and backend to this
    ``new_group`` call (the ``counter``-th), before any backend waits on the group's keys.

    Args:
        watch: a setup watch over the job's default group (its store, its ranks' liveness).

    Raises:
        CollectiveMismatchError: ranks passed different lists (the message shows each).
        CollectiveTimeoutError: some ranks did not call ``new_group`` within ``timeout``.
        PeerFailureError: a rank died or left before calling it (named at once), or the
            store's host (rank 0) is gone.
    """
    with watch.guard():  # a lost store whose host died names rank 0, not a key
        _agree(watch, counter, members, backend, timeout)


def _agree(
    watch: SetupWatch, counter: int, members: Sequence[int], backend: str, timeout: float
) -> None:
    store, me, size = watch.store, watch.info.rank, watch.info.size
    prefix = f"new_group/{counter}"
    entry = f"{','.join(map(str, members))} {backend}"
    # Ranks that passed the same entry count under one key (a digest: lists may be long).
    votes = f"{prefix}/votes/{hashlib.sha256(entry.encode()).hexdigest()[:32]}"
    agreeing = store.add(votes, 1)
    store.set(f"{prefix}/{me}", entry)  # after the vote: whoever sees the entry sees the vote
    keys = [f"{prefix}/{r}" for r in range(size)]
    if agreeing == size:
        return  # the last to arrive and everyone agrees: no need to wait
    watch.wait(
        {k: r for r, k in enumerate(keys)},
        time.monotonic() + timeout,
        f"call new_group (call {counter} of this job; every rank of the job must call it, "
        "members or not)",
    )
    if store.add(votes, 0) == size:
        return
    passed: dict[str, list[int]] = {}
    for r in range(size):
        passed.setdefault(store.get(keys[r]).decode(), []).append(r)
    told = []
    for got, ranks in sorted(passed.items(), key=lambda item: item[1]):
        listed, _, bname = got.partition(" ")
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        told.append(f"{who} passed [{listed.replace(',', ', ')}] (backend {bname!r})")
    shown = "; ".join(told)
    raise collective_error(
        CollectiveMismatchError,
        f"the ranks passed different groups to new_group (call {counter} of this job): "
        f"{shown}. Every rank must pass the same ranks (in any order) and backend",
        rank=me,
        op="new_group",
        seq=counter,
    )
