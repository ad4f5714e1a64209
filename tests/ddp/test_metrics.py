"""``ddp.metrics``: every metric against a one-process NumPy computation, at world sizes 1-4.

Each rank updates with its share of the batches (tests/ddp/metrics_bodies.py) and every
rank's ``compute()`` must equal the NumPy result over all of them, exactly where the metric
counts (accuracy, precision, confusion counts) and to float64 rounding where it sums floats.
The bodies compute between updates (update -> compute -> update -> compute), check that
``compute()`` leaves the local state alone, run with ranks that see no data, and attach the
metrics to an Engine. The single-process tests below cover the errors and the Engine
plumbing (attach, usages, output mappings, unrolling, result spreading).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import collectives
import ddp.metrics as M
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import Engine, Events
from tests.collectives.harness import RankPool
from tests.collectives.threads_pool import ThreadsPool

from . import metrics_bodies as B
from .conftest import Pools

Pool = RankPool | ThreadsPool

pytestmark = pytest.mark.timeout(120)

WORLDS = [("serial", 1), ("cpu", 2), ("cpu", 3), ("cpu", 4), ("threads", 2)]
BODIES = "tests.ddp.metrics_bodies"
C = B.NUM_CLASSES


@pytest.fixture(params=WORLDS, ids=lambda w: f"{w[0]}{w[1]}")
def world(request: pytest.FixtureRequest, pools: Pools) -> Pool:
    backend, size = request.param
    if backend == "threads":
        return ThreadsPool(size, timeout=20.0, tag="metrics")
    return pools(backend, size)


@pytest.fixture(params=[w for w in WORLDS if w[1] > 1], ids=lambda w: f"{w[0]}{w[1]}")
def multi(request: pytest.FixtureRequest, pools: Pools) -> Pool:
    backend, size = request.param
    if backend == "threads":
        return ThreadsPool(size, timeout=20.0, tag="metrics")
    return pools(backend, size)


@pytest.fixture
def alone() -> Iterator[None]:
    """This process, outside any group: every metric at world size 1."""
    if collectives.is_initialized():
        pytest.skip("another test left a process group in this process")
    yield


def _run(world: Pool, body: str, **kwargs: Any) -> list[Any]:
    return world.run(f"{BODIES}:{body}", kwargs, deadline=60.0)


# ---------------------------------------------------------------------- references
def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _stack(data: list[B.Batch]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([p for p, _ in data]), np.concatenate([y for _, y in data])


def _classes(kind: str, pred: np.ndarray, y: np.ndarray, average: Any) -> tuple[Any, Any]:
    """(predicted, true) as 0/1 matrices (samples x classes), or flat for binary/False."""
    if kind == "multilabel":
        return pred, y
    if kind == "binary" and average is False:
        return pred.reshape(-1), y.reshape(-1)
    k = 2 if kind == "binary" else C
    p = pred if kind == "binary" else np.argmax(pred, axis=1)
    return np.eye(k, dtype=np.int64)[p.reshape(-1)], np.eye(k, dtype=np.int64)[y.reshape(-1)]


def _precision_recall(name: str, kind: str, average: Any, data: list[B.Batch]) -> Any:
    pred, true = _classes(kind, *_stack(data), average)
    tp = pred * true
    pos = pred if name == "precision" else true
    if average == "samples":
        return float(np.mean(_ratio(tp.sum(axis=1), pos.sum(axis=1))))
    if average == "micro":
        return float(_ratio(tp.sum(), pos.sum()))
    per_class = _ratio(tp.sum(axis=0), pos.sum(axis=0))
    if average == "macro":
        return float(per_class.mean())
    if average == "weighted":
        w = true.sum(axis=0)
        return float((per_class * w).sum() / w.sum())
    return per_class


def _confusion(data: list[B.Batch]) -> np.ndarray:
    m = np.zeros((C, C), np.int64)
    for pred, y in data:
        p, t = np.argmax(pred, axis=1).reshape(-1), y.reshape(-1)
        ok = (t >= 0) & (t < C)
        np.add.at(m, (t[ok], p[ok]), 1)
    return m


def _cross_entropy(data: list[B.Batch]) -> float:
    logits, y = _stack(data)
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    return float(np.mean(lse - z[np.arange(len(y)), y]))


def _top_k(k: int, data: list[B.Batch]) -> float:
    pred, y = _stack(data)
    order = np.argsort(-pred, axis=1, kind="stable")[:, :k]
    return float(np.mean((order == y[:, None]).any(axis=1)))


def reference(name: str, data: list[B.Batch]) -> Any:
    """The metric ``name`` over ``data`` in one process, by its definition."""
    family, _, rest = name.partition("/")
    if family == "accuracy":
        pred, y = _stack(data)
        if rest == "multilabel":
            return float(np.mean(np.all(pred == y, axis=1)))
        if rest == "binary":
            return float(np.mean(pred == y))
        return float(np.mean(np.argmax(pred, axis=1) == y))
    if family in ("precision", "recall"):
        avg_s, kind = rest.split("/")
        average = {"False": False, "None": None}.get(avg_s, avg_s)
        return _precision_recall(family, kind, average, data)
    if family == "confusion":
        m = _confusion(data)
        if rest == "None":
            return m
        if rest == "samples":
            return m / sum(len(p) for p, _ in data)
        if rest == "recall":
            return _ratio(m, m.sum(axis=1, keepdims=True) + 0 * m)
        return _ratio(m, m.sum(axis=0, keepdims=True) + 0 * m)
    if family == "loss":
        return _cross_entropy(data)
    if family == "mse":
        pred, y = _stack(data)
        return float(((pred - y) ** 2).sum() / len(y))
    if family == "topk":
        return _top_k(int(rest), data)
    raise ValueError(name)


EXACT = ("accuracy/", "topk/", "confusion/None")


def _check(name: str, got: Any, want: Any) -> None:
    """``got`` (a JSON result) equals ``want``: exactly for counts, else to 1e-12."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, dict), f"{name}: want a tensor, got {got!r}"
        want_dtype = "int64" if want.dtype == np.int64 else "float64"
        assert got["dtype"] == want_dtype, f"{name}: dtype {got['dtype']}"
        value = np.asarray(got["value"])
        assert value.shape == want.shape, f"{name}: shape {value.shape} vs {want.shape}"
        if name.startswith(EXACT):
            np.testing.assert_array_equal(value, want, err_msg=name)
        else:
            np.testing.assert_allclose(value, want, rtol=1e-12, atol=1e-15, err_msg=name)
        return
    assert isinstance(got, float), f"{name}: want a float, got {got!r}"
    if name.startswith(EXACT):
        assert got == want, name
    else:
        rtol = 1e-6 if name.startswith("loss/") else 1e-12  # the loss is float32 per batch
        assert got == pytest.approx(want, rel=rtol, abs=1e-15), name


def _check_ranks(results: list[dict[str, Any]], seed: int, n: int, split: int) -> None:
    assert all(r == results[0] for r in results), "ranks computed different results"
    for name, (first, second, again) in results[0].items():
        data = B.batches(B.CASES[name][1], seed, n)
        _check(name, first, reference(name, data[:split]))
        _check(name, second, reference(name, data))
        assert again == second, f"{name}: a second compute() gave another result"


FAMILIES = ["accuracy", "precision", "recall", "confusion", "loss", "mse", "topk"]


# ---------------------------------------------------------------------- every rank, every metric
@pytest.mark.parametrize("family", FAMILIES)
def test_compute_over_all_ranks_equals_one_process(world: Pool, family: str, seed: int) -> None:
    names = [n for n in B.CASES if n.startswith(family + "/")]
    got = _run(world, "run_cases", names=names, seed=seed, n_batches=7, split=3)
    _check_ranks(got, seed, 7, 3)


def test_ranks_that_see_no_data_still_compute_the_whole(multi: Pool, seed: int) -> None:
    # 3 batches: at world size 4 rank 3 sees none; in the first phase only rank 0 sees one.
    names = [
        "accuracy/multiclass",
        "precision/False/multiclass",
        "precision/weighted/multilabel",
        "recall/None/binary",
        "recall/False/binary",
        "recall/samples/multilabel",
        "confusion/recall",
        "loss/cross_entropy",
        "mse/regression",
        "topk/3",
    ]
    got = _run(multi, "run_cases", names=names, seed=seed, n_batches=3, split=1)
    _check_ranks(got, seed, 3, 1)


def test_not_computable_on_every_rank(world: Pool) -> None:
    names = ["accuracy/binary", "precision/macro/multiclass", "recall/False/binary"]
    names += ["confusion/None", "loss/cross_entropy", "mse/regression", "topk/1"]
    got = _run(world, "not_computable", names=names)
    assert all(g == got[0] for g in got)
    assert got[0]["accuracy/binary"] == (
        "Accuracy must have at least one example before it can be computed."
    )
    assert got[0]["recall/False/binary"] == (
        "Recall must have at least one example before it can be computed."
    )


def test_ranks_with_different_classes_all_raise(multi: Pool) -> None:
    got = _run(multi, "mismatched_classes")
    for message in got:
        assert "the ranks saw different input types or numbers of classes" in message
        assert "('multiclass', 3)" in message and "('multiclass', 4)" in message


def test_sync_all_reduce_ops_and_local_state(world: Pool) -> None:
    ws = world.world_size
    got = _run(world, "custom_metric")
    top = ws - 0.5
    for rank, g in enumerate(got):
        assert g["first"] == {"max": top, "min": [0.5, -top], "count": ws}
        assert g["local"] == [rank + 0.5, [rank + 0.5, -(rank + 0.5)], 1]
        assert g["second"] == {"max": top, "min": [-1.0, -top], "count": 2 * ws}


# ---------------------------------------------------------------------- with an Engine
def test_engine_epoch_wise_metrics(world: Pool, seed: int) -> None:
    got = _run(world, "engine_epoch_wise", seed=seed, n_batches=7)
    assert all(g == got[0] for g in got)
    data = B.batches("multiclass", seed, 7)
    want = {
        "acc": reference("accuracy/multiclass", data),
        "prec": reference("precision/macro/multiclass", data),
        "rec": reference("recall/False/multiclass", data),
        "cm": reference("confusion/None", data),
        "loss": reference("loss/cross_entropy", data),
        "top2": _top_k(2, data),
    }
    for metrics in [*got[0]["epochs"], got[0]["final"]]:
        assert set(metrics) == set(want)
        _check("accuracy/", metrics["acc"], want["acc"])
        _check("precision/macro", metrics["prec"], want["prec"])
        _check("recall/False", metrics["rec"], want["rec"])
        _check("confusion/None", metrics["cm"], want["cm"])
        _check("loss/", metrics["loss"], want["loss"])
        _check("topk/", metrics["top2"], want["top2"])


def test_engine_running_and_batch_wise(world: Pool, seed: int) -> None:
    ws, per_rank = world.world_size, 4
    got = _run(world, "engine_running", seed=seed, per_rank=per_rank)
    data = B.batches("multiclass", seed, per_rank * ws)
    steps = [data[i * ws : (i + 1) * ws] for i in range(per_rank)]
    ra_acc = ra_out = 0.0
    for i, step in enumerate(steps):
        acc = reference("accuracy/multiclass", step)
        out = sum(float(p.mean()) for p, _ in step) / ws
        ra_acc = acc if i == 0 else ra_acc * 0.6 + 0.4 * acc
        ra_out = out if i == 0 else ra_out * 0.9 + (1 - 0.9) * out
        for g in got:
            seen = g["iterations"][i]
            assert seen["acc_bw"] == acc
            assert seen["ra_acc"] == pytest.approx(ra_acc, rel=1e-12)
            assert seen["ra_out"] == pytest.approx(ra_out, rel=1e-12)
    filtered = [b for step in steps[1::2] for b in step]  # iterations 2 and 4
    for g in got:
        assert len(g["iterations"]) == per_rank
        assert g["filtered"] == reference("accuracy/multiclass", filtered)


def test_supervised_evaluator(world: Pool, seed: int) -> None:
    got = _run(world, "evaluator", seed=seed, n_batches=7)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((C, 3)).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    data = B.batches("regression", seed, 7)
    x = np.concatenate([p for p, _ in data]).astype(np.float32)
    y = np.random.default_rng(seed + 1).integers(0, C, len(x))
    logits = x.astype(np.float64) @ w.T.astype(np.float64) + b
    acc = float(np.mean(np.argmax(logits, axis=1) == y))
    loss = _cross_entropy([(logits, y)])
    for g in got:
        assert g["acc"] == acc
        assert g["loss"] == pytest.approx(loss, rel=1e-5)


# ---------------------------------------------------------------------- one process: errors
def _pair(pred: Any, y: Any) -> tuple[tl.Tensor, tl.Tensor]:
    return tl.tensor(np.asarray(pred)), tl.tensor(np.asarray(y))


def test_numpy_inputs_and_tensor_results(alone: None) -> None:
    acc = M.Accuracy()
    acc.update((np.array([[0.1, 0.9], [0.8, 0.2]]), np.array([1, 1])))
    assert acc.compute() == 0.5
    p = M.Precision()  # binary, no average: one 0-d float64 tensor
    p.update(_pair([1, 1, 0, 1], [1, 0, 0, 1]))
    got = p.compute()
    assert isinstance(got, tl.Tensor) and got.shape == () and got.dtype == np.float64
    assert got.item() == pytest.approx(2 / 3, rel=1e-15)
    with pytest.raises(TypeError, match="y_pred should be a tensorlib Tensor or a NumPy array"):
        M.Accuracy().update(([1, 0], np.array([1, 0])))
    with pytest.raises(TypeError, match=r"output should be a pair \(y_pred, y\)"):
        M.Accuracy().update(np.zeros(3))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "pred, y, kwargs, error, text",
    [
        (np.zeros((4, 3, 2)), np.zeros(4, np.int64), {}, ValueError, "y must have shape of"),
        (np.zeros((4, 3)), np.zeros(5, np.int64), {}, ValueError, "compatible shapes"),
        (np.array([0, 2, 1]), np.array([0, 1, 1]), {}, ValueError, "y_pred must be comprised"),
        (np.array([0, 1, 1]), np.array([0, 3, 1]), {}, ValueError, "y must be comprised"),
        (np.zeros((4, 1)), np.zeros((4, 1)), {"is_multilabel": True}, ValueError, "num_categ"),
    ],
)
def test_accuracy_input_errors(
    alone: None, pred: Any, y: Any, kwargs: dict[str, Any], error: type, text: str
) -> None:
    with pytest.raises(error, match=text):
        M.Accuracy(**kwargs).update(_pair(pred, y))


def test_classification_type_and_classes_must_not_change(alone: None) -> None:
    acc = M.Accuracy()
    acc.update(_pair([0, 1, 1], [0, 1, 0]))
    with pytest.raises(RuntimeError, match="Input data type has changed from binary to multiclass"):
        acc.update(_pair(np.zeros((3, 4)), [0, 1, 2]))
    acc = M.Accuracy()
    acc.update(_pair(np.zeros((3, 4)), [0, 1, 2]))
    with pytest.raises(ValueError, match="number of classes has changed from 4 to 5"):
        acc.update(_pair(np.zeros((3, 5)), [0, 1, 2]))
    acc.reset()  # a reset forgets the type
    acc.update(_pair([0, 1], [0, 0]))
    assert acc.compute() == 0.5


def test_precision_recall_errors_and_warnings(alone: None) -> None:
    with pytest.raises(ValueError, match="Argument average should be None or a boolean"):
        M.Precision(average="binary")
    with pytest.raises(ValueError, match="incompatible with binary and multiclass"):
        M.Recall(average="samples").update(_pair(np.zeros((2, 3)), [0, 1]))
    with pytest.raises(ValueError, match="invalid class = 5"):
        M.Precision().update(_pair(np.zeros((2, 3)), [0, 4]))
    with pytest.raises(ValueError, match="invalid class = -1"):
        M.Recall().update(_pair(np.zeros((2, 3)), [0, -1]))
    with pytest.warns(RuntimeWarning, match="`y` should be of dtype long"):
        M.Precision().update(_pair(np.zeros((2, 3)), np.array([0.0, 1.0])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # int64 labels: no warning
        M.Precision().update(_pair(np.zeros((2, 3)), np.array([0, 1])))
    with pytest.raises(M.NotComputableError, match="Precision must have at least one example"):
        M.Precision(average="weighted").compute()


def test_confusion_matrix_errors_and_compute_leaves_counts(alone: None) -> None:
    with pytest.raises(ValueError, match="num_classes needs to be > 1"):
        M.ConfusionMatrix(1)
    with pytest.raises(ValueError, match="Argument average can None or one of"):
        M.ConfusionMatrix(3, average="macro")
    cm = M.ConfusionMatrix(3, average="recall")
    with pytest.raises(ValueError, match="does not have correct number of classes: 4 vs 3"):
        cm.update(_pair(np.zeros((2, 4)), [0, 1]))
    with pytest.raises(ValueError, match=r"y_pred must have shape \(batch_size, num_classes"):
        cm.update(_pair(np.zeros(2), [0, 1]))
    with pytest.raises(TypeError, match="integer class labels"):
        cm.update(_pair(np.zeros((2, 3)), np.array([0.0, 1.0])))
    eye = np.eye(3, dtype=np.float32)
    cm.update(_pair(eye, [0, 1, 1]))
    first = cm.compute().numpy()
    assert cm.confusion_matrix.dtype == np.int64  # Ignite turned its counts into floats here
    cm.update(_pair(eye, [2, 1, 2]))
    want = np.array([[1, 0, 0], [0, 0.5, 0.5], [0, 0, 0]])
    np.testing.assert_allclose(first, want, atol=1e-14)
    want = np.array([[1, 0, 0], [0, 2 / 3, 1 / 3], [0.5, 0, 0.5]])
    np.testing.assert_allclose(cm.compute().numpy(), want, atol=1e-14)
    np.testing.assert_array_equal(cm.confusion_matrix, [[1, 0, 0], [0, 2, 1], [1, 0, 1]])


def test_loss_mse_topk_errors(alone: None) -> None:
    loss = M.Loss(F.cross_entropy)
    with pytest.raises(ValueError, match="loss_fn did not return the average loss"):
        loss.update((*_pair(np.zeros((2, 3), np.float32), [0, 1]), {"reduction": "none"}))
    with pytest.raises(TypeError, match="Argument loss_fn should be callable"):
        M.Loss("cross_entropy")  # type: ignore[arg-type]
    with pytest.raises(M.NotComputableError, match="Loss must have at least one example"):
        loss.compute()
    with pytest.raises(ValueError, match="as many elements as y_pred"):
        M.MeanSquaredError().update(_pair(np.zeros((2, 3)), np.zeros((2, 2))))
    with pytest.raises(ValueError, match="k=5 is more than the 4 classes"):
        M.TopKCategoricalAccuracy().update(_pair(np.zeros((2, 4)), [0, 1]))
    with pytest.raises(ValueError, match="Argument k should be a positive int"):
        M.TopKCategoricalAccuracy(0)
    top = M.TopKCategoricalAccuracy(2)  # a label outside the classes is never in the top k
    top.update(_pair([[0.1, 0.5, 0.4], [0.3, 0.35, 0.4]], [7, 1]))
    assert top.compute() == 0.5


def test_metric_arguments(alone: None) -> None:
    with pytest.raises(TypeError, match="Argument output_transform should be callable"):
        M.Accuracy(output_transform=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown device"):
        M.Accuracy(device="tpu")
    with pytest.raises(ValueError, match="metrics_result_mode"):
        M.MeanSquaredError(metrics_result_mode="flat")  # type: ignore[arg-type]


def test_sync_all_reduce_and_reinit_decorators(alone: None) -> None:
    with pytest.raises(ValueError, match="Reduction operation is not valid"):
        M.sync_all_reduce("_x:AVERAGE")

    class Broken(M.Metric):
        def reset(self) -> None:
            self._values: list[int] = []
            self._result: Any = "stale"

        @M.reinit__is_reduced
        def update(self, output: Any) -> None:
            self._values.append(output)

        @M.sync_all_reduce("_missing")
        def compute(self) -> Any:
            return 0

        @M.sync_all_reduce("_values")
        def values(self) -> Any:
            return self._values

    m = Broken()
    m.update(1)
    assert m._result is None  # reinit__is_reduced dropped the cached result
    with pytest.raises(ValueError, match="has no attribute '_missing'"):
        m.compute()  # found at world size 1 already
    with pytest.raises(TypeError, match="should be a number, NumPy array or Tensor"):
        m.values()
    with pytest.raises(RuntimeError, match=r"should be used on ddp\.metrics\.Metric"):
        Broken.compute(object())  # type: ignore[arg-type]


# ---------------------------------------------------------------------- one process: engine
def test_attach_detach_is_attached_and_usages(alone: None) -> None:
    engine = Engine(lambda e, b: b)
    acc = M.Accuracy()
    acc.attach(engine, "acc")
    assert acc.is_attached(engine) and acc.is_attached(engine, M.RunningEpochWise())
    assert not acc.is_attached(engine, "batch_wise")  # completes on another event
    per_batch = M.Accuracy()
    per_batch.attach(engine, "acc_bw", usage=M.BatchWise())
    assert per_batch.is_attached(engine, "batch_wise")
    per_batch.detach(engine, "batch_wise")
    assert not per_batch.is_attached(engine, "batch_wise") and acc.is_attached(engine)
    data = [_pair(np.eye(2), [0, 1]), _pair(np.eye(2), [1, 1])]
    assert engine.run(data).metrics == {"acc": 0.75}
    acc.detach(engine)
    assert not acc.is_attached(engine)
    engine.state.metrics.clear()  # a new run keeps the old results (as Ignite's does)
    assert engine.run(data).metrics == {}
    with pytest.raises(ValueError, match="Argument usage should be one of"):
        acc.attach(engine, "x", usage="per_sample")
    with pytest.raises(TypeError, match="Unhandled usage type"):
        acc.attach(engine, "x", usage=3)  # type: ignore[arg-type]


def test_running_epoch_wise_and_running_average_usage(alone: None) -> None:
    engine = Engine(lambda e, b: b)
    ra = M.RunningAverage(output_transform=lambda out: out, alpha=0.5)
    ra.attach(engine, "ra")
    assert ra.is_attached(engine)  # its own default usage, running_batch_wise
    seen: list[float] = []
    engine.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.metrics["ra"])
    )
    engine.run([4.0, 2.0, 0.0, 8.0], max_epochs=2)
    assert seen == [4.0, 3.0, 1.5, 4.75, 4.375, 3.1875, 1.59375, 4.796875]  # not reset per epoch
    with pytest.warns(UserWarning, match="`epoch_bound` is deprecated"):
        bound = M.RunningAverage(output_transform=lambda out: out, alpha=0.5, epoch_bound=True)
    engine = Engine(lambda e, b: b)
    bound.attach(engine, "ra")
    engine.run([4.0, 2.0], max_epochs=2)
    assert engine.state.metrics["ra"] == 3.0  # reset at each epoch start
    with pytest.raises(M.NotComputableError, match="RunningAverage must have at least one"):
        M.RunningAverage(output_transform=lambda out: out).compute()
    vector = M.RunningAverage(output_transform=lambda out: out, alpha=0.5)
    vector.update(tl.tensor([1.0, 3.0]))
    vector.update(np.array([3.0, 5.0]))
    got = vector.compute()
    assert isinstance(got, tl.Tensor) and got.numpy().tolist() == [2.0, 4.0]


def test_mapping_outputs_unrolling_and_spread_results(alone: None) -> None:
    eye = np.eye(2)
    engine = Engine(lambda e, b: {"y_pred": tl.tensor(eye), "y": tl.tensor([0, 0]), "x": 1})
    M.Accuracy().attach(engine, "acc")
    assert engine.run([0]).metrics["acc"] == 0.5
    engine = Engine(lambda e, b: {"y_pred": tl.tensor(eye)})
    M.Accuracy().attach(engine, "acc")
    with pytest.raises(ValueError, match=r"it should contain \('y_pred', 'y'\) keys"):
        engine.run([0])
    engine = Engine(lambda e, b: {"value": 1.0})
    M.RunningAverage(output_transform=lambda out: out).attach(engine, "ra")
    with pytest.raises(TypeError, match="should be a tuple/list, but given dict"):
        engine.run([0])
    # Lists of per-sample tensors or numbers are fed one sample at a time.
    engine = Engine(lambda e, b: ([tl.tensor([0.2, 0.8]), tl.tensor([0.9, 0.1])], [1, 1]))
    M.Accuracy().attach(engine, "acc")
    M.Loss(F.cross_entropy).attach(engine, "loss")
    metrics = engine.run([0]).metrics
    assert metrics["acc"] == 0.5
    want = _cross_entropy([(np.array([[0.2, 0.8], [0.9, 0.1]]), np.array([1, 1]))])
    assert metrics["loss"] == pytest.approx(want, rel=1e-6)
    engine = Engine(lambda e, b: ([tl.tensor([0.2, 0.8])], [1, 0]))
    M.Accuracy().attach(engine, "acc")
    with pytest.raises(ValueError, match="Output should have 2 items of the same length"):
        engine.run([0])

    class Both(M.Metric):
        def __init__(self, mode: Any = "both") -> None:
            super().__init__(metrics_result_mode=mode)

        def reset(self) -> None:
            pass

        def update(self, output: Any) -> None:
            pass

        def compute(self) -> dict[str, float]:
            return {"a": 1.0, "b": 2.0}

    for mode, want_keys in (("both", {"ab", "a", "b"}), ("flatten", {"a", "b"}), ("named", {"ab"})):
        engine = Engine(lambda e, b: (0, 0))
        Both(mode).attach(engine, "ab")
        assert set(engine.run([0]).metrics) == want_keys
    engine = Engine(lambda e, b: (0, 0))
    Both().attach(engine, "a")
    with pytest.raises(ValueError, match="Argument name 'a' is conflicting with mapping keys"):
        engine.run([0])


# ---------------------------------------------------------------------- GPU inputs
@pytest.mark.gpu
def test_gpu_inputs_give_the_cpu_results(alone: None, seed: int) -> None:
    names = [
        "accuracy/multiclass",
        "accuracy/multilabel",
        "precision/False/multiclass",
        "recall/weighted/multilabel",
        "confusion/None",
        "confusion/precision",
        "loss/cross_entropy",
        "mse/regression",
        "topk/3",
    ]
    for name in names:
        make, kind = B.CASES[name]
        on_cpu, on_gpu = make(), make()
        for pred, y in B.batches(kind, seed):
            on_cpu.update(_pair(pred, y))
            on_gpu.update((tl.tensor(pred, device="cuda:0"), tl.tensor(y, device="cuda:0")))
        got, want = B.jsonable(on_gpu.compute()), B.jsonable(on_cpu.compute())
        assert got == want or got == pytest.approx(want, rel=1e-6), name
    cm = M.ConfusionMatrix(C, device="cuda:0")  # results go to the metric's device
    pred, y = B.batches("segmentation", seed)[0]
    cm.update((tl.tensor(pred, device="cuda:0"), tl.tensor(y, device="cuda:0")))
    result = cm.compute()
    assert str(result.device) == "cuda:0"
    np.testing.assert_array_equal(result.numpy(), _confusion([(pred, y)]))
