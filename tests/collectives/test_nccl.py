"""The nccl backend: the binding, the backend on a fake libnccl, the real library on a CPU.

* **Fake NCCL** (tests/fakes/fake_nccl.py over tests/fakes/fake_cupy/): the shared
  collective bodies (``bodies.py``) run at world sizes 1-4 with ranks as threads of this
  process, so every count, offset, root, dtype, in-place pointer and group call the backend
  passes is used for real. Then the failure paths: mismatches, timeouts, a rank that leaves,
  injected error codes, asynchronous errors; each must end in an error on every rank (with the
  op and sequence number), an aborted communicator (never a blocking destroy), no hang.
* **The real libnccl.so.2** from the nvidia-nccl wheel, when installed: loading, version,
  error strings, ``ncclGetUniqueId``, and a communicator init that fails with a clear error on
  a machine without a GPU. Skipped (with the reason) when the wheel is absent.
* **GPU** (marked ``gpu``): the same bodies on real NCCL with CuPy, ranks as processes; world
  size 1 always, several ranks on one GPU when NCCL >= 2.30 (``NCCL_MULTI_RANK_GPU_ENABLE=1``),
  several GPUs when there are. Skipped without a usable GPU.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from collectives._errors import CollectiveError
from collectives.backends.nccl import _lib as L
from collectives.backends.nccl import _load as _nccl_load
from tests.collectives import expect
from tests.collectives.expect import BLOCKS, DTYPE_OPS, MISMATCHES, NUMERIC, results
from tests.collectives.harness import RankPool
from tests.collectives.nccl_threads import RankThreads, ThreadPoolError
from tests.fakes import fake_nccl
from tests.fakes.install import fake_gpu_and_nccl
from tests.helpers import run_to_end

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SIZES = [0, 1, 7, 4097, 70_001]
SIZES_N = [1, 2, 3, 4]
LONG = 60.0  # a group timeout no passing test gets near
FAST = 10.0  # "within seconds" on a loaded 2-core machine


# ============================================================================ fixtures
@pytest.fixture(scope="module")
def fake() -> Iterator[fake_nccl.FakeNccl]:
    """The fake CuPy and the fake NCCL in place of the real ones, for this module's tests."""
    with fake_gpu_and_nccl() as nccl:
        try:
            yield nccl
        finally:
            _ALL_POOLS.close()


class _Pools:
    """Thread pools shared by the tests of this module, one per (world size, tag)."""

    def __init__(self) -> None:
        self.pools: dict[tuple[int, str], RankThreads] = {}

    def get(self, n: int, tag: str = "", **kw: Any) -> RankThreads:
        pool = self.pools.get((n, tag))
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = RankThreads.launch(n, tag=tag, timeout=LONG, **kw)
            self.pools[(n, tag)] = pool
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


_ALL_POOLS = _Pools()


@pytest.fixture
def pool(request: pytest.FixtureRequest, fake: fake_nccl.FakeNccl) -> RankThreads:
    return _ALL_POOLS.get(int(request.param))


@pytest.fixture
def fresh(fake: fake_nccl.FakeNccl) -> Iterator[list[RankThreads]]:
    """Dedicated pools of one test (its failures break their groups); closed at the end."""
    made: list[RankThreads] = []
    yield made
    for p in made:
        p.broken = True
        p.close()


def launch(fresh: list[RankThreads], n: int, **kw: Any) -> RankThreads:
    pool = RankThreads.launch(n, **kw)
    fresh.append(pool)
    return pool


def params(sizes: list[int]) -> Any:
    return pytest.mark.parametrize("pool", sizes, indirect=True, ids=[f"n{n}" for n in sizes])


# ============================================================================ the binding
def test_config_struct_declares_only_leading_fields() -> None:
    cfg = L.Config.make(L.version_code(2, 21, 5), blocking=False)
    # size stops after `blocking`: the padding must not overwrite cgaClusterSize with 0.
    assert cfg.size == 20 < ctypes.sizeof(L.Config)
    assert cfg.magic == 0xCAFEBEEF and cfg.version == 22105 and cfg.blocking == 0
    assert L.Config.make(22105, blocking=True).blocking == 1


def test_unique_id_is_128_bytes_by_value() -> None:
    assert ctypes.sizeof(L.UniqueId) == 128
    raw = bytes(range(128))
    assert L.UniqueId.from_bytes(raw).to_bytes() == raw
    with pytest.raises(ValueError, match="128 bytes"):
        L.UniqueId.from_bytes(b"short")
    sig = L.SIGNATURES["ncclCommInitRankConfig"][1]
    assert sig[2] is L.UniqueId  # by value, not a pointer


def test_versions_and_result_names() -> None:
    assert L.version_code(2, 8, 4) == 2804 and L.version_code(2, 18, 1) == 21801
    assert L.version_tuple(21801) == (2, 18, 1) and L.version_tuple(2804) == (2, 8, 4)
    assert L.result_name(5) == "ncclInvalidUsage" and L.result_name(99) == "ncclResult(99)"


def test_dtype_table_maps_bool_to_uint8_and_refuses_by_name() -> None:
    assert L.nccl_dtype(np.float16) == 6 and L.nccl_dtype(np.uint64) == 5
    assert L.nccl_dtype(np.bool_) == L.nccl_dtype(np.uint8) == 1
    assert L.nccl_dtype("bfloat16") == 9
    with pytest.raises(TypeError, match=r"complex64.*supported: .*float32"):
        L.nccl_dtype(np.complex64)
    assert [L.nccl_op(op) for op in L.OPS] == [0, 1, 2, 3, 4]


def test_nccl_error_carries_code_strings_and_pickles() -> None:
    err = L.NcclError(6, "ncclAllReduce", "remote process exited", "peer 3 closed the socket")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, L.NcclError)
    assert (back.code, back.name, back.call) == (6, "ncclRemoteError", "ncclAllReduce")
    assert back.last_error == "peer 3 closed the socket"
    assert "ncclRemoteError (6)" in str(back) and "remote process exited" in str(back)


def test_wrapper_raises_with_error_string_and_last_error() -> None:
    raw = fake_nccl.FakeNccl()
    lib = L.Nccl(raw, raw.version, "fake")
    raw.fail_next("ncclGetUniqueId", 2, "socket: no interface")
    with pytest.raises(L.NcclError) as info:
        lib.get_unique_id()
    e = info.value
    assert e.name == "ncclSystemError" and "unhandled system error" in e.error_string
    assert e.last_error == "socket: no interface"
    assert len(lib.get_unique_id()) == 128


def test_split_needs_2_18() -> None:
    old = fake_nccl.FakeNccl(version=21703)
    assert not L.Nccl(old, old.version, "fake").can_split
    new = fake_nccl.FakeNccl(version=21805)
    assert L.Nccl(new, new.version, "fake").can_split


def _threads(n: int, fn: Any) -> list[Any]:
    """``fn(rank)`` in ``n`` threads (ranks of the fake); results in rank order."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        return [f.result(timeout=30) for f in [ex.submit(fn, r) for r in range(n)]]


def _poll(lib: L.Nccl, comm: int) -> None:
    deadline = time.monotonic() + 20
    while (state := lib.comm_get_async_error(comm)) == L.IN_PROGRESS:
        assert time.monotonic() < deadline, "still in progress after 20 s"
        time.sleep(0.001)
    assert state == L.SUCCESS, L.result_name(state)


@pytest.mark.parametrize("version", [21703, 23203])
def test_nonblocking_init_and_split_handles_are_written_late(version: int) -> None:
    """NCCL writes a non-blocking split's child (and, before 2.18, uses an init's handle)
    through the caller's pointer after the call returned: the binding keeps that storage,
    the child is read once the *parent* left ncclInProgress, NOCOLOR gets none."""
    raw = fake_nccl.FakeNccl(version)
    lib = L.Nccl(raw, version, "fake")
    uid = lib.get_unique_id()

    def rank(r: int) -> tuple[int, ...]:
        pending = lib.comm_init_rank(3, uid, r, blocking=False)
        _poll(lib, pending.handle)
        comm = pending.handle
        if not lib.can_split:
            return (lib.comm_user_rank(comm),)
        child = lib.comm_split(comm, L.SPLIT_NOCOLOR if r == 1 else 0, -r, blocking=False)
        assert child.handle == 0, "NCCL leaves *newcomm NULL until the split completed"
        _poll(lib, comm)  # the split completes on the parent
        if r == 1:
            return (child.handle,)
        _poll(lib, child.handle)
        return lib.comm_count(child.handle), lib.comm_user_rank(child.handle)

    got = _threads(3, rank)
    assert got == ([(0,), (1,), (2,)] if version < 21800 else [(2, 1), (0,), (2, 0)])
    assert not raw.stale_writes, raw.stale_writes


def test_nccl_comm_blocking_env_is_reported(
    fake: fake_nccl.FakeNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL_COMM_BLOCKING=1 overrides the non-blocking config (init could no longer honour
    the timeout): the backend says so, once, and still works."""
    import warnings

    from collectives.backends.nccl import _setup as _nccl_setup

    monkeypatch.setenv("NCCL_COMM_BLOCKING", "1")
    monkeypatch.setattr(_nccl_setup, "_warned", __import__("threading").Event())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RankThreads.launch(2, timeout=LONG) as pool:
            assert pool.run("bodies:ping", {"seed": 0})
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1 and "NCCL_COMM_BLOCKING=1 is set" in texts[0], texts
    assert "cannot honour the group's timeout" in texts[0]


def test_candidate_paths_order(tmp_path: Path) -> None:
    (tmp_path / "libnccl.so.2").write_bytes(b"")
    paths = _nccl_load.candidate_paths({"NCCL_LIB_PATH": str(tmp_path)})
    assert paths[0] == (str(tmp_path / "libnccl.so.2"), "NCCL_LIB_PATH")
    assert paths[-1] == ("libnccl.so.2", "system loader path")
    wheel = [p for p, origin in paths if origin == "nvidia-nccl wheel"]
    assert all(p.endswith("nvidia/nccl/lib/libnccl.so.2") for p in wheel)


def test_load_failure_names_every_path_and_the_extra(tmp_path: Path) -> None:
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_bytes(b"not a library")
    with pytest.raises(L.NcclUnavailableError) as info:
        _nccl_load.open_library(
            [
                (str(tmp_path / "missing.so"), "NCCL_LIB_PATH"),
                (str(bogus), "nvidia-nccl wheel"),
                ("libnccl-does-not-exist.so.2", "system loader path"),
            ]
        )
    text = str(info.value)
    assert "missing.so (NCCL_LIB_PATH): not found" in text
    assert str(bogus) in text and "libnccl-does-not-exist.so.2" in text
    assert "dpt[cuda12]" in text and "NCCL_LIB_PATH" in text


# ============================================================================ the real library
def _real_lib() -> L.Nccl:
    wheel = [(p, o) for p, o in _nccl_load.candidate_paths({}) if o == "nvidia-nccl wheel"]
    if not any(os.path.exists(p) for p, _ in wheel):
        pytest.skip("nvidia-nccl-cu12/cu13 wheel not installed (pip install nvidia-nccl-cu12)")
    return _nccl_load.open_library(wheel)


def test_real_library_loads_and_reports_its_version() -> None:
    lib = _real_lib()
    assert lib.version >= L.version_code(2, 14, 0)
    assert "nvidia/nccl/lib/libnccl.so.2" in lib.path
    assert lib.has("ncclCommInitRankConfig") and lib.has("ncclGetLastError")
    assert lib.can_split == (lib.version >= 21800)
    assert lib.error_string(4).startswith("invalid argument")
    assert lib.error_string(0) == "no error"


def test_real_library_makes_unique_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    lib = _real_lib()
    a, b = lib.get_unique_id(), lib.get_unique_id()
    assert len(a) == len(b) == 128 and a != b and any(a)


def test_real_library_init_without_gpu_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    lib = _real_lib()
    uid = lib.get_unique_id()
    with pytest.raises(L.NcclError) as info:
        comm = lib.comm_init_rank(1, uid, 0, blocking=False).handle
        # A library that accepted the call reports the failure asynchronously.
        deadline = time.monotonic() + 30
        while lib.comm_get_async_error(comm) == L.IN_PROGRESS and time.monotonic() < deadline:
            time.sleep(0.01)
        state = lib.comm_get_async_error(comm)
        lib.comm_abort(comm)
        if state != L.SUCCESS:
            raise lib.error(state, "ncclCommInitRankConfig")
    e = info.value
    assert e.code in (1, 2, 3, 5), e  # cuda / system / internal / usage: never a crash
    assert "cuda" in str(e).lower(), str(e)
    assert pickle.loads(pickle.dumps(e)).last_error == e.last_error


def test_init_process_group_nccl_without_gpu_says_why() -> None:
    """In a fresh process (no fakes): the backend's probe names what is missing."""
    code = (
        "import collectives as C\n"
        "try:\n"
        "    C.init_process_group('nccl', rank=0, world_size=1)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    out = run_to_end([sys.executable, "-c", code], env, 60)
    text = out.stdout + out.stderr
    if "ERR" not in text:
        pytest.skip(f"nccl is usable in this environment: {text[-300:]}")
    assert "backend 'nccl' is not usable here" in text
    assert "libnccl.so.2" in text or "CUDA" in text or "CuPy" in text, text


# ============================================================================ fake: the bodies
@params(SIZES_N)
def test_backend_and_devices(pool: RankThreads) -> None:
    got = pool.run("nccl_bodies:backend_info")
    assert [g["backend"] for g in got] == ["nccl"] * pool.world_size
    assert [g["device"] for g in got] == [r % 2 for r in range(pool.world_size)]  # 2 fake GPUs
    assert all(g["comm"] and g["check"] for g in got)
    who = pool.run("bodies:whoami")
    assert [w["rank"] for w in who] == list(range(pool.world_size))
    assert {w["backend"] for w in who} == {"nccl"}


@params(SIZES_N)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_all_reduce(pool: RankThreads, seed: int, dtype: str, op: str) -> None:
    expect.all_reduce(pool, seed, dtype, op, SIZES)


@params(SIZES_N)
def test_all_reduce_tensor_and_nd(pool: RankThreads, seed: int) -> None:
    expect.all_reduce_tensor_2d(pool, seed)


@params(SIZES_N)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_broadcast_every_src(pool: RankThreads, seed: int, dtype: str) -> None:
    expect.broadcast(pool, seed, dtype, SIZES)


@params(SIZES_N)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reduce_every_dst(pool: RankThreads, seed: int, dtype: str, op: str) -> None:
    expect.reduce(pool, seed, dtype, op, SIZES)


@params(SIZES_N)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_all_gather(pool: RankThreads, seed: int, dtype: str) -> None:
    expect.all_gather(pool, seed, dtype, SIZES)
    expect.all_gather_tensor(pool, seed)


@params(SIZES_N)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reduce_scatter(pool: RankThreads, seed: int, dtype: str, op: str) -> None:
    expect.reduce_scatter(pool, seed, dtype, op, BLOCKS)


@params(SIZES_N)
@pytest.mark.parametrize("dtype", [*NUMERIC, "bool"])
def test_all_to_all(pool: RankThreads, seed: int, dtype: str, fake: fake_nccl.FakeNccl) -> None:
    before = fake.counts["ncclGroupStart"]
    expect.all_to_all(pool, seed, dtype, BLOCKS)
    n = pool.world_size
    # Blocks of 0 elements send nothing; the others go as send/recv pairs in a group.
    assert fake.counts["ncclGroupStart"] - before == n * 2 * 2 * 3


@params(SIZES_N)
def test_barrier(pool: RankThreads, tmp_path: Path) -> None:
    expect.barrier(pool, str(tmp_path))


@params([2, 3, 4])
@pytest.mark.parametrize("dtype", ["float64", "float16", "int32", "uint8", "bool"])
@pytest.mark.parametrize("senders_first", ["even", "odd"])
def test_send_recv_ring(pool: RankThreads, seed: int, dtype: str, senders_first: str) -> None:
    expect.send_recv_ring(pool, seed, dtype, [0, 1, 7, 4097, 300_007], senders_first)


@params([2, 3])
def test_send_several_before_recv_and_async(pool: RankThreads, seed: int) -> None:
    expect.send_many_then_recv(pool, seed, count=6, delay=0.2)
    expect.send_recv_async(pool, seed, 501)


@params(SIZES_N)
def test_object_collectives(pool: RankThreads, seed: int) -> None:
    expect.objects(pool, seed)
    expect.objects_not_json(pool)
    expect.broadcast_object_not_json(pool, pool.world_size - 1)


SUBGROUPS = [([0, 2], 2), ([2, 0], 0), ([1], 1), ([3, 1, 2], 1), ([0, 1, 2, 3], 3)]


@pytest.mark.parametrize("split", ["split", "fresh-id"])
@pytest.mark.parametrize("members,src", SUBGROUPS, ids=["0-2", "2-0", "1", "3-1-2", "all"])
@params([4])
def test_subgroup(
    pool: RankThreads,
    seed: int,
    members: list[int],
    src: int,
    split: str,
    fake: fake_nccl.FakeNccl,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if split == "fresh-id":
        monkeypatch.setenv("DPT_NCCL_SPLIT", "0")
    before = fake.counts["ncclCommSplit"]
    expect.subgroups(pool, seed, members, src)
    # Every rank of the default group takes part in a split (one-rank groups are serial).
    splits = fake.counts["ncclCommSplit"] - before
    assert splits == (4 if split == "split" and len(members) > 1 else 0)
    # NCCL wrote every child's handle late, into storage the backend still held.
    assert not fake.stale_writes, fake.stale_writes


@params(SIZES_N)
@pytest.mark.parametrize("pattern", ["all", "slice"])
def test_alloc_all_reduce(pool: RankThreads, seed: int, pattern: str) -> None:
    expect.alloc_all_reduce(pool, seed, 100_003, pattern)
    expect.alloc_buckets_async(pool, seed, [20_000, 70_001, 3, 40_000])


@params(SIZES_N)
def test_async_in_flight(pool: RankThreads, seed: int) -> None:
    expect.async_in_flight(pool, seed)
    expect.many_in_flight(pool, seed, 200)
    assert pool.run("nccl_bodies:synchronize_waits", {"seed": seed}) == [5] * pool.world_size


@params([2, 4])
def test_all_reduce_deterministic(pool: RankThreads, seed: int) -> None:
    expect.determinism(pool, seed, 300_007)


@pytest.mark.parametrize("n", SIZES_N)
def test_cupy_arrays_are_not_staged(fake: fake_nccl.FakeNccl, seed: int, n: int) -> None:
    """CuPy arrays go to NCCL as they are (their device pointers), results on their GPU.
    (The body puts a Tensor on cuda:0: all ranks share that GPU here.)"""
    expect.cupy_arrays(_ALL_POOLS.get(n, "1gpu", one_gpu=True), seed)


@params(SIZES_N)
def test_argument_validation(pool: RankThreads) -> None:
    expect.validation(pool)


@params([2])
def test_array_on_another_gpu_is_refused(pool: RankThreads) -> None:
    for rank, msg in enumerate(pool.run("nccl_bodies:wrong_device")):
        assert msg.startswith(f"[rank {rank}] all_reduce #"), msg
        assert f"is on cuda:{(rank + 1) % 2} but this group communicates on cuda:{rank % 2}" in msg


# ============================================================================ fake: streams, refs
@params([2])
def test_work_holds_arrays_until_done(pool: RankThreads, tmp_path: Path) -> None:
    got = pool.run("nccl_bodies:refs_until_done", {"directory": str(tmp_path), "size": 1000})
    assert got[0] == {"pending": True, "held": True, "released": True}


@params([2])
def test_wait_makes_the_stream_wait_not_the_host(pool: RankThreads, tmp_path: Path) -> None:
    got = pool.run("nccl_bodies:wait_without_host_sync", {"directory": str(tmp_path)})
    assert got[0]["returned_early"] is True


@params([2, 4])
def test_work_wait_timeout_leaves_collective_running(pool: RankThreads, tmp_path: Path) -> None:
    expect.work_wait_timeout(pool, str(tmp_path))


def test_in_progress_results_are_settled(fake: fake_nccl.FakeNccl, seed: int) -> None:
    """Non-blocking communicators may answer ncclInProgress: the backend polls until done."""
    pool = _ALL_POOLS.get(3)
    fake.in_progress_ops = 0.002
    try:
        expect.all_reduce(pool, seed, "float32", "SUM", [7, 999])
        expect.all_to_all(pool, seed, "int32", [3])
    finally:
        fake.in_progress_ops = 0.0


def test_signature_check_can_be_turned_off(
    fresh: list[RankThreads], seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPT_NCCL_CHECK", "0")
    pool = launch(fresh, 3, timeout=LONG)
    assert [g["check"] for g in pool.run("nccl_bodies:backend_info")] == [False] * 3
    expect.all_reduce(pool, seed, "int64", "MAX", SIZES)
    expect.barrier(pool, str(tmp_path))
    expect.send_recv_async(pool, seed, 33)


# ============================================================================ fake: failures
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_mismatch_fails_every_rank_fast(
    fresh: list[RankThreads], fake: fake_nccl.FakeNccl, kind: str
) -> None:
    pool = launch(fresh, 3, timeout=LONG)
    aborts, destroys = fake.counts["ncclCommAbort"], fake.counts["ncclCommDestroy"]
    got = results(pool.call("bodies:mismatch", {"kind": kind}, deadline=40))
    for after in expect.mismatched(got, kind, FAST):
        assert "unusable" in after["message"], after
    # Every communicator was aborted (never destroyed: that could block on the hung call).
    assert fake.counts["ncclCommAbort"] - aborts == 3
    assert fake.counts["ncclCommDestroy"] == destroys


@pytest.mark.parametrize("n,skipper", [(2, 1), (3, 1)])
def test_timeout_names_op_seq_and_missing_rank(
    fresh: list[RankThreads], n: int, skipper: int
) -> None:
    timeout = 1.5
    pool = launch(fresh, n, timeout=timeout)
    got = results(pool.call("bodies:skip_collective", {"sleep": timeout + 0.5, "skipper": skipper}))
    waiting = [r for r in range(n) if r != skipper]
    for rank in waiting:
        expect.timed_out(got[rank], timeout, FAST, f"ranks [{skipper}] never arrived")
    after = pool.call("bodies:collective_after_peer_death", {"timeout_hint": 0}, ranks=waiting)
    expect.aborted_after_timeout(results(after))


def test_rank_arriving_after_timeout_fails_too(fresh: list[RankThreads]) -> None:
    timeout, late = 1.5, 1
    pool = launch(fresh, 3, timeout=timeout)
    got = results(pool.call("bodies:late_rank", {"sleep": timeout + 1.5, "late": late}))
    expect.late_rank_failed(got, late)
    assert got[late]["elapsed"] < 1.5


@pytest.mark.parametrize("n", [2, 3])
def test_rank_leaving_the_group_fails_waiting_peers_fast(fresh: list[RankThreads], n: int) -> None:
    pool = launch(fresh, n, timeout=LONG)
    leaver = n - 1
    got = results(pool.call("nccl_bodies:leave_group", {"leaver": leaver}))
    expect.left_the_group(got, leaver, FAST)


def test_dead_local_peer_fails_waiting_ranks_fast(
    fresh: list[RankThreads], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose process is gone (here: declared dead; ranks are threads of one process)
    makes a rank waiting for it fail within seconds, naming its pid."""
    from collectives.backends.nccl import _watch as _nccl_watch

    pool = launch(fresh, 2, timeout=LONG)
    pool.run("bodies:ping", {"seed": 0})
    monkeypatch.setattr(_nccl_watch, "pid_alive", lambda pid: pid != os.getpid())
    got = results(pool.call("bodies:skip_collective", {"sleep": 1.0, "skipper": 1}))
    res = got[0]
    assert res["type"] == "PeerFailureError", res
    assert f"rank 1 (pid {os.getpid()}) is gone" in res["message"], res["message"]
    assert res["elapsed"] < FAST


def test_injected_error_code_fails_that_rank_and_its_peers(
    fresh: list[RankThreads], fake: fake_nccl.FakeNccl
) -> None:
    pool = launch(fresh, 3, timeout=LONG)
    pool.run("bodies:ping", {"seed": 0})
    comm = pool.worlds[1].default.backend.comm
    fake.fail_next("ncclAllReduce", 5, "fake: the buffer was not registered", comm=comm)
    got = results(pool.call("nccl_bodies:call_outcome", {"size": 100}))
    bad = got[1]
    assert bad["type"] == "CollectiveError", bad
    msg = bad["message"]
    assert msg.startswith("[rank 1] all_reduce #2") and "ncclAllReduce failed" in msg, msg
    assert "ncclInvalidUsage (5)" in msg and "fake: the buffer was not registered" in msg, msg
    for rank in (0, 2):
        res = got[rank]
        assert res["type"] == "PeerFailureError", res
        assert "rank 1 failed" in res["message"] and "ncclInvalidUsage" in res["message"]
        assert res["elapsed"] < FAST and res["value"] == rank + 1.0, res
    for res in got:
        assert res["next"]["type"] == "GroupAbortedError", res["next"]


def test_asynchronous_error_aborts_and_reaches_every_rank(
    fresh: list[RankThreads], fake: fake_nccl.FakeNccl
) -> None:
    pool = launch(fresh, 3, timeout=LONG)
    pool.run("bodies:ping", {"seed": 0})
    # Rank 2 stays out of the collective; rank 0's communicator reports a remote error.
    ranks = pool.submit("nccl_bodies:call_outcome", {"size": 10}, ranks=[0, 1])
    time.sleep(0.3)
    comm = pool.worlds[0].default.backend.comm
    assert fake.inject_async_error(comm, 6, "fake: NET/IB: connection reset by peer")
    got = results(pool.collect(ranks, deadline=30))
    assert got[0]["type"] == "PeerFailureError", got[0]
    assert "asynchronous error" in got[0]["message"] and "ncclRemoteError" in got[0]["message"]
    assert "connection reset by peer" in got[0]["message"]
    assert got[1]["type"] == "PeerFailureError" and "rank 0 failed" in got[1]["message"]
    assert got[1]["elapsed"] < FAST
    late = results(pool.call("bodies:collective_after_peer_death", {"timeout_hint": 0}, ranks=[2]))
    assert late[0]["type"] in ("PeerFailureError", "GroupAbortedError"), late[0]
    assert late[0]["elapsed"] < FAST


def test_init_timeout_names_the_ranks_that_never_joined(fresh: list[RankThreads]) -> None:
    def late_join(rank: int) -> None:
        if rank == 1:
            time.sleep(2.5)

    with pytest.raises(ThreadPoolError) as info:
        launch(fresh, 2, timeout=1.0, setup=late_join)
    text = str(info.value)
    assert "[rank 0] init" in text and "did not complete within 1 s" in text, text
    assert "ranks [1] never joined" in text, text


@pytest.mark.parametrize("n", [2])  # one rank runs the same code minus the peer
def test_benchmark_sweep_runs_on_the_fake(fake: fake_nccl.FakeNccl, tmp_path: Path, n: int) -> None:
    """benchmarks/nccl_bench.py's per-rank sweep and its report, on the fake (numbers are
    meaningless; this guards the one-shot GPU run against bugs outside NCCL)."""
    from benchmarks import nccl_bench

    pool = _ALL_POOLS.get(n)
    impls = ["ours", "ours-nocheck", "raw", "cupy", "torch"]
    got = pool.run(nccl_bench.measure, {"out_dir": tmp_path, "max_bytes": 8 << 10, "impls": impls})
    assert got == [0] * n, "a rank found a wrong all_reduce result"
    import json

    data = json.loads((tmp_path / "rank0.json").read_text())
    assert data["world"] == n and not data["failures"]
    for k in ("ours", "ours-nocheck", "raw"):
        assert [r["bytes"] for r in data["impls"][k]["rows"]] == [8, 32, 128, 512, 2048, 8192]
    assert "error" in data["impls"]["cupy"] and "error" in data["impls"]["torch"]
    lines = nccl_bench.table(data)
    assert lines[0].startswith("| size | ours us |") and len(lines) == 2 + 6
    text = "\n".join(nccl_bench.summary(data))
    assert "host time to issue one 8 B all_reduce: ours" in text and "cupy: not measured" in text


def test_errors_cross_a_process_boundary() -> None:
    err = CollectiveError("[rank 1] all_reduce #2: boom", rank=1, op="all_reduce", seq=2)
    back = pickle.loads(pickle.dumps(err))
    assert (back.rank, back.op, back.seq) == (1, "all_reduce", 2)


# ============================================================================ GPU
def _gpu_world_sizes() -> list[int]:
    return [1, 2, 4]


def _gpu_skip_reason(n: int) -> str | None:
    import tensorlib as tl

    reason = tl.cuda_unavailable_reason()
    if reason is not None:
        return f"no usable CUDA GPU: {reason}"
    import cupy

    if str(getattr(cupy, "__version__", "")).endswith("fake"):
        return "CuPy is the fake (TENSORLIB_FAKE_CUPY=1): real NCCL needs a real GPU"
    why = _nccl_load.unavailable_reason()
    if why is not None:
        return why
    if n == 1:
        return None
    gpus = int(cupy.cuda.runtime.getDeviceCount())
    if gpus >= n:
        return None
    if n > 2 * gpus:
        # NCCL 2.30+ supports at most 2 ranks per GPU (more can hang when resources run out).
        return f"{n} ranks on {gpus} GPU(s): NCCL supports at most 2 ranks per GPU"
    if _nccl_load.load().version < L.version_code(2, 30, 0):
        return (
            f"{n} ranks on {gpus} GPU(s) needs NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 "
            f"(NCCL {_nccl_load.load().version_string} refuses it: 'Duplicate GPU detected')"
        )
    return None


GPU_ENV = (
    ("NCCL_SOCKET_IFNAME", "lo"),
    ("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
    ("DPT_ALLOW_SHARED_GPU", "1"),
)


_GPU_POOLS: dict[int, RankPool] = {}


def _launch_gpu_pool(n: int) -> RankPool:
    """``n`` rank processes on real NCCL: one GPU each when there are enough (bound through
    CUDA_VISIBLE_DEVICES, as the launcher does), else all on GPU 0."""
    import cupy

    gpus = int(cupy.cuda.runtime.getDeviceCount())
    rank_env = {r: {"CUDA_VISIBLE_DEVICES": str(r)} for r in range(n)} if gpus >= n > 1 else None
    return RankPool.launch("nccl", n, env=dict(GPU_ENV), rank_env=rank_env, timeout=60.0)


@pytest.fixture(scope="module")
def gpu_pools(shm_leak_check: None) -> Iterator[dict[int, RankPool]]:
    yield _GPU_POOLS
    for p in _GPU_POOLS.values():
        p.close()
    _GPU_POOLS.clear()


@pytest.fixture
def gpu_pool(request: pytest.FixtureRequest, gpu_pools: dict[int, RankPool]) -> RankPool:
    n = int(request.param)
    reason = _gpu_skip_reason(n)
    if reason is not None:
        pytest.skip(reason)
    pool = gpu_pools.get(n)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = gpu_pools[n] = _launch_gpu_pool(n)
    return pool


def gpu_params() -> Any:
    return pytest.mark.parametrize(
        "gpu_pool", _gpu_world_sizes(), indirect=True, ids=[f"n{n}" for n in _gpu_world_sizes()]
    )


@pytest.mark.gpu
@gpu_params()
@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("float16", "MAX"), ("int64", "PROD")])
def test_gpu_all_reduce(gpu_pool: RankPool, seed: int, dtype: str, op: str) -> None:
    expect.all_reduce(gpu_pool, seed, dtype, op, SIZES)


@pytest.mark.gpu
@gpu_params()
def test_gpu_every_collective(gpu_pool: RankPool, seed: int, tmp_path: Path) -> None:
    n = gpu_pool.world_size
    expect.broadcast(gpu_pool, seed, "int32", SIZES)
    expect.reduce(gpu_pool, seed, "float64", "MIN", SIZES)
    expect.all_gather(gpu_pool, seed, "uint8", SIZES)
    expect.reduce_scatter(gpu_pool, seed, "float32", "AVG", BLOCKS)
    expect.all_to_all(gpu_pool, seed, "bool", BLOCKS)
    expect.barrier(gpu_pool, str(tmp_path))
    expect.objects(gpu_pool, seed)
    expect.async_in_flight(gpu_pool, seed)
    expect.cupy_arrays(gpu_pool, seed)
    got = gpu_pool.run("bodies:validation")
    assert len(got[0]) == 29 + (2 if n > 1 else 0)
    if n > 1:
        expect.send_recv_ring(gpu_pool, seed, "float32", [1, 4097], "even")
        assert gpu_pool.run(
            "bodies:subgroups", {"seed": seed, "members": list(range(n))[::-1], "src": 0}
        )


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2])
def test_gpu_mismatch_fails_every_rank(n: int) -> None:
    reason = _gpu_skip_reason(n)
    if reason is not None:
        pytest.skip(reason)
    with _launch_gpu_pool(n) as pool:
        got = results(pool.call("bodies:mismatch", {"kind": "shape"}, deadline=60))
    for res in got:
        assert res["first"]["type"] == "CollectiveMismatchError", res
        assert res["after"]["type"] == "GroupAbortedError", res


@params([2])
def test_calls_from_a_thread_on_another_gpu_use_the_groups(pool: RankThreads) -> None:
    """A thread whose current GPU is not the group's issues its calls: they run on the
    group's GPU (the caller's stream of that GPU), and the thread's current GPU is kept."""
    for rank, got in enumerate(pool.run("nccl_bodies:other_device_thread", {"size": 33})):
        assert got["error"] is None, got["error"]
        assert got["current"] == (rank + 1) % 2, got
        assert got["gathered_on"] == got["expected_device"], got


def test_failed_group_keeps_arrays_until_its_stream_is_idle(fresh: list[RankThreads]) -> None:
    pool = launch(fresh, 2, timeout=LONG)
    got = results(pool.call("nccl_bodies:arrays_after_abort", {"size": 1000}, ranks=[0]))[0]
    assert got["staged"] >= 1 and all(got["held"]), got  # device array and pinned staging
    assert got["released"], got


@params([1, 2, 3])
def test_ddp_step_on_nccl_makes_no_host_sync(pool: RankThreads) -> None:
    """A DDP step on nccl (forward, backward with its buckets and the end-of-backward check,
    optimizer step) never makes the host wait for the device, so it can run ahead; and the
    ranks end with the same parameters."""
    got = pool.run("nccl_bodies:ddp_steps", {"steps": 4})
    for rank, res in enumerate(got):
        assert res["error"] is None and res["buckets"] > 1, res
        assert res["per_step"] == [[]] * 4, f"rank {rank} waited: {res['per_step']}"
        assert res["params"] == got[0]["params"]


@params([2, 3])
def test_ddp_missing_gradient_on_nccl_is_reported_a_step_late(pool: RankThreads) -> None:
    """Without a host sync the end-of-backward check is read at the next backward: every
    rank raises there, naming the rank and the parameters."""
    got = pool.run("nccl_bodies:ddp_steps", {"steps": 4, "skip_on": 1})
    for res in got:
        err = res["error"]
        assert err is not None and err["step"] == 2, res
        assert "no gradient in the previous backward" in err["message"], err
        assert "rank 1: ['2.weight', '2.bias']" in err["message"], err
