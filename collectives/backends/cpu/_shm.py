"""Shared-memory segments under /dev/shm, and futex-based waiting on words inside them.

Segments are plain files in /dev/shm mapped with mmap. Their space is reserved up front with
``posix_fallocate`` so that running out of shared memory is a clear ``OSError`` at creation,
never a SIGBUS on first touch. Backends unlink each name as soon as every peer has mapped it:
the mappings stay valid, and nothing is left behind even if a process is killed later.

A name is ``dpt-{run tag}-{tag}-{creator pid}-{origin}-{random}``. The run tag is unique per
job (:func:`run_tag`), so a launcher's cleanup removes exactly its job's names. The origin
(:func:`origin_id`) says on which kernel and in which pid namespace the creator's pid means
something, so that the first segment a process creates can sweep names whose creator is dead
(every rank of a job killed while setting up, with no launcher to clean up) and only those:
a live creator's, or one in another pid namespace (a container sharing /dev/shm), is kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import mmap
import os
import platform
import re
import secrets
import sys
from typing import Any

import numpy as np

from ..._proc import host_id, pid_alive

__all__ = ["Futex", "Segment", "shm_dir"]

_SHM_DIR = "/dev/shm"
PREFIX = "dpt-"
# ...-{pid}-{origin}-{random}: the fields a sweep reads, from the end of a name.
_TAIL = re.compile(r"-([1-9][0-9]*)-([0-9a-f]{8})-[0-9a-f]{8}$")
_swept = False  # this process swept /dev/shm already (at its first Segment.create)


def shm_dir() -> str:
    """Directory that backs POSIX shared memory here."""
    return _SHM_DIR


def run_tag(run_id: str | None = None) -> str:
    """The job part of segment names, unique per run id (launchers clean up by it).

    A readable cut of DPT_RUN_ID (file-name safe, 16 characters), a dot, and a hash of the
    whole id: ids that share a prefix, or differ only in unsafe characters, get different
    tags, and no tag is a prefix of another (the dot never occurs in the cut).
    """
    raw = os.environ.get("DPT_RUN_ID", "x") if run_id is None else run_id
    cut = re.sub(r"[^A-Za-z0-9_]", "_", raw)[:16] or "x"
    return f"{cut}.{hashlib.sha256(raw.encode()).hexdigest()[:10]}"


def remove_run_segments(run_id: str) -> None:
    """Remove the segments a job's ranks left named (a rank killed while setting up).

    Backends unlink each segment as soon as all ranks mapped it, so only a rank that died in
    between leaves one; the names carry the job's tag (:func:`run_tag`), matched exactly, so
    only that job's go.
    """
    stem = f"{PREFIX}{run_tag(run_id)}-"
    for name in _names():
        if name.startswith(stem):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(_SHM_DIR, name))


def _names() -> list[str]:
    try:
        return os.listdir(_SHM_DIR)
    except OSError:
        return []


@functools.cache  # a process never changes pid namespace (unshare/setns apply to children)
def origin_id() -> str | None:
    """8 hex digits naming this kernel boot and pid namespace, or None if unknown.

    Two processes get the same value exactly when a pid means the same process to both (up
    to a 32-bit hash collision), so a sweep trusts a recorded pid only under its own origin.
    """
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None  # no /proc: this process cannot tell, so it sweeps nothing
    return hashlib.sha256(f"{host_id()}/{pidns}".encode()).hexdigest()[:8]


def sweep_dead_segments() -> list[str]:
    """Remove the segments whose creator is dead; the names removed.

    Only names that record this process's origin are looked at, and a creator counts as dead
    only when its pid is positively gone (a zombie, or no such process): a pid reused by
    another process keeps the segment (conservative), and a live creator's segment, even one
    being set up right now, is never touched. Removing a name frees the memory once the
    last mapping goes; processes that still map it are not disturbed.
    """
    origin = origin_id()
    if origin is None:
        return []
    removed: list[str] = []
    for name in _names():
        m = _TAIL.search(name) if name.startswith(PREFIX) else None
        if m is None or m.group(2) != origin or pid_alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM_DIR, name))
            removed.append(name)
    return removed


def _sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        sweep_dead_segments()


def probe() -> str | None:
    """None when shared-memory segments can be created here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux shared memory (/dev/shm); this is {sys.platform}"
    if not os.path.isdir(_SHM_DIR) or not os.access(_SHM_DIR, os.W_OK):
        return f"{_SHM_DIR} is missing or not writable"
    return None


class Segment:
    """One mapped shared-memory file.

    Attributes:
        name: file name in /dev/shm.
        size: bytes mapped.
        buf: the mmap object.
        u8: a uint8 NumPy view of the whole segment.
        address: virtual address of the first byte (for futexes and zero-copy lookups).
    """

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = size
        self.buf = mm
        self.owner = owner
        self.unlinked = not owner
        self.u8: np.ndarray[Any, Any] = np.frombuffer(mm, dtype=np.uint8)
        self.address = self.u8.__array_interface__["data"][0]

    @classmethod
    def create(cls, size: int, tag: str) -> Segment:
        """Create and map a new zeroed segment of at least ``size`` bytes.

        Raises:
            OSError: when /dev/shm cannot hold it (the message says how much was asked).
        """
        # Segments of jobs killed while setting up (nobody else removes those) are freed
        # before this one takes space.
        _sweep_once()
        size = max(mmap.PAGESIZE, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        # Without a known origin the name records none, and no sweep ever removes it.
        origin = origin_id() or "none"
        name = f"{PREFIX}{run_tag()}-{tag}-{os.getpid()}-{origin}-{secrets.token_hex(4)}"
        path = os.path.join(_SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"cannot reserve {size / 2**20:.1f} MiB of shared memory in {_SHM_DIR} "
                    f"({exc.strerror}); free some or lower DPT_CPU_CHUNK_BYTES",
                ) from exc
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment created by another process."""
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"refusing to map an unexpected shared-memory name {name!r}")
        path = os.path.join(_SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            m = _TAIL.search(name)
            if m is None or pid_alive(int(m.group(1))):
                raise
            # A sweep (or a cleanup) removed the name of a creator that died meanwhile.
            raise FileNotFoundError(
                exc.errno,
                f"shared-memory segment {name} is gone: its creator, pid {m.group(1)}, exited "
                "or was killed while the group was being set up",
            ) from exc
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid). Idempotent."""
        if not self.unlinked:
            self.unlinked = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_SHM_DIR, self.name))

    def close(self) -> None:
        """Unlink if still named, and unmap when no array views remain."""
        self.unlink()
        self.u8 = np.zeros(0, dtype=np.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self.buf.close()

    def words(self, offset: int, count: int) -> memoryview:
        """A uint32 memoryview of ``count`` words at byte ``offset`` (fast scalar access)."""
        return memoryview(self.buf)[offset : offset + 4 * count].cast("I")


# ---------------------------------------------------------------------------- futexes
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower()
)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """FUTEX_WAIT/FUTEX_WAKE on 32-bit words in shared mappings (shared, not private, futexes).

    On platforms without the syscall, ``wait`` sleeps briefly instead (correct, slower).
    """

    def __init__(self) -> None:
        self.available = False
        self._syscall: Any = None
        if _SYS_FUTEX is not None and sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.syscall
                fn.restype = ctypes.c_long
                self._syscall = fn
                self.available = True
            except (OSError, AttributeError):
                self.available = False

    def wait(self, address: int, expected: int, timeout: float) -> None:
        """Sleep while the word at ``address`` equals ``expected``, at most ``timeout`` s.

        Returns on a wake-up, a changed value, a signal or the timeout (callers re-check).
        """
        if not self.available:
            import time

            time.sleep(min(timeout, 0.0005))
            return
        sec = int(timeout)
        ts = _Timespec(sec, int((timeout - sec) * 1e9))
        self._syscall(
            _SYS_FUTEX,
            ctypes.c_void_p(address),
            _FUTEX_WAIT,
            ctypes.c_uint32(expected),
            ctypes.byref(ts),
            None,
            0,
        )

    def wake(self, address: int) -> None:
        """Wake every process sleeping on the word at ``address``."""
        if self.available:
            self._syscall(
                _SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0
            )
