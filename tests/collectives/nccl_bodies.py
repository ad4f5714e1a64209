"""Test bodies specific to the nccl backend, run in every rank (thread or process).

The shared bodies (``bodies.py``) cover what every backend must do; these cover what only the
nccl backend has: streams and events, references held by a Work, the device check, abort and
the store-published failures, and the per-call host cost.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import collectives as C
from tests.collectives.bodies import _try, _world, check, data, reference, wait_for_file


def backend_info() -> dict[str, Any]:
    """The default group's backend, GPU and communicator as this rank sees them."""
    b = C.get_default_group().backend
    return {
        "backend": b.name,
        "device": getattr(b, "device", None),
        "check": getattr(b, "check", None),
        "comm": bool(getattr(b, "comm", 0)),
    }


def leave_group(leaver: int) -> dict[str, Any]:
    """Rank ``leaver`` destroys its default group (its thread goes on) instead of joining
    all_reduce #2; the others must fail fast, not at the group timeout."""
    rank, _ = _world()
    C.all_reduce(np.ones(4))
    if rank == leaver:
        C.get_default_group().destroy()
        return {"type": None, "left": True}
    return _try(lambda: C.all_reduce(np.ones(1000, dtype=np.float32)))


def call_outcome(op: str = "all_reduce", size: int = 100) -> dict[str, Any]:
    """One collective and then the next: what each raised (or None)."""
    rank, n = _world()
    x = np.full(size, rank + 1.0, dtype=np.float32)
    if op == "all_reduce":
        first = _try(lambda: C.all_reduce(x))
    elif op == "all_to_all":
        first = _try(lambda: C.all_to_all(np.ones(2 * n, dtype=np.float32)))
    else:
        raise ValueError(op)
    first["value"] = float(x[0])
    first["next"] = _try(lambda: C.all_reduce(np.ones(4)))
    return first


def refs_until_done(directory: str, size: int) -> dict[str, Any]:
    """Rank 0 starts an async all_reduce on a CuPy array before rank 1 joins: until then the
    Work is pending and holds the array; once done it lets go."""
    import cupy

    rank, n = _world()
    flag = os.path.join(directory, "rank0-checked")
    x = cupy.asarray(np.full(size, rank + 1.0, dtype=np.float32))
    if rank == 0:
        work = C.all_reduce(x, async_op=True)
        time.sleep(0.1)
        pending = not work.is_completed()
        held = any(r is x for r in work.refs)
        with open(flag, "w") as f:
            f.write("go")
        assert work.wait(timeout=30) is x
        deadline = time.monotonic() + 10
        while work.refs and time.monotonic() < deadline:
            time.sleep(0.01)
        released = not work.refs
    else:
        assert wait_for_file(flag, 30), "rank 0 never checked its pending Work"
        C.all_reduce(x)
        pending, held, released = True, True, True
    check(x.get(), np.full(size, n * (n + 1) / 2, dtype=np.float32), "all_reduce after hold")
    return {"pending": pending, "held": held, "released": released}


def wait_without_host_sync(directory: str) -> dict[str, Any]:
    """On a (fake) non-null stream, ``wait()`` on a CuPy array returns before the collective
    ran (the stream waits, not the host); the data is right once that stream has run."""
    import cupy

    rank, n = _world()
    flag = os.path.join(directory, "rank0-returned")
    x = cupy.asarray(np.full(7, rank + 1.0, dtype=np.float64))
    returned_early = True
    if rank == 0:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            work = C.all_reduce(x, async_op=True)
            assert work.wait() is x
            returned_early = not work.is_completed()
        with open(flag, "w") as f:
            f.write("go")
        stream.synchronize()
    else:
        assert wait_for_file(flag, 30), "rank 0's wait() blocked"
        C.all_reduce(x)
    check(x.get(), np.full(7, n * (n + 1) / 2), "all_reduce waited on a stream")
    return {"returned_early": returned_early}


def wrong_device() -> str:
    """A CuPy array on another GPU than the group's is refused before anything is issued."""
    import cupy

    rank, _ = _world()
    b: Any = C.get_default_group().backend
    other = (b.device + 1) % cupy.cuda.runtime.getDeviceCount()
    seq = C.get_default_group().seq
    with cupy.cuda.Device(other):
        x = cupy.ones(4, dtype=cupy.float32)
    try:
        C.all_reduce(x)
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("all_reduce of an array on another GPU did not raise")
    assert C.get_default_group().seq == seq, "the refused call consumed a sequence number"
    with cupy.cuda.Device(b.device):
        y = cupy.full(4, rank + 1.0, dtype=cupy.float32)
    C.all_reduce(y)
    return message


def synchronize_waits(seed: int) -> int:
    """``group.synchronize()`` returns once every async collective finished."""
    import cupy

    rank, n = _world()
    xs = [cupy.asarray(data(seed, rank, 1000, "float32", i)) for i in range(5)]
    works = [C.all_reduce(x, async_op=True) for x in xs]
    assert C.get_default_group().synchronize(timeout=30)
    assert all(w.is_completed() for w in works)
    for i, x in enumerate(xs):
        ref = reference([data(seed, r, 1000, "float32", i) for r in range(n)], "SUM")
        check(x.get(), ref, f"synchronized all_reduce {i}")
    return len(xs)


def host_cost(size: int, iters: int, device: bool) -> dict[str, float]:
    """Seconds per blocking all_reduce issued from the host (the fake runs them too)."""
    x: Any
    if device:
        import cupy

        x = cupy.ones(size, dtype=cupy.float32)
    else:
        x = np.ones(size, dtype=np.float32)
    C.all_reduce(x)  # warm up
    C.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        C.all_reduce(x)
    issued = time.perf_counter() - t0
    C.get_default_group().synchronize(timeout=60)
    total = time.perf_counter() - t0
    return {"issue_us": issued / iters * 1e6, "total_us": total / iters * 1e6}


def other_device_thread(size: int) -> dict[str, Any]:
    """The group's calls issued from a thread whose current GPU is another one (a process
    that sees several GPUs): they must still run on the group's GPU and streams."""
    import threading

    import cupy

    rank, n = _world()
    g = C.get_default_group()
    b: Any = g.backend
    other = (b.device + 1) % cupy.cuda.runtime.getDeviceCount()
    x = cupy.full(size, rank + 1.0, dtype=cupy.float32)  # on the group's GPU
    h = np.full(size, rank + 1.0, dtype=np.float32)
    out: dict[str, Any] = {"error": None}

    def body() -> None:
        cupy.cuda.Device(other).use()
        try:
            g.all_reduce(x)
            g.all_reduce(h)
            g.all_reduce(x, async_op=True).wait()
            # Outputs the group allocates (no out=) live on the group's GPU, not the thread's.
            gathered = g.all_gather(x)
            out["gathered_on"] = int(gathered.device.id)
            out["gathered"] = gathered.get().tolist()
            out["current"] = cupy.cuda.runtime.getDevice()
        except BaseException as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=body, name=f"rank{rank}-other-gpu")
    g.bind_thread(t)
    t.start()
    t.join(30)
    g.bind_thread()
    if out["error"] is None:
        total = n * (n + 1) / 2
        check(x.get(), np.full(size, total * n, dtype=np.float32), "all_reduce from another GPU")
        check(h, np.full(size, total, dtype=np.float32), "staged all_reduce from another GPU")
        out["expected_device"] = int(b.device)
        want = np.full((n, size), total * n, dtype=np.float32)
        check(
            np.asarray(out.pop("gathered"), dtype=np.float32), want, "all_gather from another GPU"
        )
    return out


def arrays_after_abort(size: int) -> dict[str, Any]:
    """A group that fails while its stream still has queued copies keeps the arrays they
    use until the stream is idle (CuPy's pool would otherwise hand them out again)."""
    import threading
    import weakref

    from collectives._errors import CollectiveError

    g = C.get_default_group()
    b: Any = g.backend
    gate = threading.Event()
    b.cuda.stream._enqueue(lambda: gate.wait(30))  # the GPU is still busy with earlier work
    w = g.all_reduce(np.ones(size, dtype=np.float32), async_op=True)
    staged = [weakref.ref(r) for r in w.refs]  # device and pinned staging memory
    b.abort(b.info.error(CollectiveError, "all_reduce", None, "test: the group fails"))
    held = [r() is not None for r in staged]
    gate.set()
    deadline = time.monotonic() + 10
    while any(r() is not None for r in staged) and time.monotonic() < deadline:
        b.poll()
        time.sleep(0.01)
    return {"staged": len(staged), "held": held, "released": all(r() is None for r in staged)}


def ddp_steps(steps: int, skip_on: int = -1) -> dict[str, Any]:
    """DDP over the group's GPU: what made this rank's host wait for the device in each step
    (fake CuPy's host_syncs, and backend waits on calls not finished yet), and the final
    parameters. ``skip_on``: that rank leaves the last layer out of step 1's loss."""
    import threading
    import types

    import tensorlib as tl
    from ddp import DistributedDataParallel
    from tensorlib import nn
    from tests.fakes import fake_cupy

    rank, _ = _world()
    b: Any = C.get_default_group().backend
    dev = f"cuda:{b.device}"
    gen = tl.Generator(11)
    first = nn.Linear(4, 8, generator=gen)
    net = nn.Sequential(first, nn.Tanh(), nn.Linear(8, 2, generator=gen)).to(dev)
    model = DistributedDataParallel(net, first_bucket_mb=1e-4, bucket_cap_mb=1e-4)
    opt = tl.optim.SGD(model.parameters(), lr=0.1)
    me, waits = threading.current_thread(), []
    plain_block = b.block

    def block(w: Any, timeout: Any, sig_only: bool = False) -> bool:
        if threading.current_thread() is me and not w._done and not w.end.done:
            waits.append(f"block({w.op})")
        return bool(plain_block(w, timeout, sig_only))

    b.block = types.MethodType(lambda self, *a, **k: block(*a, **k), b)
    per_step, error = [], None
    try:
        for step in range(steps):
            rng = np.random.default_rng([rank, step])
            x = tl.tensor(rng.standard_normal((3, 4)).astype(np.float32), device=dev)
            y = tl.tensor(rng.standard_normal((3, 2)).astype(np.float32), device=dev)
            fake_cupy.host_syncs(reset=True)
            waits.clear()
            if step == 1 and rank == skip_on:
                model(x)
                loss = (first(x) ** 2).mean()  # the last layer gets no gradient
            else:
                loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            try:
                loss.backward()
            except RuntimeError as exc:
                error = {"step": step, "message": str(exc)}
                break
            opt.step()
            per_step.append(fake_cupy.host_syncs() + waits)
    finally:
        del b.block
    params = [p.data.get().ravel().tolist() for p in model.parameters()]
    return {
        "per_step": per_step,
        "params": params,
        "error": error,
        "buckets": len(model.bucket_sizes()),
    }
