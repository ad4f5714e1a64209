"""Ranks as threads of the test process, for the fake NCCL (one thread a rank).

The fake libnccl (tests/fakes/fake_nccl.py) exchanges data between ranks through the memory
of one process, so its ranks are threads. The shared test bodies (``bodies.py``) use the
module-level API on the *default* group, a process-wide global; :func:`per_thread_worlds`
replaces it, for as long as it is active, by a proxy that gives each rank thread its own world
(default group, store, environment). Everything else is the library as users get it: the
TCP store, :class:`~collectives.ProcessGroup`, the nccl backend over the fake CuPy.

:class:`RankThreads` mirrors the multi-process :class:`~tests.collectives.harness.RankPool`
(``run``/``call`` by ``"bodies:name"``, results in rank order, every rank's traceback in a
failure): one long-lived thread per rank, commands through queues, a deadline on every reply.
A thread stuck past its deadline cannot be killed; the harness marks itself broken (the next
test gets a fresh one) and the stuck rank's group timeout ends it later.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import collectives  # noqa: F401  (registers the backends)
from collectives import _api
from collectives._backend import GroupInfo
from collectives._env import EnvConfig
from collectives._group import ProcessGroup
from collectives._registry import get_backend_spec
from collectives._store import TCPStore
from tests.collectives.harness import free_port
from tests.collectives.threads_pool import Reply, resolve


class _PerThreadWorld:
    """Stands in for ``collectives._api._world``: each attribute is the calling thread's."""

    def __init__(self) -> None:
        object.__setattr__(self, "_tls", threading.local())

    def _mine(self) -> Any:
        world = getattr(self._tls, "world", None)
        if world is None:
            raise RuntimeError("collectives used from a thread that is not a test rank")
        return world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mine(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._mine(), name, value)

    def bind(self, world: Any) -> None:
        self._tls.world = world


_proxy: _PerThreadWorld | None = None
_users = 0
_proxy_lock = threading.Lock()


@contextlib.contextmanager
def per_thread_worlds() -> Iterator[_PerThreadWorld]:
    """Give every thread its own ``collectives`` world while active (nestable)."""
    global _proxy, _users
    with _proxy_lock:
        if _users == 0:
            if _api._world is not None:
                raise RuntimeError("a process group is initialized in the test process")
            _proxy = _PerThreadWorld()
            _api._world = _proxy  # type: ignore[assignment]
        _users += 1
        proxy = _proxy
    assert proxy is not None
    try:
        yield proxy
    finally:
        with _proxy_lock:
            _users -= 1
            if _users == 0:
                _api._world = None
                _proxy = None


class ThreadPoolError(AssertionError):
    """A command failed or timed out on some rank; the message has every rank's story."""


class RankThreads:
    """``world_size`` rank threads that each joined a default group of ``backend``.

    Args:
        world_size: number of ranks.
        backend: the default group's backend (``"nccl"`` on the fake).
        timeout: the groups' collective timeout in seconds.
        tag: a label for reports and test ids.
        setup: called in each rank thread before it joins (e.g. to pick a GPU).
        one_gpu: every rank gets LOCAL_RANK 0, so all use the same GPU (as several ranks on
            one GPU do with NCCL >= 2.30); else rank r uses GPU ``r % device_count``.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "nccl",
        timeout: float = 20.0,
        tag: str = "",
        setup: Callable[[int], None] | None = None,
        one_gpu: bool = False,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.tag = tag
        self.label = f"{backend} x{world_size} threads{' ' + tag if tag else ''}"
        self.broken = False
        self.closed = False
        self._setup = setup
        self._one_gpu = one_gpu
        self._port = free_port()
        self._inbox: list[queue.Queue[Any]] = [queue.Queue() for _ in range(world_size)]
        self._outbox: list[queue.Queue[tuple[bool, Any]]] = [
            queue.Queue() for _ in range(world_size)
        ]
        self._threads: list[threading.Thread] = []
        self._ctx = per_thread_worlds()
        self._proxy = self._ctx.__enter__()
        self.worlds: list[Any] = [None] * world_size

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def launch(cls, world_size: int, init_deadline: float = 60.0, **kw: Any) -> RankThreads:
        """Start the ranks and require every one to join (else fail with every story)."""
        pool = cls(world_size, **kw)
        hello = pool._start(init_deadline)
        if not all(r.ok for r in hello):
            text = pool.report("init", hello)
            pool.close()
            raise ThreadPoolError(text)
        return pool

    def _start(self, deadline: float) -> list[Reply]:
        for rank in range(self.world_size):
            t = threading.Thread(
                target=self._main, args=(rank,), name=f"test-rank-{rank}", daemon=True
            )
            t.start()
            self._threads.append(t)
        return self._collect(list(range(self.world_size)), deadline)

    def _join(self, rank: int) -> Any:
        n = self.world_size
        if self._setup is not None:
            self._setup(rank)
        store = None
        if n > 1:
            store = TCPStore("127.0.0.1", self._port, is_server=rank == 0, timeout=self.timeout)
        info = GroupInfo(
            rank=rank,
            size=n,
            ranks=tuple(range(n)),
            global_rank=rank,
            name="world",
            store=store,
            timeout=self.timeout,
            local_rank=0 if self._one_gpu else rank,
        )
        try:
            group = ProcessGroup(get_backend_spec(self.backend).factory(info))
        except BaseException:
            if store is not None:
                store.close()
            raise
        local = 0 if self._one_gpu else rank
        env = EnvConfig(rank, n, local, 1 if self._one_gpu else n, "127.0.0.1", self._port, "args")
        world = _api._World(default=group, env=env, store=store, timeout=self.timeout)
        world.groups.append(group)
        return world

    def _main(self, rank: int) -> None:
        try:
            world = self._join(rank)
        except BaseException:
            self._outbox[rank].put((False, traceback.format_exc()))
            return
        self.worlds[rank] = world
        self._proxy.bind(world)
        self._outbox[rank].put((True, {"rank": rank}))
        while True:
            item = self._inbox[rank].get()
            if item is None:
                break
            fn, kwargs = item
            try:
                result = fn(**kwargs)
            except BaseException:
                self._outbox[rank].put((False, traceback.format_exc()))
            else:
                self._outbox[rank].put((True, result))
        try:
            for g in reversed(world.groups):
                g.destroy()
        finally:
            if world.store is not None:
                world.store.close()
        self._outbox[rank].put((True, "bye"))

    def close(self, deadline: float = 15.0) -> None:
        """Destroy every rank's groups and end the threads (stuck ones are left behind)."""
        if self.closed:
            return
        self.closed = True
        for rank, t in enumerate(self._threads):
            if t.is_alive():
                self._inbox[rank].put(None)
        for t in self._threads:
            t.join(deadline if not self.broken else 1.0)
        self._ctx.__exit__(None, None, None)

    def __enter__(self) -> RankThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ commands
    def submit(
        self,
        fn: str | Callable[..., Any],
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[int]:
        """Send a command to ``ranks`` (default all) without waiting; returns them."""
        if self.closed:
            raise ThreadPoolError(f"{self.label}: closed")
        func = resolve(fn) if isinstance(fn, str) else fn
        targets = list(range(self.world_size) if ranks is None else ranks)
        for r in targets:
            args = {**(kwargs or {}), **((per_rank or {}).get(r, {}))}
            self._inbox[r].put((func, args))
        return targets

    def collect(self, ranks: Sequence[int], deadline: float = 60.0) -> list[Reply]:
        """The replies of ``ranks`` to the last :meth:`submit`."""
        return self._collect(list(ranks), deadline)

    def call(
        self,
        fn: str | Callable[..., Any],
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        ranks: Sequence[int] | None = None,
        deadline: float = 60.0,
    ) -> list[Reply]:
        """Run ``fn`` on ``ranks`` and return every reply (never raises for rank failures)."""
        targets = self.submit(fn, kwargs, per_rank=per_rank, ranks=ranks)
        return self._collect(targets, deadline)

    def run(
        self,
        fn: str | Callable[..., Any],
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        ranks: Sequence[int] | None = None,
        deadline: float = 60.0,
    ) -> list[Any]:
        """Like :meth:`call`, but every rank must succeed; returns results in rank order."""
        replies = self.call(fn, kwargs, per_rank=per_rank, ranks=ranks, deadline=deadline)
        if all(r.ok for r in replies):
            return [r.result for r in replies]
        self.broken = True
        raise ThreadPoolError(self.report(str(fn), replies))

    def _collect(self, ranks: list[int], deadline: float) -> list[Reply]:
        import time

        end = time.monotonic() + deadline
        out: list[Reply] = []
        for r in ranks:
            try:
                ok, value = self._outbox[r].get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                self.broken = True
                out.append(Reply(r, ok=False, missing=True))
                continue
            out.append(Reply(r, ok=True, result=value) if ok else Reply(r, ok=False, error=value))
        return out

    def report(self, what: str, replies: Sequence[Reply]) -> str:
        """Every rank's reply, for a failure message."""
        lines = [f"{self.label}: {what} failed"]
        for rep in replies:
            lines.append("-" * 70)
            lines.append(rep.describe())
        return "\n".join(lines)


__all__ = ["RankThreads", "Reply", "ThreadPoolError", "per_thread_worlds"]
