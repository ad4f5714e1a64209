"""Rank bodies for ``ddp.ZeroRedundancyOptimizer`` and ``ddp.memory_stats`` (test_zero.py).

Each body runs on every rank of a pool (serial x1, cpu x2..x4, threads). The model is a tiny
float64 transformer-like language model (token and position embeddings, LayerNorms, a GELU
MLP on a residual path, a linear head): shapes of every kind, none a multiple of the world
size, so shards straddle parameters and end in padding. Every rank can rebuild the data from
the seed; rank ``r`` of ``N`` takes rows ``[r*G/N, (r+1)*G/N)`` of each global batch of
``G = 12`` rows, so every world size trains on the same global batches.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
import tensorlib.functional as F
from ddp import DistributedDataParallel, ZeroRedundancyOptimizer, memory_stats
from tensorlib import nn, optim
from tensorlib.optim import lr_scheduler

VOCAB, D, HID, T, G = 11, 6, 14, 5, 12


class TinyLM(nn.Module):
    """Embeddings, a pre-LayerNorm GELU MLP block with a residual, a LayerNorm and a head."""

    def __init__(
        self, seed: int, hid: int = HID, head_bias: bool = False, mixed: bool = False
    ) -> None:
        super().__init__()
        gen = tl.Generator(seed)
        self.tok = nn.Embedding(VOCAB, D, dtype="float64", generator=gen)
        self.pos = nn.Embedding(T, D, dtype="float64", generator=gen)
        self.ln1 = nn.LayerNorm(D, dtype="float64")
        self.fc1 = nn.Linear(D, hid, dtype="float64", generator=gen)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hid, D, dtype="float64", generator=gen)
        self.ln2 = nn.LayerNorm(D, dtype="float64")
        self.head = nn.Linear(D, VOCAB, bias=head_bias, dtype="float64", generator=gen)
        self.positions = np.arange(T)
        if mixed:  # a float32 output scale: a second flat space (dtype) to partition
            scale = gen.rng.uniform(0.5, 1.5, size=VOCAB).astype(np.float32)
            self.scale = nn.Parameter(tl.tensor(scale, dtype="float32"))

    def forward(self, idx: Any) -> Any:
        x = self.tok(idx) + self.pos(self.positions)
        x = x + self.fc2(self.act(self.fc1(self.ln1(x))))
        out = self.head(self.ln2(x))
        return out * self.scale if hasattr(self, "scale") else out


def _tokens(seed: int, steps: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(steps, G, T + 1))


def _loss(model: Any, rows: np.ndarray[Any, Any]) -> Any:
    logits = model(rows[:, :T])
    return F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))


def _rank_world() -> tuple[int, int]:
    return C.get_rank(), C.get_world_size()


def _my_rows(batch: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    rank, world = _rank_world()
    b = G // world
    return batch[rank * b : (rank + 1) * b]


OPTS: dict[str, tuple[type[optim.Optimizer], dict[str, Any]]] = {
    "adamw": (optim.AdamW, {"lr": 0.02, "weight_decay": 0.1}),
    "adam_amsgrad": (optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}),
    "sgd": (optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
}


def _groups(model: Any, split: bool) -> list[dict[str, Any]]:
    params = list(model.parameters())
    if not split:
        return [{"params": params}]
    return [{"params": params[:5]}, {"params": params[5:], "lr": 0.01}]


def _train(
    model: Any,
    opt: Any,
    tokens: np.ndarray[Any, Any],
    start: int,
    stop: int,
    local: bool = True,
    late_group: list[Any] | None = None,
    schedule: bool = True,
) -> None:
    sched = lr_scheduler.StepLR(opt, step_size=7, gamma=0.7) if schedule else None
    for s in range(start, stop):
        if late_group is not None and s == 10:
            opt.add_param_group({"params": late_group, "lr": 0.03})
        opt.zero_grad()
        _loss(model, _my_rows(tokens[s]) if local else tokens[s]).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _params(model: Any) -> list[np.ndarray[Any, Any]]:
    return [p.numpy().copy() for p in model.parameters()]


def _digest(arrays: list[np.ndarray[Any, Any]]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _compare(a: list[Any], b: list[Any]) -> dict[str, Any]:
    diffs = [float(np.max(np.abs(x - y))) if x.size else 0.0 for x, y in zip(a, b, strict=True)]
    return {
        "max_diff": max(diffs),
        "bitwise": all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)),
    }


def same_as_ddp(
    seed: int,
    opt: str,
    steps: int,
    bucket_cap_mb: float,
    split: bool = False,
    late: bool = False,
    mixed: bool = False,
) -> dict[str, Any]:
    """DDP with the plain optimizer, then DDP with ZeRO-1 over it: the parameters after
    ``steps`` steps (a StepLR schedule on both; ``split``: two parameter groups; ``late``: the
    head's parameters join as a third group at step 10; ``mixed``: a float32 parameter too)."""
    cls, kw = OPTS[opt]
    tokens = _tokens(seed, steps)
    out: dict[str, Any] = {}
    finals = []
    for zero in (False, True):
        model = DistributedDataParallel(TinyLM(seed, mixed=mixed))
        groups = _groups(model, split)
        late_group = None
        if late:
            late_group = groups[-1]["params"][-1:]
            groups[-1]["params"] = groups[-1]["params"][:-1]
        if zero:
            o: Any = ZeroRedundancyOptimizer(groups, cls, bucket_cap_mb=bucket_cap_mb, **kw)
            out["buckets"] = len(o._buckets)
            out["shard_elements"] = sum(p.hi - p.lo for p in o._mine)
        else:
            o = cls(groups, **kw)
        _train(model, o, tokens, 0, steps, late_group=late_group)
        finals.append(_params(model))
        if zero:
            out["state_elements"] = int(
                sum(
                    v.size for e in o.optim.state.values() for v in e.values() if hasattr(v, "size")
                )
            )
    out.update(_compare(finals[0], finals[1]))
    out["digest"] = _digest(finals[1])
    out["total"] = int(sum(a.size for a in finals[1]))
    return out


def save_zero(seed: int, steps: int, path: str) -> dict[str, Any]:
    """Train ``steps`` AdamW steps under ZeRO-1, consolidate to rank 0, which saves the model
    and the optimizer state; the other ranks check that state_dict() refuses them."""
    cls, kw = OPTS["adamw"]
    rank, _ = _rank_world()
    model = DistributedDataParallel(TinyLM(seed))
    opt = ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
    _train(model, opt, _tokens(seed, steps), 0, steps, schedule=False)
    refusal = ""
    try:
        opt.state_dict()
    except RuntimeError as e:
        refusal = str(e)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        sd = opt.state_dict()
        tl.save({"model": model.state_dict(), "optim": sd}, path)
        return {"refusal_before": refusal, "keys": sorted(sd["state"][0])}
    try:
        opt.state_dict()
    except RuntimeError as e:
        return {"refusal_before": refusal, "refusal_other": str(e)}
    raise AssertionError(f"rank {rank}: state_dict() after consolidating to rank 0 succeeded")


def _reference(seed: int, steps: int) -> list[np.ndarray[Any, Any]]:
    """One process, the global batch, the plain optimizer: the uninterrupted run."""
    cls, kw = OPTS["adamw"]
    model = TinyLM(seed)
    opt = cls(model.parameters(), **kw)
    _train(model, opt, _tokens(seed, steps), 0, steps, local=False, schedule=False)
    return _params(model)


def resume_zero(seed: int, steps: int, more: int, path: str) -> dict[str, Any]:
    """Load what :func:`save_zero` wrote (at another world size), continue ``more`` steps
    under ZeRO-1 (and, on rank 0, with a plain AdamW loading the same state dict)."""
    cls, kw = OPTS["adamw"]
    rank, _ = _rank_world()
    ck = tl.load(path)
    tokens = _tokens(seed, steps + more)
    net = TinyLM(seed)
    net.load_state_dict(ck["model"])
    model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
    opt.load_state_dict(ck["optim"])
    _train(model, opt, tokens, steps, steps + more, schedule=False)
    want = _reference(seed, steps + more)
    out = {"zero": _compare(_params(model), want)}
    if rank == 0:
        plain = TinyLM(seed)
        plain.load_state_dict(ck["model"])
        popt = cls(plain.parameters(), **kw)
        popt.load_state_dict(ck["optim"])
        _train(plain, popt, tokens, steps, steps + more, local=False, schedule=False)
        out["plain"] = _compare(_params(plain), want)
    return out


def memory(seed: int) -> dict[str, Any]:
    """memory_stats after one AdamW step: DDP with the plain optimizer, then with ZeRO-1."""
    cls, kw = OPTS["adamw"]
    tokens = _tokens(seed, 1)
    out: dict[str, Any] = {}
    for zero in (False, True):
        model = DistributedDataParallel(TinyLM(seed))
        o: Any = (
            ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
            if zero
            else cls(model.parameters(), **kw)
        )
        _train(model, o, tokens, 0, 1)
        out["zero" if zero else "ddp"] = memory_stats(model, o)
    plain = TinyLM(seed)
    popt = cls(plain.parameters(), **kw)
    _train(plain, popt, tokens, 0, 1, local=False)
    out["plain"] = memory_stats(plain, popt)
    out["total"] = int(sum(p.size for p in plain.parameters()))
    return out


def mismatch(seed: int, kind: str) -> str:
    """Rank 1 passes other parameters (``shape``, ``count``) or another learning rate
    (``option``): every rank's construction raises; or (``late``) adds another group: every
    rank's ``add_param_group`` raises. The message comes back."""
    rank, _ = _rank_world()
    odd = rank == 1
    model = TinyLM(
        seed, hid=HID + 1 if odd and kind == "shape" else HID, head_bias=odd and kind == "count"
    )
    lr = 0.5 if odd and kind == "option" else 0.1
    params = list(model.parameters())
    try:
        if kind != "late":
            ZeroRedundancyOptimizer(params, optim.SGD, lr=lr)
            return "no error"
        opt = ZeroRedundancyOptimizer(params[:4], optim.SGD, lr=lr)
    except ValueError as e:
        return str(e)
    # ``late``: the same first group everywhere, then rank 1 adds one parameter fewer.
    try:
        opt.add_param_group({"params": params[4:-1] if odd else params[4:]})
    except ValueError as e:
        if len(opt.param_groups) != 1:
            raise AssertionError("the refused group stayed in param_groups") from e
        return str(e)
    return "no error"


def consolidate_last(seed: int, steps: int) -> dict[str, Any]:
    """ZeRO-1 and the plain optimizer under DDP for ``steps`` SGD-momentum steps, then the
    state consolidated on the last rank: it must equal the plain optimizer's state dict."""
    cls, kw = OPTS["sgd"]
    rank, world = _rank_world()
    tokens = _tokens(seed, steps)
    sds = []
    for zero in (False, True):
        model = DistributedDataParallel(TinyLM(seed))
        o: Any = (
            ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
            if zero
            else cls(model.parameters(), **kw)
        )
        _train(model, o, tokens, 0, steps)
        if zero:
            o.consolidate_state_dict(to=world - 1)
            if rank != world - 1:
                return {"rank": rank}
        sds.append(o.state_dict())
    plain, got = sds
    same = plain["param_groups"] == got["param_groups"] and sorted(plain["state"]) == sorted(
        got["state"]
    )
    for i, entry in plain["state"].items():
        for k, v in entry.items():
            same = same and np.array_equal(np.asarray(got["state"][i][k]), np.asarray(v))
    return {"rank": rank, "same": bool(same), "entries": len(got["state"])}
