"""Rank bodies for ``fully_shard``'s mixed precision, gradient accumulation without sync, and
``GradScaler`` over shards. The model is fsdp_bodies' (cast to float32 where mixed precision
is tested)."""

from __future__ import annotations

from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
from ddp import DistributedDataParallel, MixedPrecisionPolicy
from ddp.fsdp import fully_shard
from tensorlib import Tensor, nn
from tests.ddp.fsdp_bodies import Model, _batch

MP = MixedPrecisionPolicy(param_dtype=tl.float16, reduce_dtype=tl.float32)


def _shard(model: nn.Module, reshard: bool, mp: MixedPrecisionPolicy | None = None) -> Any:
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
    return fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)


def _loss(model: Any, tokens: Tensor, y: Tensor) -> Tensor:
    return ((model(tokens).astype(tl.float32) - y.astype(tl.float32)) ** 2).mean()


def mixed_precision(seed: int, steps: int, reshard: bool) -> dict[str, Any]:
    """Train under float16 gathering / float32 reduction, and, in this process, the reference:
    for each rank's batch a float16 copy of the float32 master weights computes the gradient,
    which is cast to float32 and averaged over the ranks, and AdamW steps the master."""
    rank, world = C.get_rank(), C.get_world_size()
    sharded = _shard(Model(seed).to(dtype=tl.float32), reshard, MP)
    seen: dict[str, Any] = {}

    def note(mod: nn.Module, args: tuple[Any, ...]) -> None:
        seen["weight"], seen["input"] = mod.weight.dtype, args[0].dtype

    sharded.blocks[0].up.register_forward_pre_hook(note)
    opt = tl.optim.AdamW(sharded.parameters(), lr=0.01)
    master = Model(seed).to(dtype=tl.float32)
    ref_opt = tl.optim.AdamW(master.parameters(), lr=0.01)
    half = Model(seed).to(dtype=tl.float16)
    for step in range(steps):
        opt.zero_grad()
        _loss(sharded, *_batch(seed, step, rank)).backward()
        opt.step()
        # The reference, on every rank alike.
        total: dict[str, Any] = {}
        for r in range(world):
            half.load_state_dict({k: v.numpy().astype(np.float16) for k, v in _sd(master).items()})
            half.zero_grad()
            _loss(half, *_batch(seed, step, r)).backward()
            for k, p in half.named_parameters():
                assert p.grad is not None
                g = p.grad.numpy().astype(np.float32)
                total[k] = g if k not in total else total[k] + g
        for k, p in master.named_parameters():
            p.grad = tl.tensor(total[k] / np.float32(world))
        ref_opt.step()
    full, ref = sharded.state_dict(), _sd(master)
    start = Model(seed).state_dict()
    return {
        "dtypes": {k: str(v.dtype) for k, v in full.items()},
        "shard_dtypes": sorted({str(p.dtype) for p in sharded.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in sharded.parameters()}),
        "gathered": str(seen["weight"]),
        "input": str(seen["input"]),
        "rel": max(_rel(full[k].numpy(), ref[k].numpy()) for k in ref),
        "moved": max(float(np.abs(ref[k].numpy() - start[k].numpy()).max()) for k in ref),
        "send_dtypes": sorted({str(m._fsdp_unit.buffer.array.dtype) for m in _units(sharded)}),
    }


def _sd(model: nn.Module) -> dict[str, Tensor]:
    return dict(model.state_dict())


def _units(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if "_fsdp_unit" in m.__dict__]


def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(1e-12, float(np.abs(b).max())))


def no_sync(seed: int, steps: int, reshard: bool, accum: int, api: str) -> dict[str, Any]:
    """Accumulate ``accum`` micro-batches per step, all but the last without sync (the
    ``no_sync()`` block or ``set_requires_gradient_sync``), sharded and under DDP's no_sync."""
    rank = C.get_rank()
    sharded = _shard(Model(seed), reshard)
    reference = DistributedDataParallel(Model(seed))
    pending: list[bool] = []
    for model in (sharded, reference):
        opt = tl.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(steps):
            opt.zero_grad()
            for micro in range(accum):
                last = micro == accum - 1
                tokens, y = _batch(seed, step * accum + micro, rank)
                if model is sharded and api == "set":
                    sharded.set_requires_gradient_sync(last)
                    ctx: Any = _Null()
                else:
                    ctx = _Null() if last else model.no_sync()
                with ctx:
                    ((model(tokens) - y) ** 2).mean().backward()
                if model is sharded and not last:
                    # Nothing reached the shards yet: the sum waits in each unit.
                    pending.append(all(p.grad is None for p in sharded.parameters()))
            opt.step()
    full, ref = sharded.state_dict(), reference.module.state_dict()
    start = Model(seed).state_dict()
    return {
        "diff": max(float(np.abs(full[k].numpy() - ref[k].numpy()).max()) for k in ref),
        "moved": max(float(np.abs(ref[k].numpy() - start[k].numpy()).max()) for k in ref),
        "pending": all(pending) and bool(pending),
        "left": [m._fsdp_unit.accumulated is None for m in _units(sharded)],
    }


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def scaler_skips_together(seed: int) -> dict[str, Any]:
    """An inf that lands in rank 0's gradient shard only: every rank skips the step and backs
    off its scale, so the shards stay one model."""
    rank = C.get_rank()
    sharded = _shard(Model(seed).to(dtype=tl.float32), True, MP)
    opt = tl.optim.AdamW(sharded.parameters(), lr=0.01)
    scaler = tl.amp.GradScaler(init_scale=1024.0)
    steps = []
    for step in range(3):
        before = [p.numpy().copy() for p in sharded.parameters()]
        opt.zero_grad()
        scaler.scale(_loss(sharded, *_batch(seed, step, rank))).backward()
        if step == 1 and rank == 0:
            next(iter(sharded.parameters())).grad.data[0, 0] = np.inf
        scaler.step(opt)
        scaler.update()
        moved = any(
            not np.array_equal(b, p.numpy())
            for b, p in zip(before, sharded.parameters(), strict=True)
        )
        steps.append({"moved": moved, "scale": scaler.get_scale()})
    return {"steps": steps}


def stats(seed: int, steps: int) -> dict[str, Any]:
    """``model.stats`` after each of a few steps, under ZeRO-3, ZeRO-2 and ZeRO-3 with
    float16 gathers, and the elements of this rank's flat shards (for the byte count)."""
    rank = C.get_rank()
    out: dict[str, Any] = {}
    for name, reshard, mp, cast in [
        ("zero3", True, None, False),
        ("zero2", False, None, False),
        ("zero3-fp16", True, MP, True),
    ]:
        model = _shard(Model(seed).to(dtype=tl.float32) if cast else Model(seed), reshard, mp)
        opt = tl.optim.AdamW(model.parameters(), lr=0.01)
        seen = []
        for step in range(steps):
            opt.zero_grad()
            _loss(model, *_batch(seed, step, rank)).backward()
            opt.step()
            s = model.stats
            seen.append([s.all_gathers, s.prefetched, s.reduce_scatters, s.bytes_sent])
            if not (s.wait_s >= s.gather_wait_s >= 0.0 and s.reduce_wait_s >= 0.0):
                raise AssertionError(f"wait times {s}")
        out[name] = {
            "seen": seen,
            "elements": sum(m._fsdp_unit.shard_numel for m in _units(model)),
            "units": len(_units(model)),
        }
    return out


def peak(seed: int, blocks: int, reshard: bool, fp16: bool) -> dict[str, Any]:
    """``stats.peak_bytes`` of a few steps of a model of ``blocks`` equal blocks, and the
    sizes it is bounded by: the largest unit's full parameters (gathered dtype) and the same
    elements in the reduce dtype, with this rank's flat shard of it."""
    rank, world = C.get_rank(), C.get_world_size()
    base = Model(seed, blocks=blocks, hidden=40)
    model = _shard(base.to(dtype=tl.float32) if fp16 else base, reshard, MP if fp16 else None)
    opt = tl.optim.AdamW(model.parameters(), lr=0.01)
    peaks = []
    for step in range(3):
        opt.zero_grad()
        _loss(model, *_batch(seed, step, rank)).backward()
        opt.step()
        peaks.append(model.stats.peak_bytes)
    units = [m._fsdp_unit for m in _units(model)]
    big = max(units, key=lambda u: u.shard_numel)
    return {
        "peaks": peaks,
        "full": big.buffer.array.nbytes,
        "grad": big.shard_numel * world * big.reduce_dtype.itemsize,
        "shard": big.shard_numel * big.gather_dtype.itemsize,
        "model_full": sum(u.buffer.array.nbytes for u in units),
        "live_after": model._fsdp_unit.schedule.ledger.live,
    }
