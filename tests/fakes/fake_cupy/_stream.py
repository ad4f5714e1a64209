"""The fake's streams and events, pinned host memory and ``cudaMemcpyAsync``.

Fake kernels run on the host at once (their data is ready when the call returns), but the
streams are asynchronous the way a GPU's are, so that code which waits on the host can be told
from code that does not:

* every non-null stream is an ordered queue with a worker thread of its own, for the work a
  communication library enqueues (``memcpyAsync``, ``ndarray.set(stream=)``, the fake NCCL):
  its work completes *later* than it is queued, and an event completes when the work queued
  before it has run;
* the null stream's events complete :data:`NULL_LAG_S` after they were recorded, not at once
  (the GPU is behind the host): ``Event.done`` is False right after ``record()``, and
  ``synchronize()`` really waits. Its ``wait_event`` on another stream's event still blocks
  the host (eager kernels after it must see that stream's results), which on a GPU is a
  device-side wait: it is not counted as a host synchronization;
* a stream and an event belong to the device current when they were made (the null stream:
  to the calling thread's current device), and ``Event.record`` on a stream of another device
  raises ``cudaErrorInvalidResourceHandle``, as the CUDA runtime does;
* :func:`host_syncs` counts, per host thread, the calls that make the host wait for the device
  (``Stream``/``Event``/``Device.synchronize``, blocking ``ndarray.get`` and the conversions
  built on it), so a test can assert that a step makes none.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

from ._device import CUDARuntimeError, _current


class _CurrentStream(threading.local):
    def __init__(self) -> None:
        self.stack: list[Stream] = []


_current_stream = _CurrentStream()
_stream_ptrs = itertools.count(0x57000)
_event_ptrs = itertools.count(0xE7000)
_IDLE_EXIT_S = 0.05  # a stream's worker thread ends after this long without work
NULL_LAG_S = 0.001  # the null stream's events complete this long after their record


class _Syncs(threading.local):
    def __init__(self) -> None:
        self.count = 0
        self.kinds: list[str] = []


_syncs = _Syncs()


def host_syncs(reset: bool = False) -> list[str]:
    """What made this host thread wait for the device since the last reset (see the module)."""
    kinds = list(_syncs.kinds)
    if reset:
        _syncs.kinds.clear()
    return kinds


def _note_sync(kind: str) -> None:
    _syncs.kinds.append(kind)


class Stream:
    """``cupy.cuda.Stream``. Fake kernels run on the host at once; the *null* stream's events
    complete :data:`NULL_LAG_S` after their record, and waiting on an event there blocks the
    host until it completes. Every other stream is a real queue, run in order by a worker
    thread of its own: :func:`memcpyAsync`, ``ndarray.set(stream=)`` and the fake NCCL
    (tests/fakes/fake_nccl.py) put work on it, and an event recorded there completes when the
    work queued before it has finished. ``ptr`` identifies the stream (``cudaStream_t``),
    ``device_id`` its device.
    """

    null: Stream
    _by_ptr: ClassVar[weakref.WeakValueDictionary[int, Stream]] = weakref.WeakValueDictionary()

    def __init__(
        self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority: Any = 0
    ) -> None:
        self._is_null = bool(null)
        self.device_id = _current.device  # the null stream: see _device()
        self.ptr = 0 if null else next(_stream_ptrs)
        self.non_blocking = non_blocking
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], object]] = deque()
        self._submitted = 0
        self._finished = 0
        self._worker: threading.Thread | None = None
        self.errors: list[BaseException] = []  # what queued work raised (a bug in a fake)
        if not null:
            Stream._by_ptr[self.ptr] = self

    # ------------------------------------------------------------------ queue
    def _device(self) -> int:
        """The device of this stream (the null stream is the current device's)."""
        return _current.device if self._is_null else self.device_id

    def _enqueue(self, fn: Callable[[], object]) -> int:
        """Queue ``fn``; return its ticket (done once ``_finished`` reaches it)."""
        if self._is_null:
            fn()  # eager, like the fake's kernels
            return 0
        return self._queue_work(fn)

    def _mark(self) -> int:
        """A ticket on the null stream, complete NULL_LAG_S from now (the GPU is behind)."""
        due = time.monotonic() + NULL_LAG_S

        def lag() -> None:
            left = due - time.monotonic()
            if left > 0:
                time.sleep(left)

        return self._queue_work(lag)

    def _queue_work(self, fn: Callable[[], object]) -> int:
        with self._cond:
            self._queue.append(fn)
            self._submitted += 1
            ticket = self._submitted
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name=f"fake-cuda-stream-{self.ptr:#x}", daemon=True
                )
                self._worker.start()
            else:
                self._cond.notify_all()
        return ticket

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._cond.wait(_IDLE_EXIT_S)
                    if not self._queue:
                        self._worker = None
                        return
                fn = self._queue.popleft()
            try:
                fn()
            except BaseException as exc:  # pragma: no cover - a bug in fake work: keep it
                self.errors.append(exc)
            with self._cond:
                self._finished += 1
                self._cond.notify_all()

    def _reached(self, ticket: int) -> bool:
        return self._finished >= ticket

    def _wait_for(self, ticket: int, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._finished >= ticket, timeout)

    # ------------------------------------------------------------------ CuPy's API
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (as recorded now)."""
        source, ticket = event._stream, event._ticket
        if source is None or source is self:
            return
        if self._is_null:
            # Eager kernels after this must see the source's results: the host waits (on a
            # GPU a device-side wait, so not counted as a host synchronization).
            source._wait_for(ticket)
            return
        self._enqueue(lambda: source._wait_for(ticket))

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one when None) on this stream."""
        ev = event if event is not None else Event()
        ev.record(self)
        return ev

    def synchronize(self) -> None:
        """Block until everything queued so far has run."""
        _note_sync("Stream.synchronize")
        self._wait_for(self._submitted)

    @property
    def done(self) -> bool:
        """Whether everything queued so far has run."""
        return self._finished >= self._submitted

    def use(self) -> Stream:
        """Make this the current stream of this thread."""
        _current_stream.stack[:] = [self]
        return self

    def __enter__(self) -> Stream:
        _current_stream.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _current_stream.stack.pop()

    def __repr__(self) -> str:
        return f"<fake cupy.cuda.Stream {self.ptr:#x}{' (null)' if self._is_null else ''}>"


Stream.null = Stream(null=True)


def get_current_stream(device_id: int = -1) -> Stream:
    """This thread's current stream (the null stream unless one was made current)."""
    return _current_stream.stack[-1] if _current_stream.stack else Stream.null


def _stream_for(handle: Any) -> Stream:
    """The stream of a ``cudaStream_t`` (int) or Stream; 0 is the null stream."""
    if isinstance(handle, Stream):
        return handle
    ptr = int(handle or 0)
    if ptr == 0:
        return Stream.null
    stream = Stream._by_ptr.get(ptr)
    if stream is None:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: no stream {ptr:#x}")
    return stream


class Event:
    """``cupy.cuda.Event``: complete once the work queued on its stream before ``record`` ran."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        self.ptr = next(_event_ptrs)
        self.device_id = _current.device
        self._stream: Stream | None = None
        self._ticket = 0
        self._when: float | None = None  # when it was seen complete (for get_elapsed_time)

    def record(self, stream: Stream | None = None) -> None:
        """Capture ``stream``'s queue as it is now (the current stream when None)."""
        s = stream if stream is not None else get_current_stream()
        if s._device() != self.device_id:
            raise CUDARuntimeError(
                f"cudaErrorInvalidResourceHandle: an event of device {self.device_id} recorded "
                f"on a stream of device {s._device()} (the current device of this thread)"
                if s._is_null
                else f"cudaErrorInvalidResourceHandle: an event of device {self.device_id} "
                f"recorded on a stream of device {s._device()}"
            )
        if s._is_null:
            self._stream, self._ticket, self._when = s, s._mark(), None
        else:
            self._stream, self._ticket, self._when = s, s._submitted, None

    @property
    def done(self) -> bool:
        """Whether the work before the last ``record`` has run."""
        reached = self._stream is None or self._stream._reached(self._ticket)
        if reached and self._when is None:
            self._when = time.perf_counter()
        return reached

    def synchronize(self) -> None:
        """Block the host until :attr:`done`."""
        _note_sync("Event.synchronize")
        if self._stream is not None:
            self._stream._wait_for(self._ticket)
        if self._when is None:
            self._when = time.perf_counter()


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Milliseconds between two events (here: when the host saw each complete)."""
    start_event.synchronize()  # (CuPy needs both complete too)
    end_event.synchronize()
    return ((end_event._when or 0.0) - (start_event._when or 0.0)) * 1e3


class PinnedMemoryPointer(bytearray):
    """``cupy.cuda.alloc_pinned_memory``'s result: host memory with a buffer and ``ptr``."""

    ptr: int


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    """Page-locked host memory (here: a bytearray that never moves)."""
    mem = PinnedMemoryPointer(int(size))
    mem.ptr = ctypes.addressof((ctypes.c_char * max(int(size), 1)).from_buffer(mem)) if size else 0
    return mem


_MEMCPY_KINDS = {
    0: "HostToHost",
    1: "HostToDevice",
    2: "DeviceToHost",
    3: "DeviceToDevice",
    4: "Default",
}


def _memcpy_async(dst: int, src: int, size: int, kind: int, stream: Any) -> None:
    """``cudaMemcpyAsync``: the copy runs in ``stream``'s order (host addresses here)."""
    if int(kind) not in _MEMCPY_KINDS:
        raise CUDARuntimeError(f"cudaErrorInvalidMemcpyDirection: {kind}")
    n = int(size)
    if n == 0:
        return
    if not dst or not src:
        raise CUDARuntimeError("cudaErrorInvalidValue: null pointer in memcpyAsync")
    d, s_ = int(dst), int(src)
    _stream_for(stream)._enqueue(lambda: ctypes.memmove(d, s_, n))
