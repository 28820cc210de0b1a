"""``funcaccel.testing``: hand-built rank contexts and real gloo ranks for users' tests."""

from __future__ import annotations

import argparse
import time

import pytest
import torch
import torch.distributed as dist

from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.launch import LaunchError
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks
from tests.test_launch import _custom_loop


@pytest.mark.parametrize(
    ("p", "i", "kind", "backend"),
    [
        (1, 0, DistributedType.NO, None),
        (2, 1, DistributedType.MULTI_CPU, "gloo"),
        (4, 3, DistributedType.MULTI_CPU, "gloo"),
    ],
)
def test_rank_ctx_builds_rank_i_of_p_on_cpu(
    p: int, i: int, kind: DistributedType, backend: str | None
) -> None:
    ctx = rank_ctx(p, i)
    assert ctx == DistributedContext(
        num_processes=p,
        process_index=i,
        local_process_index=i,
        distributed_type=kind,
        backend=backend,
    )
    assert ctx.is_last_process and ctx.is_main_process is (i == 0)


def test_rank_ctx_fields_override_the_defaults() -> None:
    ctx = rank_ctx(4, 3, local_process_index=1, mixed_precision="bf16", backend=None)
    assert (ctx.local_process_index, ctx.mixed_precision, ctx.backend) == (
        1,
        "bf16",
        None,
    )


def test_rank_ctx_refuses_unknown_fields_and_bad_ranks() -> None:
    with pytest.raises(TypeError, match=r"rank_ctx: unknown field\(s\) \['rank'\]"):
        rank_ctx(2, 0, rank=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"process_index \(2\) must be in"):
        rank_ctx(2, 2)


def _train_example(ctx: DistributedContext, samples: int) -> str:
    args = argparse.Namespace(
        samples=samples, batch_size=4, accumulation_steps=2, epochs=1,
        mixed_precision="no",
    )  # fmt: skip
    result: str = _custom_loop().train(ctx, args)
    return result


def _sum_ranks(ctx: DistributedContext, scale: float) -> tuple[int, float]:
    value = torch.tensor([scale * ctx.process_index])
    dist.all_reduce(value)
    return ctx.process_index, float(value.item())


def _fail_on_last_rank(ctx: DistributedContext) -> None:
    if ctx.is_last_process:
        msg = "deliberate failure on the last rank"
        raise RuntimeError(msg)
    dist.barrier()


def _hang(ctx: DistributedContext) -> None:
    del ctx  # every rank hangs
    time.sleep(600)


@pytest.mark.distributed
def test_run_ranks_runs_an_example_training_function_on_two_ranks() -> None:
    results = run_ranks(_train_example, 2, 16)
    assert len(results) == 2 and results[0] == results[1]
    assert "processes=2" in results[0] and "optimizer_steps=1" in results[0]


@pytest.mark.distributed
def test_run_ranks_passes_each_rank_its_context() -> None:
    assert run_ranks(_sum_ranks, 3, 10.0) == [(0, 30.0), (1, 30.0), (2, 30.0)]


@pytest.mark.distributed
def test_run_ranks_forks_a_lambda() -> None:
    assert run_ranks(lambda ctx: ctx.process_index, 2) == [0, 1]


def test_run_ranks_at_one_rank_runs_here() -> None:
    assert run_ranks(lambda ctx: (ctx.num_processes, dist.is_initialized()), 1) == [
        (1, False)
    ]


@pytest.mark.distributed
def test_run_ranks_reports_the_failing_rank_and_its_traceback() -> None:
    with pytest.raises(LaunchError, match=r"rank 2 of 3 raised RuntimeError") as info:
        run_ranks(_fail_on_last_rank, 3, timeout_s=60)
    assert "_fail_on_last_rank" in info.value.traceback_text


@pytest.mark.distributed
def test_run_ranks_kills_a_hang_after_timeout_s() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not return within timeout_s=15"):
        run_ranks(_hang, 2, timeout_s=15)
    assert time.monotonic() - start < 45
