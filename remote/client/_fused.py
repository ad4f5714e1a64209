"""Fused ops a remote device supplies to tensorlib (the device kind's ``fused_ops``).

``tensorlib.optim.Adam.step`` hands a parameter group to :func:`adam`, which sends it as one
ADAM record per session instead of the ~13 op records (and their frees) per parameter that
the op-by-op update would issue; the server runs ``tensorlib.optim.adam_update`` on each
parameter, the function a local step runs, so the result is the same bits.

In the same way tensorlib's ``Linear`` sends its forward as one LINEAR record (not
transpose, matmul, add) and ``CrossEntropy`` its forward and backward as one record each
(not ~17 and ~10), and ``Relu`` its backward as one record (not greater, multiply): the
server runs ``linear_forward``, ``cross_entropy_forward``, ``cross_entropy_grad`` and
``relu_backward``, the functions the local ops run. These return None for what they do
not cover (other kinds or devices, dtypes whose results they do not infer), and tensorlib
then runs its own op-by-op code, which gives the same bits or the usual error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorlib.functional import cross_entropy_grad as _ce_grad
from tensorlib.functional import cross_entropy_targets
from tensorlib.optim import adam_update

from .._wire import ADAM, ADAM_FLAGS, ADAM_HYPER, ADAM_NUMBERS, LOSS_REDUCTIONS, OP_CODES, Ids
from ._array import RemoteArray

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["adam", "cross_entropy", "cross_entropy_grad", "linear", "linear_grad", "relu_grad"]

_LINEAR, _LINEAR_GRAD = OP_CODES["linear"], OP_CODES["linear_grad"]
_CROSS_ENTROPY = OP_CODES["cross_entropy"]
_CROSS_ENTROPY_GRAD = OP_CODES["cross_entropy_grad"]
_RELU_GRAD = OP_CODES["relu_grad"]
_I64 = (-(1 << 63), (1 << 63) - 1)

_HYPER_KEYS = frozenset(ADAM_HYPER)
# Parameters per ADAM record: a TUPLE holds at most 0xFFFF values.
_CHUNK = 4096


def adam(params: list[tuple[Any, Any, Any, Any, Any, int]], **hyper: Any) -> None:
    """Adam/AdamW on ``params`` (``(data, grad, exp_avg, exp_avg_sq, max_exp_avg_sq or None,
    step)`` each, remote arrays): one record per session. ``hyper`` are the keyword
    arguments of ``tensorlib.optim.adam_update`` (``lr``, ``beta1``, ...: ``ADAM_HYPER``).

    Hyper-parameters that are not plain Python numbers (a NumPy scalar from a schedule, say)
    would round differently once sent as numbers, so those groups take tensorlib's op-by-op
    update instead, as do arrays of other kinds.
    """
    if hyper.keys() != _HYPER_KEYS:  # tensorlib's adam_update and the record must agree
        raise TypeError(f"adam: hyper-parameters {sorted(hyper)}, expected {list(ADAM_HYPER)}")
    values = tuple(hyper[k] for k in ADAM_HYPER)
    plain = all(type(hyper[k]) in (int, float) for k in ADAM_NUMBERS)
    plain = plain and all(type(hyper[k]) is bool for k in ADAM_FLAGS)
    amsgrad = bool(params) and params[0][4] is not None
    by_session: dict[Session, list[tuple[Any, ...]]] = {}
    for p in params:
        sess = _session_of(p, amsgrad) if plain else None
        if sess is None:
            adam_update(*p, **hyper)
        else:
            by_session.setdefault(sess, []).append(p)
    for sess, entries in by_session.items():
        for i in range(0, len(entries), _CHUNK):
            chunk = entries[i : i + _CHUNK]
            ids = [Ids([e[k] for e in chunk]) for k in range(4)]
            vmax = Ids([e[4] for e in chunk] if amsgrad else [])
            steps = tuple(e[5] for e in chunk)
            sess.issue(ADAM, 0, 0, (*values, *ids, vmax, steps))


def _session_of(p: tuple[Any, ...], amsgrad: bool) -> Session | None:
    """The one session all of ``p``'s arrays live in (None: they do not, ``step`` is not a
    plain int, or ``max_exp_avg_sq`` is not there as ``amsgrad`` says)."""
    data = p[0]
    if type(data) is not RemoteArray or type(p[5]) is not int or (p[4] is not None) != amsgrad:
        return None
    sess = data._sess
    for x in p[1:5] if amsgrad else p[1:4]:
        if type(x) is not RemoteArray or x._sess is not sess:
            return None
    return sess


def linear(x: Any, w: Any, b: Any) -> RemoteArray | None:
    """``x @ w.T + b`` as one LINEAR record (tensorlib's ``Linear`` checked the shapes), or
    None unless all are arrays of one session with one floating dtype."""
    if type(x) is not RemoteArray or type(w) is not RemoteArray:
        return None
    sess, dt = x._sess, x.dtype
    if w._sess is not sess or w.dtype != dt or dt.kind != "f":
        return None
    if b is not None and (type(b) is not RemoteArray or b._sess is not sess or b.dtype != dt):
        return None
    return sess.issue_new(_LINEAR, (x, w, b), (*x.shape[:-1], w.shape[0]), dt)


def linear_grad(
    g: Any, x: Any, w: Any, need_x: bool, need_w: bool, need_b: bool
) -> tuple[RemoteArray | None, ...] | None:
    """``(gx, gw, gb)`` of ``Linear`` (None where not needed) as one LINEAR_GRAD record, or
    None unless all are arrays of one session with one floating dtype."""
    if type(g) is not RemoteArray or type(x) is not RemoteArray or type(w) is not RemoteArray:
        return None
    sess, dt = g._sess, g.dtype
    if x._sess is not sess or w._sess is not sess or x.dtype != dt or w.dtype != dt:
        return None
    if dt.kind != "f" or g.ndim == 0 or x.ndim == 0:
        return None
    grads = sess.issue_results(
        _LINEAR_GRAD,
        (g, x, w, need_x, need_w, need_b),
        (
            (x.shape, dt) if need_x else None,
            (w.shape, dt) if need_w else None,
            ((w.shape[0],), dt) if need_b else None,
        ),
    )
    return tuple(grads)


def cross_entropy(
    logits: Any, target: Any, reduction: str, ignore_index: Any, smoothing: Any
) -> tuple[RemoteArray, RemoteArray, Any] | None:
    """tensorlib's ``cross_entropy_forward`` as one record: ``(loss, probs, backward)``,
    the probabilities (``e / sum_e``) being what ``backward`` (:func:`cross_entropy_grad`)
    needs; None for what it does not cover (see the module doc)."""
    if type(logits) is not RemoteArray or type(target) is not RemoteArray:
        return None
    sess, dt = logits._sess, logits.dtype
    if target._sess is not sess or dt.kind != "f" or target.dtype.kind not in "iu":
        return None
    if logits.ndim != 2 or target.shape != logits.shape[:1] or reduction not in LOSS_REDUCTIONS:
        return None
    if type(ignore_index) is not int or not _I64[0] <= ignore_index <= _I64[1]:
        return None
    if type(smoothing) is not float:
        return None
    red = LOSS_REDUCTIONS.index(reduction)
    loss_shape = logits.shape[:1] if reduction == "none" else ()
    loss, probs = sess.issue_results(
        _CROSS_ENTROPY,
        (logits, target, red, ignore_index, smoothing),
        ((loss_shape, dt), (logits.shape, dt)),
    )
    assert loss is not None and probs is not None  # both are made
    return loss, probs, cross_entropy_grad


def cross_entropy_grad(
    probs: RemoteArray, target: RemoteArray, g: Any, ignore_index: int, smoothing: float,
    reduction: str,
) -> Any:  # fmt: skip
    """The logits' gradient (tensorlib's ``cross_entropy_grad``) as one record; op by op
    when ``g`` is not an array of ``probs``'s session (the same bits)."""
    sess = probs._sess
    if type(g) is RemoteArray and g._sess is sess:
        red = LOSS_REDUCTIONS.index(reduction)
        args = (probs, target, g, ignore_index, smoothing, red)
        return sess.issue_new(_CROSS_ENTROPY_GRAD, args, probs.shape, probs.dtype)
    valid, safe_t = cross_entropy_targets(probs._sess.xp, target, ignore_index)
    count = valid.sum() if reduction == "mean" else None
    return _ce_grad(probs.copy(), safe_t, valid, count, g, smoothing)


def relu_grad(g: Any, out: Any) -> RemoteArray | None:
    """ReLU's input gradient ``g * (out > 0)`` as one RELU_GRAD record (two ops otherwise),
    or None unless both are arrays of one session with one floating dtype and shape."""
    if type(g) is not RemoteArray or type(out) is not RemoteArray:
        return None
    sess, dt = g._sess, g.dtype
    if out._sess is not sess or out.dtype != dt or dt.kind != "f" or out.shape != g.shape:
        return None
    return sess.issue_new(_RELU_GRAD, (g, out), g.shape, dt)
