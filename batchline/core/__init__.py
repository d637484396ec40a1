"""The batching core: pure policy, padding, isolation and statistics, with no I/O.

The thread driver, the asyncio driver and the Redis worker all call this same core.
"""

from batchline.core.isolation import Isolation
from batchline.core.padding import PadInfo, collate, split_outputs, split_rows, stack_rows
from batchline.core.policy import BatchPolicy, Decision, PolicyConfig
from batchline.core.stats import BatchStats, Percentiles, StatsRecorder

__all__ = [
    "BatchPolicy",
    "BatchStats",
    "Decision",
    "Isolation",
    "PadInfo",
    "Percentiles",
    "PolicyConfig",
    "StatsRecorder",
    "collate",
    "split_outputs",
    "split_rows",
    "stack_rows",
]
