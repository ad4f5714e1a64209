"""Run the shared test bodies on the ``threads`` backend, through the public ``spawn``.

:class:`ThreadsPool` has the :class:`~tests.collectives.harness.RankPool` interface the tests
and ``expect.py`` use (``run``/``call`` by ``"bodies:name"``, replies in rank order, every
rank's traceback in a failure, a deadline on every call). Each call is one
``collectives.spawn(..., backend="threads")``: ranks are threads of the test process, so a
fresh job per call costs microseconds, and every call goes through the code users run. The
spawn runs on a helper thread, so a body stuck outside collectives (which no timeout ends)
fails the test at the deadline instead of hanging it.
"""

from __future__ import annotations

import importlib
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import collectives as C


@dataclass
class Reply:
    """One rank's answer (see :class:`tests.collectives.harness.Reply`)."""

    rank: int
    ok: bool
    result: Any = None
    error: str = ""
    missing: bool = False

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok -> {self.result!r}"[:600]
        if self.missing:
            return f"rank {self.rank}: no reply before the deadline"
        return f"rank {self.rank}: FAILED\n{self.error.rstrip()}"


class ThreadsPoolError(AssertionError):
    """A body failed or ran past its deadline; the message has every rank's story."""


def resolve(spec: str) -> Callable[..., Any]:
    """``"bodies:name"`` (relative to tests.collectives) or ``"tests.x.y:name"``."""
    module, _, name = spec.partition(":")
    if not module.startswith("tests."):
        module = f"tests.collectives.{module}"
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{spec} is not callable")
    return fn


def _body(rank: int, fn: Callable[..., Any], kwargs: dict[int, dict[str, Any]]) -> Reply:
    try:
        return Reply(rank, ok=True, result=fn(**kwargs[rank]))
    except BaseException:
        return Reply(rank, ok=False, error=traceback.format_exc())


class ThreadsPool:
    """``world_size`` rank threads per call, on devices ``devices`` (default: the CPU).

    Args:
        world_size: number of ranks.
        timeout: the groups' collective timeout in seconds.
        tag: a label for reports.
        devices: one device per rank (None: the CPU).
    """

    backend = "threads"

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 20.0,
        tag: str = "",
        devices: Sequence[Any] | None = None,
    ) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.tag = tag
        self.devices = devices
        self.label = f"threads x{world_size}{' ' + tag if tag else ''}"
        self.broken = False

    def call(
        self,
        fn: str | Callable[..., Any],
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        deadline: float = 60.0,
    ) -> list[Reply]:
        """Run ``fn`` on every rank; every rank's reply (never raises for rank failures)."""
        func = resolve(fn) if isinstance(fn, str) else fn
        n = self.world_size
        args = {r: {**(kwargs or {}), **((per_rank or {}).get(r, {}))} for r in range(n)}
        box: list[Any] = []

        def job() -> None:
            try:
                box.append(
                    C.spawn(
                        _body,
                        args=(func, args),
                        nprocs=n,
                        backend="threads",
                        timeout=self.timeout,
                        devices=self.devices,
                    )
                )
            except BaseException:
                box.append(traceback.format_exc())

        t = threading.Thread(target=job, name="threads-pool", daemon=True)
        t.start()
        t.join(deadline)
        if not box:
            self.broken = True
            return [Reply(r, ok=False, missing=True) for r in range(n)]
        if isinstance(box[0], str):  # spawn itself failed: every rank shows why
            return [Reply(r, ok=False, error=box[0]) for r in range(n)]
        return list(box[0])

    def run(
        self,
        fn: str | Callable[..., Any],
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        deadline: float = 60.0,
    ) -> list[Any]:
        """Like :meth:`call`, but every rank must succeed; results in rank order."""
        replies = self.call(fn, kwargs, per_rank=per_rank, deadline=deadline)
        if all(r.ok for r in replies):
            return [r.result for r in replies]
        lines = [f"{self.label}: {fn} failed"]
        for rep in replies:
            lines += ["-" * 70, rep.describe()]
        raise ThreadsPoolError("\n".join(lines))

    def close(self) -> None:
        """Nothing to release: every call's threads ended with it."""


__all__ = ["Reply", "ThreadsPool", "ThreadsPoolError", "resolve"]
