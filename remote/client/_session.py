"""The client's side of one session: one connection to one device of a server.

Ops become records (``issue``) in a buffer that goes out as one frame when it holds enough
records or bytes, or when a read or a synchronize needs the answer (``read``, ``sync``): only
those wait, and they count as round trips. The records' order on the wire is the order the
server runs them in; ``seq`` numbers them from 0 on both ends, so an error the server
reports by ``seq`` is matched here with the call site recorded when the op was issued.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

import tensorlib

from .._errors import RemoteConnectionError, RemoteError, RemoteOpError
from .._records import (
    CLOSING,
    FLAG_OUT,
    OP_ERROR,
    Reply,
    drop_record,
    parse_reply,
    record,
    records_frame,
    reply_array,
)
from .._wire import HEARTBEAT, OPS, PIECE_BYTES, READ, SYNC, ProtocolError
from ._array import RemoteArray, code

if TYPE_CHECKING:
    from .._conn import Framed
    from ._client import ServerInfo

__all__ = ["Session"]

# A frame goes out once it holds this many records or bytes (or at a read).
FLUSH_RECORDS = 64
# After a wait the frames start small and double (2, 4, 8, ... up to FLUSH_RECORDS): the
# server, idle since its reply, starts on the first records while this process builds the
# rest, and stays fed while it does; a long stream still goes out in large frames. For the
# digits MLP (16 records a step: frames of 2, 4, 8 and the rest) this measured ~6% faster a
# step than one frame of 8 and then the rest (A/B, alternated runs).
FLUSH_FIRST = 2
FLUSH_BYTES = 1 << 20
# Frames in these directories are not call sites (remote's whole package, not only client/).
_LIB_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep
    for m in (tensorlib, sys.modules[(__package__ or "").rpartition(".")[0]])
)
_is_lib: dict[str, bool] = {}  # by file name


def _describe_site(site: tuple[Any, int] | None) -> str:
    """``file:line in function`` of a site as ``issue`` records it (code, bytecode offset):
    the line is looked up only here, when an op failed."""
    if site is None:
        return "?"
    c, lasti = site
    line = next((ln for start, end, ln in c.co_lines() if start <= lasti < end), None)
    return f"{c.co_filename}:{line if line is not None else '?'} in {c.co_name}"


def _closing(reply: Reply) -> str:
    return f"the server closed the session: {reply.error[2] if reply.error else '?'}"


def _pieces(shape: tuple[int, ...], itemsize: int) -> Iterator[tuple[Any, ...]]:
    """Indices that cover an array of ``shape`` in C order, each at most ``PIECE_BYTES``
    (or one element): runs of rows, or pieces of each row where a row is larger."""
    row = math.prod(shape[1:]) * itemsize
    if row <= PIECE_BYTES or len(shape) == 1:
        k = max(1, PIECE_BYTES // max(row, 1))
        for i in range(0, shape[0], k):
            yield (slice(i, i + k),)
    else:
        for i in range(shape[0]):
            for rest in _pieces(shape[1:], itemsize):
                yield (i, *rest)


class Session:
    """One device of one server, as this process uses it (see the module doc).

    Attributes:
        device: the tensorlib device (``remote://HOST:PORT/INDEX``).
        drops: ids of handles that died, sent as one DROP record ahead of the next record
            (after a read, which allocates nothing: see ``_put_drops``).
    """

    def __init__(self, server: ServerInfo, index: int, device: Any) -> None:
        from ._namespace import RemoteNamespace

        self.server = server
        self.index = index
        self.device = device
        self.xp = RemoteNamespace(self)
        self.drops: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()
        self._framed: Framed | None = None
        self._dead: RemoteConnectionError | None = None
        self._parts: list[bytes] = []
        self._nbuf = 0
        self._bytes = 0
        self._waits = 0  # READ and SYNC records in the buffer
        self._flush_at = FLUSH_FIRST  # records that make a frame go out
        self._ids = itertools.count(1)
        self._reqs = itertools.count(1)
        self._seq = 0  # records sent so far
        self._sites: list[tuple[Any, int] | None] = []  # of records from _site_base on
        self._site_base = 0
        # The sites before the last reply, kept one reply longer: an update the server ran
        # after answering a READ reports its failure at the next reply (``Worker._adam``).
        self._old_sites: list[tuple[Any, int] | None] = []
        self._old_base = 0
        self._failed: dict[int, str] = {}  # seq -> where that failed op was issued
        self.round_trips = 0
        self.ops = 0

    # ------------------------------------------------------------------ issuing
    def issue(self, op: int, flags: int, out: int, args: tuple[Any, ...]) -> None:
        """Queue one record (its result id ``out`` is the caller's).

        Every op runs this, so it is written for speed: the call site is the first frame
        outside tensorlib and remote, kept as code and bytecode offset (its line is looked
        up only if the op fails); ``_records.record`` encodes the record.
        """
        f: Any = sys._getframe(1)
        is_lib = _is_lib
        while f is not None:
            name = f.f_code.co_filename  # a str: its hash is cached (a code object's is not)
            lib = is_lib.get(name)
            if lib is None:
                lib = is_lib[name] = name.startswith(_LIB_DIRS)
            if not lib:
                break
            f = f.f_back
        site = None if f is None else (f.f_code, f.f_lasti)
        parts = record(op, flags, out, args)
        with self._lock:
            if self._dead is not None or self._framed is None:
                self._append(parts, site, drops_first=True)
            else:  # _append, inlined
                if self.drops:
                    self._put_drops()
                self._parts += parts
                self._nbuf += 1
                self._bytes += len(parts[-1])  # an array's data comes last
                self._sites.append(site)
            self.ops += 1
            if self._nbuf >= self._flush_at or self._bytes >= FLUSH_BYTES:
                self._flush()

    def issue_new(
        self,
        op: int,
        args: tuple[Any, ...],
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        view_of: RemoteArray | None = None,
        contig: bool = True,
    ) -> RemoteArray:
        """Queue a record whose result is a new array, and return its handle."""
        a = object.__new__(RemoteArray)
        a._sess = self
        a._id = next(self._ids)
        a.shape = shape
        a.dtype = dtype
        a.ndim = len(shape)
        a.base = None if view_of is None else (view_of if view_of.base is None else view_of.base)
        a._contig = contig
        self.issue(op, 0, a._id, args)
        return a

    def issue_results(
        self,
        op: int,
        args: tuple[Any, ...],
        results: tuple[tuple[tuple[int, ...], Any] | None, ...],
    ) -> list[RemoteArray | None]:
        """Queue a record that makes several new arrays (``_wire.OUTPUTS``), one per
        ``(shape, dtype)`` of ``results``, on consecutive ids; return their handles (None
        for a None entry: a result the server does not make)."""
        ids, n = self._ids, len(results)
        first, k = next(ids), 1
        while k < n:  # consecutive even if another thread takes ids meanwhile
            i = next(ids)
            first, k = (first, k + 1) if i == first + k else (i, 1)
        out: list[RemoteArray | None] = []
        for k, res in enumerate(results):
            if res is None:
                out.append(None)
                continue
            shape, dtype = res
            a = object.__new__(RemoteArray)
            a._sess, a._id, a.shape, a.dtype, a.ndim = self, first + k, shape, dtype, len(shape)
            a.base, a._contig = None, True
            out.append(a)
        self.issue(op, 0, first, args)
        return out

    def _append(
        self, parts: list[bytes], site: tuple[Any, int] | None, drops_first: bool = False
    ) -> None:
        if self._dead is not None:
            raise RemoteConnectionError(str(self._dead))
        if self._framed is None:
            self._connect()
        if drops_first and self.drops:
            self._put_drops()
        self._parts.extend(parts)
        self._nbuf += 1
        self._bytes += len(parts[-1])
        self._sites.append(site)

    def _connect(self) -> None:
        from ._client import dial

        self._framed = dial(self.server, self.index)

    def _put_drops(self) -> None:
        """Queue one DROP record for every handle that died so far (caller holds the lock).

        ``__del__`` only appends to ``drops`` (it may run on any thread, or inside this
        lock), so the ids are taken here, in stream order: a record issued after a handle
        died runs after its memory is freed on the server, as a local array's would be (a
        loop that drops each round's array before making the next one fits in one array's
        memory). A read does not take them first: it allocates nothing, and an ADAM record
        must stay right before the READ for the server to answer before it updates
        (``Worker._adam``); the flush sends them after the read.
        """
        drops = self.drops
        self._parts += drop_record([drops.popleft() for _ in range(len(drops))])
        self._nbuf += 1
        self._sites.append(None)

    def _flush(self) -> None:
        if self.drops:
            self._put_drops()
        if not self._nbuf or self._framed is None:
            return
        payload = records_frame(self._waits, self._nbuf, self._parts)
        self._waits = 0
        self._flush_at = min(2 * self._flush_at, FLUSH_RECORDS)
        self._seq += self._nbuf
        self._parts.clear()
        self._nbuf = 0
        self._bytes = 0
        try:
            self._framed.send(payload)
        except OSError as exc:
            why = self._closing_reason() or f"sending to it failed ({type(exc).__name__}: {exc})"
            raise self._die(why) from exc

    def flush(self) -> None:
        """Send what is buffered (drops included) without waiting for anything."""
        with self._lock:
            if self._dead is None and self._framed is not None:
                self._flush()

    # ------------------------------------------------------------------ waiting
    def read(self, a: RemoteArray) -> np.ndarray[Any, Any]:
        """The data of ``a`` (a round trip)."""
        if a._sess is not self:
            raise ValueError(f"array of {a._sess.device} read through {self.device}")
        with self._lock:
            req = next(self._reqs)
            self._append(record(READ, 0, req, (a,)), None)
            self._waits += 1
            rest = self._round_trip(req).rest
            try:
                out = reply_array(rest)
            except ProtocolError as exc:
                raise self._die(f"it sent a malformed reply ({exc})") from exc
        if out.shape != a.shape or out.dtype != a.dtype:
            raise RemoteError(
                f"{self.device}: the server computed shape {out.shape} {out.dtype} where the "
                f"client inferred {a.shape} {a.dtype} (a bug in remote's inference rules)"
            )
        return out

    def sync(self) -> None:
        """Wait until the server ran every record sent so far (a round trip)."""
        with self._lock:
            req = next(self._reqs)
            self._append(record(SYNC, 0, req, ()), None)
            self._waits += 1
            self._round_trip(req)

    def _round_trip(self, req: int) -> Reply:
        self._flush()
        self._flush_at = FLUSH_FIRST
        self.round_trips += 1
        framed = self._framed
        assert framed is not None
        timeout = self.server.timeout
        try:
            framed.sock.settimeout(timeout)
            while True:
                payload = framed.recv()
                if payload[0] == HEARTBEAT:
                    continue
                reply = parse_reply(payload)
                if reply.request == CLOSING:
                    raise self._die(_closing(reply))
                if reply.request != req:
                    raise ProtocolError(f"a reply to request {reply.request}, waiting for {req}")
                error = self._take_reply(reply)
                if error is not None:
                    raise error
                return reply
        except TimeoutError as exc:
            raise self._die(f"no reply and no heartbeat for {timeout:g} s") from exc
        except (OSError, EOFError, ProtocolError) as exc:
            raise self._die(f"{type(exc).__name__}: {exc}") from exc
        finally:
            if self._dead is None:
                try:
                    framed.sock.settimeout(None)
                except OSError:
                    pass

    def _take_reply(self, reply: Reply) -> RemoteOpError | None:
        """Note the sites of every op the reply says failed; the error to raise, if any."""
        for seq in reply.failed:
            i, j = seq - self._site_base, seq - self._old_base
            if 0 <= i < len(self._sites):
                self._failed[seq] = _describe_site(self._sites[i])
            elif 0 <= j < len(self._old_sites):
                self._failed[seq] = _describe_site(self._old_sites[j])
        self._old_base, self._old_sites = self._site_base, self._sites
        self._site_base, self._sites = self._seq, []
        if reply.error is None:
            return None
        seq, op, message = reply.error
        if reply.status == OP_ERROR:
            name = OPS[op] if op < len(OPS) else f"op {op}"
            site = self._failed.get(seq, "?")
            return RemoteOpError(
                f"remote op {name!r} failed on {self.device}: {message} (issued at {site})",
                op=name,
                site=site,
            )
        return RemoteOpError(f"{self.device}: the server refused a request: {message}")

    def _closing_reason(self) -> str | None:
        """Why the server ended the session, if it said so (a send to it failed: its REPLY to
        request ``CLOSING`` may be waiting on the socket)."""
        framed = self._framed
        if framed is None:
            return None
        try:
            framed.sock.settimeout(1.0)
            while True:
                payload = framed.recv()
                if payload[0] != HEARTBEAT:
                    reply = parse_reply(payload)
                    return _closing(reply) if reply.request == CLOSING else None
        except (OSError, EOFError, ProtocolError, IndexError):
            return None

    def _die(self, why: str) -> RemoteConnectionError:
        err = RemoteConnectionError(
            f"lost the connection to remote server {self.server.where} "
            f"(device {self.device}): {why}"
        )
        self._dead = err
        if self._framed is not None:
            self._framed.close()
        return err

    # ------------------------------------------------------------------ arguments
    def upload(self, host: np.ndarray[Any, Any]) -> RemoteArray:
        """A copy of the NumPy array ``host`` on this device.

        One larger than ``PIECE_BYTES`` goes up in pieces (``_records``): the server makes
        the array first, so a session's memory limit refuses it before any of it is held,
        and no frame carries more than a piece of it.
        """
        host = np.asarray(host)
        if host.nbytes <= PIECE_BYTES:
            return self.issue_new(code("upload"), (host,), tuple(host.shape), host.dtype)
        dt = host.dtype.newbyteorder("=") if host.dtype.byteorder == ">" else host.dtype
        shape = tuple(host.shape)
        out = self.issue_new(code("upload"), (shape, dt), shape, dt)
        for index in _pieces(shape, dt.itemsize):
            self.issue(code("setitem"), FLAG_OUT, out._id, (index, host[index]))
        return out

    def index_arg(self, index: Any) -> Any:
        """``index`` ready for a record: lists as arrays, this device's boolean masks read
        (the result's shape depends on their values), handles of other devices refused."""
        if type(index) is tuple:
            return tuple(self._index_part(p) for p in index)
        return self._index_part(index)

    def _index_part(self, p: Any) -> Any:
        if type(p) is RemoteArray:
            if p._sess is not self:
                raise ValueError(f"an index on {p._sess.device} for an array on {self.device}")
            if p.dtype.kind == "b":
                return p.get()
            if p.dtype.kind not in "iu":
                raise IndexError("arrays used as indices must be of integer (or boolean) type")
            return p
        if isinstance(p, list):
            return np.asarray(p)
        if hasattr(p, "_data") and hasattr(p, "requires_grad"):  # a tensorlib Tensor
            return self._index_part(p._data)
        return p

    def operand_shape(self, v: Any) -> tuple[int, ...] | None:
        """The shape of an operand that may go in a record (None: it may not)."""
        if type(v) is RemoteArray:
            if v._sess is not self:
                raise ValueError(f"an array on {v._sess.device} used with {self.device}")
            return v.shape
        if type(v) in (bool, int, float):
            return ()
        if isinstance(v, np.ndarray | np.generic):
            return tuple(np.shape(v))
        return None

    def close(self) -> None:
        """Send what is left and close the connection (the server frees the session)."""
        with self._lock:
            if self._framed is not None and self._dead is None:
                try:
                    self._flush()
                except RemoteError:
                    pass
                self._framed.close()
            self._dead = RemoteConnectionError(f"{self.device}: the session was closed")

    def stats(self) -> dict[str, int]:
        framed = self._framed
        return {
            "round_trips": self.round_trips,
            "ops": self.ops,
            "bytes_sent": framed.sent if framed is not None else 0,
            "bytes_received": framed.received if framed is not None else 0,
        }
