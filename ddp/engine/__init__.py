"""``ddp.engine``: PyTorch Ignite's training engine (``ignite.engine``) on tensorlib and ddp.

``Engine`` runs a process function over data with events and handlers; ``Events`` and custom
``EventEnum`` events, with filters (``every``, ``once``, ``before``, ``after``); ``State``;
``create_supervised_trainer``/``create_supervised_evaluator``. Metrics are in ``ddp.metrics``,
handlers (checkpoints, early stopping, progress bar) in ``ddp.handlers``. docs/engine.md maps
Ignite's names to these and lists what differs.
"""

from ._dispatch import RemovableEventHandle
from ._engine import Engine
from ._events import CallableEventWithFilter, EventEnum, Events, EventsList
from ._state import State
from ._supervised import (
    create_supervised_evaluator,
    create_supervised_trainer,
    supervised_evaluation_step,
    supervised_training_step,
)

__all__ = [
    "CallableEventWithFilter",
    "Engine",
    "EventEnum",
    "Events",
    "EventsList",
    "RemovableEventHandle",
    "State",
    "create_supervised_evaluator",
    "create_supervised_trainer",
    "supervised_evaluation_step",
    "supervised_training_step",
]
