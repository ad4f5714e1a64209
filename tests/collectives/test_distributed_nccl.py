"""Burn's device-list all_reduce on GPUs: the NCCL group-call engine of collectives.distributed.

On 4 fake GPUs (tests/fakes/fake_cupy) and the fake libnccl (tests/fakes/fake_nccl.py, which
performs the collectives over host memory, each communicator's part on its own stream's
thread): the shared bodies of test_distributed.py, then what is the engine's own (one group
call per all-reduce, no host wait, lifetimes, NCCL failures, close), then the fake's model of
NCCL's group calls that the engine relies on. The same bodies on real GPUs:
test_distributed_gpu.py.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from collectives import CollectiveError, PeerFailureError
from collectives import ReduceOp as PgOp
from collectives.backends.nccl import _lib as L
from collectives.distributed import (
    DistributedConfig,
    DistributedContext,
    NcclContextEngine,
    ReduceOperation,
    all_reduce,
)
from tensorlib import _device
from tests.collectives import test_distributed as bodies
from tests.fakes import fake_cupy, fake_nccl
from tests.fakes.install import fake_gpu_and_nccl
from tests.helpers import ROOT, run_to_end

pytestmark = pytest.mark.timeout(120)

GPUS = 4
QUICK = DistributedConfig(timeout=10.0)


@pytest.fixture(scope="module")
def fake() -> Iterator[fake_nccl.FakeNccl]:
    """The fake CuPy with 4 GPUs and the fake NCCL in place of the real ones."""
    with fake_gpu_and_nccl() as nccl:
        saved = fake_cupy.config.device_count
        fake_cupy.config.device_count = GPUS
        try:
            yield nccl
        finally:
            fake_cupy.config.device_count = saved
            for spec, dev in list(_device.Device._cache.items()):
                if dev.type == "cuda" and (dev.index or 0) >= saved:
                    del _device.Device._cache[spec]


def _gpus(n: int) -> list[tl.Device]:
    return list(tl.Device.enumerate("cuda"))[:n]


def _ours(fake: fake_nccl.FakeNccl) -> set[int]:
    return {handle for handle, _rank, _n in fake.live_comms()}


def _in_thread(fn: Callable[[], Any], limit: float = 20.0) -> Any:
    """``fn()`` in a thread: a hang becomes a failure, not a stuck test run."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(_capture(fn)), daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), "hung (a group call that waits for itself?)"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _capture(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as exc:
        return exc


# ============================================================================ shared bodies
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("op", bodies.OPS, ids=str)
@pytest.mark.parametrize("dtype", ["float64", "float32", "int64", "int32"])
def test_one_thread_submits_every_gpu_then_resolves(
    fake: fake_nccl.FakeNccl, n: int, op: ReduceOperation, dtype: str
) -> None:
    bodies.check_one_thread_submits_every_device_then_resolves(_gpus(n), op, dtype)


def test_the_config_op_is_the_default_and_many_calls_stay_in_order(
    fake: fake_nccl.FakeNccl,
) -> None:
    bodies.check_the_config_op_is_the_default_and_many_calls_stay_in_order(_gpus(3))


@pytest.mark.parametrize("n", [2, 4])
def test_one_thread_per_gpu_as_burns_ddp_runs(fake: fake_nccl.FakeNccl, n: int) -> None:
    bodies.check_one_thread_per_device_as_burns_ddp_runs(_gpus(n), calls=10)


def test_resolve_before_the_other_gpus_submit_fails_at_once_naming_them(
    fake: fake_nccl.FakeNccl,
) -> None:
    bodies.check_resolve_before_the_other_devices_submit_fails_at_once_naming_them(_gpus(3))


def test_leaving_the_context_destroys_the_communicators(fake: fake_nccl.FakeNccl) -> None:
    before = _ours(fake)
    destroyed = fake.counts["ncclCommDestroy"]
    bodies.check_leaving_the_context_ends_it(_gpus(2))
    assert _ours(fake) == before, "a closed context left communicators alive"
    assert fake.counts["ncclCommDestroy"] - destroyed == 4  # two contexts of two GPUs
    assert not fake.stale_writes, fake.stale_writes


# ============================================================================ the engine
def test_registering_the_gpu_engine_loads_neither_cupy_nor_nccl() -> None:
    """A machine without CuPy or NCCL imports collectives.distributed; only opening a context
    over GPUs needs them (and says what is missing)."""
    code = (
        "import sys\n"
        "import collectives.distributed as d\n"
        "from collectives.backends.nccl import _load\n"
        "assert 'cuda' in d.context_engine_kinds()\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
        "assert _load._loaded is None and _load._failure is None, 'libnccl loaded'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TENSORLIB_FAKE_CUPY", None)
    done = run_to_end([sys.executable, "-c", code], env, timeout=60)
    assert done.returncode == 0, done.stderr


def test_one_group_call_per_all_reduce_and_no_host_wait(fake: fake_nccl.FakeNccl) -> None:
    """Setup is one group of N inits; each call one ncclGroupStart/End pair around one
    ncclAllReduce per GPU, issued without the host waiting for any GPU."""
    devs = _gpus(4)
    start = fake.counts.copy()
    with DistributedContext(devs, QUICK):
        made = fake.counts - start
        assert made["ncclGetUniqueId"] == 1 and made["ncclCommInitRankConfig"] == 4
        assert made["ncclGroupStart"] == made["ncclGroupEnd"] == 1
        local = [tl.full((7,), float(i + 1), device=d) for i, d in enumerate(devs)]
        start = fake.counts.copy()
        fake_cupy.host_syncs(reset=True)
        for _ in range(3):
            pending = [all_reduce(t, ReduceOperation.Sum, devs) for t in local]
            results = [p.resolve() for p in pending]
        assert fake_cupy.host_syncs() == [], "the all-reduce path made the host wait"
        calls = fake.counts - start
        assert calls["ncclGroupStart"] == calls["ncclGroupEnd"] == 3
        assert calls["ncclAllReduce"] == 3 * 4
        assert calls["ncclCommInitRankConfig"] == 0
        assert all(np.array_equal(r.numpy(), np.full(7, 10.0)) for r in results)
        assert [int(r.data.device.id) for r in results] == [0, 1, 2, 3]


def test_odd_inputs_bools_and_empty_tensors(fake: fake_nccl.FakeNccl) -> None:
    """Non-contiguous inputs are reduced from a contiguous copy; bools stay bools (NumPy's
    sum of bools is a logical or, as on the NumPy engine); empty tensors skip NCCL."""
    devs = _gpus(3)
    base = [np.arange(12.0).reshape(4, 3) * (i + 1) for i in range(3)]
    flags = [np.array([True, False, False, True]), np.array([False, False, True, True])] + [
        np.array([False, False, False, True])
    ]
    with DistributedContext(devs, QUICK):
        views = [tl.tensor(b, device=d).T for b, d in zip(base, devs, strict=True)]
        assert not views[0].data.flags.c_contiguous
        got = [p.resolve() for p in [all_reduce(v, ReduceOperation.Max, devs) for v in views]]
        assert np.array_equal(got[2].numpy(), base[2].T)
        bools = [tl.tensor(f, device=d) for f, d in zip(flags, devs, strict=True)]
        for op, want in [(ReduceOperation.Sum, [1, 0, 1, 1]), (ReduceOperation.Prod, [0, 0, 0, 1])]:
            out = [p.resolve() for p in [all_reduce(b, op, devs) for b in bools]]
            assert out[1].numpy().view(np.uint8).tolist() == want, op
        calls = fake.counts["ncclAllReduce"]
        empty = [tl.zeros((0, 3), device=d) for d in devs]
        got = [p.resolve() for p in [all_reduce(e, ReduceOperation.Sum, devs) for e in empty]]
        assert [tuple(g.shape) for g in got] == [(0, 3)] * 3
        assert fake.counts["ncclAllReduce"] == calls


def test_arrays_are_held_until_the_gpus_are_done(fake: fake_nccl.FakeNccl) -> None:
    """The reduction runs later than it is queued (a stream held back here): until it ran,
    the engine keeps inputs and outputs alive though the caller let go of everything (CuPy's
    pool would hand their memory out); a later call lets go of them."""
    devs = _gpus(2)
    with DistributedContext(devs, QUICK) as ctx:
        engine = ctx._engine
        assert isinstance(engine, NcclContextEngine)
        gate = threading.Event()
        engine.cudas[1].stream._enqueue(lambda: gate.wait(20))
        local = [tl.full((5,), 2.0, device=d) for d in devs]
        pending = [all_reduce(t, ReduceOperation.Sum, devs) for t in local]
        held = [weakref.ref(t.data) for t in local]
        held += [weakref.ref(o) for o in engine._inflight[0].outputs]
        assert not pending[1].is_resolved()
        del local, pending
        gc.collect()
        assert all(r() is not None for r in held), "arrays let go of while NCCL uses them"
        gate.set()
        deadline = time.monotonic() + 10
        while not engine._inflight[0].done():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        again = [all_reduce(tl.ones(2, device=d), devices=devs) for d in devs]
        gc.collect()
        assert all(r() is None for r in held), "finished calls' arrays are still held"
        assert again[0].resolve().numpy().tolist() == [1.0, 1.0]  # the config's Mean


def test_an_nccl_failure_fails_the_call_and_close_aborts(fake: fake_nccl.FakeNccl) -> None:
    devs = _gpus(2)
    before = _ours(fake)
    ctx = DistributedContext(devs, QUICK)
    comms = _ours(fake) - before
    local = [tl.ones(4, device=d) for d in devs]
    fake.fail_next("ncclAllReduce", fake_nccl.UNHANDLED_CUDA, "fake: the GPU fell off the bus")
    first = all_reduce(local[0], ReduceOperation.Sum, devs)
    with pytest.raises(CollectiveError) as info:
        all_reduce(local[1], ReduceOperation.Sum, devs)
    text = str(info.value)
    assert "[cuda:1] all_reduce #0 (DistributedContext of cuda:0, cuda:1)" in text, text
    assert "ncclAllReduce failed: ncclUnhandledCudaError" in text
    assert "unhandled cuda error" in text and "the GPU fell off the bus" in text
    with pytest.raises(CollectiveError, match=r"\[cuda:0\] all_reduce #0.*fell off the bus"):
        first.resolve()
    with pytest.raises(CollectiveError, match="unusable after an earlier failure"):
        all_reduce(local[0], ReduceOperation.Sum, devs)
    aborts = fake.counts["ncclCommAbort"]
    ctx.close()
    assert fake.counts["ncclCommAbort"] - aborts == 2, "a failed engine must abort, not destroy"
    assert not comms & _ours(fake)


def test_an_asynchronous_nccl_error_reaches_resolve(fake: fake_nccl.FakeNccl) -> None:
    devs = _gpus(2)
    with DistributedContext(devs, QUICK) as ctx:
        engine = ctx._engine
        assert isinstance(engine, NcclContextEngine)
        gate = threading.Event()
        engine.cudas[0].stream._enqueue(lambda: gate.wait(20))
        pending = [all_reduce(tl.ones(3, device=d), devices=devs) for d in devs]
        fake.inject_async_error(engine.comms[1], fake_nccl.REMOTE, "fake: peer link lost")
        try:
            with pytest.raises(PeerFailureError) as info:
                pending[0].resolve()
        finally:
            gate.set()
        text = str(info.value)
        assert "[cuda:1] all_reduce #0" in text and "asynchronous error" in text
        assert "ncclRemoteError" in text and "peer link lost" in text
        aborts = fake.counts["ncclCommAbort"]
    assert fake.counts["ncclCommAbort"] - aborts == 2


def test_a_failed_setup_is_a_clear_error_and_leaves_no_communicator(
    fake: fake_nccl.FakeNccl,
) -> None:
    devs = _gpus(3)
    before = _ours(fake)
    fake.fail_next("ncclGroupEnd", fake_nccl.SYSTEM, "fake: no socket interface")
    with pytest.raises(CollectiveError) as info:
        DistributedContext(devs, QUICK)
    text = str(info.value)
    assert "making the NCCL communicators failed: ncclGroupEnd failed: ncclSystemError" in text
    assert "no socket interface" in text and "DistributedContext of cuda:0" in text
    assert _ours(fake) == before, "the communicators written before the failure leaked"
    with DistributedContext(devs, QUICK):  # the devices were not taken
        pass


def test_a_collective_after_close_is_a_clear_error(fake: fake_nccl.FakeNccl) -> None:
    devs = _gpus(2)
    ctx = DistributedContext(devs, QUICK)
    engine = ctx._engine
    ctx.close()
    ctx.close()
    with pytest.raises(CollectiveError, match="no open DistributedContext"):
        all_reduce(tl.ones(2, device=devs[0]), ReduceOperation.Sum, devs)
    with pytest.raises(RuntimeError, match="NCCL context engine is closed"):
        engine.all_reduce([tl.ones(2, device=d).data for d in devs], PgOp.SUM, 0)


def test_devices_listed_twice_invisible_or_unsupported_are_refused(
    fake: fake_nccl.FakeNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    devs = _gpus(4)
    with pytest.raises(ValueError, match="cuda:1 is listed twice"):
        DistributedContext([devs[0], devs[1], "cuda:1"])
    with pytest.raises(ValueError, match="cuda:1 listed twice"):
        NcclContextEngine([devs[1], devs[1]], QUICK)
    monkeypatch.setattr(fake_cupy.config, "device_count", 2)
    with pytest.raises(ValueError) as info:
        DistributedContext([devs[0], devs[3]])
    assert "device cuda:3 is not visible to this process, which sees 2 GPU(s)" in str(info.value)
    monkeypatch.setattr(fake_cupy.config, "device_count", GPUS)
    engine = NcclContextEngine(devs[:2], QUICK)
    try:
        assert engine.ops == frozenset(L.OPS)
        import cupy as cp

        def on_each(dtype: Any) -> list[Any]:
            made = []
            for d in devs[:2]:
                with cp.cuda.Device(d.index):
                    made.append(cp.ones(3, dtype=dtype))
            return made

        with pytest.raises(TypeError, match="NCCL cannot move dtype int16; supported:"):
            engine.all_reduce(on_each(cp.int16), PgOp.SUM, 0)
        with pytest.raises(ValueError, match="cuda:0's tensor is on cuda:1"):
            engine.all_reduce(on_each(cp.float32)[::-1], PgOp.SUM, 0)
    finally:
        engine.close()


def test_non_blocking_communicators_forced_by_the_environment_still_work(
    fake: fake_nccl.FakeNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL_COMM_BLOCKING=0 makes NCCL ignore the blocking config: ncclGroupEnd then returns
    ncclInProgress, and the engine waits for the communicators before using them."""
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    devs = _gpus(2)
    with DistributedContext(devs, QUICK):
        got = [p.resolve() for p in [all_reduce(tl.ones(2, device=d), "sum") for d in devs]]
    assert got[1].numpy().tolist() == [2.0, 2.0]


# ============================================================================ the fake's groups
def _fresh() -> tuple[fake_nccl.FakeNccl, L.Nccl]:
    raw = fake_nccl.FakeNccl()
    return raw, L.Nccl(raw, raw.version, "fake")


def _init_in_group(lib: L.Nccl, n: int, blocking: bool = True) -> tuple[list[int], int]:
    import cupy as cp

    uid = lib.get_unique_id()
    lib.group_start()
    pending = []
    for rank in range(n):
        with cp.cuda.Device(rank):
            pending.append(lib.comm_init_rank(n, uid, rank, blocking=blocking))
    handles = [p.handle for p in pending]
    assert all(handles) and len(set(handles)) == n, "NCCL writes *newcomm at the call"
    for h in handles:  # not usable before the group ended
        with pytest.raises(L.NcclError, match="ncclCommCount"):
            lib.comm_count(h)
    return handles, lib.group_end()


def test_the_fake_defers_inits_in_a_group_to_its_group_end(fake: fake_nccl.FakeNccl) -> None:
    """NCCL's ncclCommInitAll: one thread, N inits inside a group, each returning at once;
    the world exists when ncclGroupEnd returned (blocking) or once they leave ncclInProgress
    (non-blocking)."""
    raw, lib = _fresh()
    comms, rc = _in_thread(lambda: _init_in_group(lib, GPUS))
    assert rc == L.SUCCESS
    for rank, h in enumerate(comms):
        assert (lib.comm_count(h), lib.comm_user_rank(h), lib.comm_cu_device(h)) == (4, rank, rank)
    comms, rc = _in_thread(lambda: _init_in_group(lib, 2, blocking=False))
    assert rc == L.IN_PROGRESS
    for h in comms:
        deadline = time.monotonic() + 10
        while lib.comm_get_async_error(h) == L.IN_PROGRESS:
            assert time.monotonic() < deadline
        assert lib.comm_count(h) == 2
    assert not raw.stale_writes


def test_a_group_that_uses_its_initializing_comms_fails_whole(fake: fake_nccl.FakeNccl) -> None:
    import cupy as cp

    raw, lib = _fresh()
    uid = lib.get_unique_id()
    buf = cp.zeros(2, dtype=cp.float32)
    lib.group_start()
    a = lib.comm_init_rank(2, uid, 0, blocking=True)
    with pytest.raises(L.NcclError, match="Attempt to use communicator before"):
        p = int(buf.data.ptr)
        lib.all_reduce(p, p, 2, L.FLOAT32, 0, a.handle, 0)
    with pytest.raises(L.NcclError, match="ncclGroupEnd failed: ncclInvalidArgument"):
        lib.group_end()  # returns at once: the group (the init too) was dropped
    assert lib.comm_get_async_error(a.handle) == fake_nccl.INVALID_ARGUMENT
    lib.comm_abort(a.handle)
    lib.group_start()  # blocking and non-blocking inits may not share a group
    lib.comm_init_rank(2, uid, 0, blocking=True)
    with pytest.raises(L.NcclError, match="not allowed in the same group"):
        lib.comm_init_rank(2, uid, 1, blocking=False)
    with pytest.raises(L.NcclError, match="ncclInvalidArgument"):
        lib.group_end()
    assert raw.counts["ncclGroupEnd"] == 2


@pytest.mark.parametrize("streams", ["own", "null"])
def test_the_fake_runs_one_threads_group_of_collectives_at_group_end(
    fake: fake_nccl.FakeNccl, streams: str
) -> None:
    """One thread enqueues every rank's all-reduce inside a group: nothing runs before
    ncclGroupEnd, then each rank's part runs on its stream (the null stream too) and none
    waits for itself."""
    import cupy as cp

    raw, lib = _fresh()
    comms, _rc = _in_thread(lambda: _init_in_group(lib, 3))
    ins: list[Any] = []
    outs: list[Any] = []
    queues: list[Any] = []
    for rank in range(3):
        with cp.cuda.Device(rank):
            ins.append(cp.full(5, float(rank + 1), dtype=cp.float64))
            outs.append(cp.zeros(5, dtype=cp.float64))
            queues.append(cp.cuda.Stream(non_blocking=True) if streams == "own" else None)

    def issue() -> None:
        lib.group_start()
        for rank in range(3):
            q = queues[rank]
            sp = 0 if q is None else q.ptr
            lib.all_reduce(ins[rank].data.ptr, outs[rank].data.ptr, 5, 8, 0, comms[rank], sp)
        time.sleep(0.05)
        assert all(not o.get().any() for o in outs), "a grouped call ran before ncclGroupEnd"
        assert raw.counts["ncclAllReduce"] == 3
        lib.group_end()

    _in_thread(issue)
    for q in queues:
        if q is not None:
            q.synchronize()
    assert all(o.get().tolist() == [6.0] * 5 for o in outs)
