"""Rank bodies for ``ddp.join``: uneven numbers of batches per rank.

Rank ``r`` has ``counts[r]`` steps of data (each step ``accum`` micro-batches of ``batch``
samples, all but the last under ``no_sync``); every rank can rebuild any rank's batch from the
seed. The single-process reference takes, at step ``s``, the batches of the ranks that have a
step ``s`` (the rule of docs/ddp.md: the mean over those ranks of their per-rank means; with
equal batch sizes, the mean over their concatenated samples).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
from ddp import DistributedDataParallel, fp16_compress_hook, join
from tensorlib import Tensor
from tensorlib.optim.lr_scheduler import StepLR

from .ddp_bodies import D_IN, D_OUT, Net, _digest, _optimizer, _widths

# ---------------------------------------------------------------------------- helpers


def _batch(
    seed: int, rank: int, step: int, micro: int, n: int, dtype: str
) -> tuple[Tensor, Tensor]:
    rng = np.random.default_rng([seed, rank, step, micro])
    x = rng.standard_normal((n, D_IN)).astype(dtype)
    y = rng.standard_normal((n, D_OUT)).astype(dtype)
    return tl.tensor(x), tl.tensor(y)


def _uses_branch(pattern: str, rank: int, step: int) -> bool:
    if pattern == "rank1":  # only rank 1 (which runs out first in the tests) uses it
        return rank == 1
    if pattern == "alternate":
        return (rank + step) % 2 == 0
    return False


def _state_digest(opt: Any) -> str:
    """Every array (dtype and bytes) and plain value of the optimizer's state and groups."""
    h = hashlib.sha256()

    def walk(v: Any) -> Any:
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            a = np.ascontiguousarray(np.asarray(v))
            h.update(a.dtype.str.encode() + a.tobytes())
            return f"<array {a.dtype} {a.shape}>"
        if isinstance(v, dict):
            return [[repr(k), walk(x)] for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))]
        if isinstance(v, list | tuple):
            return [type(v).__name__] + [walk(x) for x in v]
        return repr(v)

    h.update(json.dumps(walk(opt.state_dict())).encode())
    return h.hexdigest()


class _Run:
    """One DDP model with its optimizer and the reference with its own, trained alike."""

    def __init__(self, seed: int, case: dict[str, Any], group: C.ProcessGroup) -> None:
        self.seed, self.case, self.group = seed, case, group
        self.dtype: str = case.get("dtype", "float64")
        self.batch: int = case.get("batch", 3)
        self.accum: int = case.get("accum", 1)
        self.pattern: str = case.get("branch", "none")
        branch = self.pattern != "none"
        widths = _widths(3, 6)
        rank = group.rank
        model = Net(widths, self.dtype, seed + 1000 * rank, branch=branch, buffer=True)
        hook = fp16_compress_hook if case.get("hook") == "fp16" else None
        self.ddp = DistributedDataParallel(
            model, find_unused_parameters=bool(case.get("find_unused")), comm_hook=hook
        )
        self.ref = Net(widths, self.dtype, seed, branch=branch, buffer=True)
        kind = case.get("opt", "sgd")
        self.opt = _optimizer(kind, list(self.ddp.parameters()))
        self.ref_opt = _optimizer(kind, list(self.ref.parameters()))
        # A schedule stepped every step: a rank that ran out stepped it fewer times.
        self.sched = StepLR(self.opt, step_size=4, gamma=0.5) if case.get("sched") else None
        self.ref_sched = StepLR(self.ref_opt, step_size=4, gamma=0.5) if self.sched else None
        self.init = {n: p.data.copy() for n, p in self.ref.named_parameters()}
        self.buffer_seen: list[float] = []

    def ddp_steps(self, epoch: int, steps: int) -> None:
        """This rank's ``steps`` steps, each ``accum`` micro-batches."""
        rank = self.group.rank
        for s in range(steps):
            self.opt.zero_grad()
            for micro in range(self.accum):
                x, y = _batch(self.seed + epoch, rank, s, micro, self.batch, self.dtype)
                # A rank-specific buffer: the forward replaces it by the source rank's.
                self.ddp.module.running.data[...] = 100.0 * rank + s
                sync = contextlib.nullcontext() if micro == self.accum - 1 else self.ddp.no_sync()
                with sync:
                    out = self.ddp(x, use_branch=_uses_branch(self.pattern, rank, s))
                    self.buffer_seen.append(float(self.ddp.module.running.data[0]))
                    (((out - y) ** 2).mean() * (1.0 / self.accum)).backward()
            self.opt.step()
            if self.sched is not None:
                self.sched.step()

    def ref_steps(self, epoch: int, counts: list[int]) -> None:
        """The reference: at step s, one backward over the batches of every rank that has s."""
        for s in range(max(counts, default=0)):
            active = [r for r, c in enumerate(counts) if c > s]
            total = len(active) * self.accum * self.batch * D_OUT
            self.ref_opt.zero_grad()
            loss: Tensor | None = None
            for r in active:
                for micro in range(self.accum):
                    x, y = _batch(self.seed + epoch, r, s, micro, self.batch, self.dtype)
                    out = self.ref(x, use_branch=_uses_branch(self.pattern, r, s))
                    part = ((out - y) ** 2).sum() * (1.0 / total)
                    loss = part if loss is None else loss + part
            assert loss is not None
            loss.backward()
            self.ref_opt.step()
            if self.ref_sched is not None:
                self.ref_sched.step()

    def summary(self) -> dict[str, Any]:
        diff = change = 0.0
        for (name, p), q in zip(
            self.ddp.module.named_parameters(), self.ref.parameters(), strict=True
        ):
            diff = max(diff, float(np.max(np.abs(p.data - q.data))))
            change = max(change, float(np.max(np.abs(q.data - self.init[name]))))
        buffers = np.concatenate([b.data.ravel() for b in self.ddp.module.buffers()])
        return {
            "digest": _digest(self.ddp.module),
            "opt_digest": _state_digest(self.opt),
            "sched_digest": _state_digest(self.sched) if self.sched else "",
            "buffers": hashlib.sha256(buffers.tobytes()).hexdigest(),
            "param_diff": diff,
            "param_change": change,
        }


# ---------------------------------------------------------------------------- bodies
def uneven(seed: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: ``counts`` (steps per rank), ``opt``, ``dtype``, ``accum``, ``hook``
    (fp16), ``branch`` with ``find_unused``, ``sched`` (a StepLR stepped every step, also
    copied at the end). Epoch 0 runs the uneven counts under join, epoch
    1 ``even`` steps on every rank (under join again). Per case: summaries after each epoch
    and the buffer value each forward of this rank saw."""
    out = []
    group = C.get_default_group()
    for i, case in enumerate(cases):
        run = _Run(seed + i, case, group)
        counts: list[int] = case["counts"]
        states = [run.opt] + ([run.sched] if run.sched else [])
        with join(run.ddp, optimizers=states):
            run.ddp_steps(0, counts[group.rank])
        run.ref_steps(0, counts)
        first = run.summary()
        even = case.get("even", 2)
        with run.ddp.join(optimizers=states):
            run.ddp_steps(1, even)
        run.ref_steps(1, [even] * group.size)
        out.append({"epoch0": first, "epoch1": run.summary(), "buffer_seen": run.buffer_seen})
    return out


def even_with_and_without(seed: int, steps: int) -> dict[str, Any]:
    """The same even training three times: under join, plain, under join(enable=False)."""
    group = C.get_default_group()
    digests = {}
    for mode in ("join", "plain", "disabled"):
        run = _Run(seed, {"opt": "adam", "dtype": "float32", "accum": 2}, group)
        ctx = (
            join(run.ddp, optimizers=[run.opt], throw_on_early_termination=True)
            if mode == "join"
            else join(run.ddp, enable=False)
            if mode == "disabled"
            else contextlib.nullcontext()
        )
        with ctx:
            run.ddp_steps(0, steps)
        digests[mode] = [_digest(run.ddp.module), _state_digest(run.opt)]
    return digests


def throws(seed: int, counts: list[int]) -> dict[str, Any]:
    """throw_on_early_termination: what each rank raised, and whether a normal step works
    afterwards (the group is still in step)."""
    group = C.get_default_group()
    run = _Run(seed, {"opt": "sgd"}, group)
    message = ""
    try:
        with join(run.ddp, optimizers=[run.opt], throw_on_early_termination=True):
            run.ddp_steps(0, counts[group.rank])
    except RuntimeError as exc:
        message = str(exc)
    run.ddp_steps(1, 1)
    return {"message": message, "digest": _digest(run.ddp.module)}


def mismatched_no_sync(seed: int) -> dict[str, Any]:
    """At step 1 rank 0 runs its forward under no_sync while the others synchronize."""
    group = C.get_default_group()
    run = _Run(seed, {"opt": "sgd"}, group)
    message = ""
    try:
        with join(run.ddp):
            for s in range(3):
                x, y = _batch(seed, group.rank, s, 0, 2, "float64")
                local = s == 1 and group.rank == 0
                with run.ddp.no_sync() if local else contextlib.nullcontext():
                    ((run.ddp(x) - y) ** 2).mean().backward()
    except RuntimeError as exc:
        message = str(exc)
    return {"message": message}


def unused_under_join(seed: int) -> dict[str, Any]:
    """Without find_unused_parameters, the branch is used at step 0 only; rank 0 has one
    step, the others three: at step 1 (rank 0 has joined) every rank must raise, naming it."""
    group = C.get_default_group()
    ddp = DistributedDataParallel(Net(_widths(3, 6), "float64", seed, branch=True))
    message = ""
    try:
        with join(ddp):
            for s in range(1 if group.rank == 0 else 3):
                x, y = _batch(seed, group.rank, s, 0, 2, "float64")
                ((ddp(x, use_branch=s == 0) - y) ** 2).mean().backward()
    except RuntimeError as exc:
        message = str(exc)
    return {"message": message}


def raises_inside(seed: int, victim: int, at: int, catch: bool) -> dict[str, Any]:
    """Rank ``victim`` raises inside the block at step ``at`` (and, unless ``catch``, lets it
    end the process); what each rank saw, and when."""
    group = C.get_default_group()
    run = _Run(seed, {"opt": "sgd"}, group)
    t0 = time.monotonic()
    try:
        with join(run.ddp, optimizers=[run.opt]):
            for s in range(at + 3):
                if s == at and group.rank == victim:
                    raise ValueError("a bad batch")
                run.ddp_steps(s, 1)
    except Exception as exc:
        if group.rank == victim and not catch:
            raise
        return {"error": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - t0}
    return {"error": None, "message": "", "after_s": time.monotonic() - t0}
