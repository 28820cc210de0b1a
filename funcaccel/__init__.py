"""funcaccel: functional, stateless distributed-training building blocks for PyTorch.

Importing funcaccel starts no process group, reads no environment variable and adds
no logging handler. The checkpoint, tracking, profiler and environment-report names are
imported on first use. Build a ``DistributedContext`` with ``build_context()`` and pass
it into the functions below.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING
from typing import Any
from typing import Final

from funcaccel._version import __version__ as __version__
from funcaccel.accumulate import accumulate_step
from funcaccel.accumulate import sync_ctx
from funcaccel.collectives import BatchInfo
from funcaccel.collectives import Reduction
from funcaccel.collectives import all_processes
from funcaccel.collectives import any_process
from funcaccel.collectives import broadcast
from funcaccel.collectives import broadcast_object
from funcaccel.collectives import gather
from funcaccel.collectives import gather_for_metrics
from funcaccel.collectives import gather_object
from funcaccel.collectives import pad_across_processes
from funcaccel.collectives import padded_count
from funcaccel.collectives import reduce
from funcaccel.collectives import split_between_processes
from funcaccel.collectives import wait_for_everyone
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.context import build_context
from funcaccel.context import close_context
from funcaccel.context import context_from_env
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
from funcaccel.launch import LaunchError
from funcaccel.launch import launch
from funcaccel.loader import Batch
from funcaccel.loader import LoaderState
from funcaccel.loader import RngType
from funcaccel.loader import ShardedLoader
from funcaccel.loader import iter_batches
from funcaccel.loader import send_to_device
from funcaccel.loader import shard_loader
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import build_mesh
from funcaccel.mixed_precision import autocast_ctx
from funcaccel.mixed_precision import autocast_dtype
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.mixed_precision import clip_grad_norm_
from funcaccel.mixed_precision import clip_grad_value_
from funcaccel.mixed_precision import optimizer_step
from funcaccel.mixed_precision import rescale_grads_
from funcaccel.mixed_precision import unscale_grads_
from funcaccel.model import DeepSpeedOptions
from funcaccel.model import FSDPOptions
from funcaccel.model import move_optimizer_state_
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.progress import progress
from funcaccel.rng import sync_rng_states
from funcaccel.sharding import ShardedBatchSampler
from funcaccel.sharding import ShardedIterableDataset
from funcaccel.sharding import shard_batch_sampler
from funcaccel.sharding import shard_iterable_dataset

if TYPE_CHECKING:
    from funcaccel.batch_size import find_executable_batch_size
    from funcaccel.batch_size import is_out_of_memory
    from funcaccel.checkpoint import CheckpointMeta
    from funcaccel.checkpoint import LoadedState
    from funcaccel.checkpoint import PendingCheckpoint
    from funcaccel.checkpoint import latest_checkpoint
    from funcaccel.checkpoint import list_checkpoints
    from funcaccel.checkpoint import load_checkpoint
    from funcaccel.checkpoint import load_model
    from funcaccel.checkpoint import read_checkpoint_meta
    from funcaccel.checkpoint import save_checkpoint
    from funcaccel.checkpoint import save_model
    from funcaccel.envreport import env_report
    from funcaccel.join import join_uneven_inputs
    from funcaccel.local_sgd import LocalSGDState
    from funcaccel.local_sgd import average_parameters_
    from funcaccel.local_sgd import local_sgd_step
    from funcaccel.plot import plot_metrics
    from funcaccel.process import get_logger
    from funcaccel.process import local_main_process_first
    from funcaccel.process import main_process_first
    from funcaccel.process import print_main
    from funcaccel.profiler import build_profiler
    from funcaccel.profiler import profiler_trace_path
    from funcaccel.scheduler import maybe_step_scheduler
    from funcaccel.scheduler import scheduler_steps_due
    from funcaccel.seeding import set_seed
    from funcaccel.sync import no_sync
    from funcaccel.sync import sync_in_backward
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

_LAZY: Final = MappingProxyType(
    {
        "find_executable_batch_size": "funcaccel.batch_size",
        "is_out_of_memory": "funcaccel.batch_size",
        "join_uneven_inputs": "funcaccel.join",
        "LocalSGDState": "funcaccel.local_sgd",
        "average_parameters_": "funcaccel.local_sgd",
        "local_sgd_step": "funcaccel.local_sgd",
        "get_logger": "funcaccel.process",
        "local_main_process_first": "funcaccel.process",
        "main_process_first": "funcaccel.process",
        "print_main": "funcaccel.process",
        "maybe_step_scheduler": "funcaccel.scheduler",
        "scheduler_steps_due": "funcaccel.scheduler",
        "set_seed": "funcaccel.seeding",
        "no_sync": "funcaccel.sync",
        "sync_in_backward": "funcaccel.sync",
        "CheckpointMeta": "funcaccel.checkpoint",
        "LoadedState": "funcaccel.checkpoint",
        "latest_checkpoint": "funcaccel.checkpoint",
        "list_checkpoints": "funcaccel.checkpoint",
        "load_checkpoint": "funcaccel.checkpoint",
        "load_model": "funcaccel.checkpoint",
        "PendingCheckpoint": "funcaccel.checkpoint",
        "read_checkpoint_meta": "funcaccel.checkpoint",
        "save_checkpoint": "funcaccel.checkpoint",
        "save_model": "funcaccel.checkpoint",
        "env_report": "funcaccel.envreport",
        "plot_metrics": "funcaccel.plot",
        "build_profiler": "funcaccel.profiler",
        "profiler_trace_path": "funcaccel.profiler",
        "ConfigValue": "funcaccel.tracking",
        "CSVTracker": "funcaccel.tracking",
        "InMemoryTracker": "funcaccel.tracking",
        "JSONLTracker": "funcaccel.tracking",
        "LogRecord": "funcaccel.tracking",
        "MetricValue": "funcaccel.tracking",
        "MLflowTracker": "funcaccel.tracking",
        "TensorBoardTracker": "funcaccel.tracking",
        "WandbTracker": "funcaccel.tracking",
        "trackers_from_names": "funcaccel.tracking",
        "Tracker": "funcaccel.tracking",
        "finish_trackers": "funcaccel.tracking",
        "log_metrics": "funcaccel.tracking",
        "store_config": "funcaccel.tracking",
    }
)

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
    "DeepSpeedOptions",
    "FSDPOptions",
    "GradScalerKwargs",
    "GradState",
    "InMemoryTracker",
    "InitProcessGroupKwargs",
    "JSONLTracker",
    "KwargsHandler",
    "LaunchError",
    "LoadedState",
    "LoaderState",
    "LocalSGDState",
    "LogRecord",
    "MLflowTracker",
    "MetricValue",
    "ParallelMesh",
    "PendingCheckpoint",
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
    "all_processes",
    "any_process",
    "autocast_ctx",
    "autocast_dtype",
    "average_parameters_",
    "broadcast",
    "broadcast_object",
    "build_context",
    "build_grad_scaler",
    "build_mesh",
    "build_profiler",
    "clip_grad_norm_",
    "clip_grad_value_",
    "close_context",
    "context_from_env",
    "env_report",
    "find_executable_batch_size",
    "finish_trackers",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "get_logger",
    "is_out_of_memory",
    "iter_batches",
    "join_uneven_inputs",
    "latest_checkpoint",
    "launch",
    "list_checkpoints",
    "load_checkpoint",
    "load_model",
    "local_main_process_first",
    "local_sgd_step",
    "log_metrics",
    "main_process_first",
    "maybe_step_scheduler",
    "move_optimizer_state_",
    "no_sync",
    "optimizer_step",
    "pad_across_processes",
    "padded_count",
    "plot_metrics",
    "print_main",
    "profiler_trace_path",
    "progress",
    "read_checkpoint_meta",
    "reduce",
    "rescale_grads_",
    "save_checkpoint",
    "save_model",
    "scheduler_steps_due",
    "send_to_device",
    "set_seed",
    "shard_batch_sampler",
    "shard_iterable_dataset",
    "shard_loader",
    "should_skip_grad_sync",
    "should_sync",
    "split_between_processes",
    "store_config",
    "sync_ctx",
    "sync_rng_states",
    "sync_in_backward",
    "trackers_from_names",
    "unscale_grads_",
    "unwrap_model",
    "wait_for_everyone",
    "window_grad_factor",
    "wrap_model",
]


def __getattr__(name: str) -> Any:
    # Names whose modules most scripts need only later (at the first save, log or
    # profile) are imported on first access, which keeps ``import funcaccel`` cheap.
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'funcaccel' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
