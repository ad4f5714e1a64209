"""DDP test bodies that run inside every rank of a :class:`~tests.collectives.harness.RankPool`.

Each body builds small seeded models (identical on every rank), trains them with
:class:`ddp.DistributedDataParallel` and, in the same process, a plain model on the global batch
(the single-process reference), and returns JSON summaries (differences, digests, messages)
that the tests assert on; a body raises only where the rank itself can tell it is wrong.

Data: every rank can rebuild the whole data set from the seed, so each rank also computes the
reference without any communication. Per step and micro-batch, rank ``r`` takes ``B`` samples:
its next ``B`` indices from :class:`ddp.DistributedSampler` when that exists (contiguous slices
otherwise); the reference uses the union of all ranks' samples for that step.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import signal
import time
from typing import Any

import numpy as np

import collectives as C
import tensorlib as tl
from ddp import (
    DataLoader,
    DistributedDataParallel,
    GradBucket,
    allreduce_hook,
    fp16_compress_hook,
)
from tensorlib import Tensor, nn

try:  # written concurrently; contiguous slices do the same job until it lands
    from ddp._sampler import DistributedSampler
except ImportError:  # pragma: no cover - depends on the checkout
    DistributedSampler = None  # type: ignore[assignment,misc]

D_IN, D_OUT = 6, 3


# ---------------------------------------------------------------------------- models
class Net(nn.Module):
    """A tanh MLP, optionally with a ``branch`` (a linear skip) that forward may leave out.

    ``variant``: "" (plain); "frozen" (the first layer's weight has requires_grad=False);
    "tied" (the second layer is applied twice, so its gradient sums two uses); "mixed" (a
    float64 output ``scale`` on a float32 net: two bucket dtypes); "strided" (the first
    weight's array is not C-contiguous).
    """

    def __init__(
        self,
        widths: list[int],
        dtype: str,
        seed: int,
        branch: bool = False,
        buffer: bool = False,
        variant: str = "",
    ) -> None:
        super().__init__()
        gen = tl.Generator(seed)
        self.variant = variant
        self.layers = nn.ModuleList(
            [nn.Linear(a, b, dtype=dtype, generator=gen) for a, b in itertools.pairwise(widths)]
        )
        if branch:
            self.branch = nn.Linear(widths[0], widths[-1], dtype=dtype, generator=gen)
        if buffer:
            self.register_buffer("running", tl.zeros(4, dtype=dtype))
            self.register_buffer("grid", tl.zeros(3, 2, dtype=dtype).transpose())  # strided
        if variant == "frozen":
            self.layers[0].weight.requires_grad = False
        elif variant == "mixed":
            scale = gen.rng.uniform(0.5, 1.5, size=widths[-1])
            self.scale = nn.Parameter(tl.tensor(scale, dtype="float64"))
        elif variant == "strided":
            # A parameter whose array is a transposed view (not C-contiguous), as a tied or
            # transposed weight can be.
            w = self.layers[0].weight
            self.layers[0].weight = nn.Parameter(
                tl.tensor(np.ascontiguousarray(w.data.T)).transpose()
            )
        elif variant not in ("", "tied"):
            raise ValueError(f"unknown variant {variant!r}")

    def forward(self, x: Tensor, use_branch: bool = False) -> Tensor:
        h = x
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < last:
                h = h.tanh()
            if i == 1 and self.variant == "tied":
                h = layer(h).tanh()
        if use_branch:
            h = h + self.branch(x)
        if self.variant == "mixed":
            h = h * self.scale
        return h


def _widths(depth: int, width: int) -> list[int]:
    return [D_IN] + [width] * (depth - 1) + [D_OUT]


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).mean()


def _group() -> C.ProcessGroup:
    return C.get_default_group()


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(np.ascontiguousarray(p.data).tobytes())
    return h.hexdigest()


def _optimizer(kind: str, params: Any) -> tl.optim.Optimizer:
    if kind == "sgd":
        return tl.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return tl.optim.Adam(params, lr=0.01)
    raise ValueError(f"unknown optimizer {kind!r}")


# ---------------------------------------------------------------------------- data
class Shards:
    """The data set and which samples each rank takes at each (step, micro-batch)."""

    def __init__(
        self, seed: int, world: int, batch: int, steps: int, accum: int, dtype: str
    ) -> None:
        self.world, self.batch, self.accum = world, batch, accum
        n = world * batch * steps * accum
        rng = np.random.default_rng([seed, 7])
        self.x = rng.standard_normal((n, D_IN)).astype(dtype)
        self.y = rng.standard_normal((n, D_OUT)).astype(dtype)
        per_rank: list[Any]
        if DistributedSampler is not None:
            per_rank = [
                list(
                    DistributedSampler(
                        n, num_replicas=world, rank=r, shuffle=True, seed=seed, drop_last=True
                    )
                )
                for r in range(world)
            ]
            self.sampler = True
        else:
            per_rank = [
                np.arange(n).reshape(-1, world, batch)[:, r].reshape(-1) for r in range(world)
            ]
            self.sampler = False
        self.idx = [np.asarray(list(ix), dtype=np.int64) for ix in per_rank]

    def rows(self, rank: int, step: int, micro: int) -> np.ndarray[Any, Any]:
        k = step * self.accum + micro
        return self.idx[rank][k * self.batch : (k + 1) * self.batch]

    def xy(self, rows: np.ndarray[Any, Any]) -> tuple[Tensor, Tensor]:
        return tl.tensor(self.x[rows]), tl.tensor(self.y[rows])


def _uses_branch(pattern: str, rank: int, step: int, micro: int, accum: int) -> bool:
    """Whether rank ``rank`` runs the branch at (step, micro) under ``pattern``."""
    if pattern == "none":
        return False
    if pattern == "rank0":  # only rank 0 ever uses it
        return rank == 0
    if pattern == "odd_steps":  # every rank on odd steps, no rank on even ones
        return step % 2 == 1
    if pattern == "nosync_only":  # only in the accumulation (no_sync) micro-batches
        return micro < accum - 1
    raise ValueError(f"unknown branch pattern {pattern!r}")


# ---------------------------------------------------------------------------- equivalence
def equivalence(seed: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train each case with DDP and, in this process, the single-process reference.

    A case: ``opt`` (sgd|adam), ``dtype``, ``steps``, ``batch``, ``accum`` (micro-batches per
    step; all but the last under ``no_sync``), ``hook`` (default|record|fp16), ``branch``
    (see :func:`_uses_branch`), ``find_unused``, ``bucket_cap_mb``, ``first_bucket_mb``,
    ``set_to_none`` (how ``zero_grad`` clears), ``depth``, ``width``, ``variant`` (see
    :class:`Net`).

    Returns per case: the largest parameter and gradient differences from the reference and the
    scale they compare to, a digest of the parameters (equal on every rank), the number of
    buckets, the parameters whose grad was None after each backward, and what the recording
    hook saw.
    """
    return [_equivalence_case(seed + i, case) for i, case in enumerate(cases)]


def _equivalence_case(
    seed: int, case: dict[str, Any], group: C.ProcessGroup | None = None
) -> dict[str, Any]:
    group = group if group is not None else _group()
    world, rank = group.size, group.rank
    opt_kind: str = case.get("opt", "sgd")
    dtype: str = case.get("dtype", "float64")
    steps: int = case.get("steps", 3)
    batch: int = case.get("batch", 4)
    accum: int = case.get("accum", 1)
    hook_kind: str = case.get("hook", "default")
    pattern: str = case.get("branch", "none")
    set_to_none: bool = case.get("set_to_none", True)
    widths = _widths(case.get("depth", 3), case.get("width", 8))
    has_branch = pattern != "none"
    variant: str = case.get("variant", "")

    data = Shards(seed, world, batch, steps, accum, dtype)
    # Rank-dependent init: DDP must replace it with the group's first rank's parameters.
    model = Net(widths, dtype, seed + 1000 * rank, branch=has_branch, variant=variant)
    ref = Net(widths, dtype, seed, branch=has_branch, variant=variant)
    init = {n: p.data.copy() for n, p in ref.named_parameters()}

    calls: list[list[int]] = []
    lasts: list[list[bool]] = []
    not_views: list[str] = []
    bucket_buffers: dict[int, Any] = {}

    def recording(state: Any, bucket: GradBucket) -> C.Work:
        calls[-1].append(bucket.index)
        lasts[-1].append(bucket.is_last())
        buf = bucket.buffer()
        bucket_buffers[bucket.index] = buf
        for p in bucket.parameters():
            # The grads are views into the bucket: communication needs no copy in or out.
            if p.grad is None or not np.shares_memory(p.grad.data, buf):
                not_views.append(names[id(p)])
        return allreduce_hook(state, bucket)

    hook = {"default": None, "record": recording, "fp16": fp16_compress_hook}[hook_kind]
    ddp = DistributedDataParallel(
        model,
        process_group=group,
        bucket_cap_mb=case.get("bucket_cap_mb", 25.0),
        first_bucket_mb=case.get("first_bucket_mb", 1.0),
        find_unused_parameters=case.get("find_unused", False),
        comm_hook=hook,
    )
    names = {id(p): n for n, p in model.named_parameters()}
    # Through the wrapper, as users do (same Parameter objects as the module's).
    opt = _optimizer(opt_kind, [p for p in ddp.parameters() if p.requires_grad])
    ref_opt = _optimizer(opt_kind, [p for p in ref.parameters() if p.requires_grad])

    grad_diff = 0.0
    grad_scale = 0.0
    none_after: list[list[str]] = []
    launch_orders: list[list[int]] = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        calls.append([])
        lasts.append([])
        _ddp_backward(ddp, data, pattern, rank, step, accum)
        launch_orders.append(list(ddp.stats.launch_order))
        none_after.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        if hook_kind == "record":
            # Still views after backward returned (the averages were written in place).
            for name, p in model.named_parameters():
                if p.grad is not None and not any(
                    np.shares_memory(p.grad.data, b) for b in bucket_buffers.values()
                ):
                    not_views.append(name)
        _reference_backward(ref, data, pattern, world, step, accum, batch)
        diff, scale = _grad_differences(model, ref, step)
        grad_diff, grad_scale = max(grad_diff, diff), max(grad_scale, scale)
        opt.step()
        ref_opt.step()

    param_diff = 0.0
    change = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        param_diff = max(param_diff, float(np.max(np.abs(p.data - q.data))))
        change = max(change, float(np.max(np.abs(q.data - init[name]))))
    return {
        "param_diff": param_diff,
        "param_change": change,
        "grad_diff": grad_diff,
        "grad_scale": grad_scale,
        "digest": _digest(model),
        "buckets": len(ddp.bucket_sizes()),
        "bucket_sizes": ddp.bucket_sizes(),
        "params": len(list(model.parameters())),
        "none_after": none_after,
        "launch_orders": launch_orders,
        "hook_calls": calls if hook_kind == "record" else None,
        "hook_lasts": lasts if hook_kind == "record" else None,
        "not_views": sorted(set(not_views)),
        "sampler": data.sampler,
    }


def _ddp_backward(
    ddp: DistributedDataParallel, data: Shards, pattern: str, rank: int, step: int, accum: int
) -> None:
    """DDP: this rank's micro-batches; the first accum-1 accumulate locally under no_sync."""
    for micro in range(accum):
        rows = data.rows(rank, step, micro)
        x, y = data.xy(rows)
        sync = contextlib.nullcontext() if micro == accum - 1 else ddp.no_sync()
        with sync:
            use = _uses_branch(pattern, rank, step, micro, accum)
            loss = _mse(ddp(x, use_branch=use), y) * (1.0 / accum)
            loss.backward()


def _reference_backward(
    ref: Net, data: Shards, pattern: str, world: int, step: int, accum: int, batch: int
) -> None:
    """The reference: one process, one backward over every sample of this step (all ranks,
    all micro-batches); the mean over all of them is what averaging rank means gives."""
    by_flag: dict[bool, list[np.ndarray[Any, Any]]] = {False: [], True: []}
    for r in range(world):
        for micro in range(accum):
            by_flag[_uses_branch(pattern, r, step, micro, accum)].append(data.rows(r, step, micro))
    total = world * accum * batch * D_OUT
    ref_loss: Tensor | None = None
    for flag, parts in by_flag.items():
        if not parts:
            continue
        x, y = data.xy(np.concatenate(parts))
        part = ((ref(x, use_branch=flag) - y) ** 2).sum() * (1.0 / total)
        ref_loss = part if ref_loss is None else ref_loss + part
    assert ref_loss is not None
    ref_loss.backward()


def _grad_differences(model: Net, ref: Net, step: int) -> tuple[float, float]:
    """The largest difference between DDP's and the reference's gradients, and the largest
    reference gradient; raises when one has a gradient where the other has None."""
    diff = scale = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(
                f"step {step}: {name}.grad is {'None' if p.grad is None else 'set'} with "
                f"DDP but {'None' if q.grad is None else 'set'} in the reference"
            )
        if p.grad is not None and q.grad is not None:
            diff = max(diff, float(np.max(np.abs(p.grad.data - q.grad.data))))
            scale = max(scale, float(np.max(np.abs(q.grad.data))))
    return diff, scale


def subgroups(seed: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The equivalence cases on a subgroup: even and odd ranks each train their own DDP over
    ``new_group`` (a group of one runs on the serial backend); the reference is the group's."""
    world = C.get_world_size()
    groups = [C.new_group([r for r in range(world) if r % 2 == k]) for k in (0, 1)]
    mine = groups[C.get_rank() % 2]
    assert isinstance(mine, C.ProcessGroup)
    try:
        # Each group trains its own model: seeds differ, so digests must differ across groups.
        return [
            {
                **_equivalence_case(seed + 100 * (C.get_rank() % 2) + i, case, mine),
                "group": list(mine.ranks),
            }
            for i, case in enumerate(cases)
        ]
    finally:
        for g in groups:
            C.destroy_process_group(g)


# ---------------------------------------------------------------------------- overlap
def overlap(seed: int, depth: int, steps: int) -> dict[str, Any]:
    """A deep MLP with one bucket per parameter: what ``ddp.stats`` says about each backward."""
    group = _group()
    model = Net(_widths(depth, 16), "float32", seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    opt = tl.optim.SGD(model.parameters(), lr=0.05)
    data = Shards(seed, group.size, 8, steps, 1, "float32")
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = data.xy(data.rows(group.rank, step, 0))
        _mse(ddp(x), y).backward()
        s = ddp.stats
        out.append(
            {
                "launched_in_backward": s.launched_in_backward,
                "ready_at_launch": list(s.ready_at_launch),
                "launch_order": list(s.launch_order),
                "num_params": s.num_params,
            }
        )
        opt.step()
    return {"steps": out, "buckets": len(ddp.bucket_sizes()), "digest": _digest(model)}


# ---------------------------------------------------------------------------- hooks & buffers
def custom_hook(seed: int) -> dict[str, Any]:
    """A user hook (registered with ``register_comm_hook`` and its own state) sees every bucket
    once, in order, and its result (the average, done by the default hook) lands in ``.grad``."""
    group = _group()
    model = Net(_widths(4, 8), "float64", seed)
    ref = Net(_widths(4, 8), "float64", seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    state: dict[str, Any] = {"group": group, "seen": []}

    def hook(st: dict[str, Any], bucket: GradBucket) -> C.Work:
        st["seen"].append([bucket.index, bucket.is_last(), len(bucket.parameters())])
        return allreduce_hook(st["group"], bucket)

    ddp.register_comm_hook(state, hook)
    data = Shards(seed, group.size, 3, 2, 1, "float64")
    seen: list[list[list[Any]]] = []
    diff = 0.0
    for step in range(2):
        state["seen"] = []
        model.zero_grad()
        ref.zero_grad()
        x, y = data.xy(data.rows(group.rank, step, 0))
        _mse(ddp(x), y).backward()
        seen.append(state["seen"])
        rows = np.concatenate([data.rows(r, step, 0) for r in range(group.size)])
        xr, yr = data.xy(rows)
        _mse(ref(xr), yr).backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            diff = max(diff, float(np.max(np.abs(p.grad.data - q.grad.data))))
    return {"seen": seen, "buckets": len(ddp.bucket_sizes()), "grad_diff": diff}


def buffers(seed: int) -> dict[str, Any]:
    """Rank-specific buffer values: rank 0's win at construction and before every forward
    (``broadcast_buffers=True``); with ``broadcast_buffers=False`` each rank keeps its own."""
    group = _group()
    out: dict[str, Any] = {}
    for flag in (True, False):
        model = Net(_widths(2, 4), "float64", seed, buffer=True)
        assert not model.grid.data.flags.c_contiguous
        for b in model.buffers():
            b.data[...] = 10.0 + group.rank
        ddp = DistributedDataParallel(model, broadcast_buffers=flag)
        at_construction = [sorted(set(b.data.ravel().tolist())) for b in model.buffers()]
        for b in model.buffers():
            b.data[...] = 20.0 + group.rank  # e.g. running statistics drifting apart
        x = tl.tensor(np.ones((2, D_IN)))
        ddp(x)
        out[str(flag)] = {
            "construction": at_construction,
            "after_forward": [sorted(set(b.data.ravel().tolist())) for b in model.buffers()],
        }
    return out


def eval_uneven(seed: int, n: int) -> dict[str, Any]:
    """A training step, then an evaluation under ``no_grad`` over unpadded shards (ranks run
    different numbers of batches), then a metric all-reduce and another training step: every
    collective after the evaluation must still pair up across the ranks.

    The model has buffers (``broadcast_buffers``), set rank-specific after each phase: the
    first eval forward broadcasts rank 0's (it follows a synchronizing forward), later eval
    forwards and the next training forward broadcast nothing (PyTorch's rule)."""
    group = _group()
    rank, world = group.rank, group.size
    model = Net(_widths(2, 4), "float64", seed, buffer=True)
    ddp = DistributedDataParallel(model)
    opt = tl.optim.SGD(list(ddp.parameters()), lr=0.1)
    rng = np.random.default_rng([seed, 11])
    x = rng.standard_normal((n, D_IN))
    y = rng.standard_normal((n, D_OUT))

    def train_step() -> None:
        opt.zero_grad()
        rows = slice(rank, None, world)  # any same-sized batch per rank
        _mse(ddp(tl.tensor(x[rows][:2])), tl.tensor(y[rows][:2])).backward()
        opt.step()

    def set_buffers(value: float) -> None:
        for b in model.buffers():
            b.data[...] = value

    train_step()
    set_buffers(20.0 + rank)  # running statistics drifting apart in training
    sampler = DistributedSampler(n, shuffle=False, even_shards=False)
    loader = DataLoader((x, y), batch_size=2, sampler=sampler)
    seen: list[float] = []
    sq, count = 0.0, 0
    with tl.no_grad():
        for i, (xb, yb) in enumerate(loader):
            out = ddp(xb)
            seen.append(float(model.running.data[0]))
            if i == 0:
                set_buffers(30.0 + rank)  # a later broadcast would overwrite these
            sq += float(((out - yb) ** 2).sum().item())
            count += int(xb.shape[0])
        # One process's metric over the whole data set, with the same parameters.
        ref = float(((model(tl.tensor(x)) - tl.tensor(y)) ** 2).sum().item())
    totals = np.array([sq, float(count)])
    group.all_reduce(totals, C.ReduceOp.SUM)
    train_step()  # the ranks are still in lockstep: its gradient all-reduce pairs up
    return {
        "batches": len(loader),
        "seen": seen,
        "sum_sq": float(totals[0]),
        "count": int(totals[1]),
        "ref_sq": ref,
        "after_train": float(model.running.data[0]),
        "digest": _digest(model),
    }


# ---------------------------------------------------------------------------- errors
def mismatch(seed: int, kind: str, odd: int) -> str:
    """Rank ``odd`` builds a different model; return the error each rank raises (or '').

    kind: "shape" (layers.1 is (9, 8) there), "extra" (it has a branch the others lack),
    "missing" (it lacks the others' branch), "dtype" (float32 there), "frozen" (its
    layers.0.weight does not require grad), "order" (it registers the branch first),
    "bucket" (other bucket_cap_mb), "find_unused" (other find_unused_parameters).
    """
    rank = _group().rank
    here = rank == odd
    widths = [D_IN, 8, 9, D_OUT] if kind == "shape" and here else _widths(3, 8)
    branch = here if kind == "extra" else (not here if kind == "missing" else kind == "order")
    dtype = "float32" if kind == "dtype" and here else "float64"
    model = Net(
        widths, dtype, seed, branch=branch, variant="frozen" if kind == "frozen" and here else ""
    )
    if kind == "order" and here:
        model._modules.move_to_end("layers")  # as if its class assigned self.branch first
    options: dict[str, Any] = {}
    if kind == "bucket" and here:
        options = {"bucket_cap_mb": 1e-6}
    if kind == "find_unused":
        options = {"find_unused_parameters": here}
    try:
        DistributedDataParallel(model, **options)
    except ValueError as exc:
        return str(exc)
    return ""


def unused_without_flag(seed: int, user: int) -> list[str]:
    """``branch`` is used by rank ``user`` only (-1: by none), without
    ``find_unused_parameters``: every rank must raise, naming it, for two steps in a row."""
    group = _group()
    model = Net(_widths(3, 8), "float64", seed, branch=True)
    ddp = DistributedDataParallel(model)
    data = Shards(seed, group.size, 2, 2, 1, "float64")
    messages = []
    for step in range(2):
        model.zero_grad()
        x, y = data.xy(data.rows(group.rank, step, 0))
        try:
            _mse(ddp(x, use_branch=group.rank == user), y).backward()
        except RuntimeError as exc:
            messages.append(str(exc))
        else:
            messages.append("")
    # The group is still in step: a normal step works afterwards.
    model.zero_grad()
    _mse(ddp(x, use_branch=True), y).backward()
    return messages


def die_mid_step(seed: int, victim: int, step_to_die: int) -> dict[str, Any]:
    """Train; on rank ``victim`` SIGKILL the process from a gradient hook in the middle of a
    backward. The survivors report what they raised and how long after the step began."""
    group = _group()
    model = Net(_widths(6, 16), "float32", seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    opt = tl.optim.SGD(model.parameters(), lr=0.05)
    data = Shards(seed, group.size, 4, step_to_die + 1, 1, "float32")
    middle = list(model.parameters())[len(list(model.parameters())) // 2]
    t0 = time.monotonic()
    try:
        for step in range(step_to_die + 1):
            if step == step_to_die and group.rank == victim:
                middle.register_post_accumulate_grad_hook(
                    lambda p: os.kill(os.getpid(), signal.SIGKILL)
                )
            t0 = time.monotonic()
            opt.zero_grad()
            x, y = data.xy(data.rows(group.rank, step, 0))
            _mse(ddp(x), y).backward()
            opt.step()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - t0}
    return {"error": None, "message": "", "after_s": time.monotonic() - t0}


# ---------------------------------------------------------------------------- no launcher
def no_launcher() -> dict[str, Any]:
    """A plain script (no launcher, no ``init_process_group``): DDP runs as world size 1."""
    cases = [{"opt": "sgd", "steps": 3}, {"opt": "adam", "accum": 2, "steps": 3}]
    results = equivalence(11, cases)
    return {"backend": C.get_backend(), "world": C.get_world_size(), "results": results}
