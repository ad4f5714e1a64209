"""The movement, indexing and copy methods of ``RemoteArray`` (its class binds them).

Views: what NumPy returns as a view of an array (``reshape``, ``transpose``, ``squeeze``,
basic indexing, and the namespace's ``broadcast_to``, ``expand_dims``) is a view on the
server too, so writes through it reach the base; the result's ``base`` says so to
tensorlib's autodiff, which never sums in place into a view. Each result also knows whether
it is C-contiguous (``flags.c_contiguous``, as NumPy would say), computed here from its
source's. What a remote array *is* (its attributes, reads, arithmetic) is ``_array``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._records import FLAG_OUT
from .._wire import OP_CODES
from . import _infer

if TYPE_CHECKING:
    from ._array import RemoteArray

__all__ = [
    "astype", "copy", "fill", "flatten", "getitem", "ravel", "reshape", "setitem", "squeeze",
    "swapaxes", "transpose",
]  # fmt: skip

_RESHAPE, _TRANSPOSE, _SQUEEZE = OP_CODES["reshape"], OP_CODES["transpose"], OP_CODES["squeeze"]
_ASTYPE, _COPY, _FILL = OP_CODES["astype"], OP_CODES["copy"], OP_CODES["fill"]
_GETITEM, _SETITEM = OP_CODES["getitem"], OP_CODES["setitem"]
_memo_get, _memo_put = _infer.memo_get, _infer.memo_put


def reshape(self: RemoteArray, *shape: Any, order: str = "C") -> RemoteArray:
    if order != "C":
        raise ValueError("remote arrays reshape in C order only")
    if len(shape) == 1 and not isinstance(shape[0], int | np.integer):
        shape = tuple(shape[0])
    new = _infer.reshape_shape(self.size, tuple(int(s) for s in shape), self.shape)
    return self._sess.issue_new(
        _RESHAPE, (self, new), new, self.dtype, view_of=self, contig=self._contig
    )


def ravel(self: RemoteArray) -> RemoteArray:
    return self.reshape(-1)


def flatten(self: RemoteArray) -> RemoteArray:
    return self.copy().reshape(-1)


def transpose(self: RemoteArray, *axes: Any) -> RemoteArray:
    key = ("transpose", self.shape, axes, self._contig)
    hit = _memo_get(key)
    if hit is None:
        hit = _transpose_infer(self, axes)
        _memo_put(key, hit)
    perm, shape, contig = hit
    return self._sess.issue_new(
        _TRANSPOSE, (self, perm), shape, self.dtype, view_of=self, contig=contig
    )


def _transpose_infer(self: RemoteArray, axes: Any) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(the permutation, the result's shape, whether it is C-contiguous)."""
    if len(axes) == 1 and axes[0] is not None and not isinstance(axes[0], int | np.integer):
        axes = tuple(axes[0])
    if not axes or axes == (None,):
        axes = tuple(range(self.ndim - 1, -1, -1))
    perm = _infer.norm_axes(axes, self.ndim) or ()
    if sorted(perm) != list(range(self.ndim)):
        raise ValueError("axes don't match array")
    shape = tuple(self.shape[i] for i in perm)
    contig = self._contig and (
        sum(1 for d in self.shape if d != 1) <= 1 or perm == tuple(range(self.ndim))
    )
    return perm, shape, contig


def swapaxes(self: RemoteArray, a: int, b: int) -> RemoteArray:
    perm = list(range(self.ndim))
    ia = (_infer.norm_axes(a, self.ndim) or (0,))[0]
    ib = (_infer.norm_axes(b, self.ndim) or (0,))[0]
    perm[ia], perm[ib] = perm[ib], perm[ia]
    return self.transpose(tuple(perm))


def squeeze(self: RemoteArray, axis: Any = None) -> RemoteArray:
    axes = _infer.norm_axes(axis, self.ndim)
    if axes is None:
        axes = tuple(i for i, d in enumerate(self.shape) if d == 1)
    if any(self.shape[i] != 1 for i in axes):
        raise ValueError("cannot select an axis to squeeze out which has size not equal to one")
    shape = tuple(d for i, d in enumerate(self.shape) if i not in axes)
    return self._sess.issue_new(
        _SQUEEZE, (self, axes), shape, self.dtype, view_of=self, contig=self._contig
    )


def astype(
    self: RemoteArray, dtype: Any, copy: bool = True, casting: str = "unsafe"
) -> RemoteArray:
    dt = np.dtype(dtype)
    if dt == self.dtype and not copy:
        return self
    return self._sess.issue_new(_ASTYPE, (self, dt), self.shape, dt)


def copy(self: RemoteArray) -> RemoteArray:
    return self._sess.issue_new(_COPY, (self,), self.shape, self.dtype)


def fill(self: RemoteArray, value: Any) -> None:
    self._sess.issue(_FILL, FLAG_OUT, self._id, (value,))


def getitem(self: RemoteArray, index: Any) -> RemoteArray:
    index = self._sess.index_arg(index)
    shape, view = _infer.index_shape(self.shape, index)
    if view:
        return self._sess.issue_new(
            _GETITEM, (self, index), shape, self.dtype,
            view_of=self, contig=self._contig and _contiguous_index(index, self.ndim),
        )  # fmt: skip
    return self._sess.issue_new(_GETITEM, (self, index), shape, self.dtype)


def setitem(self: RemoteArray, index: Any, value: Any) -> None:
    sess = self._sess
    index = sess.index_arg(index)
    target, _ = _infer.index_shape(self.shape, index)
    vshape = sess.operand_shape(value)
    if vshape is None:
        raise TypeError(f"cannot assign a {type(value).__name__} to a remote array")
    if _infer.broadcast(target, vshape) != target:
        raise ValueError(f"could not broadcast input array from shape {vshape} into shape {target}")
    sess.issue(_SETITEM, FLAG_OUT, self._id, (index, value))


def _contiguous_index(index: Any, ndim: int) -> bool:
    """Whether basic indexing with ``index`` keeps a C-contiguous array contiguous: leading
    integers, then at most one step-1 slice, then whole axes."""
    parts = index if type(index) is tuple else (index,)
    seen_slice = False
    for p in parts:
        if p is Ellipsis or p is None:
            return False
        if type(p) is slice:
            whole = p == slice(None)
            if seen_slice and not whole:
                return False
            if not whole and p.step not in (None, 1):
                return False
            seen_slice = seen_slice or not whole
        elif seen_slice:
            return False
    return True
