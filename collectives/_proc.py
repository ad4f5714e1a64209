"""Facts about processes and hosts that backends share (liveness of ranks on this host)."""

from __future__ import annotations

import os

__all__ = ["host_id", "pid_alive", "pid_namespace"]


def pid_alive(pid: int) -> bool:
    """False once process ``pid`` on this host has exited (zombies count as exited).

    Unknown pids (0) and processes we may not signal count as alive: only a positive
    answer that the process is gone makes a backend declare a rank dead.
    """
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def host_id() -> str:
    """``nodename/boot-id``: equal for two processes exactly when they share a running kernel
    (a pid means the same process to both, and they can map the same shared memory)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{os.uname().nodename}/{boot}"


def pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]``), or ``"-"`` where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "-"
