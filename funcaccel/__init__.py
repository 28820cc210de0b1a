"""funcaccel: functional, stateless distributed-training building blocks for PyTorch.

Importing funcaccel starts no process group, reads no environment variable and adds
no logging handler. Build a ``DistributedContext`` with ``build_context()`` and pass
it into the functions below.
"""

from __future__ import annotations

from funcaccel.collectives import BatchInfo
from funcaccel.collectives import Reduction
from funcaccel.collectives import broadcast
from funcaccel.collectives import broadcast_object
from funcaccel.collectives import gather
from funcaccel.collectives import gather_for_metrics
from funcaccel.collectives import gather_object
from funcaccel.collectives import pad_across_processes
from funcaccel.collectives import reduce
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.context import build_context
from funcaccel.context import close_context
from funcaccel.context import context_from_env
from funcaccel.envreport import env_report
from funcaccel.kwargs import AutocastKwargs
from funcaccel.kwargs import DDPCommunicationHookType
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.kwargs import InitProcessGroupKwargs
from funcaccel.kwargs import KwargsHandler
from funcaccel.kwargs import ProfileKwargs
from funcaccel.model import FSDPOptions
from funcaccel.model import move_optimizer_state_
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.profiler import build_profiler
from funcaccel.profiler import profiler_trace_path
from funcaccel.progress import progress
from funcaccel.sharding import ShardedBatchSampler
from funcaccel.sharding import ShardedIterableDataset
from funcaccel.sharding import shard_batch_sampler
from funcaccel.sharding import shard_iterable_dataset
from funcaccel.trackers import CSVTracker
from funcaccel.trackers import JSONLTracker
from funcaccel.trackers import TensorBoardTracker
from funcaccel.tracking import ConfigValue
from funcaccel.tracking import InMemoryTracker
from funcaccel.tracking import LogRecord
from funcaccel.tracking import MetricValue
from funcaccel.tracking import Tracker
from funcaccel.tracking import finish_trackers
from funcaccel.tracking import log_metrics
from funcaccel.tracking import store_config

__version__ = "0.1.0"

__all__ = [
    "AutocastKwargs",
    "BatchInfo",
    "CSVTracker",
    "ConfigValue",
    "DDPCommunicationHookType",
    "DistributedContext",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FSDPOptions",
    "GradScalerKwargs",
    "InMemoryTracker",
    "InitProcessGroupKwargs",
    "JSONLTracker",
    "KwargsHandler",
    "LogRecord",
    "MetricValue",
    "ProfileKwargs",
    "Reduction",
    "ShardedBatchSampler",
    "ShardedIterableDataset",
    "TensorBoardTracker",
    "Tracker",
    "broadcast",
    "broadcast_object",
    "build_context",
    "build_profiler",
    "close_context",
    "context_from_env",
    "env_report",
    "finish_trackers",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "log_metrics",
    "move_optimizer_state_",
    "pad_across_processes",
    "profiler_trace_path",
    "progress",
    "reduce",
    "shard_batch_sampler",
    "shard_iterable_dataset",
    "store_config",
    "unwrap_model",
    "wrap_model",
]
