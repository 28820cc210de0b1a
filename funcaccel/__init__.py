"""funcaccel: functional, stateless distributed-training building blocks for PyTorch.

Importing funcaccel starts no process group, reads no environment variable and adds
no logging handler. Build a ``DistributedContext`` with ``build_context()`` and pass
it into the functions below. Every public name is imported once below; the ones
imported under ``TYPE_CHECKING`` (checkpoints, tracking, the profiler, the
environment report, plots and the toolkit) load on first access, which keeps
``import funcaccel`` cheap.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING
from typing import Any
from typing import Final

from funcaccel._version import __version__ as __version__
from funcaccel.accumulate import accumulate_step as accumulate_step
from funcaccel.accumulate import sync_ctx as sync_ctx
from funcaccel.collectives import BatchInfo as BatchInfo
from funcaccel.collectives import Reduction as Reduction
from funcaccel.collectives import all_processes as all_processes
from funcaccel.collectives import any_process as any_process
from funcaccel.collectives import broadcast as broadcast
from funcaccel.collectives import broadcast_object as broadcast_object
from funcaccel.collectives import gather as gather
from funcaccel.collectives import gather_for_metrics as gather_for_metrics
from funcaccel.collectives import gather_object as gather_object
from funcaccel.collectives import pad_across_processes as pad_across_processes
from funcaccel.collectives import padded_count as padded_count
from funcaccel.collectives import reduce as reduce
from funcaccel.collectives import split_between_processes as split_between_processes
from funcaccel.collectives import wait_for_everyone as wait_for_everyone
from funcaccel.context import DistributedContext as DistributedContext
from funcaccel.context import DistributedType as DistributedType
from funcaccel.context import build_context as build_context
from funcaccel.context import close_context as close_context
from funcaccel.context import context_from_env as context_from_env
from funcaccel.flops import count_flops as count_flops
from funcaccel.grad_state import GradState as GradState
from funcaccel.grad_state import advance_grad_state as advance_grad_state
from funcaccel.grad_state import should_skip_grad_sync as should_skip_grad_sync
from funcaccel.grad_state import should_sync as should_sync
from funcaccel.grad_state import window_grad_factor as window_grad_factor
from funcaccel.kwargs import AutocastKwargs as AutocastKwargs
from funcaccel.kwargs import DDPCommunicationHookType as DDPCommunicationHookType
from funcaccel.kwargs import (
    DistributedDataParallelKwargs as DistributedDataParallelKwargs,
)
from funcaccel.kwargs import GradScalerKwargs as GradScalerKwargs
from funcaccel.kwargs import InitProcessGroupKwargs as InitProcessGroupKwargs
from funcaccel.kwargs import KwargsHandler as KwargsHandler
from funcaccel.kwargs import ProfileKwargs as ProfileKwargs
from funcaccel.launch import LaunchError as LaunchError
from funcaccel.launch import launch as launch
from funcaccel.loader import Batch as Batch
from funcaccel.loader import LoaderState as LoaderState
from funcaccel.loader import RngType as RngType
from funcaccel.loader import ShardedLoader as ShardedLoader
from funcaccel.loader import iter_batches as iter_batches
from funcaccel.loader import send_to_device as send_to_device
from funcaccel.loader import shard_loader as shard_loader
from funcaccel.mesh import ParallelMesh as ParallelMesh
from funcaccel.mesh import build_mesh as build_mesh
from funcaccel.mixed_precision import autocast_ctx as autocast_ctx
from funcaccel.mixed_precision import autocast_dtype as autocast_dtype
from funcaccel.mixed_precision import build_grad_scaler as build_grad_scaler
from funcaccel.mixed_precision import clip_grad_norm_ as clip_grad_norm_
from funcaccel.mixed_precision import clip_grad_value_ as clip_grad_value_
from funcaccel.mixed_precision import optimizer_step as optimizer_step
from funcaccel.mixed_precision import rescale_grads_ as rescale_grads_
from funcaccel.mixed_precision import unscale_grads_ as unscale_grads_
from funcaccel.model import ActivationCheckpointOptions as ActivationCheckpointOptions
from funcaccel.model import CompileOptions as CompileOptions
from funcaccel.model import CompileReport as CompileReport
from funcaccel.model import DeepSpeedOptions as DeepSpeedOptions
from funcaccel.model import FSDPOptions as FSDPOptions
from funcaccel.model import Pipeline as Pipeline
from funcaccel.model import PipelineOptions as PipelineOptions
from funcaccel.model import (
    apply_activation_checkpointing as apply_activation_checkpointing,
)
from funcaccel.model import compile_blocks as compile_blocks
from funcaccel.model import compile_report as compile_report
from funcaccel.model import materialize_meta as materialize_meta
from funcaccel.model import move_optimizer_state_ as move_optimizer_state_
from funcaccel.model import unwrap_model as unwrap_model
from funcaccel.model import wrap_ddp as wrap_ddp
from funcaccel.model import wrap_deepspeed as wrap_deepspeed
from funcaccel.model import wrap_fsdp as wrap_fsdp
from funcaccel.model import wrap_mesh as wrap_mesh
from funcaccel.model import wrap_model as wrap_model
from funcaccel.packing import PackedDocuments as PackedDocuments
from funcaccel.packing import count_targets as count_targets
from funcaccel.packing import document_attention_mask as document_attention_mask
from funcaccel.packing import pack_documents as pack_documents
from funcaccel.progress import progress as progress
from funcaccel.rng import sync_rng_states as sync_rng_states
from funcaccel.sharding import ShardedBatchSampler as ShardedBatchSampler
from funcaccel.sharding import ShardedIterableDataset as ShardedIterableDataset
from funcaccel.sharding import shard_batch_sampler as shard_batch_sampler
from funcaccel.sharding import shard_iterable_dataset as shard_iterable_dataset
from funcaccel.throughput import Throughput as Throughput
from funcaccel.throughput import measure_throughput as measure_throughput
from funcaccel.throughput import peak_flops as peak_flops

if TYPE_CHECKING:
    from funcaccel.batch_size import (
        find_executable_batch_size as find_executable_batch_size,
    )
    from funcaccel.batch_size import is_out_of_memory as is_out_of_memory
    from funcaccel.checkpoint import CheckpointMeta as CheckpointMeta
    from funcaccel.checkpoint import LoadedState as LoadedState
    from funcaccel.checkpoint import PendingCheckpoint as PendingCheckpoint
    from funcaccel.checkpoint import latest_checkpoint as latest_checkpoint
    from funcaccel.checkpoint import list_checkpoints as list_checkpoints
    from funcaccel.checkpoint import load_checkpoint as load_checkpoint
    from funcaccel.checkpoint import load_model as load_model
    from funcaccel.checkpoint import read_checkpoint_meta as read_checkpoint_meta
    from funcaccel.checkpoint import save_checkpoint as save_checkpoint
    from funcaccel.checkpoint import save_checkpoint_async as save_checkpoint_async
    from funcaccel.checkpoint import save_model as save_model
    from funcaccel.envreport import env_report as env_report
    from funcaccel.join import join_uneven_inputs as join_uneven_inputs
    from funcaccel.local_sgd import LocalSGDCount as LocalSGDCount
    from funcaccel.local_sgd import LocalSGDState as LocalSGDState
    from funcaccel.local_sgd import average_parameters_ as average_parameters_
    from funcaccel.local_sgd import local_sgd_ctx as local_sgd_ctx
    from funcaccel.local_sgd import local_sgd_step as local_sgd_step
    from funcaccel.pipeline import pipeline_eval as pipeline_eval
    from funcaccel.pipeline import pipeline_step as pipeline_step
    from funcaccel.planning import DryRunError as DryRunError
    from funcaccel.planning import DryRunReport as DryRunReport
    from funcaccel.planning import MemoryEstimate as MemoryEstimate
    from funcaccel.planning import RankMemory as RankMemory
    from funcaccel.planning import dry_run as dry_run
    from funcaccel.planning import estimate_memory as estimate_memory
    from funcaccel.plot import plot_metrics as plot_metrics
    from funcaccel.process import get_logger as get_logger
    from funcaccel.process import local_main_process_first as local_main_process_first
    from funcaccel.process import main_process_first as main_process_first
    from funcaccel.process import print_main as print_main
    from funcaccel.profiler import build_profiler as build_profiler
    from funcaccel.profiler import profiler_trace_path as profiler_trace_path
    from funcaccel.scheduler import ScheduleCounts as ScheduleCounts
    from funcaccel.scheduler import maybe_step_scheduler as maybe_step_scheduler
    from funcaccel.scheduler import scheduler_steps_due as scheduler_steps_due
    from funcaccel.seeding import set_seed as set_seed
    from funcaccel.sync import no_sync as no_sync
    from funcaccel.sync import sync_in_backward as sync_in_backward
    from funcaccel.tracking import ConfigValue as ConfigValue
    from funcaccel.tracking import CSVTracker as CSVTracker
    from funcaccel.tracking import InMemoryTracker as InMemoryTracker
    from funcaccel.tracking import JSONLTracker as JSONLTracker
    from funcaccel.tracking import LogRecord as LogRecord
    from funcaccel.tracking import MetricValue as MetricValue
    from funcaccel.tracking import MLflowTracker as MLflowTracker
    from funcaccel.tracking import TensorBoardTracker as TensorBoardTracker
    from funcaccel.tracking import Tracker as Tracker
    from funcaccel.tracking import WandbTracker as WandbTracker
    from funcaccel.tracking import finish_trackers as finish_trackers
    from funcaccel.tracking import log_metrics as log_metrics
    from funcaccel.tracking import store_config as store_config
    from funcaccel.tracking import trackers_from_names as trackers_from_names


# One re-exported name per match: "from funcaccel.x import name as name", also
# in the parenthesised form the formatter gives a long line. Indented matches are
# the ones under TYPE_CHECKING, the only indented imports of this file.
_IMPORT: Final = re.compile(
    r"^( *)from (funcaccel\.[\w.]+) import \(?\s*(\w+) as \3\b", re.MULTILINE
)


def _exported() -> tuple[Mapping[str, str], tuple[str, ...]]:
    """Read this file's imports: the lazy names' modules, and every public name.

    Each public name is written once, as an ``import ... as`` line above (so mypy
    sees it re-exported); the ones under ``TYPE_CHECKING`` load on first access.
    """
    lazy: dict[str, str] = {}
    names: list[str] = []
    for match in _IMPORT.finditer(Path(__file__).read_text(encoding="utf-8")):
        indent, module, name = match.groups()
        if indent:
            lazy[name] = module
        if not name.startswith("_"):
            names.append(name)
    return MappingProxyType(lazy), tuple(sorted(names, key=str.lower))


_LAZY, _PUBLIC = _exported()
__all__ = list(_PUBLIC)


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
