"""Train an MLP on scikit-learn's 8x8 digits with DistributedDataParallel, on 1..N ranks.

The same script runs in every configuration:

    # 2 CPU ranks that the script starts itself (collectives.Parallel -> spawn):
    python examples/train_ddp.py --nproc 2

    # 2 ranks as threads of this one process (the threads backend; with --device cuda one
    # GPU per thread, on NCCL communicators made in this process):
    python examples/train_ddp.py --threads 2

    # 2 rank threads on the devices of a remote server, the gradients averaged on it
    # (python -m remote serve --device cpu --device cpu --port 3000 --token-file tok):
    python examples/train_ddp.py --threads 2 --remote gpu-host:3000 --token-file tok

    # 2 CPU ranks started by the launcher (torchrun-compatible environment):
    python -m collectives.run --nproc-per-node 2 examples/train_ddp.py

    # 2 ranks started by mpiexec, on the mpi backend (the `mpi` extra; several hosts with a
    # hostfile; as root Open MPI also wants OMPI_ALLOW_RUN_AS_ROOT=1 and
    # OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1):
    mpiexec -n 2 python examples/train_ddp.py --backend mpi

    # one process (world size 1, the serial backend; no special case in the code):
    python examples/train_ddp.py

    # one GPU per rank (needs the cuda12/cuda13 extra; NCCL when the backend is present):
    python -m collectives.run --nproc-per-node 8 examples/train_ddp.py --device cuda

    # continue a finished or interrupted run from its checkpoint, up to epoch 40:
    python examples/train_ddp.py --nproc 2 --resume runs/train_ddp.npz --epochs 40

    # checkpoint every 10 steps too; a restarted job (the launcher's --max-restarts) resumes
    # from the latest checkpoint, mid-epoch, exactly where the failed attempt was:
    python -m collectives.run --nproc-per-node 2 --max-restarts 3 examples/train_ddp.py \
        --checkpoint-every 10
    python examples/train_ddp.py --nproc 2 --max-restarts 3 --checkpoint-every 10  # the same

Each rank trains on its own 1/N of every epoch (a DistributedSampler), with a per-rank batch
of ``--batch-size / N`` so that the global batch, and with it the learning dynamics, does not
depend on N. DDP averages the gradients during ``backward()``, so every rank makes the same
update and the ranks' parameters stay identical. Rank 0 shows the progress bar (stderr), prints
one line per epoch (train loss averaged over all ranks, test accuracy over the whole test set,
each rank scoring its own share), and writes the checkpoint (atomically) at the end of every
epoch (and every ``--checkpoint-every`` steps). Expect about 97% test accuracy in a few seconds.

Resuming is exact: the checkpoint holds the model, the optimizer, the step, the data loader's
position in its epoch and every rank's random generators (dropout), so a resumed run makes the
same updates, bit for bit, as one that was never stopped (the resumed epoch's printed train
loss averages only the batches after the resume). The rule for where a run starts: a restarted
attempt (``DPT_RESTART_COUNT`` or ``TORCHELASTIC_RESTART_COUNT`` above 0) resumes from
``--checkpoint`` when that file exists; otherwise ``--resume PATH`` resumes from PATH; otherwise
the run starts fresh and at once writes its step-0 checkpoint to ``--checkpoint``, so a later
restart of this run never picks up a stale file an older run left there. At another world size
the random generators are not restored (a warning says so) and the dropout masks are reseeded.
Under ``--threads`` each rank thread has its own tensorlib default generator (the threads
backend gives it one: ``tl.set_thread_generator``), so its dropout masks are its own and
reproducible; NumPy's and Python's global generators stay the process's, shared by the rank
threads.

The digits (1,797 images, 10 classes) ship inside scikit-learn (BSD licence; a copy of the UCI
ML hand-written digits data), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import collectives
import tensorlib as tl
import tensorlib.functional as F
from ddp import (
    DataLoader,
    DistributedDataParallel,
    DistributedSampler,
    load_checkpoint,
    save_checkpoint,
)
from tensorlib import optim

# The single-process example next to this file holds the data split and the model, so that
# both scripts train the same network on the same data. Running a script puts its directory on
# sys.path; spawned ranks inherit the parent's sys.path; the insert covers `python -m`.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mlp import load_digits_split, make_model


@dataclass
class Config:
    """Everything a rank needs (it travels to spawned ranks, so plain values only)."""

    epochs: int = 30
    batch_size: int = 64  # global: each of the N ranks takes batch_size // N per step
    lr: float = 3e-3
    hidden: int = 128
    seed: int = 0
    device: str = "cpu"
    checkpoint: str = "runs/train_ddp.npz"
    checkpoint_every: int = 0  # steps; 0: only at the end of each epoch
    resume: str | None = None
    bucket_cap_mb: float = 25.0
    progress: bool = True
    backend: str | None = None  # None: chosen by the library (cpu, or nccl on GPUs)
    remote: str | None = None  # HOST:PORT of a remote server whose devices the threads use
    token_file: str | None = None  # its token


def rank_device(spec: str, local_rank: int) -> str:
    """This rank's device: ``cpu``, or for ``cuda`` one GPU per rank on this host.

    ``python -m collectives.run`` and ``spawn`` give each rank only its own GPU (through
    CUDA_VISIBLE_DEVICES), so this is ``cuda:0`` there; under another launcher that shows every
    GPU to every rank, local rank i takes GPU ``i % count``.

    Raises:
        SystemExit: for ``cuda`` without a usable GPU, saying what is missing.
    """
    if not spec.startswith("cuda"):
        return spec
    reason = tl.cuda_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--device {spec}: no usable CUDA GPU here: {reason}")
    if spec != "cuda":
        return spec  # an explicit cuda:N
    return f"cuda:{local_rank % tl.cuda_device_count()}"


def restart_count() -> int:
    """Which attempt of the job this is: 0 for the first, N after N restarts by the launcher."""
    counts = [os.environ.get(k) for k in ("DPT_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")]
    return max((int(c) for c in counts if c and c.isdigit()), default=0)


def resume_source(cfg: Config) -> str | None:
    """The checkpoint this attempt resumes from (see the module docstring), or None."""
    if restart_count() > 0 and Path(cfg.checkpoint).is_file():
        return cfg.checkpoint
    return cfg.resume


def progress_bar(it: Any, total: int, desc: str, enabled: bool) -> Any:
    """tqdm on stderr when enabled and installed, else the iterable itself."""
    if not enabled:
        return it
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, total=total, desc=desc, leave=False, file=sys.stderr)


@tl.no_grad()
def evaluate_share(
    model: Any, x: np.ndarray, y: np.ndarray, rank: int, world: int, device: str
) -> tuple[float, int]:
    """(sum of cross-entropy, correct predictions) over this rank's share of (x, y).

    The shares are disjoint and cover every sample once (unlike a DistributedSampler, which
    pads), so summing the ranks' counts gives the exact accuracy on the whole set.
    """
    idx = np.array_split(np.arange(len(x)), world)[rank]
    if len(idx) == 0:
        return 0.0, 0
    model.eval()
    logits = model(tl.tensor(x[idx], device=device))
    loss = F.cross_entropy(logits, tl.tensor(y[idx], device=device), reduction="sum").item()
    correct = int((logits.argmax(axis=1).numpy() == y[idx]).sum())
    model.train()
    return float(loss), correct


def train(local_rank: int, cfg: Config) -> dict[str, Any]:
    """One rank's training loop; every rank runs it, rank 0 reports. Returns a JSON summary."""
    rank, world = collectives.get_rank(), collectives.get_world_size()
    master = rank == 0  # rank 0 prints, shows the bar and writes the checkpoint
    # A rank thread (--threads) is bound to its device; a process takes its GPU by local rank.
    threads = collectives.get_backend() == "threads"
    device = str(collectives.get_device()) if threads else rank_device(cfg.device, local_rank)
    if cfg.batch_size % world:
        raise SystemExit(
            f"--batch-size {cfg.batch_size} is the global batch; it must be divisible by the "
            f"world size {world}"
        )
    per_rank_batch = cfg.batch_size // world

    # The same seed everywhere gives the same split and the same initial weights; DDP would
    # copy rank 0's weights to the others anyway, but equal draws keep runs reproducible.
    tl.manual_seed(cfg.seed)
    x_train, y_train, x_test, y_test = load_digits_split(cfg.seed)
    model = DistributedDataParallel(make_model(cfg.hidden, device), bucket_cap_mb=cfg.bucket_cap_mb)
    opt = optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)

    # Rank r takes every N-th index of the epoch's shared permutation (seed + epoch), padded
    # to equal shares so that every rank runs the same number of steps (DDP needs that:
    # each step is a collective).
    sampler = DistributedSampler(len(x_train), num_replicas=world, rank=rank, seed=cfg.seed)
    loader = DataLoader(
        (x_train, y_train), batch_size=per_rank_batch, sampler=sampler, device=device
    )

    first_epoch, step, restored = 1, 0, False
    source = resume_source(cfg)
    if source:
        # Every rank reads the file itself: the weights were identical when saved, and each
        # rank gets its own random generators back (at the same world size).
        state = load_checkpoint(source, model, opt, map_location=device, loader=loader, rng=True)
        step, restored = int(state["step"]), bool(state["rng_restored"])
        done, per_epoch = loader.batches_done, len(loader)
        # A finished epoch continues with the next one; an unfinished one where it stopped.
        first_epoch = loader.epoch + (done == per_epoch)
        if master:
            at = f" batch {done}/{per_epoch}" if done < per_epoch else ""
            print(f"resumed from {source}: epoch {loader.epoch}{at}, step {step}", flush=True)
    if not restored:
        # Dropout masks should differ between ranks (they see different samples), so reseed per
        # rank after the model exists; epoch and rank make a resumed run draw fresh masks.
        tl.manual_seed(cfg.seed + 1000 * first_epoch + rank)
    if not source:
        # This run's own checkpoint at once: a restart never resumes an older run's file.
        loader.set_epoch(first_epoch)
        save_checkpoint(cfg.checkpoint, model, opt, step=0, epoch=first_epoch, loader=loader)

    if master:
        print(
            f"world size {world} ({collectives.get_backend()} backend, {device}), global batch "
            f"{cfg.batch_size} = {world} x {per_rank_batch}, {len(loader)} steps per epoch, "
            f"buckets {model.bucket_sizes()} bytes",
            flush=True,
        )
    start = time.perf_counter()
    acc = float("nan")
    for epoch in range(first_epoch, cfg.epochs + 1):
        # Without set_epoch every epoch would repeat epoch 0's order (a resumed epoch keeps
        # its position: it yields only the batches not yet trained on).
        loader.set_epoch(epoch)
        loss_sum, seen = 0.0, 0
        bar = progress_bar(
            loader, len(loader), f"epoch {epoch}/{cfg.epochs}", cfg.progress and master
        )
        for xb, yb in bar:
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()  # returns with every .grad averaged over the ranks
            opt.step()
            step += 1
            loss_sum += loss.item() * len(yb)
            seen += len(yb)
            every = cfg.checkpoint_every
            # (The epoch's end saves anyway.)
            if every and step % every == 0 and loader.batches_done < len(loader):
                save_checkpoint(cfg.checkpoint, model, opt, step=step, epoch=epoch, loader=loader)
        test_loss, correct = evaluate_share(model, x_test, y_test, rank, world, device)
        # One small all-reduce per epoch sums every rank's counts (float64: exact for these).
        totals = np.array([loss_sum, seen, test_loss, correct], dtype=np.float64)
        collectives.all_reduce(totals)
        acc = totals[3] / len(y_test)
        if master:
            print(
                f"epoch {epoch:3d}  train loss {totals[0] / max(totals[1], 1):.4f}  "
                f"test loss {totals[2] / len(y_test):.4f}  test acc {acc:.2%}",
                flush=True,
            )
        # Every rank calls it (rank 0 writes, atomically; the others wait for the write).
        save_checkpoint(cfg.checkpoint, model, opt, step=step, epoch=epoch, loader=loader)

    if first_epoch > cfg.epochs:  # resumed a run that had already reached --epochs
        _, correct = evaluate_share(model, x_test, y_test, rank, world, device)
        totals = np.array([correct], dtype=np.float64)
        collectives.all_reduce(totals)
        acc = totals[0] / len(y_test)
    took = time.perf_counter() - start
    if master:
        print(
            f"final test accuracy: {acc:.2%} ({len(y_test)} images, {world} rank(s), "
            f"{took:.1f} s, {device})",
            flush=True,
        )
        if first_epoch <= cfg.epochs:
            print(f"checkpoint: {cfg.checkpoint} (step {step})", flush=True)
    return {"rank": rank, "accuracy": float(acc), "step": step}


def parse_args(argv: list[str] | None = None) -> tuple[Config, int | None, int]:
    """The command line as a :class:`Config`, the ranks to start (``--nproc`` or
    ``--threads``) and ``--max-restarts``."""
    d = Config()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="start this many ranks on this host (omit under a launcher, or for one process)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="run N ranks as threads of this process (the threads backend; --device cuda: one "
        "GPU per thread)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="collectives backend (default: cpu, or nccl with --device cuda); mpi needs "
        "`mpiexec -n N python examples/train_ddp.py --backend mpi`",
    )
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch size")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="cpu, or cuda for one GPU per rank")
    p.add_argument("--checkpoint", default=d.checkpoint, help="written at the end of each epoch")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        metavar="K",
        help="also write the checkpoint every K steps (0: off); a restarted job resumes from it",
    )
    p.add_argument("--resume", default=None, metavar="PATH", help="continue from a checkpoint")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="with --nproc: start the ranks again up to N times after a failure (under the "
        "launcher use its --max-restarts)",
    )
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument(
        "--remote",
        default=None,
        metavar="HOST:PORT",
        help="with --threads N: the ranks run on the first N devices of this remote server "
        "(python -m remote serve), which averages the gradients",
    )
    p.add_argument("--token-file", default=None, metavar="F", help="the remote server's token")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    a = p.parse_args(argv)
    if a.threads is not None:
        if a.nproc is not None:
            p.error("--threads N starts N rank threads; leave --nproc out")
        if a.threads < 1:
            p.error(f"--threads must be >= 1, got {a.threads}")
        if a.backend not in (None, "threads"):
            p.error(f"--threads runs on the threads backend, not --backend {a.backend}")
        a.nproc, a.backend = a.threads, "threads"
    if a.remote is not None and a.threads is None:
        p.error("--remote runs rank threads on the server's devices: give --threads N")
    if a.nproc is not None and a.nproc < 1:
        p.error(f"--nproc must be >= 1, got {a.nproc}")
    if a.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be >= 0, got {a.checkpoint_every}")
    if a.max_restarts < 0:
        p.error(f"--max-restarts must be >= 0, got {a.max_restarts}")
    if a.max_restarts and a.nproc is None:
        p.error(
            "--max-restarts restarts the ranks --nproc starts; under a launcher pass it to "
            "the launcher (python -m collectives.run --max-restarts N ...)"
        )
    flag = "--threads" if a.threads is not None else "--nproc"
    if a.nproc is not None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        p.error(f"{flag} starts ranks itself; under a launcher leave it out")
    if a.nproc is not None and a.batch_size % a.nproc:
        p.error(f"--batch-size {a.batch_size} (global) must be divisible by {flag} {a.nproc}")
    cfg = Config(
        epochs=a.epochs,
        batch_size=a.batch_size,
        lr=a.lr,
        hidden=a.hidden,
        seed=a.seed,
        device=a.device,
        checkpoint=a.checkpoint,
        checkpoint_every=a.checkpoint_every,
        resume=a.resume,
        bucket_cap_mb=a.bucket_cap_mb,
        progress=not a.no_progress,
        backend=a.backend,
        remote=a.remote,
        token_file=a.token_file,
    )
    return cfg, a.nproc, a.max_restarts


def _remote_devices(address: str, token_file: str | None, n: int) -> list[Any]:
    """The first ``n`` devices of the remote server at ``address``."""
    import remote  # importing it registers the threads backend's remote engine

    token = Path(token_file).read_text().strip() if token_file else None
    found = remote.devices(address, token=token)
    if len(found) < n:
        raise SystemExit(
            f"--threads {n}: the remote server {address} hosts {len(found)} device(s); start it "
            f"with one --device per rank"
        )
    return found[:n]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: spawn ``--nproc`` ranks, or run as this process's rank."""
    cfg, nproc, max_restarts = parse_args(argv)
    if cfg.device.startswith("cuda"):
        rank_device(cfg.device, 0)  # fail here, once, before starting any rank
    # Parallel picks the mode: spawn nproc ranks; join the launcher's group (RANK/WORLD_SIZE
    # set); or world size 1 in this process. Spawned ranks run train() and report home as JSON.
    # With --max-restarts a failed attempt starts every rank again; they resume (see above).
    devices = None
    if cfg.backend == "threads" and cfg.device.startswith("cuda") and nproc is not None:
        count = tl.cuda_device_count()  # one GPU per rank thread (round robin)
        devices = [
            cfg.device if cfg.device != "cuda" else f"cuda:{r % count}" for r in range(nproc)
        ]
    if cfg.remote is not None and nproc is not None:
        devices = _remote_devices(cfg.remote, cfg.token_file, nproc)
    parallel_job = collectives.Parallel(
        backend=cfg.backend, nproc_per_node=nproc, max_restarts=max_restarts, devices=devices
    )
    with parallel_job as parallel:
        parallel.run(train, cfg)
    return 0


if __name__ == "__main__":
    # The guard matters: spawned ranks import this file again (as __mp_main__).
    raise SystemExit(main())
