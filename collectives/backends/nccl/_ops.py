"""The nccl backend's per-op enqueue functions, ``_do_<op>(req, work)``, on the group's stream.

Each puts one call on the group's CUDA stream (all-to-all as ``ncclSend``/``ncclRecv`` pairs
between ``ncclGroupStart``/``End``) after staging NumPy arrays through the GPU, and records in
the :class:`NcclWork` what must stay alive until the stream is done and what to copy back. A
non-blocking communicator may answer ``ncclInProgress``: :meth:`NcclOps._settle` then waits,
within the call's deadline, until NCCL finished enqueuing it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..._backend import GroupInfo, Request
from ..._errors import CollectiveError, CollectiveTimeoutError, PeerFailureError
from ..._types import ReduceOp
from . import _lib as nccl_lib
from ._cuda import H2D, Cuda
from ._work import NcclWork

__all__ = ["NcclOps", "error_from"]


def error_from(
    info: GroupInfo, exc: nccl_lib.NcclError, op: str, seq: int | None = None
) -> CollectiveError:
    """The collective error for an NCCL failure of call ``op`` #``seq``."""
    if exc.code == nccl_lib.TIMEOUT:
        cls: type[CollectiveError] = CollectiveTimeoutError
    elif exc.code == nccl_lib.REMOTE_ERROR:
        cls = PeerFailureError
    else:
        cls = CollectiveError
    return info.error(cls, op, seq, str(exc), cause=exc)


class NcclOps:
    """The enqueue half of :class:`~collectives.backends.nccl.NcclBackend` (a mixin)."""

    # Set by the backend.
    info: GroupInfo
    lib: Any
    comm: int
    cuda: Cuda
    check: bool
    _scratch: Any
    _dtype_cache: dict[Any, int]

    # ------------------------------------------------------------------ helpers
    def _dtype(self, dtype: Any) -> int:
        code = self._dtype_cache.get(dtype)
        if code is None:
            code = self._dtype_cache[dtype] = nccl_lib.nccl_dtype(dtype)
        return code

    def _device_array(self, work: NcclWork, arr: Any, upload: bool, download: bool) -> Any:
        """The device array the NCCL call uses for ``arr`` (a NumPy array is staged)."""
        if not isinstance(arr, np.ndarray):
            work.refs.append(arr)
            return arr
        dev = self.cuda.empty(arr.shape, arr.dtype)
        if upload and arr.size:
            # Through pinned memory: a copy from pageable memory may wait for the stream.
            mem, host = self.cuda.pinned(arr.nbytes)
            host[...] = arr.reshape(-1).view(np.uint8)
            self.cuda.memcpy(int(dev.data.ptr), int(mem.ptr), arr.nbytes, H2D, self.cuda.stream)
            work.refs.append(mem)
        work.refs.append(dev)
        work.host_sync = True
        if download and arr.size:
            work.writebacks.append((dev, arr))
        return dev

    def _settle(self, rc: int, call: str, req: Request) -> None:
        """After a call returned ncclInProgress (non-blocking communicator): wait until NCCL
        finished enqueuing it, within the collective's deadline."""
        if rc == nccl_lib.SUCCESS:
            return
        pause = 0.0001
        while True:
            state = self.lib.comm_get_async_error(self.comm)
            if state == nccl_lib.SUCCESS:
                return
            if state != nccl_lib.IN_PROGRESS:
                err = self.lib.error(state, call, self.comm)
                raise error_from(self.info, err, req.op, req.seq)
            if time.monotonic() >= req.deadline:
                raise self.info.error(
                    CollectiveTimeoutError,
                    req.op,
                    req.seq,
                    f"NCCL did not finish enqueuing {call} within {self.info.timeout:g} s "
                    "(peers not connecting?)",
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _reduction(self, req: Request) -> int:
        op = req.reduce_op
        if op is None:  # the group sets it for every reducing op
            raise ValueError(f"{req.op} #{req.seq} has no reduce op")
        return nccl_lib.nccl_op(op)

    # ------------------------------------------------------------------ the ops
    def _do_barrier(self, req: Request, work: NcclWork) -> None:
        if self.check:
            return  # the signature all-gather is the barrier
        p = int(self._scratch.data.ptr)
        rc = self.lib.all_reduce(
            p, p, 1, nccl_lib.INT32, nccl_lib.nccl_op(ReduceOp.SUM), self.comm, self.cuda.stream.ptr
        )
        self._settle(rc, "ncclAllReduce", req)

    def _do_all_reduce(self, req: Request, work: NcclWork) -> None:
        a = self._device_array(work, req.array, True, True)
        if a.size:
            p = int(a.data.ptr)
            rc = self.lib.all_reduce(
                p, p, a.size, self._dtype(a.dtype), self._reduction(req), self.comm, self._sptr
            )
            self._settle(rc, "ncclAllReduce", req)

    def _do_broadcast(self, req: Request, work: NcclWork) -> None:
        root = req.root == self.info.rank
        a = self._device_array(work, req.array, root, not root)
        if a.size:
            p = int(a.data.ptr)
            rc = self.lib.broadcast(
                p, p, a.size, self._dtype(a.dtype), req.root, self.comm, self._sptr
            )
            self._settle(rc, "ncclBroadcast", req)

    def _do_reduce(self, req: Request, work: NcclWork) -> None:
        root = req.root == self.info.rank
        a = self._device_array(work, req.array, True, root)
        if a.size:
            p = int(a.data.ptr)
            dt, rop = self._dtype(a.dtype), self._reduction(req)
            rc = self.lib.reduce(p, p, a.size, dt, rop, req.root, self.comm, self._sptr)
            self._settle(rc, "ncclReduce", req)

    def _do_all_gather(self, req: Request, work: NcclWork) -> None:
        a = self._device_array(work, req.array, True, False)
        o = self._device_array(work, req.out, False, True)
        if a.size:
            pa, po = int(a.data.ptr), int(o.data.ptr)
            rc = self.lib.all_gather(pa, po, a.size, self._dtype(a.dtype), self.comm, self._sptr)
            self._settle(rc, "ncclAllGather", req)

    def _do_reduce_scatter(self, req: Request, work: NcclWork) -> None:
        a = self._device_array(work, req.array, True, False)
        o = self._device_array(work, req.out, False, True)
        if o.size:
            pa, po = int(a.data.ptr), int(o.data.ptr)
            dt, rop = self._dtype(a.dtype), self._reduction(req)
            rc = self.lib.reduce_scatter(pa, po, o.size, dt, rop, self.comm, self._sptr)
            self._settle(rc, "ncclReduceScatter", req)

    def _do_all_to_all(self, req: Request, work: NcclWork) -> None:
        a = self._device_array(work, req.array, True, False)
        o = self._device_array(work, req.out, False, True)
        n = self.info.size
        block = a.size // n
        if not block:
            return
        lib, comm, sptr, dt = self.lib, self.comm, self._sptr, self._dtype(a.dtype)
        step = block * a.itemsize
        pa, po = int(a.data.ptr), int(o.data.ptr)
        lib.group_start()
        try:
            for j in range(n):
                lib.send(pa + j * step, block, dt, j, comm, sptr)
                lib.recv(po + j * step, block, dt, j, comm, sptr)
        finally:
            rc = lib.group_end()
        self._settle(rc, "ncclGroupEnd", req)

    def _do_send(self, req: Request, work: NcclWork) -> None:
        self._point_to_point(req, work, self.lib.send, "ncclSend", outgoing=True)

    def _do_recv(self, req: Request, work: NcclWork) -> None:
        self._point_to_point(req, work, self.lib.recv, "ncclRecv", outgoing=False)

    def _point_to_point(
        self, req: Request, work: NcclWork, call: Any, name: str, outgoing: bool
    ) -> None:
        a = self._device_array(work, req.array, outgoing, not outgoing)
        if a.size:
            p, dt = int(a.data.ptr), self._dtype(a.dtype)
            self._settle(call(p, a.size, dt, req.peer, self.comm, self._sptr), name, req)

    @property
    def _sptr(self) -> int:
        return int(self.cuda.stream.ptr)
