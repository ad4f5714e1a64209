"""ddp: DistributedDataParallel with bucketed, overlapped gradient all-reduce, and helpers."""

from ._ddp import DistributedDataParallel, StepStats
from ._hooks import GradBucket, allreduce_hook, fp16_compress_hook

__all__ = [
    "DistributedDataParallel",
    "GradBucket",
    "StepStats",
    "allreduce_hook",
    "fp16_compress_hook",
]
