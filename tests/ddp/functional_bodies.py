"""Rank bodies for ``ddp.functional``: gradients against finite differences, a
model-parallel MLP against the unsplit model, and a replicated layer before a split, trained.

Every rank builds every rank's inputs from the seed, so each can compute on its own the whole
job's objective (the sum of every rank's loss, the convention of ddp.functional) with NumPy,
and difference it. The MLP splits its first Linear by columns and its second by rows across
the ranks (Megatron's layout) and must match, in values and gradients, the same MLP computed
whole in one process. The training body runs a replicated Linear, ``scatter``, then one Linear
per rank, and the same model in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import ddp
import ddp.functional as F
import ddp.idist as idist
import tensorlib as tl
from tensorlib import nn, optim

SHAPE = (4, 8)  # both axes divisible by the world sizes 1, 2 and 4


def _slice(a: np.ndarray, axis: int, i: int, n: int) -> np.ndarray:
    k = a.shape[axis] // n
    return np.take(a, range(i * k, (i + 1) * k), axis=axis)


def _outputs(op: str, xs: list[np.ndarray], axis: int, src: int) -> list[np.ndarray]:
    """What every rank's op returns, computed in one process from every rank's input."""
    n = len(xs)
    total = np.sum(xs, axis=0)
    if op == "all_reduce":
        return [total] * n
    if op == "all_reduce_avg":
        return [total / n] * n
    if op in ("all_gather", "gather"):
        return [np.concatenate(xs, axis=axis)] * n
    if op == "reduce_scatter":
        return [_slice(total, axis, s, n) for s in range(n)]
    if op == "scatter":  # x alike on every rank: one variable (perturbed on all at once)
        return [_slice(xs[0], axis, s, n) for s in range(n)]
    if op == "scatter_src":
        return [_slice(xs[src], axis, s, n) for s in range(n)]
    raise ValueError(op)


def _distributed(op: str, x: tl.Tensor, axis: int, src: int) -> tl.Tensor:
    if op == "all_reduce":
        return F.all_reduce(x)
    if op == "all_reduce_avg":
        return F.all_reduce(x, op="avg")
    if op == "scatter_src":
        return F.scatter(x, axis=axis, src=src)
    fn: Callable[..., tl.Tensor] = getattr(F, op)
    return fn(x, axis=axis)


def op_gradient(op: str, axis: int, seed: int) -> dict[str, Any]:
    """Rank r's output and gradient against the one-process computation and its central
    finite differences (float64).

    ``scatter``'s replicated input is one variable: differenced on every rank at once, its
    gradient is every slice's, on every rank. ``scatter_src`` reads the last rank's ``x`` only
    (the others hold other values), so only that rank's gradient is not zero.
    """
    ws, rank = idist.get_world_size(), idist.get_rank()
    rngs = [np.random.default_rng([seed, s]) for s in range(ws)]
    xs = [g.standard_normal(SHAPE) for g in rngs]
    if op == "scatter":
        xs = [xs[0]] * ws  # scatter's input is alike on every rank
    src = ws - 1
    outs = _outputs(op, xs, axis, src)
    ws_out = [
        np.random.default_rng([seed, 100 + s]).standard_normal(o.shape) for s, o in enumerate(outs)
    ]

    def objective(inputs: list[np.ndarray]) -> float:
        ys = _outputs(op, inputs, axis, src)
        return float(sum(np.sum(np.tanh(y) * w) for y, w in zip(ys, ws_out, strict=True)))

    x = tl.tensor(xs[rank].copy(), requires_grad=True)
    y = _distributed(op, x, axis, src)
    loss = (y.tanh() * tl.tensor(ws_out[rank])).sum()
    loss.backward()
    assert x.grad is not None
    fd = np.zeros(SHAPE)
    eps = 1e-6
    for idx in np.ndindex(*SHAPE):
        plus = [a.copy() for a in xs]
        minus = [a.copy() for a in xs]
        for k in range(ws) if op == "scatter" else [rank]:
            plus[k][idx] += eps
            minus[k][idx] -= eps
        fd[idx] = (objective(plus) - objective(minus)) / (2 * eps)
    return {
        "value_err": float(np.max(np.abs(y.numpy() - outs[rank]))),
        "grad_err": float(np.max(np.abs(x.grad.numpy() - fd))),
        "grad_norm": float(np.linalg.norm(fd)),
        "shape": list(y.shape),
    }


def mlp(seed: int, variant: str) -> dict[str, float]:
    """Column-split then row-split Linear: values and gradients against the whole MLP.

    ``variant`` ``"all_reduce"``: the partial outputs are summed on every rank, then each rank
    keeps its rows of the batch (``scatter``) for its loss; ``"reduce_scatter"``: both in one
    op. The replicated output bias gets each rank's part of its gradient and is summed with
    ``sync_gradients(op="sum")``; the replicated input's gradient likewise with all_reduce.
    """
    ws, rank = idist.get_world_size(), idist.get_rank()
    n, d_in, hidden, d_out = 8, 5, 8, 3
    g = np.random.default_rng(seed)
    x, t = g.standard_normal((n, d_in)), g.standard_normal((n, d_out))
    w1, b1 = g.standard_normal((d_in, hidden)), g.standard_normal(hidden)
    w2, b2 = g.standard_normal((hidden, d_out)), g.standard_normal(d_out)

    def leaf(a: np.ndarray) -> tl.Tensor:
        return tl.tensor(np.ascontiguousarray(a), requires_grad=True)

    # The whole model, in this process.
    ref = [leaf(a) for a in (x, w1, b1, w2, b2)]
    rx, rw1, rb1, rw2, rb2 = ref
    ry = ((rx @ rw1 + rb1).relu() @ rw2) + rb2
    ref_loss = ((ry - tl.tensor(t)) ** 2).sum() * (1.0 / n)
    ref_loss.backward()

    cols = slice(rank * hidden // ws, (rank + 1) * hidden // ws)
    rows = slice(rank * n // ws, (rank + 1) * n // ws)
    sx, sw1, sb1, sw2, sb2 = leaf(x), leaf(w1[:, cols]), leaf(b1[cols]), leaf(w2[cols]), leaf(b2)
    z = (sx @ sw1 + sb1).relu() @ sw2  # this rank's partial sum of the output
    if variant == "all_reduce":
        # src=: all_reduce's backward sums the ranks' gradients, so they go to one rank.
        y = F.scatter(F.all_reduce(z) + sb2, axis=0, src=0)
    else:
        y = F.reduce_scatter(z, axis=0) + sb2
    loss = ((y - tl.tensor(t[rows])) ** 2).sum() * (1.0 / n)
    loss.backward()
    ddp.sync_gradients([sb2], op="sum")
    assert sx.grad is not None and sw1.grad is not None and sb1.grad is not None
    assert sw2.grad is not None and sb2.grad is not None
    assert rx.grad is not None and rw1.grad is not None and rb1.grad is not None
    assert rw2.grad is not None and rb2.grad is not None
    x_grad = idist.all_reduce(tl.tensor(sx.grad.numpy().copy()))

    def err(a: Any, b: Any) -> float:
        return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))

    return {
        "output": err(y.numpy(), ry.numpy()[rows]),
        "loss": abs(idist.all_reduce(float(loss.item())) - float(ref_loss.item())),
        "w1": err(sw1.grad.numpy(), rw1.grad.numpy()[:, cols]),
        "b1": err(sb1.grad.numpy(), rb1.grad.numpy()[cols]),
        "w2": err(sw2.grad.numpy(), rw2.grad.numpy()[cols]),
        "b2": err(sb2.grad.numpy(), rb2.grad.numpy()),
        "x": err(x_grad.numpy(), rx.grad.numpy()),
        "scale": float(np.max(np.abs(rw1.grad.numpy()))),
    }


def replicated_then_split(seed: int, steps: int) -> dict[str, Any]:
    """A replicated Linear, ``scatter`` of its output's features, one Linear per rank; SGD
    for ``steps`` steps; and the same model in one process (every rank's Linear applied to
    its slice, the ranks' losses summed).

    Returns this rank's replicated Linear and its own Linear, each trained both ways (as
    lists: float32 values are exact as Python floats, so equality stays bitwise).
    """
    ws, rank = idist.get_world_size(), idist.get_rank()
    n, d_in, hidden, d_out = 6, 5, 12, 3  # 12: divisible by the world sizes 1 to 4
    part = hidden // ws

    def build(r: int | None) -> nn.Linear:  # None: the replicated Linear
        gen = tl.Generator(seed if r is None else seed * 10 + 1 + r)
        return nn.Linear(*((d_in, hidden) if r is None else (part, d_out)), generator=gen)

    shared, mine = build(None), build(rank)
    start = shared.weight.numpy().tolist()
    ref_shared, heads = build(None), [build(r) for r in range(ws)]
    opt = optim.SGD([*shared.parameters(), *mine.parameters()], lr=0.1)
    ref_params = [*ref_shared.parameters(), *(p for h in heads for p in h.parameters())]
    ref_opt = optim.SGD(ref_params, lr=0.1)
    data = np.random.default_rng(seed + 1)
    for _ in range(steps):
        x = data.standard_normal((n, d_in)).astype(np.float32)  # alike on every rank
        ts = [data.standard_normal((n, d_out)).astype(np.float32) for _ in range(ws)]
        h = F.scatter(shared(tl.tensor(x)), axis=1)
        loss = ((mine(h) - tl.tensor(ts[rank])) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_h = ref_shared(tl.tensor(x))
        ref_loss = tl.tensor(np.float32(0.0))
        for r, head in enumerate(heads):
            out = head(ref_h[:, r * part : (r + 1) * part])
            ref_loss = ref_loss + ((out - tl.tensor(ts[r])) ** 2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    return {
        "start": start,
        "shared": [p.numpy().tolist() for p in shared.parameters()],
        "ref_shared": [p.numpy().tolist() for p in ref_shared.parameters()],
        "mine": [p.numpy().tolist() for p in mine.parameters()],
        "ref_mine": [p.numpy().tolist() for p in heads[rank].parameters()],
    }


def scatter_src_errors() -> list[str]:
    """What ``scatter`` says of a ``src`` that is not a member, or not a rank."""
    x = tl.tensor(np.ones((4, 12)))
    seen = []
    for src in (idist.get_world_size(), "0"):
        try:
            F.scatter(x, axis=1, src=src)  # type: ignore[arg-type]  # a wrong type on purpose
        except (TypeError, ValueError) as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def errors_case() -> list[str]:
    """The argument errors, the same at every world size."""
    x = tl.tensor(np.ones((3, 5)))
    seen = []
    for fn, kwargs in (
        (F.all_reduce, {"op": "max"}),
        (F.all_gather, {"axis": 2}),
        (F.reduce_scatter, {"op": "prod"}),
    ):
        try:
            fn(x, **kwargs)
        except ValueError as exc:
            seen.append(str(exc))
    if idist.get_world_size() > 1:
        for fn in (F.scatter, F.reduce_scatter):
            try:
                fn(x, axis=1 if idist.get_world_size() == 4 else 0)
            except ValueError as exc:
                seen.append(str(exc))
    return seen
