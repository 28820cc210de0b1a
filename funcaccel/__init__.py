"""funcaccel: functional, stateless distributed-training building blocks for PyTorch.

Importing funcaccel starts no process group, reads no environment variable and adds
no logging handler. Build a ``DistributedContext`` with ``build_context()`` and pass
it into the functions below.
"""

from __future__ import annotations

from funcaccel._version import __version__ as __version__
from funcaccel.accumulate import accumulate_step
from funcaccel.accumulate import sync_ctx
from funcaccel.checkpoint import CheckpointMeta
from funcaccel.checkpoint import LoadedState
from funcaccel.checkpoint import latest_checkpoint
from funcaccel.checkpoint import list_checkpoints
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import read_checkpoint_meta
from funcaccel.checkpoint import save_checkpoint
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
from funcaccel.grad_state import GradState
from funcaccel.grad_state import advance_grad_state
from funcaccel.grad_state import should_skip_grad_sync
from funcaccel.grad_state import should_sync
from funcaccel.grad_state import window_grad_factor
from funcaccel.kwargs import AutocastKwargs
from funcaccel.kwargs import DDPCommunicationHookType
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.kwargs import InitProcessGroupKwargs
from funcaccel.kwargs import KwargsHandler
from funcaccel.kwargs import ProfileKwargs
from funcaccel.loader import Batch
from funcaccel.loader import LoaderState
from funcaccel.loader import RngType
from funcaccel.loader import ShardedLoader
from funcaccel.loader import iter_batches
from funcaccel.loader import send_to_device
from funcaccel.loader import shard_loader
from funcaccel.mixed_precision import autocast_ctx
from funcaccel.mixed_precision import autocast_dtype
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.mixed_precision import clip_grad_norm_
from funcaccel.mixed_precision import optimizer_step
from funcaccel.mixed_precision import rescale_grads_
from funcaccel.mixed_precision import unscale_grads_
from funcaccel.model import FSDPOptions
from funcaccel.model import move_optimizer_state_
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.profiler import build_profiler
from funcaccel.profiler import profiler_trace_path
from funcaccel.progress import progress
from funcaccel.scheduler import maybe_step_scheduler
from funcaccel.scheduler import scheduler_steps_due
from funcaccel.sharding import ShardedBatchSampler
from funcaccel.sharding import ShardedIterableDataset
from funcaccel.sharding import shard_batch_sampler
from funcaccel.sharding import shard_iterable_dataset
from funcaccel.tracking import ConfigValue
from funcaccel.tracking import CSVTracker
from funcaccel.tracking import InMemoryTracker
from funcaccel.tracking import JSONLTracker
from funcaccel.tracking import LogRecord
from funcaccel.tracking import MetricValue
from funcaccel.tracking import MLflowTracker
from funcaccel.tracking import TensorBoardTracker
from funcaccel.tracking import Tracker
from funcaccel.tracking import WandbTracker
from funcaccel.tracking import finish_trackers
from funcaccel.tracking import log_metrics
from funcaccel.tracking import store_config
from funcaccel.tracking import trackers_from_names

__all__ = [
    "AutocastKwargs",
    "Batch",
    "BatchInfo",
    "CSVTracker",
    "CheckpointMeta",
    "ConfigValue",
    "DDPCommunicationHookType",
    "DistributedContext",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FSDPOptions",
    "GradScalerKwargs",
    "GradState",
    "InMemoryTracker",
    "InitProcessGroupKwargs",
    "JSONLTracker",
    "KwargsHandler",
    "LoadedState",
    "LoaderState",
    "LogRecord",
    "MLflowTracker",
    "MetricValue",
    "ProfileKwargs",
    "Reduction",
    "RngType",
    "ShardedBatchSampler",
    "ShardedIterableDataset",
    "ShardedLoader",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "accumulate_step",
    "advance_grad_state",
    "autocast_ctx",
    "autocast_dtype",
    "broadcast",
    "broadcast_object",
    "build_context",
    "build_grad_scaler",
    "build_profiler",
    "clip_grad_norm_",
    "close_context",
    "context_from_env",
    "env_report",
    "finish_trackers",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "iter_batches",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "log_metrics",
    "maybe_step_scheduler",
    "move_optimizer_state_",
    "optimizer_step",
    "pad_across_processes",
    "profiler_trace_path",
    "progress",
    "read_checkpoint_meta",
    "reduce",
    "rescale_grads_",
    "save_checkpoint",
    "scheduler_steps_due",
    "send_to_device",
    "shard_batch_sampler",
    "shard_iterable_dataset",
    "shard_loader",
    "should_skip_grad_sync",
    "should_sync",
    "store_config",
    "sync_ctx",
    "trackers_from_names",
    "unscale_grads_",
    "unwrap_model",
    "window_grad_factor",
    "wrap_model",
]
