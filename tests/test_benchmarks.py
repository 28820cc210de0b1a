"""Each benchmark script runs at a tiny size and checks what it compares.

Only that the scripts work is tested here (timings are never asserted): each
finishes, prints its tables, and the training benchmarks confirm that the plain
PyTorch loop and the funcaccel loop ended with identical parameters.
"""

from __future__ import annotations

import pytest

from tests._scripts import REPO
from tests._scripts import run_script

BENCHMARKS = REPO / "benchmarks"


def _run(name: str, *args: object) -> str:
    done = run_script(BENCHMARKS / f"{name}.py", *args, timeout=300)
    assert done.status == 0, f"{done.command} exited {done.status}:\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_bench_loop_runs_and_both_loops_end_equal(precision: str) -> None:
    out = _run(
        "bench_loop", "--repeats", 2, "--micro-batches", 8, "--no-accelerate",
        "--mixed-precision", precision,
    )  # fmt: skip
    assert f"mixed precision {precision}; identical final parameters: True" in out
    assert "| funcaccel |" in out and "| plain PyTorch |" in out


@pytest.mark.distributed
def test_bench_ddp_runs_and_both_loops_end_equal() -> None:
    out = _run(
        "bench_ddp", "--repeats", 2, "--warmup", 1, "--micro-batches", 8,
        "--hidden", 16, "--no-pin",
    )  # fmt: skip
    assert "equal final parameters: True" in out
    assert out.count("| funcaccel |") == 2  # wall and CPU tables


def test_bench_loader_runs() -> None:
    out = _run("bench_loader", "--repeats", 2, "--samples", 256)
    assert out.count("noise control") == 2
    assert "`iter_batches` from 90 %" in out


def test_bench_import_runs() -> None:
    out = _run("bench_import", "--repeats", 2)
    assert "funcaccel" in out
