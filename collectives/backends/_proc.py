"""Process liveness checks shared by backends (ranks on this host)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


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
