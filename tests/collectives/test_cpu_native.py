"""The cpu backend's compiled helper (``collectives/backends/cpu/_cshm.c``) and its pure-Python
path: ``DPT_CPU_NATIVE`` picks one, both give bitwise the same results, ranks may mix them,
and a mismatch fails on every rank with the same message either way.

The rest of the suite runs the cpu pools on the default path (the helper, when built) and
``test_collectives.py``'s ``-py`` pools with ``DPT_CPU_NATIVE=0``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collectives.backends
from collectives.backends.cpu import _sync as _cpu_sync
from tests.collectives import expect
from tests.collectives.expect import results
from tests.collectives.harness import PoolCache, PoolSpec, RankPool

pytestmark = pytest.mark.timeout(120)

BUILT = importlib.util.find_spec("collectives.backends.cpu._cshm") is not None
needs_helper = pytest.mark.skipif(
    not BUILT, reason="the compiled helper is not built (pip install -e . with a C compiler)"
)
PYTHON = (("DPT_CPU_NATIVE", "0"),)


# ---------------------------------------------------------------------------- the switch
def test_env_picks_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPT_CPU_NATIVE", "0")
    assert _cpu_sync.native_module() is None
    monkeypatch.setenv("DPT_CPU_NATIVE", "yes")
    with pytest.raises(ValueError, match=r"DPT_CPU_NATIVE must be 0 .* got 'yes'"):
        _cpu_sync.native_module()
    monkeypatch.delenv("DPT_CPU_NATIVE")
    assert (_cpu_sync.native_module() is not None) == BUILT
    # Not built (an import that fails): unset falls back; 1 says what is missing.
    monkeypatch.setitem(sys.modules, "collectives.backends.cpu._cshm", None)
    monkeypatch.delattr(collectives.backends.cpu, "_cshm", raising=False)
    assert _cpu_sync.native_module() is None
    monkeypatch.setenv("DPT_CPU_NATIVE", "1")
    with pytest.raises(RuntimeError, match="compiled helper is not built"):
        _cpu_sync.native_module()


@pytest.mark.parametrize("env,native", [((), BUILT), (PYTHON, False)], ids=["default", "py"])
def test_ranks_run_the_path_asked_for(pool_cache: PoolCache, env: Any, native: bool) -> None:
    pool = pool_cache.get(PoolSpec("cpu", 2, env, tag="py" if env else ""))
    assert pool.run("native_bodies:uses_native") == [native, native]


# ---------------------------------------------------------------------------- same results
@needs_helper
@pytest.mark.parametrize("n,stream", [(2, False), (3, False), (3, True)])
def test_compiled_and_python_results_are_bitwise_equal(
    pool_cache: PoolCache, seed: int, n: int, stream: bool
) -> None:
    """``stream``: the small all-reduce's copies from 16 KiB are streaming stores."""
    env = (("DPT_CPU_STREAM", "1"),) if stream else ()
    pool = pool_cache.get(PoolSpec("cpu", n, env, tag="stream" if stream else ""))
    kw = {"seed": seed, "sizes": [0, 1, 7, 1000, 16_384]}
    got = pool.run("native_bodies:same_bits", kw)
    assert all(g["native"] for g in got), got
    assert {g["checked"] for g in got} == {got[0]["checked"]} and got[0]["checked"] > 0


STREAM = (("DPT_CPU_STREAM", "1"),)


@needs_helper
@pytest.mark.parametrize(
    "chunk,sizes,zero_copy,impatient,stream",
    [
        (8192, [2049, 20_011], False, False, False),
        (8192, [2049, 20_011], True, False, False),
        (0, [200_003], False, False, False),
        (8192, [20_011], False, True, False),
        (8192, [2049, 20_011], False, False, True),
        (0, [200_003], False, False, True),
    ],
    ids=[
        "staged",
        "zero-copy",
        "short-rounds",
        "rounds-left-to-python",
        "staged-streaming",
        "short-rounds-streaming",
    ],
)
def test_large_all_reduce_is_bitwise_equal_on_both_paths(
    pool_cache: PoolCache,
    seed: int,
    chunk: int,
    sizes: list[int],
    zero_copy: bool,
    impatient: bool,
    stream: bool,
) -> None:
    """Above the small-message size, in rounds of 8 KiB staging chunks (many chunks, odd
    lengths, slices of unequal size at 3 ranks) or of the compiled path's short rounds
    (default chunk; Python takes whole chunks): the compiled rounds and the zero-copy helper
    give NumPy's in-order result bit for bit, as the Python path does; also when the compiled
    rounds stop at a wait and Python finishes the round and resumes them, and when the rounds
    write what the peers read with streaming stores (``DPT_CPU_STREAM=1``)."""
    env: tuple[tuple[str, str], ...] = (("DPT_CPU_CHUNK_BYTES", str(chunk)),) if chunk else ()
    env += STREAM if stream else ()
    tag = (f"chunk{chunk}" if chunk else "") + ("-stream" if stream else "")
    pool = pool_cache.get(PoolSpec("cpu", 3, env, tag=tag))
    kw = {"seed": seed, "sizes": sizes, "zero_copy": zero_copy, "impatient": impatient}
    got = pool.run("native_bodies:same_bits", kw)
    assert all(g["native"] for g in got), got
    assert {g["checked"] for g in got} == {got[0]["checked"]} and got[0]["checked"] > 0
    if impatient:
        assert sum(g["partial"] for g in got) > 0, got


@needs_helper
@pytest.mark.parametrize(
    "setting,tried", [("auto", (True, True)), ("0", (True, False)), ("1", (False, True))]
)
def test_the_rounds_measure_both_ways_to_store_unless_told_one(
    pools: list[RankPool], setting: str, tried: tuple[bool, bool]
) -> None:
    """``DPT_CPU_STREAM`` unset or ``auto``: the staged rounds (70,000 float32) and the small
    all-reduce from 16 KiB (8,192) time plain and streaming stores (one call in 64 the other
    way) and take the cheaper, with correct results either way; 0 or 1 takes that one only.
    Below 16 KiB (2,048) nothing is timed. (Which way is cheaper depends on whether the ranks'
    cores share a cache, so no test says which.)"""
    pool = RankPool.launch("cpu", 2, timeout=60, env={"DPT_CPU_STREAM": setting})
    pools.append(pool)
    kw = {"counts": [70_000, 8192, 2048], "calls": 70}
    for rounds, small, tiny in pool.run("native_bodies:stream_costs", kw):
        assert (rounds[0] > 0, rounds[1] > 0) == tried, rounds
        assert (small[0] > 0, small[1] > 0) == tried, small
        assert tiny == [0.0, 0.0], tiny


def test_a_bad_stream_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("", -1), ("AUTO", -1), ("0", 0), ("1", 1)):
        monkeypatch.setenv("DPT_CPU_STREAM", raw)
        assert _cpu_sync.stream_setting() == want
    monkeypatch.setenv("DPT_CPU_STREAM", "fast")
    with pytest.raises(ValueError, match=r"DPT_CPU_STREAM must be auto, 0 .* got 'fast'"):
        _cpu_sync.stream_setting()


@needs_helper
def test_ranks_may_mix_the_paths(pools: list[RankPool], seed: int, tmp_path: Path) -> None:
    """Rank 1 in pure Python, ranks 0 and 2 compiled: the same protocol, so every collective
    works, and a mismatch still fails on every rank naming both sides."""
    mixed = [RankPool.launch("cpu", 3, timeout=60, rank_env={1: dict(PYTHON)}) for _ in "ab"]
    pools.extend(mixed)
    pool = mixed[0]
    assert pool.run("native_bodies:uses_native") == [True, False, True]
    expect.all_reduce(pool, seed, "float32", "SUM", [0, 7, 4097, 70_001])
    expect.all_reduce(pool, seed, "int32", "MAX", [1, 1000])
    expect.all_reduce(pool, seed, "float64", "AVG", [300_007])  # C rounds beside Python's
    expect.barrier(pool, str(tmp_path))
    expect.broadcast(pool, seed, "float64", [7, 300_007])
    got = results(mixed[1].call("bodies:mismatch", {"kind": "reduce_op"}, deadline=30, grace=None))
    expect.mismatched(got, "reduce_op", 10.0)


@pytest.mark.parametrize("kind", ["op", "shape", "large_shape"])
def test_mismatch_fails_every_rank_in_python(pools: list[RankPool], kind: str) -> None:
    pool = RankPool.launch("cpu", 3, timeout=60, env=dict(PYTHON))
    pools.append(pool)
    got = results(pool.call("bodies:mismatch", {"kind": kind}, deadline=30, grace=None))
    for after in expect.mismatched(got, kind, 10.0):
        assert "unusable" in after["message"], after


# ---------------------------------------------------------------------------- the worker pool
def _pool_tasks() -> int:
    """The threads of this process that are the helper's pool workers (by their name)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "dpt-reduce"
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return count


def _many_call(cshm: Any, seed: int, workers: int) -> bool:
    """One reduction of three 1 MiB float32 arrays into two outputs on ``workers`` threads;
    whether it gave the one-output loop's bits."""
    rng = np.random.default_rng(seed)
    src = [rng.standard_normal(262_147).astype(np.float32) for _ in range(3)]
    want = np.empty_like(src[0])
    cshm.reduce_into(0, False, want, src)
    outs = [np.empty_like(want) for _ in range(2)]
    cshm.reduce_into_many(0, False, outs, src, 0, want.size, workers, False)
    return all(o.tobytes() == want.tobytes() for o in outs)


@needs_helper
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_pool_starts_on_first_use_and_stops_without_leaving_a_thread() -> None:
    cshm = _cpu_sync.native_module()
    cshm.pool_stop()
    assert cshm.pool_threads() == 0 and _pool_tasks() == 0
    assert _many_call(cshm, 1, 1) and cshm.pool_threads() == 0  # one thread: no pool
    assert _many_call(cshm, 2, 3)
    assert cshm.pool_threads() == 2 and _pool_tasks() == 2
    assert _many_call(cshm, 3, 2) and cshm.pool_threads() == 2  # never more than asked once
    cshm.pool_stop()
    assert cshm.pool_threads() == 0 and _pool_tasks() == 0
    assert _many_call(cshm, 4, 3) and _pool_tasks() == 2  # and it starts again
    cshm.pool_stop()
    assert _pool_tasks() == 0


@needs_helper
def test_calls_from_many_threads_at_once_share_or_skip_the_pool() -> None:
    """One call uses the pool at a time; the others run on their own threads meanwhile."""
    cshm = _cpu_sync.native_module()
    ok: list[bool] = []

    def body(seed: int) -> None:
        ok.extend(_many_call(cshm, seed * 100 + k, 3) for k in range(8))

    threads = [threading.Thread(target=body, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert ok == [True] * 32
    cshm.pool_stop()


@needs_helper
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_starts_its_own_pool() -> None:
    """The parent's workers do not exist in a child: it starts with none and makes its own."""
    cshm = _cpu_sync.native_module()
    assert _many_call(cshm, 5, 3) and cshm.pool_threads() == 2
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on
        good = cshm.pool_threads() == 0 and _many_call(cshm, 6, 3) and cshm.pool_threads() == 2
        cshm.pool_stop()
        os._exit(0 if good else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _many_call(cshm, 7, 3)
    cshm.pool_stop()


@needs_helper
def test_the_interpreter_exits_with_the_pool_running() -> None:
    """Workers sleeping or spinning at exit: atexit ends them, the process exits at once."""
    code = (
        "import numpy as np\n"
        "from collectives import ReduceOp\n"
        "from collectives.backends._reduce import reduce_to_all\n"
        "src = [np.ones(1 << 20, np.float32) for _ in range(2)]\n"
        "outs = [np.empty_like(src[0]) for _ in range(2)]\n"
        "reduce_to_all(outs, src, ReduceOp.SUM, 2, parallel=True)\n"
        "assert all((o == 2).all() for o in outs)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
