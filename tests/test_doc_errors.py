"""The error messages the docs quote are the ones the code raises.

A page's ``## Errors`` table quotes each message in its first cell, as
```` `ValueError: function: message` ````, with ``...`` standing for text left out.
For the pages in ``CHECKED_PAGES`` every quoted message has a trigger here that
raises it; the test compares type and text, so a message changed in the code (or
mistyped in the docs) fails until both agree again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from typing import Final
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.utils.data import BatchSampler
from torch.utils.data import DataLoader

import funcaccel as fa
from funcaccel import _guard
from funcaccel import accumulate as _accumulate
from funcaccel._optimizers_hold import check_optimizers_hold
from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import _agree
from funcaccel.checkpoint import _save_load
from funcaccel.collectives import _exchange
from funcaccel.collectives import _ops
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.context import _env
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.kwargs import _profile
from funcaccel.loader import _dispatch
from funcaccel.model import FSDPOptions
from funcaccel.model import wrap_model
from funcaccel.scheduler import maybe_step_scheduler

DOCS: Final = Path(__file__).resolve().parent.parent / "docs"
CHECKED_PAGES: Final = (
    "accumulate.md",
    "model.md",
    "checkpoint.md",
    "collectives.md",
    "context.md",
    "kwargs.md",
    "loader.md",
    "profiler.md",
    "sharding.md",
    "tracking.md",
)
# A quoted message in any cell of a table row (kwargs.md quotes in the second).
_CELL: Final = re.compile(r"\| `(\w+Error: [^`]+)`")

ONE: Final = DistributedContext()


def _bad(value: object) -> Any:
    """``value``, typed so that a trigger can pass what the signature refuses."""
    return value


def _world(n: int, backend: str | None = None) -> DistributedContext:
    return DistributedContext(
        num_processes=n,
        process_index=0,
        distributed_type=DistributedType.MULTI_CPU,
        backend=backend,
    )


def _step(ctx: DistributedContext = ONE, **kwargs: object) -> object:
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = kwargs.pop("loss", lambda: model(torch.ones(1, 1)).sum())
    grad = kwargs.pop("grad", GradState())
    return accumulate_step(ctx, grad, model, optimizer, loss, **kwargs)  # type: ignore[arg-type]


def _plain_model_on_two_ranks(_: Path) -> object:
    # Rank 0 of two, past the process-group check (no group here).
    model = nn.Sequential(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with mock.patch.object(_accumulate, "require_process_group"):
        return accumulate_step(
            _world(2),
            GradState(),
            model,
            optimizer,
            lambda: model(torch.ones(1, 1)).sum(),
            num_items=2,
        )


def _schedule(
    ctx: DistributedContext, plateau: bool = False, **kwargs: object
) -> object:
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler: object = (
        torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        if plateau
        else torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    )
    return maybe_step_scheduler(ctx, scheduler, GradState(), **kwargs)  # type: ignore[arg-type]


def _stale_fsdp_optimizer(tmp_path: Path) -> None:
    # accumulate_step runs this check with several processes; one gloo process
    # is enough to build a real FSDP2 module here.
    from torch.distributed.fsdp import fully_shard

    init = f"file://{tmp_path}/rendezvous"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        net = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        fully_shard(net)
        check_optimizers_hold("accumulate_step", [net], [optimizer])
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    init = f"file://{tmp_path}/rendezvous"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _saved(tmp_path: Path, **kwargs: Any) -> Path:
    """A one-process checkpoint of ``nn.Linear(2, 2)`` under ``tmp_path / 'ckpt'``."""
    saved = fa.save_checkpoint(ONE, tmp_path / "ckpt", models=nn.Linear(2, 2), **kwargs)
    assert isinstance(saved, Path)
    return saved


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)


def _truncated(tmp_path: Path) -> object:
    path = _saved(tmp_path)
    model_file = path / "model_0.pt"
    model_file.write_bytes(model_file.read_bytes() + b"x")
    return fa.load_checkpoint(ONE, path, models=nn.Linear(2, 2))


def _edit_manifest(path: Path, **fields: Any) -> None:
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    for key, value in fields.items():
        if isinstance(value, dict):
            manifest[key].update(value)
        else:
            manifest[key] = value
    (path / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def _part_on_other_world(tmp_path: Path) -> object:
    path = _saved(tmp_path, rank_extra={"n": 1})
    _edit_manifest(path, world_size=2)  # as if 2 ranks had saved it
    return fa.load_checkpoint(ONE, path, models=nn.Linear(2, 2))


def _open_window_other_k(tmp_path: Path) -> object:
    path = _saved(tmp_path, grad=GradState(accumulation_steps=2))
    _edit_manifest(path, grad={"micro_step": 1, "sync_gradients": False})
    return fa.load_checkpoint(ONE, path, models=nn.Linear(2, 2), accumulation_steps=4)


def _unsharded_into_fsdp(tmp_path: Path) -> object:
    from torch.distributed.fsdp import fully_shard

    path = _saved(tmp_path)
    with _gloo_world_of_one(tmp_path):
        net = nn.Linear(2, 2)
        fully_shard(net)
        return fa.load_checkpoint(ONE, path, models=net)


def _different_collectives(tmp_path: Path) -> None:
    # Two ranks' guard calls, simulated in one store: rank 1 is in reduce's call
    # number 1 (it named itself there); rank 0 reaches gather and lists them.
    store = HashStore()
    store.set("who/1/1", "reduce")
    report = _guard.write_hang_report(tmp_path, 0, "gather", 1)
    _guard._raise_mismatch(
        store, 0, 2, "gather", 1, timedelta(seconds=60), report=report
    )


def _missing_rank(tmp_path: Path) -> None:
    # Rank 0 gave up on gather (call 2) while rank 1's last guarded call was
    # gather_for_metrics (call 1), as the store records it.
    store = HashStore()
    store.add("count/1", 1)
    store.set("name/1", "gather_for_metrics")
    last = _guard.last_known_calls(store, [1], 2)
    report = _guard.write_hang_report(tmp_path, 0, "gather", 2)
    decision = {"rank": 0, "missing": [1]}
    _guard._raise_missing(
        0, "gather", timedelta(seconds=60), decision, last_calls=last, report=report
    )


def _two_ranks_gather(other: Any, data: Any, caller: str = "gather") -> object:
    # Rank 0's call with rank 1's leaf specs given: what the all-gather of specs
    # returns with two ranks, without a process group.
    def gathered(_ctx: object, mine: object) -> list[object]:
        return [mine, other]

    with (
        mock.patch.object(_ops, "require_process_group"),
        mock.patch.object(_ops, "guard_collective"),
        mock.patch.object(_exchange, "all_gather_objects", gathered),
    ):
        return getattr(fa, caller)(_world(2), data)


def _loader(n: int = 8, batch_size: int = 2, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(_bad(list(range(n))), batch_size=batch_size, **kwargs)


def _first(loader: object, state: object = None) -> object:
    args = () if state is None else (state,)
    return next(iter(fa.iter_batches(loader, *args)))  # type: ignore[arg-type]


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def _undispatchable(_: Path) -> object:
    # Rank 0's read of global batch 3 with two processes, and the error it sends.
    batches = [{"input_ids": torch.zeros(4, 16)}, {"input_ids": torch.zeros(4, 12)}]
    try:
        return _dispatch._build(batches, 3)
    except _dispatch._Rejected as rejected:
        raise _dispatch._fail(ONE, _dispatch._Failure(rejected, 3)) from None


def _nothing_recorded(tmp_path: Path) -> None:
    kwargs = fa.ProfileKwargs(
        schedule_option={"wait": 5, "warmup": 1, "active": 1},
        output_trace_dir=tmp_path,
    )
    with fa.build_profiler(ONE, kwargs) as prof:
        assert prof is not None
        prof.step()


def _uncreatable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("", encoding="utf-8")
    kwargs = fa.ProfileKwargs(output_trace_dir=tmp_path / "file" / "dir")
    with fa.build_profiler(ONE, kwargs):
        pass


class _Sampler:
    batch_size = 2
    drop_last = "no"

    def __iter__(self) -> Iterator[list[int]]:
        return iter([[0, 1]])


_TWO_RANKS: Final = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}


def _load_counts(tmp_path: Path) -> object:
    with contextlib.chdir(tmp_path):
        path = fa.save_checkpoint(ONE, "ckpt", optimizers=_sgd())
        assert isinstance(path, Path)
        return fa.load_checkpoint(ONE, path)


def _no_manifest(tmp_path: Path) -> object:
    with contextlib.chdir(tmp_path):
        Path("ckpt").mkdir()
        return fa.load_checkpoint(ONE, "ckpt")


def _stale_latest(tmp_path: Path) -> object:
    with contextlib.chdir(tmp_path):
        fa.save_checkpoint(ONE, "ckpt", models=nn.Linear(2, 2))
        Path("ckpt/latest").write_text("checkpoint-000003", encoding="utf-8")
        return fa.latest_checkpoint("ckpt")


def _old_gpu(_: Path) -> None:
    # A GPU without bfloat16, as torch.cuda reports it; no GPU is needed.
    with (
        mock.patch.object(torch.cuda, "is_bf16_supported", return_value=False),
        mock.patch.object(torch.cuda, "get_device_name", return_value="Tesla K80"),
    ):
        _env.check_mixed_precision("bf16", torch.device("cuda", 0))


def _no_cpu_fp16(_: Path) -> object:
    # A torch without CPU float16 autocast, as the probe reports it.
    with mock.patch.object(_env, "_cpu_fp16_problem", return_value="no autocast"):
        return fa.context_from_env({}, mixed_precision="fp16", cpu=True)


def _gpus(
    count: int, device: str, *, cpu: bool = False, local_world: int = 1
) -> object:
    # A machine with ``count`` visible GPUs, as torch.cuda reports it; none needed.
    environ = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    environ["LOCAL_WORLD_SIZE"] = str(local_world)
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=count > 0),
        mock.patch.object(torch.cuda, "device_count", return_value=count),
    ):
        return fa.build_context(
            environ=environ if local_world > 1 else {}, device=device, cpu=cpu
        )


def _mismatched_group(tmp_path: Path) -> object:
    with _gloo_world_of_one(tmp_path):
        return fa.build_context(cpu=True, environ=_TWO_RANKS)


def _cpu_only(activity: str) -> object:
    # This machine as one that can profile only the CPU.
    cpu = {torch.profiler.ProfilerActivity.CPU}
    with mock.patch.object(_profile, "supported_activities", return_value=cpu):
        return fa.ProfileKwargs(activities=[activity]).build()


def _csv_new_column(tmp_path: Path) -> None:
    tracker = fa.CSVTracker(tmp_path / "m.csv")
    try:
        tracker.log({"loss": 1.0}, step=0)
        tracker.log({"acc": 1.0}, step=1)
    finally:
        tracker.finish()


def _reserved_key(tmp_path: Path) -> None:
    tracker = fa.JSONLTracker(tmp_path / "m.jsonl")
    try:
        tracker.log({"step": 1.0})
    finally:
        tracker.finish()


def _finished(tmp_path: Path) -> None:
    tracker = fa.JSONLTracker(tmp_path / "m.jsonl")
    tracker.finish()
    tracker.log({"loss": 1.0})


def _refused_file_store(tmp_path: Path) -> None:
    variables = pytest.importorskip("mlflow.environment_variables")
    if not hasattr(variables, "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow opens a file store without an opt-out")
    with mock.patch.dict(os.environ):
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        fa.MLflowTracker((tmp_path / "mlruns").as_uri()).log({"loss": 1.0})


Trigger = Callable[[Path], object]
TRIGGERS: Final[dict[str, Trigger]] = {
    # accumulate.md
    "ValueError: accumulate_step: scaler must be a torch.amp.GradScaler when "
    "ctx.mixed_precision is 'fp16'; got None. Pass "
    "scaler=build_grad_scaler(ctx).": lambda _: _step(
        DistributedContext(mixed_precision="fp16")
    ),
    "ValueError: accumulate_step: loss_fn()'s result must be a scalar loss; got "
    "tensor(shape=(2, 1), dtype=torch.float32). Reduce it first, e.g. with "
    ".mean().": lambda _: _step(loss=lambda: nn.Linear(1, 1)(torch.ones(2, 1))),
    "TypeError: accumulate_step: loss_fn()'s result must be the loss of one "
    "micro-batch as a torch.Tensor; got 1.0 (float).": lambda _: _step(
        loss=lambda: 1.0
    ),
    "ValueError: accumulate_step: loss_fn()'s result must be a loss that requires "
    "grad; ...": lambda _: _step(loss=lambda: torch.ones(())),
    "TypeError: accumulate_step: end_of_dataloader must be a bool; got 1 (int). "
    "Pass batch.is_last.": lambda _: _step(end_of_dataloader=1),
    "ValueError: accumulate_step: max_grad_norm must be > 0; got 0. "
    "Use e.g. 1.0.": lambda _: _step(max_grad_norm=0),
    "ValueError: GradState: accumulation_steps must be >= 1; got 0.": lambda _: (
        GradState(accumulation_steps=0)
    ),
    "ValueError: GradState: sync_gradients (True) must be true exactly when "
    "micro_step == 0; got micro_step=1. Pass sync_gradients=False.": lambda _: (
        GradState(accumulation_steps=2, micro_step=1)
    ),
    "ValueError: maybe_step_scheduler: ReduceLROnPlateau steps on a metric but "
    "metrics=None; ...": lambda _: _schedule(ONE, plateau=True),
    "ValueError: maybe_step_scheduler: metrics=1.0 is only used by "
    "ReduceLROnPlateau, not StepLR; drop metrics.": lambda _: _schedule(
        ONE, metrics=1.0
    ),
    "ValueError: maybe_step_scheduler: neither loader= nor schedule_counts= says "
    "how the schedule's length is counted, ...": lambda _: _schedule(_world(2)),
    "ValueError: maybe_step_scheduler: split_batches must be left out: "
    "schedule_counts= replaced it; got False. ...": lambda _: _schedule(
        ONE, split_batches=False
    ),
    "RuntimeError: accumulate_step: ctx has num_processes=2 but no default "
    "process group is initialised; ...": lambda _: _step(_world(2)),
    "TypeError: accumulate_step: num_items must be an int or a 0-dim integer tensor "
    "...; got 2.0 (float).": lambda _: _step(num_items=2.0),
    "ValueError: accumulate_step: num_items must be an int or a 0-dim integer "
    "tensor; got tensor(shape=(2,), dtype=torch.int64). ...": lambda _: _step(
        num_items=torch.tensor([1, 2])
    ),
    "ValueError: accumulate_step: num_items was given, but the open accumulation "
    "window (micro_step=1) was started with mean losses, ...": lambda _: _step(
        grad=GradState(accumulation_steps=2, micro_step=1, sync_gradients=False),
        num_items=2,
    ),
    "ValueError: accumulate_step: num_items=None, but the open accumulation window "
    "is token-weighted (window_items=4 after 1 micro-steps); ...": lambda _: _step(
        grad=GradState(
            accumulation_steps=2, micro_step=1, sync_gradients=False, window_items=4
        )
    ),
    "ValueError: accumulate_step: num_items= with 2 processes needs every trained "
    "model's gradients averaged over the ranks, but model 0 is a plain Sequential; "
    "...": _plain_model_on_two_ranks,
    # model.md
    "ValueError: wrap_model: ddp_kwargs.comm_hook must be 'fp16' or 'no' on cpu "
    "(backend 'gloo'), which cannot all-reduce bfloat16; got 'bf16'. 'bf16' needs a "
    "CUDA (NCCL) or XPU (XCCL) device.": lambda _: wrap_model(
        _world(2, "gloo"),
        nn.Linear(1, 1),
        DistributedDataParallelKwargs(comm_hook="bf16"),
    ),
    "ValueError: wrap_model: model is already wrapped (DataParallel); pass "
    "unwrap_model(model), or use the wrapped model as it is.": lambda _: wrap_model(
        ONE, nn.DataParallel(nn.Linear(1, 1))
    ),
    "ValueError: wrap_model: ddp_kwargs only configure DDP, but fsdp was given; "
    "...": lambda _: wrap_model(
        ONE, nn.Linear(1, 1), DistributedDataParallelKwargs(), fsdp=FSDPOptions()
    ),
    "ValueError: accumulate_step: optimizer holds none of the model's parameters: "
    "...": _stale_fsdp_optimizer,
    "ValueError: wrap_model: FSDPOptions.reshard_after_forward must be a divisor of "
    "the world size (4); got 3. ...": lambda _: wrap_model(
        _world(4), nn.Linear(1, 1), fsdp=FSDPOptions(reshard_after_forward=3)
    ),
    "TypeError: FSDPOptions: every item of shard_modules must be an nn.Module "
    "subclass; got Linear(...) (Linear). Pass the class (e.g. nn.Linear), not an "
    "instance.": lambda _: FSDPOptions(shard_modules=[nn.Linear(1, 1)]),  # type: ignore[list-item]
    "TypeError: wrap_model: model must be a torch.nn.Module; got <generator "
    "object Module.parameters at ...> (generator). ...": lambda _: wrap_model(
        ONE,
        nn.Linear(1, 1).parameters(),  # type: ignore[arg-type]
    ),
    "RuntimeError: wrap_model: ctx has num_processes=2 but no default process "
    "group is initialised; ...": lambda _: wrap_model(_world(2), nn.Linear(1, 1)),
    # checkpoint.md
    "ValueError: save_checkpoint: grad has an open accumulation window (micro_step=1 "
    "of accumulation_steps=2); ... Save right after an optimizer step, when "
    "grad.sync_gradients is True.": lambda t: _saved(
        t, grad=GradState(accumulation_steps=2, micro_step=1, sync_gradients=False)
    ),
    "TypeError: save_checkpoint: extra['x'] must be JSON (str, int, finite float, "
    "bool, None, list, dict with str keys); got nan (float). ...": lambda t: _saved(
        t, extra={"x": float("nan")}
    ),
    "ValueError: save_checkpoint: objects keys name files and must be letters, "
    "digits and '_'; got 'a-b'.": lambda t: _saved(t, objects={"a-b": GradState()}),
    "ValueError: load_checkpoint: ckpt/checkpoint-000001 holds optimizers=1, but "
    "optimizers=0 was passed; pass the same optimizers as when it was saved, in "
    "that order.": _load_counts,
    "ValueError: load_checkpoint: ckpt/manifest.json is missing, so ckpt is not a "
    "complete checkpoint ...": _no_manifest,
    "ValueError: load_checkpoint: .../model_0.pt does not fit models[0] "
    "(shape mismatch: ...); pass the same models as when the checkpoint was "
    "saved.": lambda t: fa.load_checkpoint(ONE, _saved(t), models=nn.Linear(3, 3)),
    "ValueError: load_checkpoint: .../model_0.pt has 1894 bytes but the manifest "
    "records 1893 (truncated?); the checkpoint is damaged (or crafted), load an "
    "earlier one (see list_checkpoints).": _truncated,
    "ValueError: load_checkpoint: ... holds whole (unsharded) state dicts, but "
    "models[0] is sharded by FSDP2; ...": _unsharded_into_fsdp,
    "ValueError: load_checkpoint: the checkpoint holds a per-rank part "
    "(rank_objects, rank_extra) from each rank of world size 2, but this load runs "
    "on world size 1, ...": _part_on_other_world,
    "ValueError: load_checkpoint: ... holds rank_objects=['data'], but "
    "rank_objects=[] was passed; pass the same rank_objects as when it was "
    "saved.": lambda t: fa.load_checkpoint(
        ONE, _saved(t, rank_objects={"data": _sgd()}), models=nn.Linear(2, 2)
    ),
    "ValueError: load_checkpoint: ... holds a GradState inside an accumulation "
    "window (micro_step=1 of accumulation_steps=2), so accumulation_steps=4 cannot "
    "take over: ...": _open_window_other_k,
    "ValueError: latest_checkpoint: ckpt/latest names 'checkpoint-000003', which is "
    "not a complete checkpoint in ckpt; ...": _stale_latest,
    "RuntimeError: save_checkpoint: the checkpoint was not written (the previous one "
    "is still the latest); rank 1: "
    "...": lambda _: _agree._raise_failures(
        [None, "OSError: disk full"], _save_load._FAILED, "save_checkpoint"
    ),
    # collectives.md
    "TypeError: gather: data['x'] must be a tensor (in a list / tuple / dict); got 3 "
    "(int). ...": lambda _: fa.gather(ONE, {"x": 3}),
    "ValueError: gather: data must have the same dtype and every dim but 0 on every "
    "rank; got rank 0: (4, 16) torch.float32, rank 1: (4, 12) torch.float32. "
    "...": lambda _: _two_ranks_gather(
        (["data"], [((4, 12), "torch.float32")]), torch.zeros(4, 16)
    ),
    "ValueError: gather: data has a different structure on different ranks "
    "(...); pass the same nesting, keys and key order on every rank.": lambda _: (
        _two_ranks_gather(
            (["data['y']"], [((4,), "torch.float32")]), {"x": torch.zeros(4)}
        )
    ),
    "ValueError: reduce: reduction must be one of 'sum', 'mean', 'max', 'none'; "
    "got 'min'. 'none' is the sum.": lambda _: fa.reduce(
        ONE,
        torch.ones(1),
        reduction="min",  # type: ignore[arg-type]
    ),
    "TypeError: reduce: reduction='mean' is undefined for data of dtype "
    "torch.int64; ...": lambda _: fa.reduce(
        ONE, torch.ones(1, dtype=torch.int64), reduction="mean"
    ),
    "ValueError: broadcast: from_process (1) must be in [0, num_processes=1); "
    "...": lambda _: fa.broadcast(ONE, torch.ones(1), from_process=1),
    "ValueError: pad_across_processes: dim must be >= 0; got -1. ...": lambda _: (
        fa.pad_across_processes(ONE, torch.ones(1), dim=-1)
    ),
    "ValueError: pad_across_processes: dim (5) is not a dimension of any leaf; got "
    "leaf shapes (2, 3); pass a dim below 2 (the most dims any leaf has).": lambda _: (
        fa.pad_across_processes(ONE, torch.ones(2, 3), dim=5)
    ),
    "TypeError: gather_object: obj must be a list or tuple on every rank; got rank "
    "0: str; wrap a single object as [obj].": lambda _: fa.gather_object(ONE, "a"),  # type: ignore[arg-type]
    "TypeError: gather_for_metrics: data must be a list or tuple on every rank; "
    "...": lambda _: fa.gather_for_metrics(ONE, {"x": "a"}),
    "TypeError: gather_for_metrics: batch= is missing; with num_processes=2 an "
    "evened-out loader repeats samples from the epoch's start in its last batch, "
    "...": lambda _: _two_ranks_gather(None, torch.ones(1), "gather_for_metrics"),
    "TypeError: gather_for_metrics: batch must have is_last: bool and remainder: "
    "int (a record from iter_batches); ...": lambda _: fa.gather_for_metrics(
        ONE,
        torch.ones(1),
        batch=_bad(torch.ones(1)),
    ),
    "RuntimeError: gather: ctx has num_processes=2 but no default process group is "
    "initialised; ...": lambda _: fa.gather(_world(2), torch.ones(1)),
    "RuntimeError: gather: a collective call; rank 1 did not reach it within 60 s: "
    "call gather on every rank (not under ...": _missing_rank,
    "RuntimeError: gather: a collective call; rank 1 did not reach it within 60 s: "
    "... Last known funcaccel calls: rank 1: gather_for_metrics (call 1). This "
    "rank's call and every thread's stack are in .../rank0.txt (each rank whose "
    "check fails writes rank<r>.txt in ...": _missing_rank,
    "RuntimeError: gather: a collective call, but the ranks reached different "
    "collectives (rank 0: gather, rank 1: reduce); ...": _different_collectives,
    # context.md
    "ValueError: DistributedContext: process_index (4) must be in [0, "
    "num_processes=4).": lambda _: DistributedContext(
        num_processes=4, process_index=4, distributed_type=DistributedType.MULTI_CPU
    ),
    "ValueError: DistributedContext: distributed_type must be MULTI_CPU with "
    "num_processes=4 on device cpu; got 'NO'. Pass "
    "distributed_type=DistributedType.MULTI_CPU.": lambda _: DistributedContext(
        num_processes=4
    ),
    "ValueError: context_from_env: RANK is not set but WORLD_SIZE='2'; launch with "
    "torchrun, ...": lambda _: fa.context_from_env({"WORLD_SIZE": "2"}),
    "ValueError: context_from_env: RANK must be an integer; got 'x'.": lambda _: (
        fa.context_from_env({"WORLD_SIZE": "2", "RANK": "x", "LOCAL_RANK": "0"})
    ),
    "ValueError: context_from_env: mixed_precision must be one of 'no', 'fp16', "
    "'bf16'; got 'fp8'. fp8 is not supported.": lambda _: fa.context_from_env(
        {},
        mixed_precision="fp8",  # type: ignore[arg-type]
    ),
    "ValueError: context_from_env: mixed_precision must be a mode cuda:0 runs with "
    "torch ...; got 'bf16'. Tesla K80 has no bfloat16; use mixed_precision='fp16' "
    "or 'no'.": _old_gpu,
    "ValueError: context_from_env: mixed_precision must be a mode cpu runs with "
    "torch ...; got 'fp16'. CPU float16 autocast fails here (...); ...": _no_cpu_fp16,
    "ValueError: build_context: the default rendezvous's MASTER_ADDR and "
    "MASTER_PORT must be set in the environment; got None. Launch with torchrun or "
    "pass InitProcessGroupKwargs(init_method=...).": lambda _: fa.build_context(
        cpu=True, environ=_TWO_RANKS
    ),
    "ValueError: build_context: device must be a device this machine has: 'cpu' "
    "(torch.cuda.is_available() is False); got 'cuda:1'. Pass device='cpu', or run "
    "where a CUDA GPU is visible.": lambda _: _gpus(0, "cuda:1"),
    "ValueError: build_context: device must be one of the 2 visible GPU(s), cuda:0 "
    "to cuda:1; got 'cuda:2'. CUDA_VISIBLE_DEVICES renumbers the GPUs a process "
    "sees from 0.": lambda _: _gpus(2, "cuda:2"),
    "ValueError: build_context: device must be a CPU device when cpu=True; got "
    "'cuda:1'. Pass cpu=True without a device, or device='cuda:1' without "
    "cpu=True.": lambda _: _gpus(2, "cuda:1", cpu=True),
    "ValueError: build_context: device (by local rank) must be a different GPU for "
    "each of the 2 processes on this machine with the NCCL backend; got ['cuda:1', "
    "'cuda:1']. Pass a rule by local rank, ...": lambda _: _gpus(
        2, "cuda:1", local_world=2
    ),
    "RuntimeError: build_context: the default process group has world_size=..., "
    "rank=... but ctx has ...": _mismatched_group,
    # kwargs.md
    "ValueError: DistributedDataParallelKwargs: comm_hook must be one of 'no', "
    "'fp16', 'bf16', 'power_sgd', 'batched_power_sgd'; got 'fp32'.": lambda _: (
        DistributedDataParallelKwargs(comm_hook="fp32")
    ),
    "ValueError: ...: comm_hook must be 'power_sgd' or 'batched_power_sgd' when "
    "comm_wrapper='fp16'; got 'no'. ...": lambda _: DistributedDataParallelKwargs(
        comm_wrapper="fp16"
    ),
    "ValueError: ...: comm_state_option must be empty with comm_hook='fp16'; got "
    "{'matrix_approximation_rank': 2}. Only the PowerSGD hooks read it.": lambda _: (
        DistributedDataParallelKwargs(
            comm_hook="fp16", comm_state_option={"matrix_approximation_rank": 2}
        )
    ),
    "ValueError: ...: every key of comm_state_option must be one of "
    "'matrix_approximation_rank', ...; got 'rank'.": lambda _: (
        DistributedDataParallelKwargs(
            comm_hook="power_sgd", comm_state_option={"rank": 2}
        )
    ),
    "ValueError: ...: start_powerSGD_iter must be > 1 when use_error_feedback or "
    "warm_start is true; got 1. Set both to False, or start later.": lambda _: (
        DistributedDataParallelKwargs(
            comm_hook="power_sgd", comm_state_option={"start_powerSGD_iter": 1}
        )
    ),
    "ValueError: GradScalerKwargs: growth_factor must be > 1.0; got 1.0. Use e.g. "
    "2.0.": lambda _: fa.GradScalerKwargs(growth_factor=1.0),
    "TypeError: AutocastKwargs: enabled must be a bool; got 'yes' (str).": lambda _: (
        fa.AutocastKwargs(enabled="yes")  # type: ignore[arg-type]
    ),
    "TypeError: ...: timeout must be a datetime.timedelta or None; got 30 (int). "
    "Use e.g. timedelta(seconds=600).": lambda _: fa.InitProcessGroupKwargs(
        timeout=30  # type: ignore[arg-type]
    ),
    "ValueError: ...: timeout must be positive; ...": lambda _: (
        fa.InitProcessGroupKwargs(timeout=timedelta(0))
    ),
    "ValueError: ProfileKwargs: every activity must be one of 'cpu', 'cuda', "
    "'xpu', 'hpu', 'mtia'; got 'gpu'.": lambda _: fa.ProfileKwargs(activities=["gpu"]),
    "ValueError: ProfileKwargs: activity 'xpu' cannot be profiled by this torch "
    "build on this machine; supported here: 'cpu'.": lambda _: _cpu_only("xpu"),
    "ValueError: ProfileKwargs: schedule_option must be a mapping with 'wait', "
    "'warmup' and 'active'; got {'wait': 1, 'warmup': 1}. Add ['active'].": lambda _: (
        fa.ProfileKwargs(schedule_option={"wait": 1, "warmup": 1})
    ),
    # loader.md
    "ValueError: shard_loader: batch_size (3) must be a multiple of num_processes "
    "(2) when split_batches=True; ...": lambda _: fa.shard_loader(
        _world(2), _loader(batch_size=3), split_batches=True
    ),
    "ValueError: shard_loader: put_on_device must be True when dispatch_batches=True "
    "(rank 0 sends each rank its rows); got False. ...": lambda _: fa.shard_loader(
        ONE, _loader(), dispatch_batches=True, put_on_device=False
    ),
    "ValueError: shard_loader: each name in rng_types must be one of 'torch', "
    "'cuda', 'generator'; got 'numpy'. Remove it ...": lambda _: fa.shard_loader(
        ONE,
        _loader(),
        rng_types=["numpy"],  # type: ignore[list-item]
    ),
    "ValueError: shard_loader: rng_types must be free of 'cuda' when ctx.device is "
    "cpu; got ['cuda']. Remove 'cuda' on a CPU run.": lambda _: fa.shard_loader(
        ONE, _loader(), rng_types=["cuda"]
    ),
    "ValueError: shard_loader: the DataLoader's batch_size must be set (not None) to "
    "shard batches across 2 processes; got None. ...": lambda _: fa.shard_loader(
        _world(2), _loader(batch_size=_bad(None))
    ),
    "ValueError: iter_batches: the samples state counts (global_batches * "
    "global_batch_size) must be a multiple of this loader's total_batch_size (8); "
    "got 4. ...": lambda _: _first(
        fa.shard_loader(ONE, _loader(16, 8)),
        fa.LoaderState(global_batches=1, global_batch_size=4),
    ),
    "ValueError: iter_batches: LoaderState(epoch=0, global_batches=4, "
    "global_batch_size=4) is 4 global batches of 4 samples into epoch 0, past the "
    "end of the epoch: this loader's epoch has 3 global batches (len(loader) on "
    "rank 0). ...": lambda _: _first(
        fa.shard_loader(ONE, _loader(12, 4)),
        fa.LoaderState(global_batches=4, global_batch_size=4),
    ),
    "ValueError: shard_loader: the DataLoader has a generator (initial seed 4), "
    "which a sharded loader does not use: ...": lambda _: fa.shard_loader(
        ONE, _loader(shuffle=True, generator=torch.Generator().manual_seed(4))
    ),
    "TypeError: iter_batches: state must be a LoaderState; got {'epoch': 0} "
    "(dict). Use LoaderState.from_dict for a saved dict.": lambda _: _first(
        fa.shard_loader(ONE, _loader()), {"epoch": 0}
    ),
    "TypeError: iter_batches: loader must be a ShardedLoader from "
    "shard_loader(ctx, dataloader); got <...DataLoader object ...> (DataLoader).": (
        lambda _: _first(_loader())
    ),
    "TypeError: ShardedLoader.__len__: the ... has no len(), ...": lambda _: len(
        fa.shard_loader(ONE, DataLoader(_Stream(), batch_size=2))
    ),
    "RuntimeError: iter_batches: ctx has num_processes=2 but no default process "
    "group is initialised; ...": lambda _: _first(
        fa.shard_loader(_world(2), _loader(), rng_types=["torch"])
    ),
    "ValueError: shard_loader: dispatch_batches=True cannot concatenate the 2 "
    "batches of global batch 3: leaf batch['input_ids'] has "
    "shapes (4, 16) and (4, 12); "
    "...": _undispatchable,
    # profiler.md
    "ValueError: build_profiler: nothing was recorded to export to "
    "'.../profile_0.json': the body ended at profiler step 1, before the first "
    "active step of schedule_option={...}; ...": _nothing_recorded,
    "ValueError: build_profiler: every item of ranks (2) must be in [0, "
    "num_processes=2).": lambda _: fa.build_profiler(_world(2), ranks=[2]).__enter__(),
    "ValueError: ProfileKwargs: activity 'cuda' cannot be profiled by this torch "
    "build on this machine; supported here: 'cpu'.": lambda _: _cpu_only("cuda"),
    "OSError: build_profiler: cannot create output_trace_dir '...': ...": _uncreatable,
    # sharding.md
    "ValueError: shard_batch_sampler: batch_size (3) must be a multiple of "
    "num_processes (2) when split_batches=True; use a batch size divisible by 2 or "
    "split_batches=False.": lambda _: fa.shard_batch_sampler(
        BatchSampler(range(6), 3, False),
        num_processes=2,
        process_index=0,
        split_batches=True,
    ),
    "ValueError: shard_batch_sampler: process_index (2) must be in [0, "
    "num_processes=2); ...": lambda _: fa.shard_batch_sampler(
        BatchSampler(range(6), 2, False), num_processes=2, process_index=2
    ),
    "ValueError: shard_iterable_dataset: batch_size (0) must be >= 1; pass a larger "
    "value.": lambda _: fa.shard_iterable_dataset(_Stream(), batch_size=0),
    "TypeError: ...: batch_sampler.drop_last must be a bool; got ...": lambda _: (
        fa.shard_batch_sampler(_Sampler(), num_processes=1, process_index=0)
    ),
    "TypeError: ShardedIterableDataset.__len__: the dataset (...) has no len(); "
    "...": lambda _: len(fa.shard_iterable_dataset(_Stream())),
    # tracking.md
    "TypeError: log_metrics: trackers must be a list of trackers; got "
    "<...JSONLTracker ...> (JSONLTracker). Wrap a single tracker in a list: [tracker].": lambda t: (
        fa.log_metrics(ONE, fa.JSONLTracker(t / "m.jsonl"), {"loss": 1.0})  # type: ignore[arg-type]
    ),
    "TypeError: log_metrics: trackers[0] must be a Tracker (with name, log, "
    "store_init_configuration and finish); got ... (object).": lambda _: fa.log_metrics(
        ONE,
        [_bad(object())],
        {"loss": 1.0},
    ),
    "ValueError: InMemoryTracker.log: value 'x' must be one number; got "
    "tensor(shape=(3,), dtype=torch.float32). Log a single number, ...": lambda _: (
        fa.InMemoryTracker().log({"x": torch.ones(3)})
    ),
    "TypeError: ...: configuration value 'betas' is (0.9, 0.99) (tuple); store a "
    "bool, str, int, float or None (for example str(betas)).": lambda _: (
        fa.InMemoryTracker().store_init_configuration({"betas": (0.9, 0.99)})
    ),
    "ValueError: JSONLTracker.log: every metric name must be other than 'step', "
    "'time' and 'config' (each record's own keys); got 'step'. Rename that "
    "metric.": _reserved_key,
    "ValueError: CSVTracker.log: every metric must be a column of its own (the "
    "columns are ['step', 'time', 'loss']); got 'acc'. ...": _csv_new_column,
    "ValueError: JSONLTracker.log: the tracker was finished; ...": _finished,
    "ValueError: MLflowTracker.log: MLflow refused the tracking backend "
    "'file:///.../mlruns' (a file store, which MLflow 3 opens only on request); set "
    "MLFLOW_ALLOW_FILE_STORE=true in the environment, or pass a database URI such "
    "as 'sqlite:///mlruns.db'.": _refused_file_store,
}


def _quoted() -> list[str]:
    return [
        quote
        for page in CHECKED_PAGES
        for line in (DOCS / page).read_text(encoding="utf-8").splitlines()
        if line.startswith("|")
        for quote in _CELL.findall(line)
    ]


def _matches(quote: str, real: str) -> bool:
    """Whether ``real`` reads as ``quote`` with each ``...`` standing for any text."""
    first, *middle, last = quote.split("...") if "..." in quote else (quote, "")
    if "..." not in quote:
        return real == quote
    if not (real.startswith(first) and real.endswith(last)):
        return False
    position = len(first)
    for part in middle:
        found = real.find(part, position)
        if found < 0:
            return False
        position = found + len(part)
    return position <= len(real) - len(last)


def test_matches_reads_dots_as_any_text() -> None:
    assert _matches("E: f: got x(...). Fix.", "E: f: got x(a=1). Fix.")
    assert _matches("E: f: got 1; ...", "E: f: got 1; pass 2.")
    assert not _matches("E: f: got 1; ...", "E: g: got 1; pass 2.")
    assert not _matches("E: f: got 1.", "E: f: got 1. More.")


def test_every_quoted_message_has_a_trigger() -> None:
    quoted = _quoted()
    assert len(quoted) >= 15  # the tables are found
    assert sorted(set(quoted) - TRIGGERS.keys()) == []
    assert sorted(TRIGGERS.keys() - set(quoted)) == []


@pytest.mark.parametrize("quote", list(TRIGGERS), ids=lambda q: q[:60])
def test_quoted_message_is_the_one_raised(quote: str, tmp_path: Path) -> None:
    kind = quote.split(":", 1)[0]
    with pytest.raises(Exception) as caught:
        TRIGGERS[quote](tmp_path)
    real = f"{type(caught.value).__name__}: {caught.value}"
    assert type(caught.value).__name__ == kind, real
    assert _matches(quote, real), real
