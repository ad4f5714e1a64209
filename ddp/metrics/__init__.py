"""``ddp.metrics``: PyTorch Ignite's ``ignite.metrics``, exact across ranks.

Each metric keeps a local state (integer counts, float64 sums) that ``update`` adds one batch
to; under several ranks ``compute()`` all-reduces a copy of it, so every rank gets the
result over all the data, and the local state keeps accumulating unchanged.
"""

from ._accuracy import Accuracy
from ._confusion_matrix import ConfusionMatrix
from ._loss import Loss
from ._metric import Metric, NotComputableError, reinit__is_reduced, sync_all_reduce
from ._precision_recall import Precision, Recall
from ._regression import MeanSquaredError
from ._running_average import RunningAverage
from ._top_k import TopKCategoricalAccuracy
from ._usage import (
    BatchFiltered,
    BatchWise,
    EpochWise,
    MetricUsage,
    RunningBatchWise,
    RunningEpochWise,
    SingleEpochRunningBatchWise,
)

__all__ = [
    "Accuracy",
    "BatchFiltered",
    "BatchWise",
    "ConfusionMatrix",
    "EpochWise",
    "Loss",
    "MeanSquaredError",
    "Metric",
    "MetricUsage",
    "NotComputableError",
    "Precision",
    "Recall",
    "RunningAverage",
    "RunningBatchWise",
    "RunningEpochWise",
    "SingleEpochRunningBatchWise",
    "TopKCategoricalAccuracy",
    "reinit__is_reduced",
    "sync_all_reduce",
]
