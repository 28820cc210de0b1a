"""Run each example at a tiny size, on one process and under torchrun with 2 (gloo).

Every run is a subprocess of the example script as a user starts it; the test parses
the one result line the main process prints (``name: key=value ...``) and checks it:
the loss is finite and went down, the optimizer stepped once per accumulation window
(the short last window included), and metrics count every sample once.
"""

from __future__ import annotations

import math
from typing import Final

import pytest

from tests._scripts import REPO
from tests._scripts import run_script

PROCESSES: Final = [
    pytest.param(1, id="1-process"),
    pytest.param(2, id="2-processes", marks=pytest.mark.distributed),
]


def run_example(name: str, processes: int, *args: object) -> dict[str, float]:
    """Run ``examples/<name>.py`` and return the numbers of its result line."""
    done = run_script(
        REPO / "examples" / f"{name}.py",
        *args,
        processes=processes,
    )
    assert done.status == 0, f"{done.command} exited {done.status}:\n{done.stderr}"
    lines = [line for line in done.stdout.splitlines() if line.startswith(f"{name}: ")]
    assert len(lines) == 1, (
        f"expected one result line (main process only):\n{done.stdout}"
    )
    pairs = (item.split("=") for item in lines[0].split()[1:])
    return {key: float(value) for key, value in pairs}


def windows(samples: int, batch_size: int, processes: int, k: int) -> int:
    """Return the optimizer steps of one epoch: ceil(batches per rank / k)."""
    return math.ceil(math.ceil(samples / (batch_size * processes)) / k)


def assert_trained(result: dict[str, float], processes: int) -> None:
    assert result["processes"] == processes
    assert math.isfinite(result["first_loss"]), result
    assert math.isfinite(result["final_loss"]), result
    assert result["final_loss"] < result["first_loss"], result


@pytest.mark.parametrize("processes", PROCESSES)
def test_custom_loop_steps_once_per_window_and_lowers_the_loss(processes: int) -> None:
    # 40 samples in batches of 4: 10 (1 process) or 5 (2) micro-batches per rank,
    # so with k=3 the last window is short (1 or 2 micro-batches). Two processes
    # run fp16, so the scaler path (unscale before clipping) runs too.
    precision = "fp16" if processes > 1 else "no"
    result = run_example(
        "custom_loop", processes, "--samples", 40, "--batch-size", 4,
        "--accumulation-steps", 3, "--epochs", 2, "--mixed-precision", precision,
    )  # fmt: skip
    assert_trained(result, processes)
    steps = result["optimizer_steps"] + result["skipped_steps"]
    assert steps == 2 * windows(40, 4, processes, 3)


@pytest.mark.parametrize("processes", PROCESSES)
def test_iterable_dispatch_counts_every_sample_once(processes: int) -> None:
    # 45 = 2 * 16 + 13: on 2 processes the last global batch of 13 rows is evened
    # out to 14 with a repeated row, which gather_for_metrics must drop.
    result = run_example(
        "iterable_dispatch", processes, "--samples", 45, "--batch-size", 8,
        "--epochs", 2,
    )  # fmt: skip
    assert_trained(result, processes)
    assert result["samples"] == result["unique"] == 45
    assert 0.0 <= result["accuracy"] <= 1.0
    assert result["optimizer_steps"] == 2 * windows(45, 8, processes, 1)


@pytest.mark.parametrize("processes", PROCESSES)
def test_fsdp2_cpu_shards_parameters_and_trains(processes: int) -> None:
    result = run_example(
        "fsdp2_cpu", processes, "--samples", 48, "--batch-size", 4,
        "--accumulation-steps", 2, "--epochs", 2,
    )  # fmt: skip
    assert_trained(result, processes)
    assert result["optimizer_steps"] == 2 * windows(48, 4, processes, 2)
    if processes == 1:
        assert result["local_params"] == result["full_params"]
    else:  # rank 0 holds its rows of each parameter: about half, never all
        assert result["full_params"] / 2 <= result["local_params"]
        assert result["local_params"] < result["full_params"]
