"""``ddp.handlers``: Ignite's handlers that runs reach for first, for ``ddp.engine``.

``Checkpoint``/``ModelCheckpoint``/``DiskSaver`` (rank-0, atomic ``tensorlib.save`` files,
rotation, keep-best, exact resume with ``Checkpoint.load_objects``), ``EarlyStopping``,
``Timer``, ``TerminateOnNan``, the tqdm ``ProgressBar`` (rank 0 only; tqdm optional) and
``global_step_from_engine``, with Ignite 0.5's names and semantics. docs/ lists what differs.
"""

from ._checkpoint import Checkpoint, CheckpointEvents
from ._early_stopping import EarlyStopping
from ._model_checkpoint import ModelCheckpoint
from ._progress_bar import ProgressBar
from ._savers import BaseSaveHandler, DiskSaver
from ._terminate_on_nan import TerminateOnNan
from ._timer import Timer
from ._utils import global_step_from_engine

__all__ = [
    "BaseSaveHandler",
    "Checkpoint",
    "CheckpointEvents",
    "DiskSaver",
    "EarlyStopping",
    "ModelCheckpoint",
    "ProgressBar",
    "TerminateOnNan",
    "Timer",
    "global_step_from_engine",
]
