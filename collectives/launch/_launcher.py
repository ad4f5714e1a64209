"""What ``python -m collectives.run`` and ``spawn`` share: how ranks start and how a job ends.

Starting: each rank gets the torchrun-compatible environment of :func:`rank_env` (read back by
``env://``), one OpenMP thread when several ranks share a host (:func:`thread_env`), its own GPU
through ``CUDA_VISIBLE_DEVICES`` (:func:`gpu_assignment`), rank 0's store port (:func:`free_port`
when none is given), the job's id (:func:`new_run_id`), and a parent-death signal so that no
rank outlives a launcher that was killed (:func:`set_parent_death_signal`). Every rank leads its
own process group, so ending the group ends whatever the rank started too.

The failure policy, the same for both launchers:

1. A rank has failed when it exits non-zero, dies by a signal, or (``spawn``) reports an error.
2. Every other rank's process group gets SIGTERM (or the signal the launcher itself received),
   then SIGKILL if still alive after the grace period (:func:`shutdown`). A rank that already
   reported its failure gets no SIGTERM: it is exiting on its own.
3. Of the ranks seen failing at the same time, the likeliest root cause is reported
   (:func:`pick_first`): errors that say another rank failed (``PeerFailureError``,
   ``GroupAbortedError``) come last, then the earliest recorded error, then the lowest rank.
4. The report (:func:`format_failure`) names that rank, how it ended and its own traceback,
   then says what became of each other rank (:func:`describe_others`): finished, also failed,
   terminated or killed.
5. ``collectives.run`` exits with that rank's status (:func:`exit_status`: its code, or
   128 + N for signal N); ``spawn`` raises ``SpawnError``. With restarts allowed, the job
   starts again instead, as :mod:`collectives.launch._restarts` says, and the last attempt's
   status or error is the result.
"""

from __future__ import annotations

import ctypes
import math
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import signal_name

__all__ = [
    "ALLOW_SHARED_GPU_ENV",
    "DEFAULT_GRACE_PERIOD",
    "Ending",
    "Failure",
    "ProcLike",
    "describe_exit",
    "describe_others",
    "exit_status",
    "format_banner",
    "format_failure",
    "free_port",
    "gpu_assignment",
    "killed_hint",
    "load_prctl",
    "new_run_id",
    "pick_first",
    "rank_env",
    "set_parent_death_signal",
    "shutdown",
    "signal_group",
    "signal_name",
    "thread_env",
]

ALLOW_SHARED_GPU_ENV = "DPT_ALLOW_SHARED_GPU"
DEFAULT_GRACE_PERIOD = 5.0

# Ranks failing with these were most likely failed by another rank: report the other one first.
_SECONDARY_ERRORS = ("PeerFailureError", "GroupAbortedError")


# ---------------------------------------------------------------------- starting ranks
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, for rank 0's store (``MASTER_PORT``).

    ``collectives.run`` and ``spawn`` call it when no port is given; code that starts ranks of
    its own (benchmarks, tests) uses it as ``from collectives.run import free_port``.

    The port is drawn at random from outside the kernel's ephemeral range
    (``net.ipv4.ip_local_port_range``) and checked free by binding it. A port the kernel hands
    out itself (port 0) is the one the next outgoing connection on this host may take before
    the store binds it, which happened under a parallel test run; outside that range only
    another explicit bind can take it. If no such port is found, the kernel's choice is used.

    Args:
        host: the address the store will listen on.

    Returns:
        The port number.
    """
    lo, hi = _ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST_PICKED_PORT, lo - 1), (hi + 1, 65535)) if a <= b]
    total = sum(b - a + 1 for a, b in spans)
    for _ in range(64 if total else 0):
        k = secrets.randbelow(total)  # not `random`: forked callers would share its state
        for a, b in spans:
            if k <= b - a:
                port = a + k
                break
            k -= b - a + 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Below this, well-known services (databases, web servers) are likelier to come and go.
_LOWEST_PICKED_PORT = 20000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself; Linux's default if unreadable."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def rank_env(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    gpu: str | None = None,
    restart_count: int = 0,
    max_restarts: int = 0,
) -> dict[str, str]:
    """The torchrun-compatible variables that describe one rank (read back by ``env://``).

    ``gpu`` is the rank's ``CUDA_VISIBLE_DEVICES`` (one entry of :func:`gpu_assignment`); None
    leaves the inherited value alone. ``restart_count`` is the attempt (0 on the first start,
    see :mod:`collectives.launch._restarts`), exported as ``DPT_RESTART_COUNT`` and torchrun's
    ``TORCHELASTIC_RESTART_COUNT``; ``max_restarts`` as ``TORCHELASTIC_MAX_RESTARTS``.
    """
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "DPT_RUN_ID": run_id,
        "DPT_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def thread_env(environ: Mapping[str, str], local_world_size: int) -> dict[str, str]:
    """Like torchrun: one OpenMP thread per rank when several share a host, unless set."""
    if local_world_size > 1 and "OMP_NUM_THREADS" not in environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def new_run_id() -> str:
    """A fresh job id for ``DPT_RUN_ID``."""
    return uuid.uuid4().hex[:12]


def gpu_assignment(
    local_world_size: int,
    environ: Mapping[str, str],
    device_count: int | None = None,
) -> list[str] | None:
    """Choose the ``CUDA_VISIBLE_DEVICES`` value of each local rank: one GPU per rank.

    An existing ``CUDA_VISIBLE_DEVICES`` list is respected (rank i gets its i-th entry).

    Args:
        local_world_size: ranks on this host.
        environ: the environment the ranks inherit.
        device_count: visible GPUs; None asks ``tensorlib.cuda_device_count()`` (which imports
            CuPy only when it is installed).

    Returns:
        One device string per local rank, or None when no GPU is visible (nothing to bind).

    Raises:
        ValueError: when there are fewer GPUs than local ranks and ``DPT_ALLOW_SHARED_GPU=1`` is
            not set (then ranks share GPUs round-robin).
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None  # GPUs hidden on purpose: skip probing (and importing CuPy) entirely
    if device_count is None:
        from tensorlib import cuda_device_count

        device_count = cuda_device_count()
    if device_count <= 0:
        return None
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()][:device_count]
    else:
        ids = [str(i) for i in range(device_count)]
    if not ids:
        return None
    if len(ids) < local_world_size and environ.get(ALLOW_SHARED_GPU_ENV, "") not in ("1", "true"):
        shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ValueError(
            f"{local_world_size} local ranks but only {len(ids)} GPU(s) visible{shown}: each "
            f"rank gets its own GPU. Start at most {len(ids)} ranks per node, set "
            f"{ALLOW_SHARED_GPU_ENV}=1 to let ranks share GPUs round-robin, or set "
            "CUDA_VISIBLE_DEVICES= (empty) to run every rank on the CPU."
        )
    return [ids[i % len(ids)] for i in range(local_world_size)]


_libc: Any = None


def load_prctl() -> Any:
    """libc's prctl, loaded in the parent (loading after fork is not async-signal-safe)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        try:
            # The running program's own symbols include libc's (find_library would run ldconfig).
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    return _libc.prctl if _libc else None


def set_parent_death_signal(sig: int, parent_pid: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere).

    Exits at once when the parent is already gone, which closes the race between the fork and
    this call. This is what keeps workers from outliving a launcher killed by SIGKILL.
    """
    prctl = load_prctl()
    if prctl is None:
        return
    pr_set_pdeathsig = 1
    prctl(pr_set_pdeathsig, sig, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


# ---------------------------------------------------------------------- ending ranks
class ProcLike(Protocol):
    """What the failure policy needs from a child: its pid and a non-blocking poll."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


def signal_group(proc: ProcLike, sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (workers lead their own), or to it alone."""
    try:
        os.killpg(proc.pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    # Not (yet) a group leader: a spawned child calls setsid() only once it runs.
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Ending:
    """How shutdown ended one process."""

    signaled: bool = False  # we sent it the first signal while it was running
    killed: bool = False  # it outlived the grace period and got SIGKILL


def shutdown(
    procs: Sequence[ProcLike],
    grace_period: float,
    *,
    sig: int = signal.SIGTERM,
    spare: Iterable[int] = (),
    wait: Callable[[float], None] | None = None,
) -> list[Ending]:
    """End every process: ``sig`` to each group, then SIGKILL to what outlives the grace period.

    Args:
        procs: the children.
        grace_period: seconds between ``sig`` and SIGKILL.
        sig: the first signal (SIGTERM, or the one the launcher received).
        spare: indices that get no first signal, only SIGKILL if still alive after the grace
            period (a rank that already reported its failure and is exiting on its own).
        wait: sleeps up to the given seconds while doing useful work (draining output).

    Returns:
        One :class:`Ending` per process.
    """
    spared = set(spare)
    endings = [Ending() for _ in procs]
    for i, proc in enumerate(procs):
        if i not in spared and proc.poll() is None:
            endings[i].signaled = True
        if i not in spared:
            # Also exited leaders: their group may still hold grandchildren.
            signal_group(proc, sig)
    deadline = time.monotonic() + max(0.0, grace_period)
    sleep = wait or time.sleep
    while any(p.poll() is None for p in procs):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sleep(min(left, 0.02))
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            endings[i].killed = True
        signal_group(proc, signal.SIGKILL)
    # SIGKILL cannot be ignored, but a process stuck in the kernel (D state) may take a while:
    # wait a bounded time, then report it as it is rather than hang.
    deadline = time.monotonic() + 10.0
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.005)
    return endings


# ---------------------------------------------------------------------- reporting
def describe_exit(returncode: int) -> str:
    """Say how a process ended, from a ``Popen.returncode``/``Process.exitcode``."""
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    return f"exited with code {returncode}"


def killed_hint(returncode: int | None) -> str:
    """What a report adds about a rank that a SIGKILL ended without a traceback."""
    return " (out of memory? check `dmesg`)" if returncode == -signal.SIGKILL else ""


def exit_status(returncode: int) -> int:
    """The shell's exit status for a child's end: its code, or 128 + signal number."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Failure:
    """A rank that failed: how it ended and what it said."""

    rank: int
    returncode: int | None  # None while it is still running (it reported an error first)
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    traceback_source: str | None = None  # "its error file", "its stderr", "the rank's report"
    time: float | None = None  # when the rank recorded the error (its clock), if known
    note: str | None = None  # when there is no traceback: what we know instead


def pick_first(failures: Sequence[Failure]) -> Failure:
    """Among failures seen at the same time, the likeliest root cause.

    Errors that say "another rank failed" come last; then the earliest recorded error; then
    the lowest rank.
    """

    def key(f: Failure) -> tuple[bool, float, int]:
        secondary = bool(f.exc_type) and str(f.exc_type).endswith(_SECONDARY_ERRORS)
        return (secondary, f.time if f.time is not None else math.inf, f.rank)

    return min(failures, key=key)


def describe_others(
    ranks: Sequence[int],
    returncodes: Sequence[int | None],
    endings: Sequence[Ending],
    first: int,
    grace_period: float,
    sig: int = signal.SIGTERM,
) -> str:
    """One phrase per other rank: finished, also failed, terminated or killed."""
    parts = []
    for rank, rc, ending in zip(ranks, returncodes, endings, strict=True):
        if rank == first:
            continue
        if ending.killed:
            what = f"killed by SIGKILL after the {grace_period:g} s grace period"
        elif ending.signaled:
            if rc == -sig:
                what = f"terminated by {signal_name(sig)}"
            else:
                what = f"{describe_exit(rc if rc is not None else 0)} after {signal_name(sig)}"
        elif rc == 0:
            what = "had already finished (exit code 0)"
        elif rc is not None:
            what = f"also failed: {describe_exit(rc)}"
        else:
            what = "still running"
        parts.append(f"rank {rank} {what}")
    return "; ".join(parts) if parts else "none"


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


def format_failure(failure: Failure, world_size: int, where: str = "") -> str:
    """The lines that say which rank failed, how, and its traceback."""
    how = (
        describe_exit(failure.returncode) if failure.returncode is not None else "reported an error"
    )
    lines = [f"rank {failure.rank} (of {world_size}{where}) failed first: {how}"]
    if failure.exc_type is not None:
        lines.append(f"error: {failure.exc_type}: {failure.message or ''}".rstrip())
    if failure.traceback:
        lines.append(f"traceback of rank {failure.rank} (from {failure.traceback_source}):")
        lines.append(_indent(failure.traceback))
    elif failure.note:
        lines.append(failure.note)
    return "\n".join(lines)


def format_banner(title: str, body: str) -> str:
    """A report framed by lines of ``=`` (the title centred in the first), ending in a newline."""
    head = f" {title} ".center(80, "=")
    return f"{head}\n{body.rstrip()}\n{'=' * 80}\n"
