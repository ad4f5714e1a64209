"""``DistributedContext`` over remote devices of one server: every device's all_reduce issued
from one thread, reduced on the server, bit for bit as ``reduce_in_order`` on the host."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import remote
import tensorlib as tl
from collectives import CollectiveError
from collectives.backends._reduce import reduce_in_order
from collectives.distributed import (
    DistributedConfig,
    DistributedContext,
    ReduceOperation,
    all_reduce,
    context_engine_kinds,
)
from remote.client._context_engine import RemoteContextEngine

from .conftest import TOKEN

QUICK = DistributedConfig(timeout=10.0)


@pytest.fixture(scope="module")
def four() -> Iterator[list[tl.Device]]:
    """Four cpu devices of one in-process server."""
    server = remote.RemoteServer(["cpu"] * 4).with_authorizer(remote.TokenAuthorizer(TOKEN))
    with server.serve() as s:
        yield list(tl.Device.enumerate(remote.RemoteHost(s.address).with_credential(TOKEN)))


def _inputs(n: int, dtype: str, shape: tuple[int, ...] = (7, 5)) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    if np.dtype(dtype).kind == "i":
        return [rng.integers(-99, 99, shape).astype(dtype) for _ in range(n)]
    return [rng.uniform(-2.0, 2.0, shape).astype(dtype) for _ in range(n)]


def _expected(arrays: list[np.ndarray], op: ReduceOperation) -> np.ndarray:
    out = np.empty_like(arrays[0])
    reduce_in_order(out, arrays, op.op, len(arrays))
    return out


def test_the_remote_engine_is_registered_at_import() -> None:
    assert "remote" in context_engine_kinds()


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    ("op", "dtype"),
    [
        (ReduceOperation.Sum, "float64"),
        (ReduceOperation.Mean, "float64"),
        (ReduceOperation.Max, "float64"),
        (ReduceOperation.Sum, "float32"),
        (ReduceOperation.Max, "int64"),
    ],
)
def test_one_thread_reduces_every_device_on_the_server(
    four: list[tl.Device], n: int, op: ReduceOperation, dtype: str
) -> None:
    devs = four[:n]
    host = _inputs(n, dtype)
    ts = [tl.tensor(a, device=d) for a, d in zip(host, devs, strict=True)]
    before = remote.stats(devs[0])["bytes_received"]
    with DistributedContext(devs, QUICK) as ctx:
        assert isinstance(ctx._engine, RemoteContextEngine)
        pending = [all_reduce(t, op, devs) for t in ts]
        reduced = [p.resolve() for p in pending]
    # Nothing came back to the client for the reduction itself.
    assert remote.stats(devs[0])["bytes_received"] - before < 1024
    want = _expected(host, op)
    for r, d, t, a in zip(reduced, devs, ts, host, strict=True):
        assert r.device == d and r is not t
        got = r.numpy()
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()
        np.testing.assert_array_equal(t.numpy(), a)  # the inputs are not written


def test_several_calls_in_a_row_keep_their_order(four: list[tl.Device]) -> None:
    devs = four[:2]
    rounds = [_inputs(2, "float64", (3,)) for _ in range(3)]
    with DistributedContext(devs, QUICK):
        pending = [
            [
                all_reduce(tl.tensor(a, device=d), ReduceOperation.Sum, devs)
                for a, d in zip(r, devs, strict=True)
            ]
            for r in rounds
        ]
        results = [[p.resolve().numpy() for p in ps] for ps in pending]
    for r, got in zip(rounds, results, strict=True):
        want = _expected(r, ReduceOperation.Sum)
        assert all(g.tobytes() == want.tobytes() for g in got)


def test_devices_of_two_servers_are_refused(four: list[tl.Device]) -> None:
    with remote.serve(["cpu"], token=TOKEN) as other:
        theirs = remote.RemoteHost(other.address).with_credential(TOKEN).devices()[0]
        with pytest.raises(ValueError, match="one server") as err:
            DistributedContext([four[0], theirs], QUICK)
        addr0 = str(four[0])[len("remote://") :].rsplit("/", 1)[0]
        assert addr0 in str(err.value) and other.address in str(err.value)


def test_a_device_listed_twice_is_refused(four: list[tl.Device]) -> None:
    with pytest.raises(ValueError, match=r"twice|once"):
        DistributedContext([four[0], four[0]], QUICK)


def test_an_array_of_another_device_is_refused(four: list[tl.Device]) -> None:
    engine = RemoteContextEngine(four[:2], QUICK)
    arrays: list[Any] = [tl.tensor(np.ones(2), device=four[1]).data] * 2
    with pytest.raises(ValueError, match="must be an array of that remote device"):
        engine.all_reduce(arrays, ReduceOperation.Sum.op, 0)
    with pytest.raises(ValueError, match="must be an array"):
        engine.all_reduce([np.ones(2), np.ones(2)], ReduceOperation.Sum.op, 0)
    engine.close()


def test_one_thread_per_device_submits_its_own_tensor(four: list[tl.Device]) -> None:
    devs = four[:3]
    host = _inputs(3, "float64")
    out: list[Any] = [None] * 3
    with DistributedContext(devs, QUICK):

        def worker(i: int) -> None:
            t = tl.tensor(host[i], device=devs[i])
            out[i] = all_reduce(t, ReduceOperation.Mean, devs).resolve().numpy()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
    want = _expected(host, ReduceOperation.Mean)
    assert all(o is not None and o.tobytes() == want.tobytes() for o in out), out


def test_a_collective_after_close_is_a_clear_error(four: list[tl.Device]) -> None:
    devs = four[:2]
    with DistributedContext(devs, QUICK):
        pass
    with pytest.raises(CollectiveError, match="no open DistributedContext"):
        all_reduce(tl.tensor(np.ones(2), device=devs[0]), ReduceOperation.Sum, devs)
    # The devices are free again: a new context over them works.
    with DistributedContext(devs, QUICK):
        ps = [all_reduce(tl.tensor(np.ones(2), device=d), ReduceOperation.Sum, devs) for d in devs]
        assert [p.resolve().numpy().tolist() for p in ps] == [[2.0, 2.0]] * 2
