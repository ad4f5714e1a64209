"""``ddp.metrics`` against PyTorch Ignite's ``ignite.metrics`` on identical inputs.

Each case feeds the same batches (built once in NumPy, then as torch tensors for Ignite and
tensorlib tensors for ours) to both, with a ``compute()`` between batches, and compares every
result. Counts agree exactly; the float sums agree to float32 precision where Ignite keeps
them in float32 (Loss, MeanSquaredError, the normalized ConfusionMatrix), to float64 rounding
elsewhere. Run with the parity environment: ``/work/parity-venv/bin/python -m pytest``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

ignite_metrics = pytest.importorskip("ignite.metrics")
torch = pytest.importorskip("torch")
from ignite.exceptions import NotComputableError as IgniteNotComputable  # noqa: E402

import ddp.metrics as M  # noqa: E402
import tensorlib as tl  # noqa: E402
import tensorlib.functional as F  # noqa: E402

pytestmark = pytest.mark.timeout(60)

Batches = list[tuple[np.ndarray, np.ndarray]]


# ---------------------------------------------------------------------- inputs
def _scores(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _binary(rng: np.random.Generator, n_batches: int = 3, shape: tuple[int, ...] = (9,)) -> Batches:
    return [(rng.integers(0, 2, shape), rng.integers(0, 2, shape)) for _ in range(n_batches)]


def _multiclass(rng: np.random.Generator, c: int = 4, extra: tuple[int, ...] = ()) -> Batches:
    out = []
    for n in (7, 1, 12):
        out.append((_scores(rng, n, c, *extra), rng.integers(0, c, (n, *extra))))
    return out


def _multilabel(rng: np.random.Generator, c: int = 3, extra: tuple[int, ...] = ()) -> Batches:
    out = []
    for n in (8, 2, 11):
        shape = (n, c, *extra)
        out.append((rng.integers(0, 2, shape), rng.integers(0, 2, shape)))
    return out


INPUTS: dict[str, Callable[[np.random.Generator], Batches]] = {
    "binary": _binary,
    "binary_n1": lambda r: [(p[:, None], y) for p, y in _binary(r)],
    "binary_2d": lambda r: _binary(r, shape=(6, 5)),
    "multiclass": _multiclass,
    "multiclass_seq": lambda r: _multiclass(r, c=5, extra=(3,)),
    "multilabel": _multilabel,
    "multilabel_seq": lambda r: _multilabel(r, c=4, extra=(2, 3)),
}


# ---------------------------------------------------------------------- comparison
def _plain(x: Any) -> Any:
    """A result as a float or a float64 NumPy array, from either library."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    elif isinstance(x, tl.Tensor):
        x = x.numpy()
    arr = np.asarray(x)
    return float(arr) if arr.ndim == 0 else arr


def _feed(ours: Any, theirs: Any, batches: Batches, rtol: float) -> None:
    """Both metrics update with every batch and compute after each: same results."""
    for i, (pred, y) in enumerate(batches):
        ours.update((tl.tensor(pred), tl.tensor(y)))
        theirs.update((torch.from_numpy(pred), torch.from_numpy(y)))
        got, want = ours.compute(), theirs.compute()
        assert type(_plain(got)) is type(_plain(want)), f"batch {i}: {got!r} vs {want!r}"
        np.testing.assert_allclose(_plain(got), _plain(want), rtol=rtol, atol=1e-12)
        if isinstance(want, torch.Tensor):  # a tensor result stays a tensor, same shape
            assert isinstance(got, tl.Tensor) and tuple(got.shape) == tuple(want.shape)
        else:
            assert isinstance(got, float)


# ---------------------------------------------------------------------- classification
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_accuracy(kind: str) -> None:
    batches = INPUTS[kind](np.random.default_rng(1))
    multilabel = kind.startswith("multilabel")
    _feed(
        M.Accuracy(is_multilabel=multilabel),
        ignite_metrics.Accuracy(is_multilabel=multilabel),
        batches,
        rtol=0,
    )


AVERAGES: list[Any] = [False, None, True, "macro", "micro", "weighted", "samples"]


@pytest.mark.parametrize("average", AVERAGES, ids=str)
@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize("name", ["Precision", "Recall"])
def test_precision_recall(name: str, kind: str, average: Any) -> None:
    multilabel = kind.startswith("multilabel")
    if average == "samples" and not multilabel:
        # Both refuse 'samples' for binary and multiclass input, with the same error.
        ours = getattr(M, name)(average="samples")
        theirs = getattr(ignite_metrics, name)(average="samples")
        pred, y = INPUTS[kind](np.random.default_rng(2))[0]
        with pytest.raises(ValueError, match="incompatible with binary and multiclass") as e1:
            ours.update((tl.tensor(pred), tl.tensor(y)))
        with pytest.raises(ValueError) as e2:
            theirs.update((torch.from_numpy(pred), torch.from_numpy(y)))
        assert str(e1.value) == str(e2.value)
        return
    batches = INPUTS[kind](np.random.default_rng(2))
    _feed(
        getattr(M, name)(average=average, is_multilabel=multilabel),
        getattr(ignite_metrics, name)(average=average, is_multilabel=multilabel),
        batches,
        rtol=1e-12,
    )


def test_precision_recall_warn_alike_on_float_binary_labels() -> None:
    pred = np.array([1.0, 0.0, 1.0, 1.0])
    y = np.array([1.0, 0.0, 0.0, 1.0])
    for name in ("Precision", "Recall"):
        with pytest.warns(RuntimeWarning, match="should be of dtype long") as ours_w:
            ours = getattr(M, name)(average="macro")
            ours.update((tl.tensor(pred), tl.tensor(y)))
        with pytest.warns(RuntimeWarning) as theirs_w:
            theirs = getattr(ignite_metrics, name)(average="macro")
            theirs.update((torch.from_numpy(pred), torch.from_numpy(y)))
        assert [str(w.message) for w in ours_w] == [str(w.message) for w in theirs_w]
        assert ours.compute() == pytest.approx(theirs.compute(), rel=1e-12)


@pytest.mark.parametrize("average", [None, "samples", "recall", "precision"], ids=str)
@pytest.mark.parametrize("extra", [(), (3, 2)], ids=["flat", "segmentation"])
def test_confusion_matrix(average: str | None, extra: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    batches = _multiclass(rng, c=4, extra=extra)
    # Labels outside [0, C) are ignored by both (an ignore index).
    batches[0][1].reshape(-1)[:3] = [-1, 4, 255]
    ours = M.ConfusionMatrix(4, average=average)
    theirs = ignite_metrics.ConfusionMatrix(4, average=average)
    for pred, y in batches:
        ours.update((tl.tensor(pred), tl.tensor(y)))
        theirs.update((torch.from_numpy(pred), torch.from_numpy(y)))
        got, want = ours.compute(), theirs.compute()
        assert isinstance(got, tl.Tensor) and tuple(got.shape) == (4, 4)
        if average is None:  # the counts, int64, exactly
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got.numpy(), want.numpy())
        else:  # Ignite divides in float32; ours in float64
            assert got.dtype == np.float64
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k(k: int) -> None:
    batches = _multiclass(np.random.default_rng(4), c=6)
    _feed(M.TopKCategoricalAccuracy(k), ignite_metrics.TopKCategoricalAccuracy(k), batches, 0)


def test_top_1_is_accuracy() -> None:
    # With ties too: ours orders them by class index, as argmax does.
    rng = np.random.default_rng(5)
    pred = rng.integers(0, 3, (40, 5)).astype(np.float32)
    y = rng.integers(0, 5, 40)
    top, acc = M.TopKCategoricalAccuracy(1), M.Accuracy()
    top.update((tl.tensor(pred), tl.tensor(y)))
    acc.update((tl.tensor(pred), tl.tensor(y)))
    theirs = ignite_metrics.Accuracy()
    theirs.update((torch.from_numpy(pred), torch.from_numpy(y)))
    assert top.compute() == acc.compute() == theirs.compute()


# ---------------------------------------------------------------------- regression, loss
@pytest.mark.parametrize("shape", [(10,), (10, 3)], ids=["vector", "matrix"])
def test_mean_squared_error(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(6)
    batches = [(_scores(rng, *shape), _scores(rng, *shape)) for _ in range(3)]
    _feed(M.MeanSquaredError(), ignite_metrics.MeanSquaredError(), batches, rtol=1e-6)


def test_loss_cross_entropy() -> None:
    batches = _multiclass(np.random.default_rng(7), c=5)
    _feed(
        M.Loss(F.cross_entropy),
        ignite_metrics.Loss(torch.nn.functional.cross_entropy),
        batches,
        rtol=1e-6,
    )


def test_loss_with_criterion_kwargs_and_batch_size() -> None:
    batches = _multiclass(np.random.default_rng(8), c=3)
    ours = M.Loss(F.cross_entropy, batch_size=lambda y: 2 * len(y))
    theirs = ignite_metrics.Loss(torch.nn.functional.cross_entropy, batch_size=lambda y: 2 * len(y))
    for pred, y in batches:
        ours.update((tl.tensor(pred), tl.tensor(y), {"reduction": "mean"}))
        theirs.update((torch.from_numpy(pred), torch.from_numpy(y), {"reduction": "mean"}))
    assert ours.compute() == pytest.approx(theirs.compute(), rel=1e-6)
    with pytest.raises(ValueError, match="loss_fn did not return the average loss"):
        ours.update((tl.tensor(pred), tl.tensor(y), {"reduction": "none"}))
    with pytest.raises(ValueError, match="loss_fn did not return the average loss"):
        theirs.update((torch.from_numpy(pred), torch.from_numpy(y), {"reduction": "none"}))


# ---------------------------------------------------------------------- running average
def test_running_average_of_the_output() -> None:
    values = [3.0, 1.5, -2.0, 7.25]
    ours = M.RunningAverage(output_transform=lambda x: x, alpha=0.7)
    theirs = ignite_metrics.RunningAverage(output_transform=lambda x: x, alpha=0.7)
    for v in values:
        ours.update(v)
        theirs.update(v)
        assert ours.compute() == pytest.approx(theirs.compute(), rel=1e-15)


def test_running_average_of_a_metric() -> None:
    batches = _multiclass(np.random.default_rng(9), c=3)
    ours_src, theirs_src = M.Accuracy(), ignite_metrics.Accuracy()
    ours = M.RunningAverage(ours_src, alpha=0.5)
    theirs = ignite_metrics.RunningAverage(theirs_src, alpha=0.5)
    for pred, y in batches:
        ours_src.update((tl.tensor(pred), tl.tensor(y)))
        theirs_src.update((torch.from_numpy(pred), torch.from_numpy(y)))
        ours.update(None)
        theirs.update(None)
        assert ours.compute() == pytest.approx(theirs.compute(), rel=1e-15)
        # Both read the source and reset it: the next batch is averaged alone.
        with pytest.raises(M.NotComputableError):
            ours_src.compute()
        with pytest.raises(IgniteNotComputable):
            theirs_src.compute()


def test_running_average_argument_errors_alike() -> None:
    for kwargs in (
        {"src": 1.0},
        {"alpha": 0.0, "output_transform": lambda x: x},
        {"alpha": 1.5, "output_transform": lambda x: x},
        {},
        {"src": "accuracy"},
    ):
        with pytest.raises((TypeError, ValueError)) as e1:
            M.RunningAverage(**kwargs)
        with pytest.raises((TypeError, ValueError)) as e2:
            ignite_metrics.RunningAverage(**kwargs)
        assert e1.type is e2.type, kwargs
    with pytest.raises(ValueError, match="output_transform should be None"):
        M.RunningAverage(M.Accuracy(), output_transform=lambda x: x)
    with pytest.raises(ValueError, match="output_transform should be None"):
        ignite_metrics.RunningAverage(ignite_metrics.Accuracy(), output_transform=lambda x: x)


# ---------------------------------------------------------------------- errors alike
BAD_INPUTS: list[tuple[str, dict[str, Any], list[tuple[Any, Any]]]] = [
    # (metric, kwargs, batches: the last one fails)
    ("Accuracy", {}, [(np.zeros((4, 3, 2), np.float32), np.zeros(4, np.int64))]),
    ("Accuracy", {}, [(np.zeros((4, 3), np.float32), np.zeros(5, np.int64))]),
    ("Accuracy", {}, [(np.array([0, 2, 1]), np.array([0, 1, 1]))]),
    ("Accuracy", {}, [(np.array([0, 1, 1]), np.array([0, 3, 1]))]),
    (
        "Accuracy",
        {"is_multilabel": True},
        [(np.zeros((4, 1), np.int64), np.zeros((4, 1), np.int64))],
    ),
    (
        "Accuracy",
        {},
        [
            (np.array([0, 1, 1]), np.array([0, 1, 1])),
            (np.zeros((3, 4), np.float32), np.zeros(3, np.int64)),
        ],
    ),
    (
        "Accuracy",
        {},
        [
            (np.zeros((3, 4), np.float32), np.zeros(3, np.int64)),
            (np.zeros((3, 5), np.float32), np.zeros(3, np.int64)),
        ],
    ),
    ("Precision", {"average": "macro"}, [(np.zeros((3, 4), np.float32), np.array([0, 1, 4]))]),
    ("Recall", {}, [(np.zeros((3, 2, 2), np.float32), np.zeros((3, 3), np.int64))]),
    (
        "ConfusionMatrix",
        {"num_classes": 3},
        [(np.zeros((3, 4), np.float32), np.zeros(3, np.int64))],
    ),
    ("ConfusionMatrix", {"num_classes": 3}, [(np.zeros(3, np.float32), np.zeros(3, np.int64))]),
    (
        "ConfusionMatrix",
        {"num_classes": 3},
        [(np.zeros((3, 3), np.float32), np.zeros((3, 2), np.int64))],
    ),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_inputs_raise_the_same_error(case: int) -> None:
    name, kwargs, batches = BAD_INPUTS[case]
    ours, theirs = getattr(M, name)(**kwargs), getattr(ignite_metrics, name)(**kwargs)
    for pred, y in batches[:-1]:
        ours.update((tl.tensor(pred), tl.tensor(y)))
        theirs.update((torch.from_numpy(pred), torch.from_numpy(y)))
    pred, y = batches[-1]
    with pytest.raises(Exception) as theirs_e:
        theirs.update((torch.from_numpy(pred), torch.from_numpy(y)))
    with pytest.raises(theirs_e.type) as ours_e:
        ours.update((tl.tensor(pred), tl.tensor(y)))
    # Our messages start as Ignite's (some add the shapes given).
    want = str(theirs_e.value).split(",")[0].split(":")[0]
    assert str(ours_e.value).startswith(want[:40]), (str(ours_e.value), str(theirs_e.value))


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("Accuracy", {}),
        ("Precision", {}),
        ("Recall", {"average": "micro"}),
        ("ConfusionMatrix", {"num_classes": 3}),
        ("TopKCategoricalAccuracy", {}),
        ("MeanSquaredError", {}),
    ],
)
def test_not_computable_before_an_update_same_message(name: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(M.NotComputableError) as e1:
        getattr(M, name)(**kwargs).compute()
    with pytest.raises(IgniteNotComputable) as e2:
        getattr(ignite_metrics, name)(**kwargs).compute()
    assert str(e1.value) == str(e2.value)


def test_constructor_errors_alike() -> None:
    for name, kwargs in (
        ("Precision", {"average": "bogus"}),
        ("ConfusionMatrix", {"num_classes": 1}),
        ("ConfusionMatrix", {"num_classes": 3, "average": "bogus"}),
        ("Accuracy", {"output_transform": 3}),
    ):
        with pytest.raises((TypeError, ValueError)) as e1:
            getattr(M, name)(**kwargs)
        with pytest.raises((TypeError, ValueError)) as e2:
            getattr(ignite_metrics, name)(**kwargs)
        assert e1.type is e2.type, (name, kwargs)


# ---------------------------------------------------------------------- attached to engines
def _engine_trace(lib: str, batches: Batches) -> list[dict[str, Any]]:
    """Run an engine of ``lib`` ("ours" or "ignite") with metrics of every usage attached;
    ``state.metrics`` after each iteration and epoch."""
    import ignite.engine

    import ddp.engine

    engines: Any = ddp.engine if lib == "ours" else ignite.engine
    if lib == "ours":
        mods, data = M, [(tl.tensor(p), tl.tensor(y)) for p, y in batches]
    else:
        mods = ignite_metrics
        data = [(torch.from_numpy(p), torch.from_numpy(y)) for p, y in batches]
    Events = engines.Events
    engine = engines.Engine(lambda e, b: b)
    mods.Accuracy().attach(engine, "acc")
    mods.Accuracy().attach(engine, "acc_bw", usage="batch_wise")
    mods.Accuracy().attach(engine, "acc_f", usage=mods.BatchFiltered(every=2))
    mods.RunningAverage(mods.Accuracy(), alpha=0.7).attach(engine, "ra_acc")
    mods.RunningAverage(output_transform=lambda out: out[0].mean().item(), alpha=0.8).attach(
        engine, "ra_out"
    )
    mods.Precision(average=False).attach(engine, "prec")
    mods.ConfusionMatrix(4, average="recall").attach(engine, "cm")
    trace: list[dict[str, Any]] = []
    for event in (Events.ITERATION_COMPLETED, Events.EPOCH_COMPLETED):
        engine.add_event_handler(
            event, lambda e: trace.append({k: _plain(v) for k, v in e.state.metrics.items()})
        )
    engine.run(data, max_epochs=2)
    return trace


def test_metrics_attached_to_an_engine_write_the_same_state() -> None:
    batches = _multiclass(np.random.default_rng(10), c=4) * 2
    ours, theirs = _engine_trace("ours", batches), _engine_trace("ignite", batches)
    assert len(ours) == len(theirs) == 2 * (len(batches) + 1)
    for step, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert set(got) == set(want), step
        for key in want:
            rtol = 1e-6 if key in ("cm", "ra_out") else 1e-12
            np.testing.assert_allclose(got[key], want[key], rtol=rtol, err_msg=f"{step} {key}")
