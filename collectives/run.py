"""Launcher: ``python -m collectives.run [options] script.py args...`` (or ``-m module``).

Starts ``--nproc-per-node`` worker processes with the environment torchrun gives (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK/NODE_RANK, MASTER_ADDR, MASTER_PORT, and
DPT_RUN_ID), so ``init_process_group()`` needs no arguments. On one node a free port on
127.0.0.1 is chosen automatically. When GPUs are visible, each local rank sees exactly one
(CUDA_VISIBLE_DEVICES), so in a worker the rank's GPU is ``cuda:0``.

Failure policy: when the first worker exits non-zero or dies by a signal, every other worker's
process group gets SIGTERM, then SIGKILL after ``--grace-period`` seconds; the launcher prints
which rank failed first, how, and that rank's own traceback (from the error file its excepthook
wrote, else from the tail of its stderr), and exits with its exit code (128 + N for signal N).
SIGINT/SIGTERM/SIGHUP sent to the launcher are forwarded to the workers the same way; a
second one kills them at once. Workers get SIGKILL if the launcher itself dies (Linux).

Restarts (``--max-restarts N``): after a failed attempt is reported, the whole job
starts again, up to N times, with ``DPT_RESTART_COUNT``/``TORCHELASTIC_RESTART_COUNT`` set to
the attempt; nothing of the old attempt is left (its processes, segments, error files; the
port is fresh unless ``--master-port`` was given). A signal to the launcher ends the job
without a restart; the exit code is the last attempt's. See :mod:`collectives.launch._restarts`.

Several nodes: ``--rdzv-backend static`` (the default) takes ``--node-rank`` and rank 0's
address as given, and each node's launcher runs alone (no restarts); ``--rdzv-backend c10d
--rdzv-endpoint HOST:PORT`` makes every node's launcher join rounds that assign node ranks,
restart every node's workers together and let ``--nnodes MIN:MAX`` jobs shrink and grow (see
:mod:`collectives.launch._elastic`). Every flag also reads torchrun's ``PET_*`` variable.

Workers' stdout is inherited; their stderr goes through the launcher unchanged (raw bytes, so
``\\r`` progress bars still work), keeping the last 64 KiB per rank for the report.

The policy's pieces (rank environment, GPU binding, shutdown, the report) live in
:mod:`collectives.launch._launcher`, shared with ``spawn``; the options and their checks in
:mod:`collectives.launch._args`. :func:`free_port` is exported here for code
that starts ranks itself (``from collectives.run import free_port``).

Example:
    python -m collectives.run --nproc-per-node 4 --max-restarts 2 train.py --epochs 3
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

from ._errorfile import ERROR_FILE_ENV, extract_traceback, read_error_file
from .backends.cpu._shm import remove_run_segments
from .launch._args import PROG, LaunchConfig, parse_args
from .launch._launcher import (
    Failure,
    describe_exit,
    describe_others,
    exit_status,
    format_banner,
    format_failure,
    free_port,
    gpu_assignment,
    killed_hint,
    load_prctl,
    pick_first,
    rank_env,
    set_parent_death_signal,
    shutdown,
    signal_group,
    signal_name,
    thread_env,
)
from .launch._restarts import attempt_run_id, attempt_title, restart_line, wait_groups_gone

__all__ = ["LaunchConfig", "free_port", "main", "parse_args"]

TAIL_BYTES = 64 * 1024
_POLL_S = 0.05
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class _Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    error_file: Path
    fd: int | None
    tail: bytearray = field(default_factory=bytearray)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()


@dataclass(frozen=True)
class _Placement:
    """Where this node's workers sit in the job (fixed, or from a rendezvous round)."""

    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    master_addr: str


class _Signals:
    """Records SIGINT/SIGTERM/SIGHUP sent to the launcher; the main loop acts on them."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def install(self) -> None:
        for sig in _FORWARDED_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: leave signals to the caller
                return

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")


class _Supervisor:
    """Starts the workers, forwards their stderr, and ends them all as the failure policy says."""

    def __init__(self, cfg: LaunchConfig, out: IO[bytes] | None = None) -> None:
        self.cfg = cfg
        self.out = out if out is not None else _stderr_bytes()
        self.workers: list[_Worker] = []
        self.selector = selectors.DefaultSelector()
        self.signals = _Signals()
        self.host = socket.gethostname()
        self._at_line_start = True  # whether the forwarded stderr ended with a newline
        self._signals_handled = 0  # launcher signals already acted on; one more means SIGKILL
        self.attempt = 0  # 0 on the first start, k on restart k
        self.placement = _Placement(
            node_rank=cfg.node_rank,
            nnodes=cfg.nnodes,
            rank_offset=cfg.node_rank * cfg.nproc_per_node,
            world_size=cfg.world_size,
            master_addr=cfg.master_addr,
        )
        self._restart = False  # the attempt just ended failed and may be restarted

    # ------------------------------------------------------------------ output
    def _say(self, text: str) -> None:
        if not self._at_line_start:  # do not glue the report onto a progress bar
            text = "\n" + text
            self._at_line_start = True
        try:
            self.out.write(text.encode("utf-8", errors="replace"))
            self.out.flush()
        except (OSError, ValueError):
            pass

    def _drain(self, timeout: float) -> None:
        """Forward whatever the workers wrote to stderr, waiting up to ``timeout`` for some."""
        if not self.selector.get_map():
            if timeout > 0:
                time.sleep(timeout)
            return
        for key, _ in self.selector.select(timeout):
            worker: _Worker = key.data
            try:
                chunk = os.read(key.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._close_fd(worker)
                continue
            # Raw bytes, chunk by chunk: "\r" progress bars and partial lines pass unchanged.
            try:
                self.out.write(chunk)
                self.out.flush()
            except (OSError, ValueError):
                pass  # our stderr is gone; keep the tail for the report anyway
            self._at_line_start = chunk.endswith(b"\n")
            worker.tail += chunk
            if len(worker.tail) > TAIL_BYTES:
                del worker.tail[:-TAIL_BYTES]

    def _drain_all(self, rounds: int = 50) -> None:
        """Read what is already in the pipes (without waiting for late writers)."""
        for _ in range(rounds):
            if not self.selector.get_map() or not self.selector.select(0):
                return
            self._drain(0)

    def _close_fd(self, worker: _Worker) -> None:
        if worker.fd is not None:
            self.selector.unregister(worker.fd)
            os.close(worker.fd)
            worker.fd = None

    # ------------------------------------------------------------------ start
    def _start(self, errdir: Path, gpus: list[str] | None, run_id: str, port: int) -> None:
        cfg, where = self.cfg, self.placement
        python = [sys.executable, "-u"]
        cmd = [*python, "-m", cfg.target] if cfg.module else [*python, cfg.target]
        cmd += list(cfg.target_args)
        base = dict(os.environ)
        base.update(thread_env(base, cfg.nproc_per_node))
        parent = os.getpid()
        load_prctl()  # now, not between fork and exec

        def child_setup() -> None:
            # Runs in the child between fork and exec: die with the launcher, never orphaned.
            set_parent_death_signal(signal.SIGKILL, parent)

        for local_rank in range(cfg.nproc_per_node):
            rank = where.rank_offset + local_rank
            env = dict(base)
            env.update(
                rank_env(
                    rank=rank,
                    world_size=where.world_size,
                    local_rank=local_rank,
                    local_world_size=cfg.nproc_per_node,
                    node_rank=where.node_rank,
                    nnodes=where.nnodes,
                    master_addr=where.master_addr,
                    master_port=port,
                    run_id=run_id,
                    gpu=None if gpus is None else gpus[local_rank],
                    restart_count=self.attempt,
                    max_restarts=cfg.max_restarts,
                )
            )
            error_file = errdir / f"rank{rank}.json"
            env[ERROR_FILE_ENV] = str(error_file)
            proc = subprocess.Popen(
                cmd,
                env=env,
                stderr=subprocess.PIPE,
                # Own session and process group: the launcher ends a worker together with
                # everything it started, and a terminal's Ctrl-C reaches only the launcher,
                # which then ends the workers in order.
                start_new_session=True,
                preexec_fn=child_setup,
            )
            # Our own descriptor, so closing it can never close a reused number twice.
            stderr = proc.stderr
            fd = os.dup(stderr.fileno()) if stderr is not None else os.open(os.devnull, 0)
            if stderr is not None:
                stderr.close()
            os.set_blocking(fd, False)
            worker = _Worker(rank, local_rank, proc, error_file, fd)
            self.workers.append(worker)
            self.selector.register(fd, selectors.EVENT_READ, worker)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        cfg = self.cfg
        try:
            gpus = gpu_assignment(cfg.nproc_per_node, os.environ)
        except ValueError as exc:
            self._say(f"{PROG}: error: {exc}\n")
            return 2
        self.signals.install()
        try:
            return self._run(gpus)
        finally:
            self.selector.close()
            self.signals.restore()

    def _run(self, gpus: list[str] | None) -> int:
        """The attempts, with the signal handlers installed: restarted up to
        ``--max-restarts`` (the elastic supervisor runs rendezvous rounds instead)."""
        while True:
            code = self._attempt(gpus)
            if not self._restart:
                return code
            self.attempt += 1
            if self.signals.received:  # arrived while the failed attempt was cleaned up
                sig = self.signals.received[0]
                self._say(f"{PROG}: received {signal_name(sig)}; not restarting\n")
                return 128 + sig

    def _attempt(self, gpus: list[str] | None, port: int | None = None) -> int:
        """Start every worker once and see the attempt to its end; nothing of it is left.

        ``port`` is rank 0's store port (a rendezvous round's); None: the command line's on
        the first attempt or when given, else a fresh free one.
        """
        cfg = self.cfg
        self._restart = False
        self.workers = []
        run_id = attempt_run_id(cfg.run_id, self.attempt)
        if port is None:
            # The first attempt's port was chosen (or given) with the command line.
            fixed = self.attempt == 0 or cfg.fixed_port
            port = cfg.master_port if fixed else free_port("127.0.0.1")
        errdir = Path(tempfile.mkdtemp(prefix="dpt-run-"))
        try:
            try:
                self._start(errdir, gpus, run_id, port)
            except OSError as exc:
                self._say(f"{PROG}: error: could not start rank {len(self.workers)}: {exc}\n")
                return 1
            return self._monitor()
        finally:
            # Whatever happened (even an error in the launcher), no worker outlives it, and
            # the next attempt finds no process, segment or error file of this one.
            if self.workers:
                shutdown(self.workers, min(cfg.grace_period, 1.0), wait=self._drain)
            self._drain_all()
            for w in self.workers:
                self._close_fd(w)
            wait_groups_gone([w.pid for w in self.workers])
            shutil.rmtree(errdir, ignore_errors=True)
            remove_run_segments(run_id)

    def _external_end(self) -> int | None:
        """An exit code when something outside this node ends the attempt (a rendezvous)."""
        return None

    def _monitor(self) -> int:
        while True:
            if self.signals.received:
                return self._on_signal(self.signals.received[0])
            code = self._external_end()
            if code is not None:
                return code
            # Exit codes first, output second: a worker's last words are in the pipe by the
            # time its exit is seen, so the drain below has them for the report.
            returncodes = [w.poll() for w in self.workers]
            self._drain(_POLL_S)
            failed = [w for w, rc in zip(self.workers, returncodes, strict=True) if rc]
            if failed:
                self._drain_all()
                return self._on_failure(failed)
            if all(rc == 0 for rc in returncodes):
                self._drain_all()
                return 0

    def _failure_of(self, w: _Worker) -> Failure:
        rc = w.proc.returncode
        record = read_error_file(w.error_file)
        if record is not None:
            t = record.get("time")
            return Failure(
                rank=w.rank,
                returncode=rc,
                exc_type=record["exc_type"],
                message=record["message"],
                traceback=record["traceback"],
                traceback_source="its error file",
                time=float(t) if isinstance(t, int | float) else None,
            )
        text = w.tail.decode("utf-8", errors="replace")
        tb = extract_traceback(text)
        if tb is not None:
            exc_type = message = None
            last = tb.rstrip().splitlines()[-1].strip()
            m = _EXC_LINE.match(last)
            if m:
                exc_type, message = m.group(1), m.group(2) or ""
            return Failure(
                rank=w.rank,
                returncode=rc,
                exc_type=exc_type,
                message=message,
                traceback=tb,
                traceback_source="its stderr",
            )
        note = "no traceback: it wrote no error file and no Python traceback to stderr"
        if rc is not None and rc < 0:
            note = f"no traceback: it was {describe_exit(rc)} before it could write one"
            note += killed_hint(rc)
        last_lines = text.rstrip().splitlines()[-10:]
        if last_lines:
            note += "\nlast lines of its stderr:\n" + "\n".join("  " + ln for ln in last_lines)
        return Failure(rank=w.rank, returncode=rc, note=note)

    def _on_failure(self, failed: list[_Worker]) -> int:
        cfg = self.cfg
        code, text = self._end_failed(failed)
        last = restart_line(PROG, self.attempt, cfg.max_restarts, f"{PROG} exits with code {code}")
        self._restart = self.attempt < cfg.max_restarts
        if self._restart and self.signals.received:
            self._restart = False
            sig = signal_name(self.signals.received[0])
            last = f"{PROG} received {sig}: no restart; {PROG} exits with code {code}"
        self._report(
            f"job failed{attempt_title(self.attempt, cfg.max_restarts)}", f"{text}\n{last}"
        )
        return code

    def _end_failed(self, failed: list[_Worker]) -> tuple[int, str]:
        """End every worker after ``failed`` failed; the exit code and the report's lines."""
        first = pick_first([self._failure_of(w) for w in failed])
        code, text = self._failure_text(first)
        return code, f"{text}\nother ranks on this node: {self._end_others(first)}"

    def _failure_text(self, first: Failure) -> tuple[int, str]:
        """The exit status a failed rank gives the launcher, and the lines that describe it."""
        worker = next(w for w in self.workers if w.rank == first.rank)
        where = f"; local rank {worker.local_rank} on {self.host}, pid {worker.pid}"
        rc = first.returncode if first.returncode is not None else 1
        return exit_status(rc), format_failure(first, self.placement.world_size, where)

    def _end_others(self, first: Failure) -> str:
        """End every worker after ``first`` failed; what became of the others."""
        cfg = self.cfg
        self._signals_handled = len(self.signals.received)
        endings = shutdown(self.workers, cfg.grace_period, wait=self._wait_escalating)
        self._drain_all()
        return describe_others(
            [w.rank for w in self.workers],
            [w.proc.returncode for w in self.workers],
            endings,
            first.rank,
            cfg.grace_period,
        )

    def _on_signal(self, sig: int) -> int:
        cfg = self.cfg
        code, states = self._end_signaled(sig)
        no_restart = "no restart; " if cfg.max_restarts > 0 else ""
        self._report(
            f"job interrupted{attempt_title(self.attempt, cfg.max_restarts)}",
            f"{PROG} received {signal_name(sig)}; ranks: {states}\n"
            f"{no_restart}{PROG} exits with code {code}",
        )
        return code

    def _end_signaled(self, sig: int) -> tuple[int, str]:
        """Pass ``sig`` on to the workers and end them; the exit code and their states."""
        cfg = self.cfg
        self._say(
            f"{PROG}: received {signal_name(sig)}; sending it to the workers (SIGKILL after "
            f"{cfg.grace_period:g} s, or at once on a second signal)\n"
        )
        self._signals_handled = len(self.signals.received)
        endings = shutdown(self.workers, cfg.grace_period, sig=sig, wait=self._wait_escalating)
        self._drain_all()
        parts = []
        for w, ending in zip(self.workers, endings, strict=True):
            rc = w.proc.returncode
            if ending.killed:
                state = "killed by SIGKILL"
            elif rc is None:
                state = "still running"
            else:
                state = describe_exit(rc)
            parts.append(f"rank {w.rank} {state}")
        return 128 + sig, "; ".join(parts)

    def _wait_escalating(self, seconds: float) -> None:
        """Drain output while waiting; a further signal to the launcher means SIGKILL now."""
        if len(self.signals.received) > self._signals_handled:
            for w in self.workers:
                signal_group(w, signal.SIGKILL)
        self._drain(seconds)

    def _report(self, title: str, body: str) -> None:
        self._say(format_banner(f"{PROG}: {title}", body))


def _stderr_bytes() -> IO[bytes]:
    buffer = getattr(sys.stderr, "buffer", None)
    if buffer is not None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        return buffer
    return os.fdopen(os.dup(2), "wb", buffering=0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher.

    Args:
        argv: the arguments after ``python -m collectives.run`` (default: ``sys.argv[1:]``).

    Returns:
        0 when every worker exited 0; the first failed worker's exit code (128 + N when it died
        by signal N); 128 + N when the launcher got signal N; 2 for a usage error. With
        ``--max-restarts``, what the last attempt ended with.
    """
    cfg = parse_args(argv)
    for note in cfg.notes:
        print(note, file=sys.stderr, flush=True)
    if cfg.rdzv is not None:
        # Imported here: the elastic supervisor builds on this module's.
        from .launch._elastic import ElasticSupervisor

        return ElasticSupervisor(cfg).run()
    return _Supervisor(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
