"""Throughput and measure_throughput: rates of a window, counted over every rank.

The distributed check trains a tiny token model with accumulation on padded
batches at 1 and 2 gloo ranks and compares the tokens/s that measure_throughput
gives at each optimizer step with a count by hand of the unpadded tokens of that
window's sentences over every rank.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.testing import run_ranks
from funcaccel.throughput import PEAK_FLOPS
from funcaccel.throughput import Throughput
from funcaccel.throughput import measure_throughput
from funcaccel.throughput import peak_flops
from tests.fixtures import rank_ctx

PAD = -100
# Sentence lengths (tokens the loss scores) of each rank's micro-batches; each
# micro-batch is padded to its longest sentence. 5 micro-batches, k=2: windows of
# 2, 2 and 1 micro-batches.
LENGTHS = {
    0: [[3, 5], [1, 4], [6, 6], [2, 2], [7, 1]],
    1: [[2, 2], [5, 1], [3, 3], [8, 1], [4, 4]],
}
K = 2
SECONDS = {0: 2.0, 1: 4.0}  # each rank's window time, fixed for the check


def _batch(lengths: list[int]) -> torch.Tensor:
    width = max(lengths)
    labels = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for row, n in enumerate(lengths):
        labels[row, :n] = torch.arange(n) % 5
    return labels


def _windows(world: int) -> list[int]:
    """The tokens of each window over the ranks, counted from LENGTHS by hand."""
    steps = len(LENGTHS[0])
    bounds = [*range(0, steps, K), steps]
    return [
        sum(sum(sum(LENGTHS[r][i]) for i in range(a, b)) for r in range(world))
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def _train(ctx: DistributedContext) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5)).double()
    if ctx.num_processes > 1:
        from funcaccel.model import wrap_model

        model = wrap_model(ctx, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grad = GradState(accumulation_steps=K)
    tokens = 0
    found: list[dict[str, Any]] = []
    batches = LENGTHS[ctx.process_index]
    for i, lengths in enumerate(batches):
        labels = _batch(lengths)
        scored = (labels != PAD).sum()

        def loss_fn(labels: torch.Tensor = labels) -> torch.Tensor:
            logits = model(labels.clamp(min=0))
            return nn.functional.cross_entropy(
                logits.transpose(1, 2), labels, ignore_index=PAD, reduction="sum"
            )

        _, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            loss_fn,
            num_items=scored,
            end_of_dataloader=i == len(batches) - 1,
        )
        tokens += int(scored)
        if grad.sync_gradients:
            t = measure_throughput(
                ctx,
                seconds=SECONDS[ctx.process_index],
                tokens=tokens,
                samples=K,
                flops=1e12,
                peak_flops_per_device=4e12,
            )
            counts = {"tokens": t.tokens, "seconds": t.seconds}
            found.append({**t.metrics(), **counts})
            tokens = 0
    try:  # rank 1 forgets its count: every rank is told
        measure_throughput(ctx, seconds=1.0, tokens=ctx.process_index or None)
    except ValueError as error:
        found.append({"error": str(error)})
    return found


@pytest.fixture(scope="module")
def runs() -> dict[int, list[list[dict[str, Any]]]]:
    return {
        1: [_train(rank_ctx())],
        2: run_ranks(_train, 2, timeout_s=240, start_method="forkserver"),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_tokens_per_second_under_accumulation_with_padding_is_the_hand_count(
    runs: dict[int, list[list[dict[str, Any]]]], world: int
) -> None:
    hand = _windows(world)
    assert len(hand) == 3  # the last window is short: one micro-batch
    seconds = max(SECONDS[r] for r in range(world))  # the slowest rank's
    for found in runs[world]:
        if world == 2:
            *found, last = found
            assert "measure_throughput: tokens must be given on every rank" in str(
                last["error"]
            ) and "[0]" in str(last["error"])
        assert [w["tokens"] for w in found] == hand
        assert [w["tokens_per_second"] for w in found] == [n / seconds for n in hand]
        assert [w["samples_per_second"] for w in found] == [K * world / seconds] * 3
        # 1e12 FLOPs per rank on `world` devices: 1e12 / seconds each, of 4e12.
        assert [w["tflops_per_device"] for w in found] == [1 / seconds] * 3
        assert [w["mfu"] for w in found] == [1e12 / seconds / 4e12] * 3


def test_throughput_rates_follow_from_the_window() -> None:
    t = Throughput(seconds=0.25, tokens=1000, samples=8, flops=2e14, num_devices=2)
    assert t.tokens_per_second == 4000.0 and t.samples_per_second == 32.0
    assert t.tflops_per_device == 400.0 and t.mfu is None
    assert set(t.metrics("train/")) == {
        "train/tokens_per_second",
        "train/samples_per_second",
        "train/tflops_per_device",
    }
    assert Throughput(seconds=1.0).metrics() == {}
    named = Throughput(seconds=1.0, flops=989e12, peak_flops_per_device="H100 SXM")
    assert named.peak_flops_per_device == 989e12 and named.mfu == 1.0
    assert "MFU 100.0%" in named.describe()


def test_peak_flops_matches_device_names_most_specific_first() -> None:
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("nvidia h100 pcie") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA L4") == 121e12
    assert all(flops > 1e13 for _, flops in PEAK_FLOPS)
    with pytest.raises(ValueError, match=r"peak_flops: device_name must be .*'Tesla"):
        peak_flops("Tesla K80")


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (
            {"seconds": 0.0},
            ValueError,
            r"Throughput: seconds must be a finite number > 0; got 0.0",
        ),
        ({"seconds": math.inf}, ValueError, r"seconds must be a finite"),
        ({"seconds": "1"}, TypeError, r"Throughput: seconds must be an int or float"),
        ({"seconds": 1.0, "tokens": -1}, ValueError, r"tokens \(-1\) must be >= 0"),
        ({"seconds": 1.0, "tokens": 2.5}, TypeError, r"tokens must be an int"),
        ({"seconds": 1.0, "flops": math.nan}, ValueError, r"flops must be a finite"),
        ({"seconds": 1.0, "num_devices": 0}, ValueError, r"num_devices \(0\)"),
        ({"seconds": 1.0, "peak_flops_per_device": 0}, ValueError, r"> 0, or None"),
        ({"seconds": 1.0, "peak_flops_per_device": "TPU"}, ValueError, r"peak_flops"),
    ],
)
def test_throughput_refuses_bad_fields(
    fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Throughput(**fields)


def test_measure_throughput_on_one_process_sends_nothing() -> None:
    t = measure_throughput(rank_ctx(), seconds=2.0, tokens=torch.tensor(7), flops=4.0)
    assert (t.tokens, t.samples, t.flops, t.num_devices) == (7, None, 4.0, 1)
    with pytest.raises(TypeError, match=r"measure_throughput: seconds"):
        measure_throughput(rank_ctx(), seconds=None, tokens=1)  # type: ignore[arg-type]
