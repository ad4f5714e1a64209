"""Rank bodies for ``ddp.fully_shard``: a small model trained sharded and, in the same
process, under DistributedDataParallel on the same per-rank batches (the reference).

The model: an Embedding, blocks of Linear -> ReLU -> Linear -> LayerNorm with a residual, and
a Linear head. Its sizes (7 tokens, width 6, hidden 10, 5 outputs) are not multiples of 4, and
most not of 3, so the shards of most parameters are padded.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
from ddp import DistributedDataParallel
from ddp.fsdp import fully_shard
from tensorlib import Tensor, nn

VOCAB, WIDTH, HIDDEN, OUT, BATCH = 7, 6, 10, 5, 4


class Block(nn.Module):
    def __init__(self, gen: tl.Generator, hidden: int, norm_bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, hidden, dtype="float64", generator=gen)
        self.act = nn.ReLU()
        self.down = nn.Linear(hidden, WIDTH, dtype="float64", generator=gen)
        self.norm = nn.LayerNorm(WIDTH, bias=norm_bias, dtype="float64")

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.down(self.act(self.up(x))))


class Model(nn.Module):
    def __init__(
        self, seed: int, blocks: int = 2, hidden: int = HIDDEN, norm_bias: bool = True
    ) -> None:
        super().__init__()
        gen = tl.Generator(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH, dtype="float64", generator=gen)
        self.blocks = nn.ModuleList([Block(gen, hidden, norm_bias) for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, OUT, dtype="float64", generator=gen)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch(seed: int, step: int, rank: int) -> tuple[Tensor, Tensor]:
    rng = np.random.default_rng([seed, step, rank])
    tokens = rng.integers(0, VOCAB, size=BATCH)
    return tl.tensor(tokens), tl.tensor(rng.standard_normal((BATCH, OUT)))


def _shard(model: Model, reshard: bool) -> Model:
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _train(model: nn.Module, seed: int, steps: int, rank: int, accum: int) -> list[float]:
    """AdamW steps, each on ``accum`` micro-batches whose gradients add up in ``.grad``."""
    opt = tl.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            tokens, y = _batch(seed, step * accum + micro, rank)
            loss = ((model(tokens) - y) ** 2).mean()
            loss.backward()
            losses.append(float(loss.item()))
        opt.step()
    return losses


def same_as_ddp(seed: int, steps: int, reshard: bool, accum: int = 1) -> dict[str, Any]:
    """Train sharded and under DDP; how far the gathered parameters are from DDP's."""
    rank = C.get_rank()
    sharded = _shard(Model(seed), reshard)
    reference = DistributedDataParallel(Model(seed))
    fs_losses = _train(sharded, seed, steps, rank, accum)
    ref_losses = _train(reference, seed, steps, rank, accum)
    full = sharded.state_dict()
    ref = reference.module.state_dict()
    if list(full) != list(ref):
        raise AssertionError(f"keys {list(full)} != {list(ref)}")
    diffs = {k: float(np.max(np.abs(full[k].numpy() - ref[k].numpy()))) for k in ref}
    shapes = {k: list(full[k].shape) == list(ref[k].shape) for k in ref}
    moved = max(
        float(np.max(np.abs(ref[k].numpy() - Model(seed).state_dict()[k].numpy()))) for k in ref
    )
    return {
        "diffs": diffs,
        "shapes": shapes,
        "bitwise": all(np.array_equal(full[k].numpy(), ref[k].numpy()) for k in ref),
        "losses_equal": fs_losses == ref_losses,
        "loss_diff": max(abs(a - b) for a, b in zip(fs_losses, ref_losses, strict=True)),
        "moved": moved,
    }


def shards(seed: int) -> dict[str, Any]:
    """Local shards: shapes, bytes against the full model's, and the grads' shapes after a
    backward (the gradient shard only)."""
    world = C.get_world_size()
    full_bytes = sum(p.data.nbytes for p in Model(seed).parameters())
    model = _shard(Model(seed), True)
    local = model.local_state_dict()
    tokens, y = _batch(seed, 0, C.get_rank())
    ((model(tokens) - y) ** 2).mean().backward()
    params = dict(model.named_parameters())
    return {
        "world": world,
        "full_bytes": full_bytes,
        "local_bytes": sum(p.data.nbytes for p in model.parameters()),
        "local_shapes": {k: list(t.shape) for k, t in local.items()},
        "grad_shapes": {k: list(p.grad.shape) for k, p in params.items() if p.grad is not None},
        "full_shapes": {k: list(t.shape) for k, t in model.state_dict().items()},
        "param_names": list(params),
    }


def load_full(seed: int) -> dict[str, Any]:
    """load_state_dict of another model's full state, then state_dict gives it back."""
    model = _shard(Model(seed), True)
    other = Model(seed + 1).state_dict()
    model.load_state_dict(other)
    back = model.state_dict()
    return {"equal": all(np.array_equal(back[k].numpy(), other[k].numpy()) for k in other)}


def mismatch(seed: int, kind: str) -> dict[str, Any]:
    """Rank 1 differs (``kind``: "wider" blocks, a "missing" LayerNorm bias, or the other
    "option"): fully_shard must raise on every rank."""
    odd = C.get_rank() == 1
    hidden = HIDDEN + 1 if odd and kind == "wider" else HIDDEN
    model = Model(seed, hidden=hidden, norm_bias=not (odd and kind == "missing"))
    try:
        _shard(model, not (odd and kind == "option"))
    except ValueError as exc:
        return {"message": str(exc)}
    return {"message": None}


def memory_freed(seed: int) -> dict[str, Any]:
    """Whether each unit's full buffer is held after forward and after backward."""
    out: dict[str, Any] = {}
    for reshard in (True, False):
        model = _shard(Model(seed), reshard)
        units = [m.__dict__["_fsdp_unit"] for m in [*model.blocks, model]]
        tokens, y = _batch(seed, 0, C.get_rank())
        loss = ((model(tokens) - y) ** 2).mean()
        after_forward = [u.buffer.gathered for u in units]
        # Freed pages went back to the system: the mapping reads as zeros until refilled.
        zeros = [not u.buffer.array.any() for u in units]
        loss.backward()
        out[json.dumps(reshard)] = {
            "after_forward": after_forward,
            "after_backward": [u.buffer.gathered for u in units],
            "zeros_after_forward": zeros,
        }
    return out


def bypassed_output(seed: int) -> dict[str, Any]:
    """A unit whose forward output does not carry backward (a dict): under ZeRO-3 backward
    would use freed parameters, so it must raise instead."""

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(WIDTH, OUT, dtype="float64", generator=tl.Generator(seed))

        def forward(self, x: Tensor) -> dict[str, Tensor]:
            return {"out": self.inner(x)}

    model = fully_shard(Wrapped())
    x = tl.tensor(np.ones((2, WIDTH)))
    try:
        model(x)["out"].sum().backward()
    except RuntimeError as exc:
        return {"message": str(exc)}
    return {"message": None}


def no_grad_forward(seed: int) -> dict[str, Any]:
    """Evaluation under no_grad: the same outputs as the plain model, nothing left gathered."""
    plain = Model(seed)
    model = _shard(Model(seed), False)
    tokens, _ = _batch(seed, 0, 0)
    with tl.no_grad():
        out = model(tokens)
    units = [m.__dict__["_fsdp_unit"] for m in [*model.blocks, model]]
    return {
        "equal": bool(np.array_equal(out.numpy(), plain(tokens).numpy())),
        "gathered": [u.buffer.gathered for u in units],
    }


def argument_errors() -> dict[str, str]:
    """What fully_shard refuses, by case: each message."""
    out: dict[str, str] = {}

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(tl.zeros(3, dtype="float64"))
            self.b = nn.Parameter(tl.zeros(3, dtype="float32"))

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(tl.tensor(1.0))

    twice = fully_shard(nn.Linear(2, 2))
    cases: dict[str, Any] = {
        "mixed": lambda: fully_shard(Mixed()),
        "scalar": lambda: fully_shard(Scalar()),
        "twice": lambda: fully_shard(twice),
        "not a module": lambda: fully_shard(3),  # type: ignore[arg-type]
    }
    for name, call in cases.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def prefetch_hits(seed: int, steps: int) -> dict[str, list[int]]:
    """For each option, how many gathers of each unit (blocks, then the root) found their
    all-gather already issued by a prefetch, over ``steps`` training steps."""
    out: dict[str, list[int]] = {}
    for reshard in (True, False):
        model = _shard(Model(seed), reshard)
        _train(model, seed, steps, C.get_rank(), 1)
        units = [m.__dict__["_fsdp_unit"] for m in [*model.blocks, model]]
        out[json.dumps(reshard)] = [u.prefetch_hits for u in units]
    return out


class Twice(nn.Module):
    """One block applied twice: its unit gathers (and, under ZeRO-3, frees) twice a forward."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = tl.Generator(seed)
        self.block = Block(gen, HIDDEN)
        self.head = nn.Linear(WIDTH, OUT, dtype="float64", generator=gen)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.block(x)))


def unit_called_twice(seed: int, reshard: bool) -> float:
    """Largest difference between each shard's gradient and its rows of a plain model's
    (every rank feeds the same batch, so the average is the plain gradient)."""
    world, rank = C.get_world_size(), C.get_rank()
    plain, model = Twice(seed), Twice(seed)
    fully_shard(model.block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    x = tl.tensor(np.random.default_rng(seed).standard_normal((3, WIDTH)))
    for m in (plain, model):
        (m(x) ** 2).sum().backward()
    full = dict(plain.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        ref, got = full[name].grad, p.grad
        if ref is None or got is None:
            raise AssertionError(f"{name}: no gradient")
        g = ref.numpy()
        rows = -(-g.shape[0] // world)
        padded = np.zeros((rows * world, *g.shape[1:]))
        padded[: g.shape[0]] = g
        mine = padded[rank * rows : (rank + 1) * rows]
        worst = max(worst, float(np.max(np.abs(got.numpy() - mine))))
    return worst


def _train_clipped(
    model: nn.Module, clip: Any, seed: int, steps: int, rank: int, max_norm: float, norm_type: float
) -> list[float]:
    """AdamW steps with the gradients clipped by ``clip``; the norms it returned."""
    opt = tl.optim.AdamW(model.parameters(), lr=0.01)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        tokens, y = _batch(seed, step, rank)
        ((model(tokens) - y) ** 2).mean().backward()
        norms.append(float(clip(model.parameters(), max_norm, norm_type).item()))
        opt.step()
    return norms


def clip_same_as_ddp(
    seed: int, steps: int, reshard: bool, max_norm: float, norm_type: float
) -> dict[str, Any]:
    """Train sharded with ``ddp.clip_grad_norm_`` and under DDP with tensorlib's plain clip:
    the norms each returned and how far the parameters are apart."""
    from ddp import clip_grad_norm_
    from tensorlib.nn.utils import clip_grad_norm_ as plain
    from tensorlib.nn.utils import get_total_norm

    rank = C.get_rank()
    sharded = _shard(Model(seed), reshard)
    reference = DistributedDataParallel(Model(seed))
    fs_norms = _train_clipped(sharded, clip_grad_norm_, seed, steps, rank, max_norm, norm_type)
    ref_norms = _train_clipped(reference, plain, seed, steps, rank, max_norm, norm_type)
    full = sharded.state_dict()
    ref = reference.module.state_dict()
    # One more backward: the plain norm of this rank's shard gradients is a local one.
    tokens, y = _batch(seed, steps, rank)
    ((sharded(tokens) - y) ** 2).mean().backward()
    local = float(
        get_total_norm(
            [q.grad for q in sharded.parameters() if q.grad is not None], norm_type
        ).item()
    )
    global_norm = float(clip_grad_norm_(sharded.parameters(), 1e30, norm_type).item())
    return {
        "param_diff": max(float(np.max(np.abs(full[k].numpy() - ref[k].numpy()))) for k in ref),
        "norm_rel_diff": max(abs(a - b) / b for a, b in zip(fs_norms, ref_norms, strict=True)),
        "clipped_steps": sum(n > max_norm for n in ref_norms),
        "last_norm": fs_norms[-1],
        "local_norm_of_shards": local,
        "global_norm": global_norm,
        "world": C.get_world_size(),
    }


def _grad(p: Tensor) -> Any:
    """``p.grad`` as a NumPy view (backward has set it)."""
    if p.grad is None:
        raise AssertionError("no gradient")
    return p.grad.numpy()


def clip_edge_cases(seed: int) -> dict[str, Any]:
    """Without shards ddp's clip is tensorlib's; a nan in one rank's shard stops every rank."""
    from ddp import clip_grad_norm_
    from tensorlib.nn.utils import clip_grad_norm_ as plain

    rank = C.get_rank()
    a, b = Model(seed), Model(seed)
    for m in (a, b):
        tokens, y = _batch(seed, 0, rank)
        ((m(tokens) - y) ** 2).mean().backward()
    na = clip_grad_norm_(a.parameters(), 0.1)
    nb = plain(b.parameters(), 0.1)
    same = float(na.item()) == float(nb.item()) and all(
        np.array_equal(_grad(p), _grad(q))
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    sharded = _shard(Model(seed), True)
    tokens, y = _batch(seed, 0, rank)
    ((sharded(tokens) - y) ** 2).mean().backward()
    if rank == 0:
        _grad(next(iter(sharded.parameters())))[0, 0] = np.nan
    try:
        clip_grad_norm_(sharded.parameters(), 1.0, error_if_nonfinite=True)
        message = None
    except RuntimeError as e:
        message = str(e)
    return {"plain_when_unsharded": same, "nonfinite": message}
