"""The fused LINEAR, LINEAR_GRAD, CROSS_ENTROPY and CROSS_ENTROPY_GRAD records: a remote
Linear layer and cross-entropy loss are one record each way, give the local bits, fail like
any op (every result of a record poisoned), and malformed records never hurt the server."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

import remote
import tensorlib as tl
import tensorlib.functional as F
from remote import _records as wire_records
from remote import _wire

from .conftest import TOKEN
from .test_errors import _handshake
from .test_fused import _answer, _record, _records, _ref, _sealed

DTYPES = {"f64": np.float64, "f32": np.float32, "f16": np.float16}


def _ops(dev: Any) -> int:
    return remote.stats(dev)["ops"] if dev != "cpu" else 0


def _loss_and_grads(
    dev: Any, dtype: Any, reduction: str, smoothing: float, x_shape: tuple[int, ...]
) -> tuple[list[np.ndarray], list[int]]:
    """Linear + cross-entropy on ``dev``: the loss and the gradients (as NumPy), and the
    records the linear, the loss and the backward each issued."""
    rng = np.random.default_rng(3)
    x = tl.tensor(rng.standard_normal(x_shape).astype(dtype), device=dev, requires_grad=True)
    w_host = rng.standard_normal((5, x_shape[-1])).astype(dtype)
    w = tl.tensor(w_host, device=dev, requires_grad=True)
    b = tl.tensor(rng.standard_normal(5).astype(dtype), device=dev, requires_grad=True)
    y_host = rng.integers(0, 5, x_shape[:-1]).reshape(-1)
    y_host[:2] = -100  # ignored rows
    y = tl.tensor(y_host, device=dev)
    n0 = _ops(dev)
    logits = F.linear(x, w, b)
    n1 = _ops(dev)
    loss = F.cross_entropy(logits, y, reduction=reduction, label_smoothing=smoothing)
    total = loss.sum() if reduction == "none" else loss
    n2 = _ops(dev)
    total.backward()
    n3 = _ops(dev)
    got = [t.numpy() for t in (loss, x.grad, w.grad, b.grad) if t is not None]
    return got, [n1 - n0, n2 - n1, n3 - n2]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # float16 may overflow: both sides alike
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_remote_linear_and_cross_entropy_are_one_record_each_way_with_the_local_bits(
    rdev: tl.Device, dtype: str, reduction: str, smoothing: float
) -> None:
    want, _ = _loss_and_grads("cpu", DTYPES[dtype], reduction, smoothing, (12, 7))
    got, records = _loss_and_grads(rdev, DTYPES[dtype], reduction, smoothing, (12, 7))
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b, equal_nan=True)
    # linear: LINEAR; cross_entropy: CROSS_ENTROPY (its 1-d target needs no reshape; "none"
    # adds the sum); backward: the seed (and the sum's) gradient, CROSS_ENTROPY_GRAD and
    # LINEAR_GRAD.
    assert records[:2] == [1, 2 if reduction == "none" else 1]
    assert records[2] <= 5


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_remote_relu_backward_is_one_record_with_the_local_bits(
    rdev: tl.Device, dtype: str
) -> None:
    def run(dev: Any) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(9)
        host = rng.standard_normal((6, 5)).astype(DTYPES[dtype])
        host[0, :3] = (0.0, -0.0, np.nan)  # ReLU's edge cases: no gradient through them
        x = tl.tensor(host, device=dev, requires_grad=True)
        g = tl.tensor(rng.standard_normal((6, 5)).astype(DTYPES[dtype]), device=dev)
        y = F.relu(x)
        n0 = _ops(dev)
        y.backward(g)
        n1 = _ops(dev)
        assert x.grad is not None
        return x.grad.numpy(), n1 - n0

    (want, _), (got, records) = run("cpu"), run(rdev)
    assert want.dtype == got.dtype and np.array_equal(want, got)
    assert records == 1  # RELU_GRAD, not greater and multiply


def test_a_batched_linear_without_bias_or_weight_grad_gives_the_local_bits(
    rdev: tl.Device,
) -> None:
    def run(dev: Any) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(5)
        x = tl.tensor(rng.standard_normal((2, 3, 4)), device=dev, requires_grad=True)
        w = tl.tensor(rng.standard_normal((6, 4)), device=dev)  # frozen: no gradient asked
        out = F.linear(x, w)
        (out * out).sum().backward()
        assert w.grad is None
        assert x.grad is not None
        return out.numpy(), x.grad.numpy()

    for a, b in zip(run("cpu"), run(rdev), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_a_cross_entropy_that_fails_poisons_both_its_results_and_names_its_call_site(
    rdev: tl.Device,
) -> None:
    logits = tl.tensor(np.zeros((3, 4)), device=rdev, requires_grad=True)
    bad = tl.tensor(np.array([0, 9, 1]), device=rdev)  # 9: out of range, found on the server
    line = sys._getframe().f_lineno + 1
    loss = F.cross_entropy(logits, bad)
    with pytest.raises(remote.RemoteOpError, match="'cross_entropy'") as info:
        loss.item()
    assert f"test_fused_nn.py:{line}" in str(info.value)
    loss.backward()  # the saved probabilities are poisoned too: so is the gradient
    assert logits.grad is not None
    with pytest.raises(remote.RemoteOpError, match="'cross_entropy'"):
        logits.grad.numpy()
    assert (tl.tensor([1.0, 2.0], device=rdev) * 2).numpy().tolist() == [2.0, 4.0]


def _fused_frame() -> bytes:
    """Uploads, each fused nn record (valid), and a SYNC (request 1)."""
    x, w, b = np.ones((3, 4)), np.ones((2, 4)), np.ones(2)
    ups = [_record("upload", i, a) for i, a in ((1, x), (2, w), (3, b), (4, np.array([0, 1, 1])))]
    recs = [
        _record("linear", 10, _ref(1), _ref(2), _ref(3)),
        _record("linear_grad", 11, _ref(10), _ref(1), _ref(2), True, True, True),
        _record("cross_entropy", 20, _ref(10), _ref(4), 2, -100, 0.0),
        _record("cross_entropy_grad", 30, _ref(21), _ref(4), _ref(20), -100, 0.0, 2),
        _record("relu_grad", 40, _ref(10), _ref(10)),
    ]
    sync = wire_records.record_head(_wire.SYNC, 0, 1, 0)
    return _records(*ups, *recs, sync, waits=1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fused_nn_records_malformed_or_fuzzed_fail_or_close_only_their_own_session(
    local_server: remote.Server, rdev: tl.Device
) -> None:
    keep = tl.tensor(np.arange(3.0), device=rdev)
    sync = wire_records.record_head(_wire.SYNC, 0, 1, 0)
    hostile = [
        _record("linear", 5, 1.0, 2.0, None),  # numbers for arrays
        _record("linear_grad", 5, _ref(1), _ref(1), _ref(1), 1, 0, 0),  # ints for booleans
        _record("cross_entropy", 5, _ref(1), _ref(1), 7, -100, 0.0),  # no reduction 7
        _record("cross_entropy", 5, _ref(1)),  # too few values
        _record("cross_entropy_grad", 5, (1, 2), _ref(1), _ref(1), -100, 0.0, 2),
        _record("relu_grad", 5, 1.0, _ref(1)),  # a number for an array
        _record("relu_grad", 5, _ref(1)),  # too few values
    ]
    for rec in hostile:  # each an op error in the reply; the connection stays open
        s, seal = _handshake(local_server)
        up = _record("upload", 1, np.ones((2, 2)))
        s.sendall(_sealed(seal, _records(up, rec, sync, waits=1)))
        assert _answer(s) == "reply"
        s.close()
    frame = _fused_frame()
    s, seal = _handshake(local_server)
    s.sendall(_sealed(seal, frame))
    assert _answer(s) == "reply"
    s.close()
    rng = np.random.default_rng(12)
    for k in range(60):
        b = bytearray(frame)
        if k % 3 == 0:
            b = b[: int(rng.integers(wire_records.RECORDS_HEAD.size, len(b)))]
        else:
            for i in rng.integers(wire_records.RECORDS_HEAD.size, len(b), 3):
                b[i] = int(rng.integers(0, 256))
        s, seal = _handshake(local_server)
        s.sendall(_sealed(seal, bytes(b)))
        assert _answer(s) in ("reply", "closed")
        s.close()
    assert (keep + 1).numpy().tolist() == [1.0, 2.0, 3.0]
    assert len(remote.devices(local_server.address, token=TOKEN)) == 2
