"""Train a small GPT-style character language model with DistributedDataParallel.

    # 2 CPU ranks started by the script (about a minute on 2 cores):
    python examples/train_transformer_ddp.py --nproc 2

    # the same through the launcher:
    python -m collectives.run --nproc-per-node 2 examples/train_transformer_ddp.py

    # show what gradient bucketing buys: the same model and batches trained side by side
    # with one bucket (communication starts after backward), the default buckets, and small
    # buckets; prints how long the end of backward waited for communication (stats.wait_s):
    python examples/train_transformer_ddp.py --nproc 2 --compare-buckets --steps 60

    # mixed precision (float16 matmuls under tl.autocast, a GradScaler) and gradient
    # accumulation over 2 micro-batches per optimizer step (the first under no_sync):
    python examples/train_transformer_ddp.py --nproc 2 --amp --grad-accum 2

    # one GPU per rank:
    python -m collectives.run --nproc-per-node 8 examples/train_transformer_ddp.py --device cuda

    # sharded data parallelism (ZeRO): 1 = DDP + ZeroRedundancyOptimizer (1/N of AdamW's
    # state per rank), 2 = fully_shard per block and at the root keeping the gathered
    # parameters through backward, 3 = fully_shard freeing them after forward:
    python examples/train_transformer_ddp.py --nproc 2 --zero 3

    # checkpoint every 50 steps; a restarted job resumes from the latest one, exactly:
    python -m collectives.run --nproc-per-node 2 --max-restarts 3 \
        examples/train_transformer_ddp.py --checkpoint-every 50

The model is a pre-LayerNorm causal transformer written with tensorlib's nn layers
(Embedding, Linear, LayerNorm, GELU) and attention spelled out with matmuls and softmax.

The text is the Python documentation's topic help that ships with CPython itself
(``pydoc_data.topics``, what ``help("assert")`` prints): about 465,000 characters of real
English prose and code from the Language Reference, identical for a given Python version and
nothing to download. It is Python documentation, (c) Python Software Foundation, under the
PSF License Agreement (its code examples under the Zero-Clause BSD licence).

Each rank trains on its share of the text's non-overlapping windows (a DistributedSampler);
``--batch-size`` is the global batch of one micro-batch, and ``--grad-accum N`` sums the
gradients of N of them per optimizer step (an effective batch of N x batch-size). Training
is what nanoGPT does: AdamW, a linear warm-up (``--warmup`` steps) then a cosine decay to a
tenth of ``--lr`` (one ``SequentialLR``), gradients clipped to ``--clip`` (their norm, after
DDP averaged them, so every rank clips alike) and, with ``--amp``, ``tl.autocast`` to float16
with a ``GradScaler`` (a step whose gradients overflowed is skipped on every rank). Rank 0
prints the training loss averaged over the ranks, the learning rate, the time per step and
how long each step's backward waited for the last gradient buckets, then a validation loss
(computed in float32) and a short sample of generated text.

With ``--checkpoint-every K`` the run writes ``--checkpoint`` at step 0 and every K steps
(model, AdamW, schedule, GradScaler, the loader's position, every rank's random generators);
a restarted attempt (``DPT_RESTART_COUNT``/``TORCHELASTIC_RESTART_COUNT`` above 0) resumes
from it and makes the same updates as an uninterrupted run. A fresh attempt never resumes: its
step-0 checkpoint replaces whatever an older run left at the path. With
``--sharded-checkpoint`` the checkpoint is a directory in which each rank writes its own
shard and rank 0 the index (nothing is gathered to one rank: the form for ``--zero``), and it
resumes at any ``--nproc``.

``--zero 1|2|3`` trains the same model with its state sharded over the ranks (docs/ddp.md says
when to pick which stage); each reaches DDP's validation loss. ZeRO-1 works with everything
above. ZeRO-2/3 (``fully_shard``) clip with ``ddp.clip_grad_norm_`` (the global norm over
every rank's gradient shards), checkpoint and resume (the optimizer's shards gathered into
the checkpoint, split again on resume), accumulate ``--grad-accum`` micro-batches without
sync (one reduce-scatter per step), and with ``--amp`` gather the parameters in float16 and
reduce gradients in float32 over float32 master shards (FSDP2's ``MixedPrecisionPolicy``),
under autocast and a GradScaler that skips on every rank alike; they refuse
``--compare-buckets`` (DDP's buckets) and ``--device cuda`` (CPU shards only).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

import collectives
import tensorlib as tl
import tensorlib.functional as F
from ddp import (
    DataLoader,
    DistributedDataParallel,
    DistributedSampler,
    MixedPrecisionPolicy,
    ZeroRedundancyOptimizer,
    clip_grad_norm_,
    fully_shard,
    load_checkpoint,
    save_checkpoint,
)
from tensorlib import Tensor, nn, optim
from tensorlib.nn import init
from tensorlib.optim import lr_scheduler

# ---------------------------------------------------------------------------- data


def load_text() -> str:
    """The CPython documentation's topic help (``pydoc_data.topics``), topics in sorted order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions move it to a separate package
        raise SystemExit(
            "this example reads its text from the standard library's pydoc_data.topics, which "
            "this Python lacks (on Debian/Ubuntu it is in the libpython3.X-stdlib package)"
        ) from exc
    return "".join(topics[key] for key in sorted(topics))


class CharVocab:
    """Characters <-> integer ids, built from the text (sorted, so it is deterministic)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Ids of ``text`` as int64."""
        return np.fromiter((self.index[c] for c in text), dtype=np.int64, count=len(text))

    def decode(self, ids: Any) -> str:
        """Text of the ids."""
        return "".join(self.chars[int(i)] for i in ids)


def make_windows(
    ids: np.ndarray[Any, np.dtype[np.int64]], block: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Non-overlapping (input, next-character target) windows of ``block`` characters."""
    n = (len(ids) - 1) // block
    x = ids[: n * block].reshape(n, block)
    y = ids[1 : n * block + 1].reshape(n, block)
    return x, y


# ---------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, d_model: int, n_head: int, block: int, device: str) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} must be divisible by n_head {n_head}")
        self.n_head, self.head_dim = n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, device=device)
        self.proj = nn.Linear(d_model, d_model, device=device)
        # Added to the scores: -1e9 above the diagonal (the future), so softmax gives it ~0.
        # A plain attribute, not a buffer: a constant is neither saved nor broadcast by DDP.
        future = np.triu(np.ones((block, block), dtype=np.float32), k=1)
        self.mask = tl.tensor(future * -1e9, device=device)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        H, D = self.n_head, self.head_dim
        # (B, T, 3C) -> (3, B, H, T, D): one matmul makes queries, keys and values.
        qkv = self.qkv(x).reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(D)) + self.mask[:T, :T]
        y = F.softmax(scores, axis=-1) @ v  # (B, H, T, D)
        return self.proj(y.transpose(0, 2, 1, 3).reshape(B, T, C))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and an MLP, each on a residual path."""

    def __init__(self, d_model: int, n_head: int, block: int, device: str) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, device=device)
        self.attn = CausalSelfAttention(d_model, n_head, block, device)
        self.ln2 = nn.LayerNorm(d_model, device=device)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model, device=device),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model, device=device),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final LayerNorm and a linear head."""

    def __init__(
        self, vocab: int, d_model: int, n_layer: int, n_head: int, block: int, device: str
    ) -> None:
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, d_model, device=device)
        self.pos = nn.Embedding(block, d_model, device=device)
        # GPT-2's scale: N(0, 1) embeddings would swamp the residual stream at the start.
        init.normal_(self.tok.weight, std=0.02)
        init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList([Block(d_model, n_head, block, device) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model, device=device)
        self.head = nn.Linear(d_model, vocab, bias=False, device=device)
        self.positions = np.arange(block)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(self.positions[:T])
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))  # (B, T, vocab) logits


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-character cross-entropy over every position."""
    B, T, V = logits.shape
    return F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T))


@tl.no_grad()
def generate(model: CharGPT, prompt: np.ndarray[Any, Any], n: int, device: str, seed: int) -> Any:
    """Sample ``n`` characters after ``prompt`` (temperature 0.8, seeded: reproducible)."""
    model.eval()
    rng = np.random.default_rng(seed)
    ids = list(prompt)
    for _ in range(n):
        ctx = np.array([ids[-model.block :]], dtype=np.int64)
        logits = model(tl.tensor(ctx, device=device)).numpy()[0, -1] / 0.8
        p = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
    model.train()
    return ids[len(prompt) :]


# ---------------------------------------------------------------------------- training


@dataclass
class Config:
    """Everything a rank needs (it travels to spawned ranks, so plain values only)."""

    steps: int = 300
    batch_size: int = 32  # global: each of the N ranks takes batch_size // N windows per step
    block: int = 64
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    lr: float = 3e-3
    warmup: int = 30  # linear warm-up steps, then cosine decay to lr / 10
    clip: float = 1.0  # max gradient norm (0: no clipping)
    amp: bool = False  # float16 autocast + GradScaler
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0
    device: str = "cpu"
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    compare_buckets: bool = False
    log_every: int = 25
    progress: bool = True
    checkpoint: str = "runs/train_transformer_ddp.npz"
    checkpoint_every: int = 0  # steps; 0: no checkpoints
    sharded_checkpoint: bool = False  # a directory: each rank writes its shard, rank 0 the index
    zero: int = 0  # ZeRO stage: 0 DDP, 1 ZeroRedundancyOptimizer, 2/3 fully_shard


# What each --zero stage shards, for the start-up line.
ZERO_HOW = {
    1: "DDP + ZeroRedundancyOptimizer: AdamW state sharded",
    2: "fully_shard, reshard_after_forward=False: gradients and AdamW state sharded",
    3: "fully_shard, reshard_after_forward=True: parameters, gradients and AdamW state sharded",
}

# Bucket layouts for --compare-buckets: (name, first_bucket_mb, bucket_cap_mb).
LAYOUTS = [
    ("one bucket", 1e6, 1e6),  # everything in one bucket: it can only start once backward ends
    ("default", 1.0, 25.0),
    ("small", 0.25, 0.25),
]


def rank_device(spec: str, local_rank: int) -> str:
    """``cpu``, or for ``cuda`` this rank's GPU (``cuda:0`` under our launcher and spawn).

    Raises:
        SystemExit: for ``cuda`` without a usable GPU, saying what is missing.
    """
    if not spec.startswith("cuda"):
        return spec
    reason = tl.cuda_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--device {spec}: no usable CUDA GPU here: {reason}")
    return spec if spec != "cuda" else f"cuda:{local_rank % tl.cuda_device_count()}"


def build(cfg: Config, vocab: int, device: str, first_mb: float, cap_mb: float) -> Any:
    """A freshly initialized model (seeded: identical on every call) wrapped in DDP, or under
    ``--zero 2|3`` sharded with ``fully_shard``: each block, then the root (the embeddings, the
    final LayerNorm and the head), as FSDP2 users shard a transformer."""
    tl.manual_seed(cfg.seed)
    model = CharGPT(vocab, cfg.d_model, cfg.n_layer, cfg.n_head, cfg.block, device)
    if cfg.zero >= 2:
        # --amp: float16 all-gathers and compute, float32 gradient reduction and master shards.
        mp = MixedPrecisionPolicy(param_dtype=tl.float16, reduce_dtype=tl.float32)
        policy = mp if cfg.amp else None
        for blk in model.blocks:
            fully_shard(blk, reshard_after_forward=cfg.zero == 3, mp_policy=policy)
        return fully_shard(model, reshard_after_forward=cfg.zero == 3, mp_policy=policy)
    return DistributedDataParallel(model, bucket_cap_mb=cap_mb, first_bucket_mb=first_mb)


def plain_model(model: Any, cfg: Config, vocab: int, device: str) -> CharGPT:
    """The model to sample from on rank 0: DDP's module, or a sharded model's full parameters
    gathered into a plain copy (``state_dict()`` is a collective: every rank calls this)."""
    if isinstance(model, DistributedDataParallel):
        return cast(CharGPT, model.module)
    full = model.state_dict()
    plain = CharGPT(vocab, cfg.d_model, cfg.n_layer, cfg.n_head, cfg.block, device)
    plain.load_state_dict(full)
    return plain


@dataclass
class Trainer:
    """One model with what steps it: optimizer, learning-rate schedule, gradient scaler."""

    model: Any
    opt: optim.Optimizer
    sched: lr_scheduler.LRScheduler
    scaler: tl.amp.GradScaler
    skipped: int = 0  # optimizer steps the scaler skipped (overflowed float16 gradients)


def make_trainer(model: Any, cfg: Config) -> Trainer:
    """AdamW (under ``--zero 1`` inside a ZeroRedundancyOptimizer, each rank stepping its
    share; under ``--zero 2|3`` on the shards); ``cfg.warmup`` steps of linear warm-up, then
    cosine decay to lr / 10."""
    opt: optim.Optimizer
    if cfg.zero == 1:
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=optim.AdamW, lr=cfg.lr, weight_decay=0.01
        )
    else:
        opt = optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    warmup = min(cfg.warmup, cfg.steps - 1)
    cosine = lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps - warmup, eta_min=cfg.lr / 10)
    sched: lr_scheduler.LRScheduler = cosine
    if warmup > 0:
        ramp = lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup)
        sched = lr_scheduler.SequentialLR(opt, [ramp, cosine], milestones=[warmup])
    return Trainer(model, opt, sched, tl.amp.GradScaler(enabled=cfg.amp))


def train_step(tr: Trainer, micro: list[tuple[Tensor, Tensor]], cfg: Config) -> list[float]:
    """One optimizer step over the micro-batches; the loss and the times DDP reports.

    Returns [loss, backward s, wait s, step s, when backward ended]: the backward times are the
    last micro-batch's, the only one that communicates (the others run under ``no_sync``:
    DDP's, or a ``fully_shard`` model's, which accumulates full gradients in each unit and
    reduce-scatters their sum in the last backward; its wait is what its ``stats`` say the
    last micro-batch's forward and backward waited for all-gathers and reduce-scatters).
    """
    t0 = time.perf_counter()
    tr.opt.zero_grad()
    total = 0.0
    for i, (xb, yb) in enumerate(micro):
        last = i == len(micro) - 1
        with contextlib.nullcontext() if last else tr.model.no_sync():
            with tl.autocast(dtype=tl.float16, enabled=cfg.amp):
                loss = lm_loss(tr.model(xb), yb) * (1.0 / len(micro))
            t1 = time.perf_counter()
            tr.scaler.scale(loss).backward()  # the last returns once every all-reduce is done
            t2 = time.perf_counter()
        total += loss.item()
    tr.scaler.unscale_(tr.opt)  # the averaged gradients: every rank sees the same inf/NaN
    if cfg.clip > 0:
        # ddp's clip: the global norm over fully_shard's gradient shards (a collective); with
        # full gradients (DDP, ZeRO-1: averaged on every rank) it is tensorlib's plain clip.
        clip_grad_norm_(tr.model.parameters(), cfg.clip)
    scale = tr.scaler.get_scale()
    tr.scaler.step(tr.opt)  # skipped, on every rank alike, when a gradient overflowed
    tr.scaler.update()
    tr.skipped += tr.scaler.get_scale() < scale
    tr.sched.step()
    t3 = time.perf_counter()
    # DDP: the end of backward's wait for all-reduces; fully_shard: the step's waits for
    # all-gathers and reduce-scatters that prefetching and overlap did not hide.
    wait = tr.model.stats.wait_s
    return [total, t2 - t1, wait, t3 - t0, t2 - wait]


def batches(loader: DataLoader) -> Any:
    """Endless batches, reshuffled every epoch (the same epoch number on every rank), from the
    loader's epoch and position (where a checkpoint left them)."""
    epoch = loader.epoch
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def checkpoint(tr: Trainer, loader: DataLoader, cfg: Config, step: int) -> None:
    """Everything the run needs to continue exactly (every rank calls it; rank 0 writes)."""
    save_checkpoint(
        cfg.checkpoint,
        tr.model,
        tr.opt,
        step=step,
        extra={"skipped": tr.skipped},
        scheduler=tr.sched,
        scaler=tr.scaler,
        loader=loader,
        sharded=cfg.sharded_checkpoint,
    )


def resume(tr: Trainer, loader: DataLoader, cfg: Config, master: bool) -> int:
    """The step to continue after: a restarted attempt's checkpoint, else 0 (saved now)."""
    counts = [os.environ.get(k) for k in ("DPT_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")]
    restarted = any(c and c.isdigit() and int(c) > 0 for c in counts)
    if not cfg.checkpoint_every:
        return 0
    found = os.path.isfile(cfg.checkpoint) or os.path.isfile(
        os.path.join(cfg.checkpoint, "index.npz")  # a sharded checkpoint's directory
    )
    if not (restarted and found):
        checkpoint(tr, loader, cfg, 0)  # this run's own: a restart never finds a stale one
        return 0
    state = load_checkpoint(
        cfg.checkpoint, tr.model, tr.opt, scheduler=tr.sched, scaler=tr.scaler,
        loader=loader, rng=True,
    )  # fmt: skip
    tr.skipped = int(state["extra"]["skipped"])
    if master:
        print(f"resumed from {cfg.checkpoint} at step {state['step']}", flush=True)
    return int(state["step"])


def train(local_rank: int, cfg: Config) -> dict[str, Any]:
    """One rank's training loop; rank 0 reports. Returns a JSON summary."""
    rank, world = collectives.get_rank(), collectives.get_world_size()
    master = rank == 0
    device = rank_device(cfg.device, local_rank)
    if cfg.batch_size % world:
        raise SystemExit(f"--batch-size {cfg.batch_size} must be divisible by {world} ranks")

    text = load_text()
    vocab = CharVocab(text)
    ids = vocab.encode(text)
    split = int(0.9 * len(ids))
    x_train, y_train = make_windows(ids[:split], cfg.block)
    x_val, y_val = make_windows(ids[split:], cfg.block)
    sampler = DistributedSampler(len(x_train), num_replicas=world, rank=rank, seed=cfg.seed)
    loader = DataLoader(
        (x_train, y_train), batch_size=cfg.batch_size // world, sampler=sampler, device=device
    )

    layouts = LAYOUTS if cfg.compare_buckets else [("run", cfg.first_bucket_mb, cfg.bucket_cap_mb)]
    models = [build(cfg, len(vocab), device, first, cap) for _, first, cap in layouts]
    trainers = [make_trainer(m, cfg) for m in models]
    n_params = sum(p.size for p in models[0].parameters())
    if cfg.zero >= 2:  # parameters() are this rank's shards; state_dict() gathers full ones
        buffers = {k for k, _ in models[0].named_buffers()}
        n_params = sum(v.size for k, v in models[0].state_dict().items() if k not in buffers)
    if master:
        print(
            f"{len(text):,} characters of pydoc_data.topics, vocabulary {len(vocab)}, "
            f"{len(x_train):,} training windows of {cfg.block}; model {n_params:,} parameters; "
            f"world size {world} ({collectives.get_backend()}, {device}), global batch "
            f"{cfg.batch_size} = {world} x {cfg.batch_size // world}"
            + (f", {cfg.grad_accum} micro-batches per step" if cfg.grad_accum > 1 else "")
            + (", float16 autocast + GradScaler" if cfg.amp else "")
            + (f", ZeRO stage {cfg.zero} ({ZERO_HOW[cfg.zero]})" if cfg.zero else ""),
            flush=True,
        )
        for (name, _, _), m in zip(layouts, models, strict=True):
            if not isinstance(m, DistributedDataParallel):
                continue
            sizes = ", ".join(f"{b / 1024:.0f}" for b in m.bucket_sizes())
            print(f"  {name}: {len(m.bucket_sizes())} bucket(s) of [{sizes}] KiB", flush=True)

    # Per layout: backward seconds (includes the final wait), wait_s, whole-step seconds, and
    # when this rank's backward reached its end (perf_counter is one clock for the host).
    rec: list[dict[str, list[float]]] = [
        {"backward": [], "wait": [], "step": [], "arrive": []} for _ in layouts
    ]
    warmup = min(5, cfg.steps // 5)  # first steps pay for allocation and page faults
    start = resume(trainers[0], loader, cfg, master)
    it = batches(loader)
    bar: Any = None
    if cfg.progress and master:
        try:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, desc="train", leave=False, file=sys.stderr)
        except ImportError:
            pass
    loss_sums = np.zeros(len(layouts))
    since = 0
    for step in range(start + 1, cfg.steps + 1):
        micro = [next(it) for _ in range(cfg.grad_accum)]
        # Rotate which layout goes first so machine noise does not favour one of them.
        for k in [(step + j) % len(layouts) for j in range(len(layouts))]:
            loss, backward, wait, took, arrive = train_step(trainers[k], micro, cfg)
            loss_sums[k] += loss
            if step > warmup:
                rec[k]["backward"].append(backward)
                rec[k]["wait"].append(wait)
                rec[k]["step"].append(took)
                rec[k]["arrive"].append(arrive)
        since += 1
        if bar is not None:
            bar.update(1)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            checkpoint(trainers[0], loader, cfg, step)
        if step % cfg.log_every == 0 or step == cfg.steps:
            # Average the loss over ranks only when printing: one small all-reduce.
            collectives.all_reduce(loss_sums, op="avg")
            if master:
                # Medians since the last line (rank 0's view); per layout when comparing.
                waits = " / ".join(
                    f"{_recent_ms(rec[k]['wait'], since):.2f}"
                    + (f" ({name})" if cfg.compare_buckets else "")
                    for k, (name, _, _) in enumerate(layouts)
                )
                print(
                    f"step {step:4d}  train loss {loss_sums[0] / since:.4f}  "
                    f"lr {trainers[0].sched.get_last_lr()[0]:.2e}  "
                    f"{_recent_ms(rec[0]['step'], since):.1f} ms/step"
                    + (f"  wait after backward {waits} ms" if cfg.zero < 2 else "")
                    + (f"  wait for gathers/reductions {waits} ms" if cfg.zero >= 2 else ""),
                    flush=True,
                )
            loss_sums[:] = 0.0
            since = 0
    if bar is not None:
        bar.close()

    val_loss = evaluate(models[0], x_val, y_val, rank, world, device)
    skipped = trainers[0].skipped
    summary: dict[str, Any] = {"rank": rank, "val_loss": val_loss, "skipped_steps": skipped}
    sampler_model = plain_model(models[0], cfg, len(vocab), device)
    if master:
        if cfg.amp:
            print(
                f"GradScaler: {skipped} of {cfg.steps} steps skipped (overflow), final scale "
                f"{trainers[0].scaler.get_scale():g}",
                flush=True,
            )
        print(f"validation loss {val_loss:.6f} ({min(len(x_val), 256)} windows)", flush=True)
        prompt = vocab.encode("The ")
        sample = vocab.decode(generate(sampler_model, prompt, 160, device, cfg.seed))
        print(f"sample: {'The ' + sample!r}", flush=True)
    # The bucket table is DDP's (fully_shard has no buckets).
    summary["layouts"] = report_layouts(layouts, models, rec, master) if cfg.zero < 2 else []
    if cfg.compare_buckets:
        same = all(
            np.array_equal(a.numpy(), b.numpy())
            for m in models[1:]
            for a, b in zip(models[0].parameters(), m.parameters(), strict=True)
        )
        if master:
            print(f"parameters identical across bucket layouts: {'yes' if same else 'NO'}")
        summary["identical"] = same
    return summary


def _recent_ms(seconds: list[float], n: int) -> float:
    """Median of the last ``n`` entries, in milliseconds (0 when there are none yet)."""
    return 1e3 * statistics.median(seconds[-n:] or [0.0])


@tl.no_grad()
def evaluate(
    model: Any, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], rank: int, world: int, dev: str
) -> float:
    """Mean loss over (up to 256) validation windows, each rank scoring a disjoint share."""
    x, y = x[:256], y[:256]
    idx = np.array_split(np.arange(len(x)), world)[rank]
    total = np.zeros(2)
    model.eval()
    for start in range(0, len(idx), 32):
        j = idx[start : start + 32]
        loss = lm_loss(model(tl.tensor(x[j], device=dev)), tl.tensor(y[j], device=dev))
        total += (loss.item() * len(j), len(j))
    model.train()
    collectives.all_reduce(total)
    return float(total[0] / max(total[1], 1))


def report_layouts(
    layouts: list[tuple[str, float, float]],
    models: list[Any],
    rec: list[dict[str, list[float]]],
    master: bool,
) -> list[dict[str, Any]]:
    """Median backward/wait/step times per layout (the largest over ranks), in a table on rank 0.

    Also the skew: how far apart the ranks reached the end of backward. A rank that gets there
    first waits for the other whatever the buckets do, so ``wait`` is at least about the skew.
    """
    rows = []
    for (name, _, _), m, r in zip(layouts, models, rec, strict=True):
        keys = ("backward", "wait", "step")
        med = np.array([statistics.median(r[k] or [0.0]) for k in keys], dtype=np.float64)
        collectives.all_reduce(med, op="max")
        backward, wait, step = (float(v) for v in med)
        arrive = collectives.all_gather(np.array(r["arrive"] or [0.0], dtype=np.float64))
        skew = float(np.median(arrive.max(axis=0) - arrive.min(axis=0)))
        rows.append(
            {
                "layout": name,
                "buckets": len(m.bucket_sizes()),
                "bucket_bytes": m.bucket_sizes(),
                "launched_in_backward": m.stats.launched_in_backward,
                "backward_ms": 1e3 * backward,
                "wait_ms": 1e3 * wait,
                "skew_ms": 1e3 * skew,
                "step_ms": 1e3 * step,
            }
        )
    if master:
        print(
            f"\n{'layout':<11} {'buckets':>7} {'in bwd':>6} {'backward ms':>11} "
            f"{'wait ms':>8} {'wait/bwd':>8} {'skew ms':>8} {'step ms':>8}"
        )
        for row in rows:
            share = row["wait_ms"] / row["backward_ms"] if row["backward_ms"] else 0.0
            print(
                f"{row['layout']:<11} {row['buckets']:>7} {row['launched_in_backward']:>6} "
                f"{row['backward_ms']:>11.2f} {row['wait_ms']:>8.3f} {share:>8.1%} "
                f"{row['skew_ms']:>8.3f} {row['step_ms']:>8.2f}"
            )
        print(
            "(medians over steps, largest over ranks; in bwd: buckets whose all-reduce started "
            "during backward;\n wait: DDP's stats.wait_s, the time the end of backward waited "
            "for communication; skew: how far apart\n the ranks reached the end of backward, "
            "which the first one waits out whatever the buckets)",
            flush=True,
        )
    return rows


def parse_args(argv: list[str] | None = None) -> tuple[Config, int | None]:
    """The command line as a :class:`Config` and the ``--nproc`` value."""
    d = Config()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="start this many ranks on this host")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch size")
    p.add_argument("--block", type=int, default=d.block, help="context length in characters")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--n-layer", type=int, default=d.n_layer)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    p.add_argument("--clip", type=float, default=d.clip, help="max gradient norm (0: off)")
    p.add_argument("--amp", action="store_true", help="float16 autocast with a GradScaler")
    p.add_argument(
        "--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="cpu, or cuda for one GPU per rank")
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument("--first-bucket-mb", type=float, default=d.first_bucket_mb)
    p.add_argument(
        "--compare-buckets",
        action="store_true",
        help="train one-bucket, default and small-bucket layouts side by side and compare "
        "how long backward waits for communication",
    )
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--checkpoint", default=d.checkpoint, help="with --checkpoint-every")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        metavar="K",
        help="write --checkpoint every K steps (0: never); a restarted job resumes from it",
    )
    p.add_argument(
        "--sharded-checkpoint",
        action="store_true",
        help="write --checkpoint as a directory: each rank its shard, rank 0 the index (nothing "
        "gathered to one rank); it loads at any --nproc",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=d.zero,
        help="ZeRO stage: 0 DDP; 1 DDP + ZeroRedundancyOptimizer; 2 fully_shard keeping the "
        "gathered parameters through backward; 3 fully_shard freeing them after forward",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    a = p.parse_args(argv)
    if a.nproc is not None and a.nproc < 1:
        p.error(f"--nproc must be >= 1, got {a.nproc}")
    if a.nproc is not None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        p.error("--nproc starts ranks itself; under a launcher leave it out")
    if a.nproc is not None and a.batch_size % a.nproc:
        p.error(f"--batch-size {a.batch_size} (global) must be divisible by --nproc {a.nproc}")
    if a.steps < 1 or a.log_every < 1 or a.grad_accum < 1:
        p.error("--steps, --log-every and --grad-accum must be >= 1")
    if a.warmup < 0 or a.clip < 0 or a.checkpoint_every < 0:
        p.error("--warmup, --clip and --checkpoint-every must be >= 0")
    if a.checkpoint_every and a.compare_buckets:
        p.error("--checkpoint-every saves one model; --compare-buckets trains three")
    if a.zero and a.compare_buckets:
        p.error("--compare-buckets compares DDP's bucket layouts; leave out --zero")
    if a.zero >= 2 and a.device != "cpu":
        p.error(f"--zero {a.zero} with --device {a.device}: fully_shard shards CPU parameters only")
    cfg = replace(
        d,
        steps=a.steps,
        batch_size=a.batch_size,
        block=a.block,
        d_model=a.d_model,
        n_layer=a.n_layer,
        n_head=a.n_head,
        lr=a.lr,
        warmup=a.warmup,
        clip=a.clip,
        amp=a.amp,
        grad_accum=a.grad_accum,
        seed=a.seed,
        device=a.device,
        bucket_cap_mb=a.bucket_cap_mb,
        first_bucket_mb=a.first_bucket_mb,
        compare_buckets=a.compare_buckets,
        log_every=a.log_every,
        progress=not a.no_progress,
        checkpoint=a.checkpoint.removesuffix(".npz")
        if a.sharded_checkpoint and a.checkpoint == d.checkpoint
        else a.checkpoint,
        checkpoint_every=a.checkpoint_every,
        sharded_checkpoint=a.sharded_checkpoint,
        zero=a.zero,
    )
    return cfg, a.nproc


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: spawn ``--nproc`` ranks, or run as this process's rank."""
    cfg, nproc = parse_args(argv)
    if cfg.device.startswith("cuda"):
        rank_device(cfg.device, 0)  # fail once, here, before starting ranks
    with collectives.Parallel(nproc_per_node=nproc) as parallel:
        parallel.run(train, cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())  # guarded: spawned ranks import this file again
