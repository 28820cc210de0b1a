"""estimate_memory: the held parts equal the closed form; peaks, ranks and errors.

Every estimate runs in this process on torch's fake process group and fake
tensors; the autouse fixture in conftest.py fails a test that leaves a group.
The closed form: a float32 parameter of n elements sharded over s ranks is
4 * n / s bytes on each, its gradient the same, AdamW's state twice that plus a
4-byte step counter per parameter tensor.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from funcaccel.model import FSDPOptions
from funcaccel.planning import MemoryEstimate
from funcaccel.planning import RankMemory
from funcaccel.planning import estimate_memory
from tests.fixtures import adamw
from tests.fixtures import mlp_blocks

F32 = 4


def _mlp(blocks: int = 2, width: int = 64) -> nn.Sequential:
    return mlp_blocks(blocks, width)


BATCH = torch.zeros(8, 64)
# Per block: up (128 x 64 + 128) and down (64 x 128 + 64); 4 tensors.
UP, UP_B, DOWN, DOWN_B = 128 * 64, 128, 64 * 128, 64


def _closed_form(elements: int, tensors: int) -> tuple[int, int, int]:
    """(parameters, gradients, AdamW state) bytes of ``elements`` float32 values."""
    return elements * F32, elements * F32, 2 * elements * F32 + tensors * F32


def _held(estimate: MemoryEstimate) -> list[tuple[int, int, int]]:
    return [(r.parameters, r.gradients, r.optimizer_state) for r in estimate.ranks]


@pytest.mark.parametrize(
    ("sizes", "shards"),
    [
        ({"world_size": 8, "fsdp": FSDPOptions(shard_modules=(nn.Sequential,))}, 8),
        ({"world_size": 8, "dp_replicate": 2, "fsdp": FSDPOptions()}, 4),  # HSDP 2x4
        # 4,096 ranks as HSDP 64 x 64 (FSDP2 builds a chunk per shard rank for
        # every parameter: 4,096 shards of each would take minutes here).
        ({"world_size": 4096, "dp_replicate": 64, "fsdp": FSDPOptions()}, 64),
        ({"world_size": 8}, 1),  # DDP: every rank holds the whole model
    ],
)
def test_held_parts_equal_the_closed_form(sizes: dict[str, Any], shards: int) -> None:
    estimate = estimate_memory(_mlp, BATCH, optimizer_fn=adamw, **sizes)
    elements = 2 * (UP + UP_B + DOWN + DOWN_B)
    assert _held(estimate) == [_closed_form(elements // shards, 8)]


# RowwiseParallel hands on its local output as a view; torch warns that an
# in-place op on it would skip FSDP2's hook. The model does none.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
def test_fsdp_times_tp_shards_by_the_plan_then_over_dp_shard() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan = {
        f"{b}.{i}": style
        for b in "01"
        for i, style in ((0, ColwiseParallel()), (2, RowwiseParallel()))
    }
    estimate = estimate_memory(
        _mlp, BATCH, optimizer_fn=adamw, world_size=8, dp_shard=4, tp=2,
        tp_plan=plan, fsdp=FSDPOptions(),
    )  # fmt: skip
    assert estimate.strategy == "fsdp+tp" and estimate.mesh == (1, 1, 4, 2)
    # tp halves up (rows) and down's weight (columns); down's bias is replicated
    # over tp; then every tensor is split over the 4 dp_shard ranks.
    per_block = (UP // 2 + UP_B // 2 + DOWN // 2 + DOWN_B) // 4
    assert _held(estimate) == [_closed_form(2 * per_block, 8)]


def test_uneven_shards_report_the_last_rank_separately() -> None:
    estimate = estimate_memory(
        lambda: nn.Linear(4, 1024), torch.zeros(2, 4), optimizer_fn=adamw,
        world_size=6, fsdp=FSDPOptions(),
    )  # fmt: skip
    first, last = estimate.ranks
    assert (first.rank, last.rank) == (0, 5)
    # 1,024 rows over 6 ranks: chunks of 171, the last 1024 - 5 * 171 = 169.
    assert first.parameters == 171 * 5 * F32 and last.parameters == 169 * 5 * F32
    assert estimate.peak == max(first.peak, last.peak)


def test_peak_parts_add_up_and_grow_with_accumulation_and_batch() -> None:
    fsdp = FSDPOptions(shard_modules=(nn.Sequential,))
    one = estimate_memory(_mlp, BATCH, optimizer_fn=adamw, world_size=4, fsdp=fsdp)
    (rank,) = one.ranks
    parts = dict(rank.peak_parts)
    assert sum(parts.values()) == rank.peak
    assert parts["optimizer state"] == rank.optimizer_state  # held at the peak
    assert rank.peak > rank.model_state
    bigger = estimate_memory(
        _mlp, torch.zeros(512, 64), optimizer_fn=adamw, world_size=4, fsdp=fsdp
    )
    assert dict(bigger.ranks[0].peak_parts)["activations"] > parts["activations"]
    # Accumulation under FSDP2 keeps unsharded gradients between micro-batches.
    two = estimate_memory(
        _mlp, BATCH, optimizer_fn=adamw, world_size=4, fsdp=fsdp, accumulation_steps=2
    )
    assert two.peak > one.peak
    # bf16 autocast (the context's mixed_precision): half-size activations.
    bf16 = estimate_memory(
        _mlp, torch.zeros(512, 64), optimizer_fn=adamw, world_size=4, fsdp=fsdp,
        mixed_precision="bf16",
    )  # fmt: skip
    acts = dict(bf16.ranks[0].peak_parts)["activations"]
    assert acts < dict(bigger.ranks[0].peak_parts)["activations"]
    assert bf16.ranks[0].parameters == rank.parameters  # float32 parameters kept
    assert one.peak_with_margin == -(-one.peak * 11 // 10)
    text = one.table()
    assert "fsdp on 4 ranks" in text and "| **peak** |" in text and "NCCL" in text
    assert one.to_dict()["ranks"][0]["parameters"] == rank.parameters


def test_estimate_memory_refuses_an_existing_group_and_leaves_none() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", world_size=2, rank=0, store=FakeStore())
    try:
        with pytest.raises(
            RuntimeError,
            match=r"estimate_memory: a default process group is already initialised .*world_size=2",
        ):
            estimate_memory(_mlp, BATCH, optimizer_fn=adamw, world_size=8)
    finally:
        dist.destroy_process_group()

    def broken() -> nn.Module:
        raise KeyError("no such layer")

    hook = sys.excepthook
    with pytest.raises(KeyError):
        estimate_memory(broken, BATCH, optimizer_fn=adamw, world_size=8)
    assert not dist.is_initialized()
    assert sys.excepthook is hook  # torch's rank-prefixing hook is taken back


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"world_size": 8, "dp_shard": 3, "fsdp": FSDPOptions()},
            ValueError,
            r"build_mesh: .* must be the world size \(8\)",
        ),
        (
            {"world_size": 0},
            ValueError,
            r"estimate_memory: world_size \(0\) must be >= 1",
        ),
        (
            {"world_size": 2, "margin": -0.1},
            ValueError,
            r"estimate_memory: margin must be a finite",
        ),
        (
            {"world_size": 2, "optimizer_fn": None},
            TypeError,
            r"estimate_memory: optimizer_fn must be a function",
        ),
        (
            {"world_size": 2, "accumulation_steps": 0},
            ValueError,
            r"accumulation_steps \(0\)",
        ),
    ],
)
def test_estimate_memory_refuses_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    arguments: dict[str, Any] = {"optimizer_fn": adamw, **kwargs}
    with pytest.raises(error, match=match):
        estimate_memory(_mlp, BATCH, **arguments)
    assert not dist.is_initialized()


def test_a_tp_plan_naming_a_missing_module_is_wrap_models_error() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(
        ValueError, match=r"wrap_model: every tp_plan key must be .*got 'attn'"
    ):
        estimate_memory(
            _mlp, BATCH, optimizer_fn=adamw, world_size=4, tp=2, dp_shard=2,
            fsdp=FSDPOptions(), tp_plan={"attn": ColwiseParallel()},
        )  # fmt: skip
    with pytest.raises(
        TypeError, match=r"estimate_memory: model_fn must be a function"
    ):
        estimate_memory(_mlp(), BATCH, optimizer_fn=adamw, world_size=2)


def test_memory_values_check_their_fields() -> None:
    rank = RankMemory(rank=0, parameters=1, gradients=1, optimizer_state=2, peak=8)
    with pytest.raises(ValueError, match=r"MemoryEstimate: ranks must be at least one"):
        MemoryEstimate(world_size=1, mesh=(1, 1, 1), strategy="none", ranks=())
    with pytest.raises(ValueError, match=r"RankMemory: peak \(-1\) must be >= 0"):
        RankMemory(rank=0, parameters=1, gradients=1, optimizer_state=2, peak=-1)
    est = MemoryEstimate(
        world_size=1, mesh=(1, 1, 1), strategy="none", ranks=(rank,), margin=0.5
    )
    assert est.peak_with_margin == 12 and est.fits(12) and not est.fits(11)
    # A 3-tuple mesh, (dp_replicate, dp_shard, tp) before pipelines, has pp=1.
    assert est.mesh == (1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"MemoryEstimate: mesh must be \(pp, dp_"):
        MemoryEstimate(world_size=1, mesh=(1, 1), strategy="none", ranks=(rank,))
    with pytest.raises(ValueError, match=r"RankMemory: every stage \(-1\) must be"):
        RankMemory(
            rank=0, parameters=1, gradients=1, optimizer_state=2, peak=8, stages=(-1,)
        )


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


def test_wrap_model_options_pass_through_activation_checkpointing() -> None:
    from funcaccel.model import ActivationCheckpointOptions

    def build() -> nn.Module:
        return nn.Sequential(*(_Residual() for _ in range(4)))

    fsdp = FSDPOptions(shard_modules=(_Residual,))
    layouts: list[dict[str, Any]] = [
        {"world_size": 4, "fsdp": fsdp},
        {"world_size": 2},  # DDP: the whole model, checkpointed too
        {"world_size": 1},
    ]
    for layout in layouts:
        kwargs: dict[str, Any] = {"optimizer_fn": adamw, **layout}
        plain = estimate_memory(build, torch.zeros(512, 64), **kwargs)
        checkpointed = estimate_memory(
            build,
            torch.zeros(512, 64),
            activation_checkpointing=ActivationCheckpointOptions(blocks=(_Residual,)),
            **kwargs,
        )
        # Each block keeps only its input (512 x 64 floats) instead of its inner
        # activations (a 512 x 256 product and its ReLU among them).
        saved = dict(plain.ranks[0].peak_parts)["activations"]
        kept = dict(checkpointed.ranks[0].peak_parts)["activations"]
        assert kept < saved / 4, layout
        assert checkpointed.peak < plain.peak
        assert _held(checkpointed) == _held(plain)


def test_estimate_memory_of_one_process_counts_the_whole_model_and_adam() -> None:
    # World 1: no wrapping; the whole model, its gradients and AdamW's two
    # moments are held (the model cannot be built on meta there and swapped).
    estimate = estimate_memory(_mlp, BATCH, world_size=1, optimizer_fn=adamw)
    (rank,) = estimate.ranks
    tensors = list(_mlp().parameters())
    params = sum(p.numel() * p.element_size() for p in tensors)
    assert estimate.strategy == "none"
    # AdamW: two moments per parameter and a float32 step count per tensor.
    assert (rank.parameters, rank.gradients, rank.optimizer_state) == (
        params,
        params,
        2 * params + 4 * len(tensors),
    )
    assert rank.peak > 4 * params


@pytest.mark.parametrize(
    ("bucket_view", "accumulation", "buckets"),
    [(False, 1, True), (False, 2, True), (True, 1, False), (True, 2, True)],
)
def test_ddp_adds_one_set_of_gradient_buckets_to_one_process_peak(
    bucket_view: bool, accumulation: int, buckets: bool
) -> None:
    # A DDP rank runs one process's step plus the reducer's buckets, one flat
    # copy of the gradients; with gradient_as_bucket_view the gradients are
    # the buckets' views, except beside them in a no-sync micro-step.
    from funcaccel.kwargs import DistributedDataParallelKwargs

    common: dict[str, Any] = {
        "optimizer_fn": adamw,
        "accumulation_steps": accumulation,
        "device": "cpu",
    }
    one = estimate_memory(_mlp, BATCH, world_size=1, **common)
    ddp = estimate_memory(
        _mlp,
        BATCH,
        world_size=2,
        ddp_kwargs=DistributedDataParallelKwargs(gradient_as_bucket_view=bucket_view),
        **common,
    )
    (rank,) = ddp.ranks
    expected = rank.gradients if buckets else 0
    assert dict(rank.peak_parts)["DDP gradient buckets"] == expected
    assert rank.peak == one.peak + expected
