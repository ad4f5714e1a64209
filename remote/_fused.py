"""Fused updates a remote device supplies to tensorlib (the device kind's ``fused_ops``).

``tensorlib.optim.Adam.step`` hands a parameter group to :func:`adam`, which sends it as one
ADAM record per session instead of the ~13 op records (and their frees) per parameter that
the op-by-op update would issue; the server runs ``tensorlib.optim.adam_update`` on each
parameter, the function a local step runs, so the result is the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorlib.optim import adam_update

from ._array import RemoteArray
from ._wire import ADAM, Ids

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["adam"]

# Parameters per ADAM record: a TUPLE holds at most 0xFFFF values.
_CHUNK = 4096


def adam(
    params: list[tuple[Any, Any, Any, Any, Any, int]],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
) -> None:
    """Adam/AdamW on ``params`` (``(data, grad, exp_avg, exp_avg_sq, max_exp_avg_sq or None,
    step)`` each, remote arrays): one record per session.

    Hyper-parameters that are not plain Python numbers (a NumPy scalar from a schedule, say)
    would round differently once sent as numbers, so those groups take tensorlib's op-by-op
    update instead, as do arrays of other kinds.
    """
    hyper: dict[str, Any] = {
        "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        "decoupled": decoupled, "maximize": maximize,
    }  # fmt: skip
    plain = all(type(v) in (int, float) for v in (lr, beta1, beta2, eps, weight_decay))
    plain = plain and type(decoupled) is bool and type(maximize) is bool
    amsgrad = bool(params) and params[0][4] is not None
    by_session: dict[Session, list[tuple[Any, ...]]] = {}
    for p in params:
        sess = _session_of(p, amsgrad) if plain else None
        if sess is None:
            adam_update(*p, **hyper)
        else:
            by_session.setdefault(sess, []).append(p)
    values = (lr, beta1, beta2, eps, weight_decay, decoupled, maximize)
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
