"""The parent side of the harness: :class:`RankPool` (see the package docstring)."""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

from collectives.backends.cpu._shm import run_tag
from collectives.run import free_port  # the launcher's own (re-exported as harness.free_port)

REPO_ROOT = Path(__file__).resolve().parents[3]
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dpt-"
_WORKER = "tests.collectives.harness.worker"
# Launcher variables of other schedulers would be read (and cross-checked) by env://.
_SCRUB = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
_STDERR_TAIL = 3000

_SESSION_ID = secrets.token_hex(3)
_pool_counter = 0


def session_run_id() -> str:
    """Prefix of the DPT_RUN_ID of every pool of this test session (names its /dev/shm files)."""
    return f"t{_SESSION_ID}"


def leaked_segments(run_id: str | None = None) -> list[str]:
    """Names of /dev/shm segments of the job ``run_id`` (exactly: ``...p1`` is not ``...p10``),
    or of every pool of this test session when None."""
    if run_id is None:
        prefix = SHM_PREFIX + session_run_id()  # every pool's tag starts with it (short ids)
    else:
        prefix = f"{SHM_PREFIX}{run_tag(run_id)}-"
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


@dataclass
class Reply:
    """What one rank answered to one command.

    Attributes:
        rank: the rank.
        ok: the command returned normally.
        result: its JSON result (when ok).
        error: the traceback text (when it raised), or why there is no reply.
        exited: the worker process had ended (``returncode`` says how).
        returncode: the exit status (negative: killed by that signal), or None while running.
        missing: no reply came before the deadline.
    """

    rank: int
    ok: bool
    result: Any = None
    error: str = ""
    exited: bool = False
    returncode: int | None = None
    missing: bool = False

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok -> {json.dumps(self.result)[:500]}"
        if self.missing:
            state = "no reply before the deadline"
            if self.exited:
                state += f" (process exited, returncode {self.returncode})"
            return f"rank {self.rank}: {state}"
        if self.exited and not self.error:
            return f"rank {self.rank}: process exited, returncode {self.returncode}"
        return f"rank {self.rank}: FAILED\n{self.error.rstrip()}"


class PoolError(AssertionError):
    """A pool command failed, timed out or lost a worker; the message has every rank's story."""


class RankPool:
    """``world_size`` rank processes that each joined a process group, driven over pipes.

    Args:
        backend: backend name passed to ``init_process_group``.
        world_size: number of ranks.
        timeout: the group's collective timeout in seconds.
        env: extra environment for every rank.
        rank_env: extra environment per rank (``{rank: {name: value}}``), e.g. to make one
            rank's configuration differ.
        world_sizes: the WORLD_SIZE each rank is told (default: ``world_size`` for all).
        ranks: which ranks to start (default all); the others are simply never started.
        master_port: the store's port (default: a free one).
        tag: a label for reports (e.g. which chunk-size variant this pool is).
    """

    def __init__(
        self,
        backend: str,
        world_size: int,
        *,
        timeout: float = 20.0,
        env: Mapping[str, str] | None = None,
        rank_env: Mapping[int, Mapping[str, str]] | None = None,
        world_sizes: Sequence[int] | None = None,
        ranks: Sequence[int] | None = None,
        master_port: int | None = None,
        tag: str = "",
    ) -> None:
        global _pool_counter
        _pool_counter += 1
        self.backend = backend
        self.world_size = world_size
        self.timeout = timeout
        self.run_id = f"{session_run_id()}p{_pool_counter}"
        self.tag = tag
        self.label = f"{backend} x{world_size}{' ' + tag if tag else ''} (pool {self.run_id})"
        self.broken = False
        self.closed = False
        self.pids: dict[int, int] = {}
        self._env = dict(env or {})
        self._rank_env = {r: dict(v) for r, v in (rank_env or {}).items()}
        self._world_sizes = (
            list(world_sizes) if world_sizes is not None else [world_size] * world_size
        )
        self._ranks = list(ranks) if ranks is not None else list(range(world_size))
        self._port = master_port if master_port is not None else free_port()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._stderr: dict[int, IO[bytes]] = {}
        self._buf: dict[int, bytes] = {}
        self._eof: set[int] = set()

    # ------------------------------------------------------------------ lifecycle
    @property
    def master_port(self) -> int:
        """The store's port (MASTER_PORT) the ranks were given."""
        return self._port

    @property
    def ranks(self) -> list[int]:
        """The ranks this pool started."""
        return list(self._ranks)

    @classmethod
    def launch(
        cls, backend: str, world_size: int, *, init_deadline: float = 60.0, **kw: Any
    ) -> Self:
        """Start a pool and require every rank to join (else fail with every rank's story)."""
        for attempt in range(2):
            pool = cls(backend, world_size, **kw)
            hello = pool.start(init_deadline)
            if all(r.ok for r in hello):
                return pool
            text = pool.report("init_process_group", hello)
            pool.kill_all()
            if attempt == 0 and cls._transient(text, kw):
                sys.stderr.write(f"harness: retrying a failed pool start once:\n{text}\n")
                continue
            raise PoolError(text)
        raise AssertionError("unreachable")

    @staticmethod
    def _transient(text: str, kw: Mapping[str, Any]) -> bool:
        """Whether a failed start is worth one more try."""
        # Another process may have taken the free port between our probe and rank 0's bind.
        return "already in use" in text and "master_port" not in kw

    def start(self, init_deadline: float = 60.0) -> list[Reply]:
        """Start the ranks; return each rank's answer to joining the group."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB)}
        base.update(
            PYTHONPATH=os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            PYTHONDONTWRITEBYTECODE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self._port),
            LOCAL_WORLD_SIZE=str(self.world_size),
            DPT_RUN_ID=self.run_id,
            DPT_TEST_BACKEND=self.backend,
            DPT_TEST_TIMEOUT=str(self.timeout),
            DPT_TEST_PARENT_PID=str(os.getpid()),
        )
        # As the launcher (and torchrun) does for several ranks on one host: one BLAS thread
        # per rank, else ranks x cores spinning BLAS threads starve the ranks' communication.
        base.setdefault("OMP_NUM_THREADS", "1")
        base.update(self._env)
        for rank in self._ranks:
            env = dict(base)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(self._world_sizes[rank]),
            )
            env.update(self._rank_env.get(rank, {}))
            # Lives as long as the pool (its tail goes into failure reports).
            err = tempfile.TemporaryFile(prefix=f"dpt-test-r{rank}-")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, "-m", _WORKER],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
            assert proc.stdout is not None
            os.set_blocking(proc.stdout.fileno(), False)
            self._procs[rank] = proc
            self._stderr[rank] = err
            self._buf[rank] = b""
            self.pids[rank] = proc.pid
        return self._collect(self._ranks, init_deadline, grace=None)

    def close(self, deadline: float = 15.0) -> None:
        """Ask every rank to destroy its group and exit; kill what is left after ``deadline``."""
        if self.closed:
            return
        if not self.broken:
            alive = [r for r in self._ranks if self._procs[r].poll() is None]
            self._send(alive, {"fn": "__exit__"})
            end = time.monotonic() + deadline
            for r in alive:
                try:
                    self._procs[r].wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every rank that still runs, reap them, release pipes; the pool is unusable."""
        self.broken = True
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end
                pass
        if not self.closed:
            self.closed = True
            for proc in self._procs.values():
                for f in (proc.stdin, proc.stdout):
                    if f is not None:
                        try:
                            f.close()
                        except OSError:
                            pass

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        for f in self._stderr.values():
            f.close()

    # ------------------------------------------------------------------ control
    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one rank (the pool is not usable for normal work afterwards)."""
        self.broken = True
        self._procs[rank].send_signal(sig)

    def wait_exit(self, rank: int, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for a rank to end; its returncode, or None if it still runs."""
        try:
            return self._procs[rank].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def returncode(self, rank: int) -> int | None:
        """The rank's exit status, or None while it runs."""
        return self._procs[rank].poll()

    def stderr_tail(self, rank: int, limit: int = _STDERR_TAIL) -> str:
        """The last ``limit`` characters the rank wrote to stderr."""
        f = self._stderr[rank]
        try:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return "<stderr unavailable>"

    # ------------------------------------------------------------------ commands
    def call(
        self,
        fn: str,
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        ranks: Sequence[int] | None = None,
        deadline: float = 60.0,
        grace: float | None = 3.0,
        uncaught: bool = False,
    ) -> list[Reply]:
        """Send one command to ``ranks`` (default: all) and collect their replies.

        Args:
            fn: ``"module:function"`` (``module`` relative to ``tests.collectives``, or absolute).
            kwargs: keyword arguments for every rank (JSON-able).
            per_rank: extra keyword arguments per rank.
            deadline: seconds to wait for all replies.
            grace: once one rank failed or died, seconds to wait for the others (None: the
                whole deadline).
            uncaught: an exception in ``fn`` ends the worker through ``sys.excepthook``.

        Returns:
            One :class:`Reply` per rank, in the order of ``ranks``; never raises for rank
            failures (see :meth:`run`).
        """
        targets = self.submit(fn, kwargs, per_rank=per_rank, ranks=ranks, uncaught=uncaught)
        return self._collect(targets, deadline, grace)

    def submit(
        self,
        fn: str,
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        ranks: Sequence[int] | None = None,
        uncaught: bool = False,
    ) -> list[int]:
        """Send a command without waiting (see :meth:`call`); returns the ranks it went to.
        Collect the replies with :meth:`collect`."""
        if self.closed:
            raise PoolError(f"{self.label}: the pool is closed")
        targets = list(self._ranks if ranks is None else ranks)
        spec = fn if fn.startswith("tests.") else f"tests.collectives.{fn}"
        for r in targets:
            args = {**(kwargs or {}), **((per_rank or {}).get(r, {}))}
            msg: dict[str, Any] = {"fn": spec, "kwargs": args}
            if uncaught:
                msg["uncaught"] = True
            self._send([r], msg)
        return targets

    def collect(
        self, ranks: Sequence[int], deadline: float = 60.0, grace: float | None = None
    ) -> list[Reply]:
        """The replies of ``ranks`` to the last :meth:`submit`, within ``deadline`` seconds."""
        return self._collect(ranks, deadline, grace)

    def run(
        self,
        fn: str,
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        ranks: Sequence[int] | None = None,
        deadline: float = 60.0,
    ) -> list[Any]:
        """Like :meth:`call` but every rank must succeed: returns the results in rank order.

        Raises:
            PoolError: a rank raised, died or did not answer in time; the pool is killed
                first (so the next test gets a fresh one) and the message has every rank's
                reply and stderr tail.
        """
        replies = self.call(fn, kwargs, per_rank=per_rank, ranks=ranks, deadline=deadline)
        if all(r.ok for r in replies):
            return [r.result for r in replies]
        text = self.report(fn, replies)
        self.kill_all()
        raise PoolError(text)

    def report(self, what: str, replies: Sequence[Reply]) -> str:
        """Every rank's reply and stderr tail, for a failure message."""
        lines = [f"{self.label}: {what} failed"]
        for rep in replies:
            lines.append("-" * 70)
            lines.append(rep.describe())
            tail = self.stderr_tail(rep.rank).strip()
            if tail:
                lines.append(f"  stderr of rank {rep.rank} (tail):")
                lines.extend("    " + ln for ln in tail.splitlines()[-25:])
        return "\n".join(lines)

    # ------------------------------------------------------------------ plumbing
    def _send(self, ranks: Sequence[int], message: Mapping[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        for r in ranks:
            stdin = self._procs[r].stdin
            assert stdin is not None
            try:
                stdin.write(data)
                stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # the worker is gone; _collect reports it

    def _collect(self, ranks: Sequence[int], deadline: float, grace: float | None) -> list[Reply]:
        replies: dict[int, Reply] = {}
        pending = set(ranks)
        end = time.monotonic() + deadline
        sel = selectors.DefaultSelector()
        try:
            for r in pending:
                stdout = self._procs[r].stdout
                if r not in self._eof and stdout is not None:
                    sel.register(stdout, selectors.EVENT_READ, r)
            while pending:
                for rank in list(pending):
                    if b"\n" in self._buf[rank]:
                        line, _, self._buf[rank] = self._buf[rank].partition(b"\n")
                        replies[rank] = self._parse(rank, line)
                        pending.discard(rank)
                    elif rank in self._eof or (
                        # The pipe can outlive the process when a child inherited it.
                        self._procs[rank].poll() is not None and not self._readable(rank)
                    ):
                        replies[rank] = self._dead(rank)
                        pending.discard(rank)
                if any(not r.ok for r in replies.values()) and grace is not None:
                    end = min(end, time.monotonic() + grace)
                    grace = None  # one grace period, from the first failure
                now = time.monotonic()
                if not pending or now >= end:
                    break
                for key, _ in sel.select(timeout=min(0.2, end - now)):
                    rank = key.data
                    try:
                        chunk = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if chunk:
                        self._buf[rank] += chunk
                    else:
                        self._eof.add(rank)
                        sel.unregister(key.fileobj)
        finally:
            sel.close()
        for rank in pending:
            proc = self._procs[rank]
            rc = proc.poll()
            replies[rank] = Reply(
                rank, ok=False, missing=True, exited=rc is not None, returncode=rc
            )
        return [replies[r] for r in ranks]

    def _readable(self, rank: int) -> bool:
        """Read whatever the rank's pipe holds now; True if it gave data (False at EOF)."""
        stdout = self._procs[rank].stdout
        if stdout is None or rank in self._eof:
            return False
        try:
            chunk = os.read(stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            self._eof.add(rank)
            return False
        self._buf[rank] += chunk
        return True

    def _parse(self, rank: int, line: bytes) -> Reply:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            return Reply(rank, ok=False, error=f"unparseable reply: {line[:300]!r}")
        if msg.get("ok"):
            return Reply(rank, ok=True, result=msg.get("result"))
        return Reply(rank, ok=False, error=str(msg.get("error", "")))

    def _dead(self, rank: int) -> Reply:
        proc = self._procs[rank]
        try:
            rc = proc.wait(5)
        except subprocess.TimeoutExpired:
            rc = None
        return Reply(rank, ok=False, exited=True, returncode=rc)
