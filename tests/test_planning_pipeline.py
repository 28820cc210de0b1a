"""estimate_memory with pipeline stages (pp): a real 2-rank run, closed forms, schedules.

The chain below has four blocks (up 64 -> 128, ReLU, down 128 -> 64); cut into
stages, each stage holds whole blocks. The closed form is test_planning's: a
float32 parameter of n elements over s shards is 4 * n / s bytes, its gradient
the same, AdamW's state twice that plus a 4-byte step per parameter tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from typing import Final

import pytest
import torch
import torch.distributed as dist
from torch import nn

from funcaccel import GradState
from funcaccel import build_mesh
from funcaccel import pipeline_step
from funcaccel import wrap_model
from funcaccel.context import DistributedContext
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.model import FSDPOptions
from funcaccel.model import Pipeline
from funcaccel.model import PipelineOptions
from funcaccel.planning import estimate_memory
from funcaccel.planning._counting import build_tracker
from funcaccel.planning._counting import peak_parts
from funcaccel.planning._counting import tracking_repeated_calls
from funcaccel.testing import run_ranks
from tests.fixtures import adamw
from tests.fixtures import mlp_blocks

F32: Final = 4
WIDTH: Final = 64
BLOCK: Final = 2 * WIDTH * 2 * WIDTH + 2 * WIDTH + WIDTH  # up and down, biases
ROWS: Final = 256  # one pipeline step's batch
MICRO: Final = 4


def _chain(blocks: int = 4) -> nn.Sequential:
    return mlp_blocks(blocks, WIDTH)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _real_stage_memory(ctx: DistributedContext, schedule: str) -> dict[str, Any]:
    """One rank of a real pp=2 run: the bytes it holds and its tracked peak.

    The same steps as the estimate: one step in an open window (the gradients
    are counted there: the closing step frees them), then two windows of one
    step under torch's memory tracker.
    """
    torch.manual_seed(0)
    mesh = build_mesh(ctx, pp=2)
    options = PipelineOptions(microbatches=MICRO, schedule=schedule)
    pipe = wrap_model(ctx, _chain(), mesh=mesh, pipeline=options)
    assert isinstance(pipe, Pipeline)
    optimizer = adamw(pipe.parameters())
    batch = _batch()
    pipeline_step(ctx, GradState(accumulation_steps=2), pipe, optimizer, batch, _mse)
    grads = _nbytes(p.grad for p in pipe.parameters() if p.grad is not None)
    optimizer.zero_grad(set_to_none=True)
    (stage,) = pipe.stage_modules
    tracker = build_tracker(stage, optimizer, batch)
    with tracking_repeated_calls(tracker, pipe.stage_modules), tracker:
        grad = GradState()
        for _ in range(2):
            _, grad = pipeline_step(ctx, grad, pipe, optimizer, batch, _mse)
            tracker.reset_mod_stats()
    state = [
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    return {
        "stages": pipe.stage_indices,
        "parameters": _nbytes(pipe.parameters()),
        "gradients": grads,
        "optimizer_state": _nbytes(state),
        "peak": sum(peak_parts(tracker).values()),
    }


@pytest.mark.distributed
def test_each_stage_matches_a_real_two_rank_run() -> None:
    real = run_ranks(
        _real_stage_memory, 2, "1f1b", timeout_s=120, start_method="forkserver"
    )
    estimate = estimate_memory(
        _chain, _batch(), world_size=2, pp=2, optimizer_fn=adamw, loss_fn=_mse,
        pipeline=PipelineOptions(microbatches=MICRO), device="cpu",
    )  # fmt: skip
    assert estimate.strategy == "pp" and estimate.mesh == (2, 1, 1, 1)
    assert [(r.rank, r.stages) for r in estimate.ranks] == [(0, (0,)), (1, (1,))]
    for rank, found in zip(estimate.ranks, real, strict=True):
        assert found["stages"] == rank.stages
        # Two blocks per stage, held exactly as the real rank holds them.
        held = (rank.parameters, rank.gradients, rank.optimizer_state)
        assert held == (
            found["parameters"],
            found["gradients"],
            found["optimizer_state"],
        )
        assert held == (2 * BLOCK * F32, 2 * BLOCK * F32, 4 * BLOCK * F32 + 4 * F32 * 2)
        assert rank.peak == pytest.approx(found["peak"], rel=0.15), (rank, found)
    text = estimate.table()
    assert "(pp x dp_replicate x dp_shard x tp = 2 x 1 x 1 x 1)" in text
    assert "| | rank 0 (stage 0) | rank 1 (stage 1) |" in text
    as_dict = estimate.to_dict()
    assert as_dict["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert [r["stages"] for r in as_dict["ranks"]] == [[0], [1]]


def test_fsdp_inside_stages_at_64_ranks_holds_the_closed_form_per_stage() -> None:
    # pp 4 x dp_shard 16: the 12 units (3 a block) make one block per stage,
    # each of its tensors split over the 16 ranks of its stage.
    estimate = estimate_memory(
        _chain, (torch.zeros(8, WIDTH), torch.zeros(8, WIDTH)), world_size=64, pp=4,
        fsdp=FSDPOptions(), optimizer_fn=adamw, device="cpu",
        pipeline=PipelineOptions(microbatches=4),  # 1F1B: one per stage at least
    )  # fmt: skip
    assert estimate.strategy == "pp+fsdp" and estimate.mesh == (4, 1, 16, 1)
    assert [(r.rank, r.stages) for r in estimate.ranks] == [
        (0, (0,)), (16, (1,)), (32, (2,)), (48, (3,)),
    ]  # fmt: skip
    shard = BLOCK // 16
    for rank in estimate.ranks:
        held = (rank.parameters, rank.gradients, rank.optimizer_state)
        assert held == (shard * F32, shard * F32, 2 * shard * F32 + 4 * F32)
        assert dict(rank.peak_parts)["parameters (gathered)"] == BLOCK * F32


# RowwiseParallel hands on its local output as a view; torch warns that an
# in-place op on it would skip FSDP2's hook. The model does none.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
def test_tp_and_fsdp_inside_stages_split_each_stage_by_the_plan() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan = {
        f"{b}.{i}": style
        for b in range(4)
        for i, style in ((0, ColwiseParallel()), (2, RowwiseParallel()))
    }
    estimate = estimate_memory(
        _chain, (torch.zeros(8, WIDTH), torch.zeros(8, WIDTH)), world_size=8, pp=2,
        tp=2, tp_plan=plan, fsdp=FSDPOptions(), optimizer_fn=adamw, device="cpu",
        pipeline=PipelineOptions(microbatches=2),
    )  # fmt: skip
    assert estimate.strategy == "pp+fsdp+tp" and estimate.mesh == (2, 1, 2, 2)
    # Per block: tp halves up (rows, bias) and down's weight (columns), down's
    # bias is replicated; then dp_shard=2 halves every tensor. Two blocks a stage.
    per_block = (BLOCK - WIDTH) // 2 + WIDTH
    for rank in estimate.ranks:
        assert rank.parameters == 2 * per_block // 2 * F32


def test_uneven_stage_shards_report_each_stages_last_rank() -> None:
    # Two units, one per stage; 64 and 1024 rows over 3 shards are uneven.
    estimate = estimate_memory(
        lambda: nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 1024)),
        (torch.zeros(4, 4), torch.zeros(4, 1024)), world_size=6, pp=2, dp_shard=3,
        fsdp=FSDPOptions(), optimizer_fn=adamw, device="cpu",
        pipeline=PipelineOptions(microbatches=2),
    )  # fmt: skip
    assert [(r.rank, r.stages) for r in estimate.ranks] == [
        (0, (0,)), (2, (0,)), (3, (1,)), (5, (1,)),
    ]  # fmt: skip
    # Rows 22, 22, 20 of 64 (x 4 + 1 values each); 342, 342, 340 of 1024 (x 65).
    params = [r.parameters // F32 for r in estimate.ranks]
    assert params == [22 * 5, 20 * 5, 342 * 65, 340 * 65]


def test_gpipe_holds_more_activations_than_1f1b() -> None:
    # GPipe runs every micro-batch's forward before any backward; 1F1B keeps
    # at most pp - stage of them in flight (2 on stage 0, 1 on stage 1).
    found = {}
    for schedule in ("gpipe", "1f1b"):
        estimate = estimate_memory(
            _chain, (torch.zeros(1024, WIDTH), torch.zeros(1024, WIDTH)),
            world_size=2, pp=2, optimizer_fn=adamw, device="cpu",
            pipeline=PipelineOptions(microbatches=MICRO, schedule=schedule),
        )  # fmt: skip
        found[schedule] = [dict(r.peak_parts)["activations"] for r in estimate.ranks]
    for gpipe, one_f_one_b in zip(found["gpipe"], found["1f1b"], strict=True):
        assert gpipe > one_f_one_b, found
    # Stage 0: 4 micro-batches' activations against 2.
    assert found["gpipe"][0] > 1.5 * found["1f1b"][0], found


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"pp": 2}, ValueError, r"estimate_memory: pipeline must be a PipelineOptions with pp=2 .*; got None\. Pass e\.g\."),
        ({"pipeline": PipelineOptions(microbatches=2)}, ValueError, r"estimate_memory: pp must be > 1 with pipeline=.*; got 1\."),
        ({"pp": 2, "pipeline": "1f1b"}, TypeError, r"estimate_memory: pipeline must be"),
        ({"pp": 2, "pipeline": PipelineOptions(microbatches=2), "batch": torch.zeros(4, WIDTH)}, ValueError, r"estimate_memory: batch must be \(inputs, targets\)"),
        ({"pp": 2, "pipeline": PipelineOptions(microbatches=3)}, ValueError, r"estimate_memory: the batch's first dimensions \(inputs, targets\) must be positive multiples of pipeline.microbatches \(3\); got \(4, 4\)"),
        ({"pp": 2, "pipeline": PipelineOptions(microbatches=2), "mixed_precision": "bf16"}, ValueError, r"estimate_memory: mixed_precision must be 'no' with pipeline=.*; got 'bf16'"),
        ({"pp": 2, "pipeline": PipelineOptions(microbatches=2), "ddp_kwargs": DistributedDataParallelKwargs()}, ValueError, r"wrap_model: ddp_kwargs"),
        ({"pp": 4, "world_size": 6, "pipeline": PipelineOptions(microbatches=2)}, ValueError, r"build_mesh: pp \* dp_replicate \* dp_shard \* tp must be the world size \(6\); got 4"),
    ],
)  # fmt: skip
def test_pipeline_arguments_are_refused_by_name(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    arguments: dict[str, Any] = {
        "world_size": 2, "optimizer_fn": adamw,
        "batch": (torch.zeros(4, WIDTH), torch.zeros(4, WIDTH)), **kwargs,
    }  # fmt: skip
    with pytest.raises(error, match=message):
        estimate_memory(_chain, **arguments)
    assert not dist.is_initialized()
