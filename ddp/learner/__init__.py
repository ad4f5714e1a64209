"""ddp.learner: Burn's ``Learner`` with the execution strategy as a parameter.

::

    from ddp.learner import ExecutionStrategy, Learner, SupervisedTraining

    strategy = ExecutionStrategy.ddp(devices, DistributedConfig(all_reduce_op=ReduceOperation.Mean))
    model = make_model().to(strategy.main_device())
    result = (SupervisedTraining("runs/exp1", train_loader, valid_loader, loss_fn=loss)
              .with_training_strategy(strategy).num_epochs(10)
              .launch(Learner(model, optimizer, lr_scheduler)))

Modules: ``_strategy`` (the strategies), ``_training`` (Learner, SupervisedTraining),
``_loop`` (the epoch loop and checkpoints), ``_local`` (one thread over one or several
devices), ``_ddp_worker`` (a rank thread per device), ``_batches`` (splitting a batch),
``_replicas`` (copies of model, optimizer and scheduler), ``_step`` (a batch to a loss),
``_outputs`` (TrainOutput, TrainingResult), ``_progress``.
"""

from ._outputs import EpochMetrics, TrainingResult, TrainOutput
from ._strategy import DdpStrategy, ExecutionStrategy, MultiDeviceStrategy, SingleDeviceStrategy
from ._training import Learner, SupervisedTraining

__all__ = [
    "DdpStrategy",
    "EpochMetrics",
    "ExecutionStrategy",
    "Learner",
    "MultiDeviceStrategy",
    "SingleDeviceStrategy",
    "SupervisedTraining",
    "TrainOutput",
    "TrainingResult",
]
