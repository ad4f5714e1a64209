"""The fused ADAM record and the packed frees (IDS): a remote optimizer step is one record
that gives the local step's bits, its failures are reported like any op's, and malformed
records of these kinds never hurt the server."""

from __future__ import annotations

import inspect
import socket
import struct
import sys
from typing import Any

import numpy as np
import pytest

import remote
import tensorlib as tl
import tensorlib.functional as F
from collectives.framing import Seal
from remote import _records as wire_records
from remote import _wire
from remote.client import _fused
from remote.server import _ops
from tensorlib import nn, optim

from .conftest import TOKEN
from .test_errors import _closed_by_server, _handshake

OPTIMIZERS = {
    "adamw": lambda ps: optim.AdamW(ps, lr=1e-2),
    "adam-l2-amsgrad": lambda ps: optim.Adam(ps, lr=3e-3, weight_decay=0.1, amsgrad=True),
    "adamw-maximize": lambda ps: optim.AdamW(ps, lr=1e-3, betas=(0.5, 0.9), maximize=True),
    "int-lr": lambda ps: optim.AdamW(ps, lr=1, weight_decay=0),
    "two-groups": lambda ps: optim.AdamW(
        [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "weight_decay": 0.3}], lr=1e-3
    ),
}


def _train(dev: Any, make_opt: Any, dtype: Any, steps: int = 4) -> tuple[list[np.ndarray], int]:
    """A small MLP trained ``steps`` steps on ``dev``: its parameters, and (remote) the
    records the last ``opt.step()`` issued."""
    tl.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)
    model.to(dev)
    opt = make_opt(list(model.parameters()))
    rng = np.random.default_rng(0)
    records = 0
    for _ in range(steps):
        x = tl.tensor(rng.standard_normal((32, 8)).astype(dtype), device=dev)
        y = tl.tensor(rng.integers(0, 3, 32), device=dev)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        before = remote.stats(dev)["ops"] if dev != "cpu" else 0
        opt.step()
        records = remote.stats(dev)["ops"] - before if dev != "cpu" else 0
    return [p.numpy() for p in model.parameters()], records


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [tl.float64, tl.float32], ids=["f64", "f32"])
def test_a_remote_adam_step_is_one_record_a_group_and_gives_the_local_bits(
    rdev: tl.Device, name: str, dtype: Any
) -> None:
    want, _ = _train("cpu", OPTIMIZERS[name], dtype)
    got, records = _train(rdev, OPTIMIZERS[name], dtype)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert records == (2 if name == "two-groups" else 1)


def test_numpy_scalar_hyperparameters_go_op_by_op_and_still_give_the_local_bits(
    rdev: tl.Device,
) -> None:
    # A NumPy float64 lr is a strong scalar (NEP 50): sent as a number it would round as a
    # Python float; the fused path hands such groups back to tensorlib's op-by-op update.
    make = lambda ps: optim.AdamW(ps, lr=np.float64(1e-2))  # noqa: E731
    want, _ = _train("cpu", make, tl.float32)
    got, records = _train(rdev, make, tl.float32)
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(a, b)
    assert records > 6 * 4  # ~13 records a parameter, not one ADAM record


def test_the_adam_record_carries_adam_updates_keywords_in_one_order() -> None:
    # Both ends build and read ADAM's values by these names: they are tensorlib's.
    params = inspect.signature(optim.adam_update).parameters.values()
    keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert list(_wire.ADAM_HYPER) == keywords
    with pytest.raises(TypeError, match="hyper-parameters"):
        _fused.adam([], **_adam_args(), foreach=True)


def _adam_args(**kw: Any) -> dict[str, Any]:
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    args.update(decoupled=True, maximize=False)
    args.update(kw)
    return args


def test_a_fused_update_that_fails_poisons_what_it_writes_and_names_its_call_site(
    rdev: tl.Device,
) -> None:
    xp = rdev.xp
    data, m, v = xp.ones((4,)), xp.zeros((4,)), xp.zeros((4,))
    bad_grad = xp.arange(4) ** -1  # fails on the server: integers to a negative power
    line = sys._getframe().f_lineno - 1
    _fused.adam([(data, bad_grad, m, v, None, 1)], **_adam_args())
    with pytest.raises(remote.RemoteOpError, match="'power'") as info:
        data.get()  # the update never ran: its parameter fails as its grad did
    assert f"test_fused.py:{line}" in str(info.value)
    with pytest.raises(remote.RemoteOpError, match="'power'"):
        m.get()
    # A record the server refuses (step 0): every array it would write fails with it.
    data, grad, m, v = xp.ones((4,)), xp.ones((4,)), xp.zeros((4,)), xp.zeros((4,))
    _fused.adam([(data, grad, m, v, None, 0)], **_adam_args())
    line = sys._getframe().f_lineno - 1
    with pytest.raises(remote.RemoteOpError, match=r"'adam'.*steps must be") as info:
        v.get()
    assert f"test_fused.py:{line}" in str(info.value)
    assert grad.get().tolist() == [1.0] * 4  # what it only reads is untouched
    assert (xp.ones((2,)) * 3).get().tolist() == [3.0, 3.0]  # the session goes on


def test_a_read_the_update_does_not_touch_is_answered_first_and_its_failure_comes_next(
    rdev: tl.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server answers ``loss.item()`` before running the ADAM record just before it (the
    client starts its next step meanwhile); an update that passed its checks and then failed
    is reported at the next read, naming its call site, and poisons what it writes."""
    xp = rdev.xp
    data, grad, m, v = xp.ones((4,)), xp.ones((4,)), xp.zeros((4,)), xp.zeros((4,))
    loss = xp.ones(()) * 2.5
    rdev.synchronize()  # so that ADAM and the READ go out in one frame

    def boom(*args: Any, **kw: Any) -> None:
        raise FloatingPointError("boom")

    monkeypatch.setattr(_ops, "adam_update", boom)  # the in-process server's
    _fused.adam([(data, grad, m, v, None, 1)], **_adam_args())
    line = sys._getframe().f_lineno - 1
    assert float(loss.get()) == 2.5  # answered before the update ran (and failed)
    with pytest.raises(remote.RemoteOpError, match=r"'adam'.*boom") as info:
        (xp.ones((2,)) + 1).get()
    assert f"test_fused.py:{line}" in str(info.value)
    with pytest.raises(remote.RemoteOpError, match="boom"):
        m.get()
    assert grad.get().tolist() == [1.0] * 4


@pytest.mark.parametrize("read", ["data", "view of data", "moment"])
def test_a_read_of_what_the_update_writes_waits_for_it(rdev: tl.Device, read: str) -> None:
    xp = rdev.xp
    host = [np.ones(4), np.full(4, 0.5), np.zeros(4), np.zeros(4)]
    data, grad, m, v = (xp.asarray(h.copy()) for h in host)
    view = data[1:3]
    rdev.synchronize()
    _fused.adam([(data, grad, m, v, None, 1)], **_adam_args(lr=0.1))
    got = {"data": data, "view of data": view, "moment": v}[read].get()
    pick = {
        "data": lambda: host[0],
        "view of data": lambda: host[0][1:3],
        "moment": lambda: host[3],
    }
    before = pick[read]().copy()
    optim.adam_update(host[0], host[1], host[2], host[3], None, 1, **_adam_args(lr=0.1))
    want = pick[read]()
    assert np.array_equal(got, want) and not np.array_equal(want, before)


def _sealed(seal: Seal, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload) + 32) + payload + seal.tag(payload)


def _records(*records: bytes, waits: int = 0) -> bytes:
    return wire_records.RECORDS_HEAD.pack(_wire.RECORDS, waits, len(records)) + b"".join(records)


def _record(op: str, out: int, *values: Any) -> bytes:
    parts = [wire_records.record_head(_wire.OP_CODES[op], 0, out, len(values))]
    for v in values:
        if isinstance(v, bytes):
            parts.append(v)  # already encoded
        else:
            _wire.put(parts, v)
    return b"".join(parts)


def _ref(i: int) -> bytes:
    return struct.pack("<BI", _wire.T_REF, i)


def _valid_frame() -> bytes:
    """Four uploads, an ADAM record on them, a packed free and a SYNC (request 1)."""
    ups = [_record("upload", i, np.full(5, float(i))) for i in (1, 2, 3, 4)]
    ids = [_wire.ids_value([k]) for k in (1, 2, 3, 4)]
    adam = _record(
        "adam", 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, *ids, _wire.ids_value([]), (1,)
    )
    free = _record("drop", 0, _wire.ids_value([2, 99]))
    sync = wire_records.record_head(_wire.SYNC, 0, 1, 0)
    return _records(*ups, adam, free, sync, waits=1)


def _answer(s: socket.socket) -> str:
    """What the server did with the frame: "reply", or "closed"."""
    s.settimeout(5)
    try:
        head = s.recv(4)
        if not head:
            return "closed"
        (n,) = struct.unpack(">I", head)
        body = b""
        while len(body) < n:
            chunk = s.recv(n - len(body))
            if not chunk:
                return "closed"
            body += chunk
        return "reply" if body[0] in (_wire.REPLY, _wire.HEARTBEAT) else "other"
    except (ConnectionResetError, BrokenPipeError):
        return "closed"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # mutated floats overflow on the server
def test_adam_and_ids_records_fuzzed_close_or_fail_only_their_own_session(
    local_server: remote.Server, rdev: tl.Device
) -> None:
    x = tl.tensor(np.arange(3.0), device=rdev)
    frame = _valid_frame()
    s, seal = _handshake(local_server)
    s.sendall(_sealed(seal, frame))
    assert _answer(s) == "reply"  # the valid frame runs and answers
    s.close()
    rng = np.random.default_rng(11)
    seen = set()
    for k in range(120):
        b = bytearray(frame)
        if k % 3 == 0:  # truncated at a random place (the count no longer matches)
            b = b[: int(rng.integers(wire_records.RECORDS_HEAD.size, len(b)))]
        else:  # random bytes changed, the frame's tag still right: the records are hostile
            for i in rng.integers(wire_records.RECORDS_HEAD.size, len(b), 3):
                b[i] = int(rng.integers(0, 256))
        s, seal = _handshake(local_server)
        s.sendall(_sealed(seal, bytes(b)))
        answer = _answer(s)
        assert answer in ("reply", "closed")
        seen.add(answer)
        s.close()
    assert seen == {"reply", "closed"}  # both outcomes were exercised
    # An IDS longer than its frame closes the connection; one among an op's values is
    # resolved like a tuple of REFs (here to a missing array: an op error in the reply).
    huge = _record("drop", 0, struct.pack("<BI", _wire.T_IDS, 1 << 30))
    s, seal = _handshake(local_server)
    s.sendall(_sealed(seal, _records(huge)))
    assert _closed_by_server(s)
    s.close()
    sync = wire_records.record_head(_wire.SYNC, 0, 1, 0)
    odd = _records(_record("add", 5, _wire.ids_value([1]), 1.0), sync, waits=1)
    s, seal = _handshake(local_server)
    s.sendall(_sealed(seal, odd))
    assert _answer(s) == "reply"
    s.close()
    # The server and the other session are unaffected.
    assert (x + 1).numpy().tolist() == [1.0, 2.0, 3.0]
    assert len(remote.devices(local_server.address, token=TOKEN)) == 2
