"""Rank bodies for ``ddp.metrics``: each rank updates with its share of one data set.

The data (a list of batches) is drawn from a seed, so every rank and the test process build
the same; batch ``i`` belongs to rank ``i % world_size`` (every sample seen once, shares of
unequal length, and with fewer batches than ranks some ranks see none). The test compares
what ``compute()`` returns on every rank with a one-process NumPy computation over all the
batches (tests/ddp/test_metrics.py). Results travel as JSON: floats, or
``{"dtype", "value"}`` for tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import ddp.idist as idist
import ddp.metrics as M
import tensorlib as tl
import tensorlib.functional as F
from ddp.engine import Engine, Events, create_supervised_evaluator
from tensorlib import nn

Batch = tuple[np.ndarray, np.ndarray]

SIZES = (5, 1, 8, 3, 6, 2, 7)
NUM_CLASSES = 4


# ---------------------------------------------------------------------- data
def batches(kind: str, seed: int, n: int = len(SIZES)) -> list[Batch]:
    """``n`` batches of input ``kind`` (sizes cycling through :data:`SIZES`)."""
    rng = np.random.default_rng(seed)
    c = NUM_CLASSES
    out: list[Batch] = []
    for i in range(n):
        b = SIZES[i % len(SIZES)]
        if kind == "binary":
            out.append((rng.integers(0, 2, b), rng.integers(0, 2, b)))
        elif kind == "multiclass":
            out.append((rng.standard_normal((b, c)).astype(np.float32), rng.integers(0, c, b)))
        elif kind == "multiclass_seq":
            scores = rng.standard_normal((b, c, 5)).astype(np.float32)
            out.append((scores, rng.integers(0, c, (b, 5))))
        elif kind == "multilabel":
            out.append((rng.integers(0, 2, (b, c)), rng.integers(0, 2, (b, c))))
        elif kind == "segmentation":  # labels -1 and 255 are ignored by ConfusionMatrix
            y = rng.choice(np.array([-1, 0, 1, 2, 3, 255]), size=(b, 3, 2))
            out.append((rng.standard_normal((b, c, 3, 2)).astype(np.float32), y))
        elif kind == "regression":
            out.append((rng.standard_normal((b, 3)), rng.standard_normal((b, 3))))
        else:
            raise ValueError(f"unknown data kind {kind!r}")
    return out


# ---------------------------------------------------------------------- cases
def _pr(name: str, average: Any, kind: str) -> tuple[Callable[[], M.Metric], str]:
    cls = M.Precision if name == "precision" else M.Recall
    multilabel = kind == "multilabel"
    return (lambda: cls(average=average, is_multilabel=multilabel)), kind


def _cm(average: str) -> Callable[[], M.Metric]:
    return lambda: M.ConfusionMatrix(NUM_CLASSES, average=average)


CASES: dict[str, tuple[Callable[[], M.Metric], str]] = {
    "accuracy/binary": (M.Accuracy, "binary"),
    "accuracy/multiclass": (M.Accuracy, "multiclass"),
    "accuracy/multiclass_seq": (M.Accuracy, "multiclass_seq"),
    "accuracy/multilabel": (lambda: M.Accuracy(is_multilabel=True), "multilabel"),
    "confusion/None": (lambda: M.ConfusionMatrix(NUM_CLASSES), "segmentation"),
    "loss/cross_entropy": (lambda: M.Loss(F.cross_entropy), "multiclass"),
    "mse/regression": (M.MeanSquaredError, "regression"),
    "topk/1": (lambda: M.TopKCategoricalAccuracy(1), "multiclass"),
    "topk/3": (lambda: M.TopKCategoricalAccuracy(3), "multiclass"),
}
for _cm_avg in ("samples", "recall", "precision"):
    CASES[f"confusion/{_cm_avg}"] = _cm(_cm_avg), "segmentation"
for _name in ("precision", "recall"):
    for _kind in ("binary", "multiclass", "multilabel"):
        for _avg in (False, None, "macro", "micro", "weighted"):
            CASES[f"{_name}/{_avg}/{_kind}"] = _pr(_name, _avg, _kind)
    CASES[f"{_name}/samples/multilabel"] = _pr(_name, "samples", "multilabel")


def jsonable(x: Any) -> Any:
    """A result for the trip back: floats stay floats, tensors carry their dtype."""
    if isinstance(x, tl.Tensor):
        return {"dtype": str(x.dtype), "value": x.numpy().tolist()}
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, float | int):
        return x
    raise TypeError(f"unexpected result type {type(x).__name__}: {x!r}")


def _as_input(pred: np.ndarray, y: np.ndarray) -> tuple[tl.Tensor, tl.Tensor]:
    return tl.tensor(pred), tl.tensor(y)


def _mine(data: list[Batch]) -> list[Batch]:
    return data[idist.get_rank() :: idist.get_world_size()]


# ---------------------------------------------------------------------- bodies
def run_cases(names: list[str], seed: int, n_batches: int, split: int) -> dict[str, Any]:
    """For each case: update with this rank's share of the first ``split`` batches,
    compute; then the rest, compute again; then compute once more with no update.
    Returns the three results per case, and checks the local state was not changed."""
    out: dict[str, Any] = {}
    for name in names:
        make, kind = CASES[name]
        data = batches(kind, seed, n_batches)
        metric = make()
        results = []
        for part in (data[:split], data[split:]):
            for pred, y in _mine(part):
                metric.update(_as_input(pred, y))
            before = {k: np.copy(v) for k, v in vars(metric).items() if _is_state(v)}
            results.append(jsonable(metric.compute()))
            for k, v in before.items():
                if not np.array_equal(np.asarray(getattr(metric, k)), v):
                    raise AssertionError(f"{name}: compute() changed the local {k}")
        results.append(jsonable(metric.compute()))
        out[name] = results
    return out


def _is_state(v: Any) -> bool:
    return isinstance(v, np.ndarray | np.generic | int | float) and not isinstance(v, bool)


def not_computable(names: list[str]) -> dict[str, str]:
    """compute() before any update, on every rank: the error each rank got."""
    out = {}
    for name in names:
        try:
            CASES[name][0]().compute()
        except M.NotComputableError as e:
            out[name] = str(e)
        else:
            raise AssertionError(f"{name}: compute() before any update did not raise")
    return out


def mismatched_classes() -> str:
    """Rank 0 sees 3 classes, the others 4: Precision says so on every rank (no hang)."""
    c = 3 if idist.get_rank() == 0 else 4
    p = M.Precision()
    p.update(_as_input(np.eye(c, dtype=np.float32), np.arange(c)))
    try:
        p.compute()
    except ValueError as e:
        return str(e)
    raise AssertionError("compute() with different numbers of classes did not raise")


class _Extremes(M.Metric):
    """A user metric with a MAX and a MIN reduction and a tensor state."""

    def reset(self) -> None:
        self._max = -np.inf
        self._min = np.full(2, np.inf)
        self._count = tl.tensor(0)

    def update(self, output: Any) -> None:
        self._max = max(self._max, float(output))
        self._min = np.minimum(self._min, [float(output), -float(output)])
        self._count = self._count + 1

    @M.sync_all_reduce("_max:MAX", "_min:MIN", "_count")
    def compute(self) -> dict[str, Any]:
        return {"max": self._max, "min": self._min.tolist(), "count": int(self._count.item())}


def custom_metric() -> dict[str, Any]:
    """sync_all_reduce with MAX/MIN/SUM on numbers, arrays and tensors; local state kept."""
    rank = idist.get_rank()
    m = _Extremes()
    m.update(rank + 0.5)
    first = m.compute()
    local = (m._max, m._min.tolist(), m._count.item())
    m.update(-1.0)
    return {"first": first, "local": list(local), "second": m.compute()}


def engine_epoch_wise(seed: int, n_batches: int) -> dict[str, Any]:
    """Metrics attached to an Engine whose output is the batch; two epochs over this rank's
    share; ``state.metrics`` at the end of each epoch."""
    data = [_as_input(p, y) for p, y in _mine(batches("multiclass", seed, n_batches))]
    engine = Engine(lambda e, b: b)
    M.Accuracy().attach(engine, "acc")
    M.Precision(average="macro").attach(engine, "prec")
    M.Recall().attach(engine, "rec")
    M.ConfusionMatrix(NUM_CLASSES).attach(engine, "cm")
    M.Loss(F.cross_entropy).attach(engine, "loss")
    M.TopKCategoricalAccuracy(2).attach(engine, "top2", usage=M.EpochWise())
    seen: list[dict[str, Any]] = []
    engine.add_event_handler(
        Events.EPOCH_COMPLETED, lambda e: seen.append(jsonable(dict(e.state.metrics)))
    )
    engine.run(data, max_epochs=2)
    return {"epochs": seen, "final": jsonable(dict(engine.state.metrics))}


def engine_running(seed: int, per_rank: int) -> dict[str, Any]:
    """RunningAverage (of the output, of a metric) and a batch-wise Accuracy, recorded after
    every iteration; each rank runs ``per_rank`` iterations (iteration i of rank r gets batch
    ``i * world_size + r``)."""
    ws = idist.get_world_size()
    data = [_as_input(p, y) for p, y in _mine(batches("multiclass", seed, per_rank * ws))]
    engine = Engine(lambda e, b: b)
    M.RunningAverage(M.Accuracy(), alpha=0.6).attach(engine, "ra_acc")
    M.RunningAverage(output_transform=lambda out: out[0].numpy().mean(), alpha=0.9).attach(
        engine, "ra_out"
    )
    M.Accuracy().attach(engine, "acc_bw", usage="batch_wise")
    M.Accuracy().attach(engine, "acc_filtered", usage=M.BatchFiltered(every=2))
    seen: list[dict[str, Any]] = []

    @engine.on(Events.ITERATION_COMPLETED)
    def record(e: Engine) -> None:
        seen.append({k: e.state.metrics[k] for k in ("ra_acc", "ra_out", "acc_bw")})

    engine.run(data, max_epochs=1)
    return {"iterations": seen, "filtered": engine.state.metrics["acc_filtered"]}


def evaluator(seed: int, n_batches: int) -> dict[str, Any]:
    """create_supervised_evaluator over a linear model (weights drawn from the seed, the same
    on every rank) on this rank's share of regression-like data."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((NUM_CLASSES, 3)).astype(np.float32)
    b = rng.standard_normal(NUM_CLASSES).astype(np.float32)
    model = nn.Linear(3, NUM_CLASSES)
    model.weight.data = w.copy()
    model.bias.data = b.copy()
    data = batches("regression", seed, n_batches)
    labels = np.random.default_rng(seed + 1).integers(0, NUM_CLASSES, sum(len(x) for x, _ in data))
    cut = np.cumsum([len(x) for x, _ in data])[:-1]
    pairs = list(zip([x.astype(np.float32) for x, _ in data], np.split(labels, cut), strict=True))
    ev = create_supervised_evaluator(
        model, metrics={"acc": M.Accuracy(), "loss": M.Loss(F.cross_entropy)}
    )
    ev.run([_as_input(x, y) for x, y in _mine(pairs)])
    return jsonable(dict(ev.state.metrics))
