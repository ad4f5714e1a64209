"""Burn's device-list collectives (collectives.distributed) on logical CPU devices: one thread
submitting every device, one thread per device, and every way a call can go wrong.

The ``check_*`` bodies take the device list, so that every engine runs them: logical CPU
devices here, fake GPUs with the fake NCCL in test_distributed_nccl.py, real GPUs in
test_distributed_gpu.py.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from collectives import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from collectives import ReduceOp as PgOp
from collectives.backends._reduce import reduce_in_order
from collectives.distributed import (
    CollectiveTensor,
    DistributedConfig,
    DistributedContext,
    ReduceOperation,
    all_reduce,
    register_context_engine,
    unregister_context_engine,
)

OPS = list(ReduceOperation)
QUICK = DistributedConfig(timeout=5.0)


@pytest.fixture(autouse=True)
def four_cpu_devices() -> Iterator[None]:
    tl.set_cpu_device_count(4)
    yield
    tl.set_cpu_device_count(None)


def _devices(n: int) -> list[tl.Device]:
    return list(tl.Device.enumerate("cpu"))[:n]


def _local(devs: list[tl.Device], dtype: str, shape: tuple[int, ...] = (5, 3)) -> list[Any]:
    rng = np.random.default_rng(len(devs))
    arrays = [rng.uniform(0.5, 2.0, shape).astype(dtype) for _ in devs]
    if np.dtype(dtype).kind == "i":
        arrays = [rng.integers(-9, 9, shape).astype(dtype) for _ in devs]
    return [tl.tensor(a, device=d) for a, d in zip(arrays, devs, strict=True)]


def _expected(tensors: list[tl.Tensor], op: ReduceOperation) -> np.ndarray:
    arrays = [t.numpy() for t in tensors]
    out = np.empty_like(arrays[0])
    reduce_in_order(out, arrays, op.op, len(arrays))
    return out


def _shifted(t: tl.Tensor, scale: float = 1.0, shift: float = 0.0) -> tl.Tensor:
    """``t * scale + shift`` on ``t``'s device, made from the host (a kernel on a GPU that is
    not the thread's current device would need that device made current first)."""
    return tl.tensor(t.numpy() * scale + shift, device=t.device)


def _same(got: np.ndarray, want: np.ndarray, exact: bool = True) -> bool:
    """Bitwise equal; or, where ``exact`` is False (NCCL on GPUs reduces floats in its own
    order, and its Mean multiplies each input by 1/n), equal to a float's rounding."""
    if exact or got.dtype.kind != "f":
        return bool(np.array_equal(got, want))
    rtol = 1e-5 if got.dtype.itemsize <= 4 else 1e-12
    return bool(np.allclose(got, want, rtol=rtol, atol=0.0))


def _run_threads(fns: list[Callable[[], Any]], limit: float = 20.0) -> list[Any]:
    """Run each fn in its own thread; a thread still running after ``limit`` s fails the test."""
    results: list[Any] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # reported to the test below
            results[i] = exc

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit)
    assert not any(t.is_alive() for t in threads), "a device thread hung"
    return results


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", ["float64", "float32", "int64"])
def test_one_thread_submits_every_device_then_resolves(
    n: int, op: ReduceOperation, dtype: str
) -> None:
    check_one_thread_submits_every_device_then_resolves(_devices(n), op, dtype)


def check_one_thread_submits_every_device_then_resolves(
    devs: list[tl.Device], op: ReduceOperation, dtype: str, exact: bool = True
) -> None:
    """The page's code: every device's tensor reduced, the same bits on each device as the
    in-order reduction of the cpu backend, each result on its input's device, inputs intact."""
    n = len(devs)
    local = _local(devs, dtype)
    before = [t.numpy().copy() for t in local]
    with DistributedContext(devs, DistributedConfig(all_reduce_op=ReduceOperation.Mean)):
        pending = [all_reduce(t, op, devs) for t in local]
        reduced = [p.resolve() for p in pending]
    want = _expected(local, op)
    for d, r in zip(devs, reduced, strict=True):
        assert r.device == d
        assert r.dtype == local[0].dtype
        assert _same(r.numpy(), want, exact), (d, op)
    for t, b in zip(local, before, strict=True):
        assert np.array_equal(t.numpy(), b), "all_reduce wrote its input"
    if n > 1:  # each device owns its result: writing one leaves the others alone
        reduced[0].data[...] = 0
        assert _same(reduced[1].numpy(), want, exact)


def test_the_config_op_is_the_default_and_many_calls_stay_in_order() -> None:
    check_the_config_op_is_the_default_and_many_calls_stay_in_order(_devices(3))


def check_the_config_op_is_the_default_and_many_calls_stay_in_order(
    devs: list[tl.Device], exact: bool = True
) -> None:
    local = _local(devs, "float64")
    with DistributedContext.init(devs, DistributedConfig(all_reduce_op=ReduceOperation.Sum)):
        first = [all_reduce(t) for t in local]  # no op: the config's (Sum)
        second = [all_reduce(_shifted(t, 2.0), ReduceOperation.Max, devs) for t in local]
        third = [all_reduce(t, "mean", list(reversed(devs))) for t in local]  # any order
        assert [p.seq for p in first + second + third] == [0] * 3 + [1] * 3 + [2] * 3
        got = [[p.resolve() for p in calls] for calls in (third, first, second)]
    assert _same(got[1][2].numpy(), _expected(local, ReduceOperation.Sum), exact)
    doubled = [_shifted(t, 2.0) for t in local]
    assert _same(got[2][0].numpy(), _expected(doubled, ReduceOperation.Max), exact)
    assert _same(got[0][1].numpy(), _expected(local, ReduceOperation.Mean), exact)


@pytest.mark.parametrize("n", [2, 4])
def test_one_thread_per_device_as_burns_ddp_runs(n: int) -> None:
    check_one_thread_per_device_as_burns_ddp_runs(_devices(n))


def check_one_thread_per_device_as_burns_ddp_runs(
    devs: list[tl.Device], calls: int = 20, exact: bool = True
) -> None:
    """Each device's thread submits and resolves its own tensor, many calls in a row."""
    n = len(devs)
    local = _local(devs, "float64")

    def worker(i: int) -> list[np.ndarray]:
        out = []
        for k in range(calls):
            p = all_reduce(_shifted(local[i], shift=k), ReduceOperation.Sum, devs)
            out.append(p.resolve().numpy())
        return out

    with DistributedContext(devs, QUICK):
        results = _run_threads([functools.partial(worker, i) for i in range(n)])
    for r in results:
        assert not isinstance(r, BaseException), r
    for k in range(calls):
        want = _expected([_shifted(t, shift=k) for t in local], ReduceOperation.Sum)
        for r in results:
            assert _same(r[k], want, exact)


def test_resolve_before_the_other_devices_submit_fails_at_once_naming_them() -> None:
    check_resolve_before_the_other_devices_submit_fails_at_once_naming_them(_devices(3))


def check_resolve_before_the_other_devices_submit_fails_at_once_naming_them(
    devs: list[tl.Device],
) -> None:
    local = _local(devs, "float32")
    with DistributedContext(devs):
        p = all_reduce(local[0], ReduceOperation.Sum, devs)
        t0 = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            p.resolve()
        assert time.monotonic() - t0 < 3.0
        text = str(info.value)
        assert "all_reduce #0" in text and f"{devs[1]}, {devs[2]}" in text and "first" in text
        assert info.value.op == "all_reduce" and info.value.seq == 0
        with pytest.raises(CollectiveError, match="no result yet"):
            p.assume_resolved()
        # The call is still open: submitting the rest completes it.
        rest = [all_reduce(t, ReduceOperation.Sum, devs) for t in local[1:]]
        assert np.array_equal(p.resolve().numpy(), _expected(local, ReduceOperation.Sum))
        if devs[0].type == "cpu":  # the NumPy engine reduces in the last submitter's thread
            assert all(q.is_resolved() for q in rest)
        assert np.array_equal(rest[1].assume_resolved().numpy(), p.resolve().numpy())


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "op", "order"],
)
def test_mismatched_calls_raise_on_every_participant(change: str) -> None:
    devs = _devices(3)
    a = _local(devs, "float64")
    b = _local(devs, "float64", shape=(2,))
    with DistributedContext(devs, QUICK) as ctx:
        if change == "order":  # cpu:2 makes its two calls the other way round
            first = [all_reduce(a[0], devices=devs), all_reduce(a[1], devices=devs)]
            second = [all_reduce(b[0], devices=devs), all_reduce(b[1], devices=devs)]
            with pytest.raises(CollectiveMismatchError) as info:
                all_reduce(b[2], devices=devs)
            pending = first + second
        else:
            pending = [all_reduce(t, ReduceOperation.Sum, devs) for t in a[:2]]
            odd = {
                "shape": (b[2], ReduceOperation.Sum),
                "dtype": (a[2].to(tl.float32), ReduceOperation.Sum),
                "op": (a[2], ReduceOperation.Max),
            }[change]
            with pytest.raises(CollectiveMismatchError) as info:
                all_reduce(*odd, devs)
        assert "[cpu:2] all_reduce #0" in str(info.value) and "disagree" in str(info.value)
        for p in pending[:2]:  # the devices that had submitted call #0 learn it too
            with pytest.raises(CollectiveMismatchError, match=rf"\[{p.device}\] all_reduce #0"):
                p.resolve()
        with pytest.raises(CollectiveError, match="unusable after an earlier failure"):
            all_reduce(a[0], devices=devs)
        assert "broken" in repr(ctx)


def test_leaving_the_context_ends_it() -> None:
    check_leaving_the_context_ends_it(_devices(2))


def check_leaving_the_context_ends_it(devs: list[tl.Device]) -> None:
    local = _local(devs, "float64")
    with DistributedContext(devs) as ctx:
        done = [all_reduce(t, devices=devs) for t in local]
        half = all_reduce(local[0], devices=devs)
    assert ctx.closed and "closed" in repr(ctx)
    assert np.array_equal(done[1].resolve().numpy(), _expected(local, ReduceOperation.Mean))
    with pytest.raises(CollectiveError, match="context is closed"):
        half.resolve()
    with pytest.raises(CollectiveError, match="no open DistributedContext"):
        all_reduce(local[0], ReduceOperation.Sum, devs)
    ctx.close()  # idempotent
    with DistributedContext(devs):  # the devices are free again
        again = [all_reduce(t, devices=devs) for t in local]
        assert again[0].seq == 0 and again[1].resolve().device == devs[1]


def test_closing_fails_a_waiting_resolve_and_a_timeout_names_the_missing_device() -> None:
    devs = _devices(2)
    local = _local(devs, "float64")
    ctx = DistributedContext(devs, DistributedConfig(timeout=0.5))

    def waiter() -> Any:
        return all_reduce(local[0], devices=devs).resolve(timeout=10)

    def closer() -> None:
        time.sleep(0.3)
        ctx.close()

    got = _run_threads([waiter, closer])
    assert isinstance(got[0], CollectiveError) and "context is closed" in str(got[0])

    with DistributedContext(devs, DistributedConfig(timeout=0.5)):
        # Another thread submitted cpu:1's earlier call, so it may submit this one: wait.
        _run_threads([lambda: all_reduce(local[1], devices=devs)])
        first = all_reduce(local[0], devices=devs)
        assert first.resolve().device == devs[0]
        p = all_reduce(local[0], devices=devs)
        with pytest.raises(CollectiveTimeoutError, match=r"0.5 s waiting for device cpu:1"):
            p.resolve()


def test_bad_device_lists_and_tensors_are_refused_clearly() -> None:
    devs = _devices(2)
    with pytest.raises(ValueError, match="cpu:1 is listed twice"):
        DistributedContext([devs[0], devs[1], "cpu:1"])
    with pytest.raises(ValueError, match="empty"):
        DistributedContext([])
    with pytest.raises(TypeError, match="list of devices"):
        DistributedContext("cpu")
    with pytest.raises(TypeError, match="DistributedConfig"):
        DistributedContext(devs, {"all_reduce_op": "mean"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown reduce operation"):
        DistributedConfig(all_reduce_op="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        DistributedConfig(timeout=0)
    with DistributedContext(devs):
        with pytest.raises(ValueError, match="already in an open context"):
            DistributedContext([devs[1], "cpu:2"])
        outside = tl.ones(3, device="cpu:3")
        with pytest.raises(CollectiveError, match="no open DistributedContext has device cpu:3"):
            all_reduce(outside)
        with pytest.raises(CollectiveError, match="not one of the context's devices"):
            all_reduce(outside, devices=devs)
        with pytest.raises(TypeError, match="tensorlib Tensor"):
            all_reduce(np.ones(3), devices=devs)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown reduce operation"):
            all_reduce(tl.ones(3), "median", devs)


class _Odd:
    """A device kind whose engine has only Sum (as an engine without the others would)."""

    type = "odd"


def test_an_op_the_engine_lacks_and_a_failing_engine_are_clear_errors() -> None:
    class SumOnly:
        ops = frozenset({PgOp.SUM})

        def __init__(self, devices: list[Any], config: DistributedConfig) -> None:
            self.calls = 0

        def all_reduce(self, arrays: list[Any], op: PgOp, seq: int) -> Any:
            raise OSError("the link is down")

        def close(self) -> None:
            return None

    from collectives.distributed import make_context_engine
    from collectives.distributed._numpy import make_numpy_engine

    register_context_engine("odd", SumOnly)
    try:
        engine = make_context_engine([_Odd()], DistributedConfig())
        assert engine.ops == frozenset({PgOp.SUM})
    finally:
        unregister_context_engine("odd")
    with pytest.raises(ValueError, match="no engine for devices of kind 'odd'"):
        make_context_engine([_Odd()], DistributedConfig())
    with pytest.raises(ValueError, match="of one kind"):
        make_context_engine([_Odd(), tl.Device("cpu")], DistributedConfig())

    # An engine that fails a launch fails the call for every device and breaks the context.
    devs = _devices(2)
    local = _local(devs, "float64")
    register_context_engine("cpu", SumOnly)  # in place of the NumPy engine, for this test
    try:
        ctx = DistributedContext(devs)
    finally:
        register_context_engine("cpu", make_numpy_engine)
    with ctx:
        with pytest.raises(CollectiveError, match="Max is not supported"):
            all_reduce(local[0], ReduceOperation.Max, devs)
        first = all_reduce(local[0], ReduceOperation.Sum, devs)
        with pytest.raises(CollectiveError, match="the link is down"):
            all_reduce(local[1], ReduceOperation.Sum, devs)
        with pytest.raises(CollectiveError, match=r"\[cpu\] all_reduce #0.*link is down"):
            first.resolve()
        with pytest.raises(CollectiveError, match="unusable"):
            all_reduce(local[0], ReduceOperation.Sum, devs)


def test_collective_tensor_says_what_it_is() -> None:
    devs = _devices(2)
    with DistributedContext(devs):
        p = all_reduce(tl.ones(2, device=devs[1]), devices=devs)
        assert isinstance(p, CollectiveTensor) and p.device == devs[1]
        assert repr(p) == "CollectiveTensor(all_reduce #0 on cpu:1, pending)"
        all_reduce(tl.ones(2), devices=devs)
        assert p.is_resolved() and "resolved" in repr(p)
        assert p.resolve() is p.resolve()


def test_large_results_are_recycled_only_once_nothing_holds_them() -> None:
    """Outputs of 64 KiB and more come from a pool: a result (or a view of it) the caller
    still holds is never overwritten by a later call; a dropped one is reused."""
    devs = _devices(2)
    size = 40_000  # float64: 320 KB

    def step(value: float) -> list[tl.Tensor]:
        ts = [tl.full((size,), value, dtype=tl.float64, device=d) for d in devs]
        return [p.resolve() for p in [all_reduce(t, ReduceOperation.Sum, devs) for t in ts]]

    with DistributedContext(devs):
        kept = step(1.0)
        view = step(2.0)[1].data[:5]  # only a view of this result survives
        later = [step(float(k)) for k in range(3, 7)]
        assert np.all(kept[0].numpy() == 2.0) and np.all(kept[1].numpy() == 2.0)
        assert np.all(view == 4.0)
        assert np.all(later[-1][1].numpy() == 12.0)
        seen = {t.data.ctypes.data for r in later for t in r}
        del later
        again = step(7.0)
        assert {t.data.ctypes.data for t in again} <= seen, "dropped results were not reused"
        assert np.all(again[0].numpy() == 14.0) and np.all(kept[0].numpy() == 2.0)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "uint8", "float16"])
def test_large_calls_reduce_on_every_core_with_the_same_bits(
    n: int, op: ReduceOperation, dtype: str
) -> None:
    """Past the size where the helper's worker threads share the reduction (uneven chunks),
    and in the compiled loops' absence (float16, float min/max): the in-order bits on every
    device, each device its own array; a non-contiguous input goes through NumPy alike."""
    devs = _devices(n)
    local = _local(devs, dtype, (1001, 263))
    with DistributedContext(devs):
        reduced = [p.resolve() for p in [all_reduce(t, op, devs) for t in local]]
        strided = [tl.from_array(t.numpy().T, t.device) for t in local]  # F-order views
        again = [p.resolve() for p in [all_reduce(t, op, devs) for t in strided]]
    want = _expected(local, op)
    for r, a in zip(reduced, again, strict=True):
        assert r.numpy().tobytes() == want.tobytes(), (n, op, dtype)
        assert np.array_equal(a.numpy(), want.T), (n, op, dtype)
    assert not any(
        np.shares_memory(x.data, y.data) for i, x in enumerate(reduced) for y in reduced[i + 1 :]
    )
