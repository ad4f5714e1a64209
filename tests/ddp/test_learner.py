"""ddp.learner: one Learner, three strategies, the same training.

Float64, a fixed global batch: ``single_device`` equals ``ddp`` over N logical CPU devices
and over N remote cpu devices of one server (1e-12), and ``multi_device`` in both optimizer
modes within rounding (1e-10), for N = 1..4; a resumed run ends bit for bit where an
uninterrupted one does; models with ``train_step``/``valid_step`` and with ``loss_fn``;
bad arguments are refused with messages that say what was expected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import remote
import tensorlib as tl
import tensorlib.functional as F
from collectives import SpawnError
from collectives.distributed import DistributedConfig, ReduceOperation
from ddp import DataLoader
from ddp.learner import (
    ExecutionStrategy,
    Learner,
    SupervisedTraining,
    TrainingResult,
    TrainOutput,
)
from tensorlib import nn, optim

pytestmark = pytest.mark.timeout(120)

TOKEN = "learner-token"
RTOL = ATOL = 1e-12
MULTI_TOL = 1e-10
BATCH = 12  # divisible by 1..4: every strategy splits it evenly
NS = [1, 2, 3, 4]


def _data(n: int = 48, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)), rng.integers(0, 3, n).astype(np.int64)


def _batches(batch: int = BATCH, n: int = 48, seed: int = 0) -> list[tuple[Any, Any]]:
    x, y = _data(n, seed)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def _mlp() -> nn.Module:
    tl.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(tl.float64)


def _learner(model: nn.Module, kind: str = "adam", lr: float = 1e-2) -> Learner:
    params = list(model.parameters())
    opt = optim.Adam(params, lr=lr) if kind == "adam" else optim.SGD(params, lr=lr)
    sched = optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return Learner(model, opt, sched)


def _train(
    tmp: Path,
    strategy: ExecutionStrategy,
    epochs: int = 2,
    model: nn.Module | None = None,
    train: Any = None,
    valid: Any = None,
    loss_fn: Any = F.cross_entropy,
    kind: str = "adam",
    lr: float = 1e-2,
) -> TrainingResult:
    model = _mlp() if model is None else model
    model.to(strategy.main_device())
    train = _batches() if train is None else train
    valid = _batches(n=24, seed=1) if valid is None else valid
    return (
        SupervisedTraining(tmp, train, valid, loss_fn=loss_fn)
        .with_training_strategy(strategy)
        .num_epochs(epochs)
        .with_progress(False)
        .launch(_learner(model, kind, lr))
    )


def _params(result: TrainingResult) -> list[np.ndarray]:
    return [np.array(p.numpy()) for p in result.model.parameters()]


def _close(a: TrainingResult, b: TrainingResult, tol: float) -> None:
    for x, y in zip(_params(a), _params(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)
    for ma, mb in zip(a.history, b.history, strict=True):
        for name in ("train_loss", "valid_loss", "train_accuracy", "valid_accuracy"):
            va, vb = getattr(ma, name), getattr(mb, name)
            assert va is not None and vb is not None, name
            assert abs(va - vb) <= 1e-9, (name, va, vb)


def _cpus(n: int) -> list[tl.Device]:
    return [tl.Device(f"cpu:{i}") for i in range(n)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> TrainingResult:
    """The single-device run everything else is compared with."""
    return _train(tmp_path_factory.mktemp("single"), ExecutionStrategy.single_device("cpu"))


@pytest.fixture(scope="module")
def server_devices() -> Iterator[list[tl.Device]]:
    """Four remote cpu devices of one in-process server."""
    with remote.serve(["cpu"] * 4, token=TOKEN) as server:
        devs = remote.devices(server.address, token=TOKEN)
        yield devs
        for d in devs:
            remote.close(d)


# ---------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("n", NS)
def test_ddp_and_multi_device_over_logical_cpus_equal_one_device(
    tmp_path: Path, reference: TrainingResult, n: int
) -> None:
    ddp = _train(tmp_path / "ddp", ExecutionStrategy.ddp(_cpus(n)))
    _close(ddp, reference, RTOL)
    assert ddp.model.parameters().__next__().device is tl.Device("cpu:0")
    for mode in ("main_device", "sharded"):
        multi = _train(tmp_path / mode, ExecutionStrategy.multi_device(_cpus(n), optim=mode))
        _close(multi, reference, MULTI_TOL)
    assert reference.valid_accuracy[-1] is not None and len(reference.history) == 2


@pytest.mark.parametrize("n", NS)
def test_ddp_over_remote_devices_of_one_server_equals_one_device(
    tmp_path: Path, reference: TrainingResult, server_devices: list[tl.Device], n: int
) -> None:
    devs = server_devices[:n]
    config = DistributedConfig(all_reduce_op=ReduceOperation.Mean, timeout=30.0)
    result = _train(tmp_path, ExecutionStrategy.ddp(devs, config))
    assert next(result.model.parameters()).device is devs[0]
    _close(result, reference, RTOL)


def test_uneven_shards_are_weighted_to_the_global_batch(tmp_path: Path) -> None:
    """Batches of 10 (and a last one of 8) over 3 devices: shards of 4, 3, 3 (3, 3, 2)."""
    train = _batches(batch=10)
    single = _train(tmp_path / "s", ExecutionStrategy.single_device(), train=train)
    _close(_train(tmp_path / "d", ExecutionStrategy.ddp(_cpus(3)), train=train), single, RTOL)
    multi = _train(tmp_path / "m", ExecutionStrategy.multi_device(_cpus(3)), train=train)
    _close(multi, single, MULTI_TOL)


def test_sum_config_sums_the_replicas_gradients(tmp_path: Path) -> None:
    """SGD: the sum over 2 equal shards is twice the mean, i.e. one device at twice the lr."""
    config = DistributedConfig(all_reduce_op=ReduceOperation.Sum)
    summed = _train(tmp_path / "sum", ExecutionStrategy.ddp(_cpus(2), config), kind="sgd")
    single = _train(tmp_path / "one", ExecutionStrategy.single_device(), kind="sgd", lr=2e-2)
    for a, b in zip(_params(summed), _params(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL)


# ---------------------------------------------------------------------------- resume
class _CrashError(RuntimeError):
    pass


class _CrashErroringLoader:
    """The batches, raising in epoch ``at_epoch`` (counted by set_epoch) at batch 2."""

    def __init__(self, batches: list[Any], at_epoch: int | None) -> None:
        self.batches, self.at_epoch, self.epoch = batches, at_epoch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        for i, b in enumerate(self.batches):
            if self.epoch == self.at_epoch and i == 2:
                raise _CrashError("killed mid-epoch")
            yield b


@pytest.mark.parametrize(
    "make",
    [
        lambda: ExecutionStrategy.single_device("cpu"),
        lambda: ExecutionStrategy.ddp(_cpus(2)),
        lambda: ExecutionStrategy.multi_device(_cpus(2), optim="sharded"),
    ],
    ids=["single", "ddp2", "sharded2"],
)
def test_a_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_does(
    tmp_path: Path, make: Callable[[], ExecutionStrategy]
) -> None:
    whole = _train(tmp_path / "whole", make(), epochs=4)
    crashing = _CrashErroringLoader(_batches(), at_epoch=2)
    with pytest.raises(_CrashError):
        _train(tmp_path / "cut", make(), epochs=4, train=crashing)
    crashing.at_epoch = None  # the job restarts: a fresh model, optimizer and scheduler
    resumed = _train(tmp_path / "cut", make(), epochs=4, train=crashing)
    assert resumed.resumed_from == 2 and len(resumed.history) == 4
    for a, b in zip(_params(resumed), _params(whole), strict=True):
        assert np.array_equal(a, b)
    assert resumed.train_loss == whole.train_loss
    again = _train(tmp_path / "cut", make(), epochs=4)  # nothing left to do: loaded as is
    assert again.resumed_from == 4
    assert all(np.array_equal(a, b) for a, b in zip(_params(again), _params(whole), strict=True))


def test_with_resume_false_starts_over_and_more_epochs_than_asked_is_refused(
    tmp_path: Path,
) -> None:
    first = _train(tmp_path, ExecutionStrategy.single_device(), epochs=2)
    model = _mlp()
    fresh = (
        SupervisedTraining(tmp_path, _batches(), None, loss_fn=F.cross_entropy)
        .num_epochs(2)
        .with_progress(False)
        .with_resume(False)
        .launch(_learner(model))
    )
    assert fresh.resumed_from == 0 and fresh.valid_loss == [None, None]
    assert all(np.array_equal(a, b) for a, b in zip(_params(fresh), _params(first), strict=True))
    with pytest.raises(ValueError, match=r"holds a run of 2 epochs, more than num_epochs\(1\)"):
        _train(tmp_path, ExecutionStrategy.single_device(), epochs=1)


# ---------------------------------------------------------------------------- model kinds
class _Classifier(nn.Module):
    """Burn's TrainStep/ValidStep: the model says how a batch becomes a loss."""

    def __init__(self, bare: bool = False) -> None:
        super().__init__()
        self.net = _mlp()
        self.bare = bare
        # A buffer: DDP broadcasts it before each step, multi_device copies it.
        self.register_buffer("scale", tl.tensor(np.ones(3)))

    def forward(self, x: tl.Tensor) -> tl.Tensor:
        return self.net(x) * self.scale

    def train_step(self, batch: dict[str, tl.Tensor]) -> TrainOutput | tl.Tensor:
        out = self(batch["x"])
        loss = F.cross_entropy(out, batch["y"])
        return loss if self.bare else TrainOutput(loss, out, batch["y"])

    def valid_step(self, batch: dict[str, tl.Tensor]) -> TrainOutput | tl.Tensor:
        with tl.no_grad():
            return self.train_step(batch)


def test_a_model_with_train_step_and_valid_step(tmp_path: Path, reference: TrainingResult) -> None:
    train = [{"x": x, "y": y} for x, y in _batches()]
    valid = [{"x": x, "y": y} for x, y in _batches(n=24, seed=1)]
    for n in (1, 3):
        got = _train(
            tmp_path / str(n), ExecutionStrategy.ddp(_cpus(n)), model=_Classifier(),
            train=train, valid=valid, loss_fn=None,
        )  # fmt: skip
        _close(got, reference, RTOL)  # the same network and batches as the loss_fn run
    bare = _train(
        tmp_path / "bare", ExecutionStrategy.multi_device(_cpus(2)), model=_Classifier(True),
        train=train, valid=valid, loss_fn=None,
    )  # fmt: skip
    assert bare.train_accuracy == [None, None] and bare.valid_accuracy == [None, None]
    assert bare.train_loss[0] == pytest.approx(reference.train_loss[0], abs=1e-9)


def test_a_loss_fn_model_on_a_shuffling_ddp_dataloader(tmp_path: Path) -> None:
    x, y = _data()
    loaders = [DataLoader((x, y), batch_size=BATCH, shuffle=True, seed=5) for _ in range(2)]
    one = _train(tmp_path / "1", ExecutionStrategy.single_device(), epochs=3, train=loaders[0])
    three = _train(tmp_path / "3", ExecutionStrategy.ddp(_cpus(3)), epochs=3, train=loaders[1])
    _close(three, one, RTOL)
    assert loaders[1].epoch == 2  # set_epoch was called before each epoch


def test_the_model_is_moved_to_the_main_device(tmp_path: Path, reference: TrainingResult) -> None:
    model = _mlp()  # on cpu; the strategy's main device is cpu:1
    result = (
        SupervisedTraining(tmp_path, _batches(), _batches(n=24, seed=1), loss_fn=F.cross_entropy)
        .with_training_strategy(ExecutionStrategy.ddp(_cpus(3)[1:]))
        .num_epochs(2)
        .with_progress(False)
        .launch(_learner(model))
    )
    assert result.model is model and next(model.parameters()).device is tl.Device("cpu:1")
    _close(result, reference, RTOL)


def test_progress_prints_a_line_per_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _mlp()
    SupervisedTraining(tmp_path, _batches(), _batches(n=24), loss_fn=F.cross_entropy).num_epochs(
        2
    ).launch(_learner(model))
    out = capsys.readouterr().out
    assert "epoch 1/2" in out and "epoch 2/2" in out and "valid loss" in out and "acc" in out
    _train(tmp_path / "quiet", ExecutionStrategy.single_device())
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------- bad input
def test_bad_strategy_arguments_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="device list is empty"):
        ExecutionStrategy.ddp([])
    with pytest.raises(ValueError, match=r"device cpu:1 is listed twice \(positions 0 and 1\)"):
        ExecutionStrategy.multi_device(["cpu:1", "cpu:1"])
    with pytest.raises(ValueError, match=r"optim must be one of \['main_device', 'sharded'\]"):
        ExecutionStrategy.multi_device(_cpus(2), optim="everywhere")
    with pytest.raises(ValueError, match="Mean or Sum, got all_reduce_op"):
        ExecutionStrategy.ddp(_cpus(2), DistributedConfig(all_reduce_op=ReduceOperation.Max))
    with pytest.raises(TypeError, match="must be a list of devices"):
        ExecutionStrategy.ddp("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        ExecutionStrategy.single_device("abacus")
    strategy = ExecutionStrategy.multi_device(_cpus(2))
    assert strategy.main_device() is tl.Device("cpu:0")
    assert ExecutionStrategy.ddp(_cpus(3)[1:]).main_device() is tl.Device("cpu:1")
    assert ExecutionStrategy.single_device("cpu:2").main_device() is tl.Device("cpu:2")


def test_bad_training_arguments_are_refused_clearly(tmp_path: Path) -> None:
    model = _mlp()
    with pytest.raises(TypeError, match=r"optimizer must be a tensorlib\.optim\.Optimizer"):
        Learner(model, "adam")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not parameters of the model"):
        Learner(model, optim.SGD(_mlp().parameters(), lr=0.1))
    training = SupervisedTraining(tmp_path, _batches()).with_progress(False)
    with pytest.raises(TypeError, match="no train_step"):
        training.launch(_learner(model))
    with pytest.raises(ValueError, match="expected an int >= 1, got 0"):
        training.num_epochs(0)
    with pytest.raises(TypeError, match="expected an ExecutionStrategy"):
        training.with_training_strategy("ddp")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="train_loader must be an iterable"):
        SupervisedTraining(tmp_path, 3)  # type: ignore[arg-type]
    small = [(np.zeros((2, 8)), np.zeros(2, dtype=np.int64))]
    for strategy in (ExecutionStrategy.ddp(_cpus(3)), ExecutionStrategy.multi_device(_cpus(3))):
        with pytest.raises(ValueError, match=r"has 2 sample.*fewer than the strategy's 3 devices"):
            _train(tmp_path / "small", strategy, train=small)
    ragged = [(np.zeros((4, 8)), np.zeros(3, dtype=np.int64))]
    with pytest.raises(ValueError, match="same first dimension"):
        _train(tmp_path / "ragged", ExecutionStrategy.single_device(), train=ragged)


def test_multi_device_over_devices_of_two_servers_equals_one_device(
    tmp_path: Path, reference: TrainingResult
) -> None:
    """Burn's case for the non-DDP path: no collectives between two servers' devices."""
    with remote.serve(["cpu"], token=TOKEN) as a, remote.serve(["cpu"], token=TOKEN) as b:
        devs = [remote.devices(s.address, token=TOKEN)[0] for s in (a, b)]
        try:
            for mode in ("main_device", "sharded"):
                got = _train(tmp_path / mode, ExecutionStrategy.multi_device(devs, optim=mode))
                assert next(got.model.parameters()).device is devs[0]
                _close(got, reference, MULTI_TOL)
            # DDP needs collectives among the devices: refused, pointing to multi_device.
            with pytest.raises(SpawnError, match=r"ExecutionStrategy\.multi_device"):
                _train(tmp_path / "ddp", ExecutionStrategy.ddp(devs))
            with pytest.raises(ValueError, match=r"of one kind.*ExecutionStrategy.multi_device"):
                ExecutionStrategy.ddp([_cpus(1)[0], devs[0]])
        finally:
            for d in devs:
                remote.close(d)


def test_without_tqdm_progress_is_plain_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp.learner import _progress

    monkeypatch.setattr(_progress, "_tqdm", lambda: None)
    model = _mlp()
    SupervisedTraining(tmp_path, _batches(), loss_fn=F.cross_entropy).launch(_learner(model))
    captured = capsys.readouterr()
    assert captured.out.startswith("epoch 1/1  train loss ") and captured.err == ""


def test_the_epoch_benchmark_prints_a_row_per_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.learner_epoch import main

    args = ["--samples", "64", "--batch", "16", "--hidden", "8", "--epochs", "1", "--runs", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for row in ("hand loop", "single_device", "ddp(2 cpu devices)", "main_device", "sharded"):
        assert row in out, out
