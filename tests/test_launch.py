"""``launch``: N local gloo processes from a running interpreter, results per rank.

The workers are module-level functions of this file, so "spawn" children import
them as ``tests.test_launch``; the notebook/REPL case (``__main__`` without a
file) runs in a subprocess fed a script on stdin.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import funcaccel as fa
from funcaccel.launch import LaunchError
from funcaccel.launch import launch
from funcaccel.launch import pick_start_method
from tests._scripts import REPO
from tests._scripts import script_env


def _custom_loop() -> ModuleType:
    """Load ``examples/custom_loop.py`` by path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "custom_loop", REPO / "examples" / "custom_loop.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_custom_loop(samples: int) -> str:
    """What a notebook cell would launch: build the context, train, close it."""
    ctx = fa.build_context(cpu=True)
    try:
        args = argparse.Namespace(
            samples=samples,
            batch_size=4,
            accumulation_steps=2,
            epochs=2,
            mixed_precision="no",
        )
        result: str = _custom_loop().train(ctx, args)
        return result
    finally:
        fa.close_context(ctx)


def _rank_and_sum(scale: float) -> tuple[int, int, float]:
    ctx = fa.build_context(cpu=True)
    value = torch.tensor([scale * ctx.process_index])
    dist.all_reduce(value)
    return ctx.process_index, ctx.num_processes, float(value.item())


def _where(tag: str) -> tuple[int, int, bool, str]:
    ctx = fa.build_context(cpu=True)
    return ctx.process_index, ctx.num_processes, dist.is_initialized(), tag


def _fail_on_rank_one() -> None:
    ctx = fa.build_context(cpu=True)
    if ctx.process_index == 1:
        msg = "deliberate failure on rank 1"
        raise ValueError(msg)
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def _hang_on_rank_zero() -> int:
    if dist.get_rank() == 0:
        time.sleep(600)
    return dist.get_rank()


def _numbers(line: str) -> dict[str, float]:
    pairs = (item.split("=") for item in line.split()[1:])
    return {key: float(value) for key, value in pairs}


@pytest.mark.distributed
def test_launch_runs_the_custom_loop_example_on_two_processes() -> None:
    results = launch(_train_custom_loop, 32, num_processes=2, timeout_s=240)
    assert len(results) == 2
    assert results[0] == results[1]  # losses are reduced over the ranks
    numbers = _numbers(results[0])
    assert numbers["processes"] == 2
    # 32 samples, 4 per batch, 2 ranks: 4 micro-batches per rank, 2 windows of 2.
    assert numbers["optimizer_steps"] == 2 * 2
    assert math.isfinite(numbers["final_loss"])
    assert numbers["final_loss"] < numbers["first_loss"]


@pytest.mark.distributed
def test_launch_gives_each_rank_torchrun_variables_and_a_group() -> None:
    assert launch(_rank_and_sum, 2.0, num_processes=3, timeout_s=120) == [
        (0, 3, 6.0),
        (1, 3, 6.0),
        (2, 3, 6.0),
    ]


@pytest.mark.distributed
def test_launch_reports_the_failing_rank_with_its_traceback_in_bounded_time() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 of 2 raised ValueError") as info:
        launch(_fail_on_rank_one, num_processes=2, timeout_s=120)
    assert time.monotonic() - start < 60  # rank 0 was killed, not waited for
    assert info.value.rank == 1
    assert "_fail_on_rank_one" in info.value.traceback_text
    assert "deliberate failure on rank 1" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.distributed
def test_launch_kills_a_hanging_rank_after_timeout_s() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not return"):
        launch(_hang_on_rank_zero, num_processes=2, timeout_s=20)
    assert time.monotonic() - start < 60


def _abort_at_exit_on_rank_one() -> int:
    rank = dist.get_rank()
    if rank == 1:
        # Returns its result, then dies during interpreter shutdown.
        atexit.register(os.abort)
    return rank


def _hang_at_exit_on_rank_one() -> int:
    rank = dist.get_rank()
    if rank == 1:
        atexit.register(time.sleep, 3600)
    return rank


@pytest.mark.distributed
def test_launch_reports_a_rank_that_crashed_after_returning() -> None:
    # A user's torchrun job fails when a rank aborts at exit: launch says so too.
    with pytest.raises(
        LaunchError,
        match=r"^launch: rank 1 of 2 was killed by signal 6 after returning its "
        r"result \(a crash at interpreter exit\)",
    ) as caught:
        launch(_abort_at_exit_on_rank_one, num_processes=2, timeout_s=60)
    assert caught.value.rank == 1


@pytest.mark.distributed
def test_launch_bounds_a_rank_that_hangs_at_exit_by_timeout_s() -> None:
    # timeout_s bounds the whole run, exits included; it is generous so that a
    # loaded machine's slow start and exit of rank 0 stay within it.
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"^launch: ranks? \[(0, )?1\] of 2 returned"
    ):
        launch(_hang_at_exit_on_rank_one, num_processes=2, timeout_s=45)
    assert time.monotonic() - start < 120


@pytest.mark.distributed
def test_launch_forks_for_a_lambda() -> None:
    assert launch(lambda: dist.get_rank() * 10, num_processes=2, timeout_s=60) == [
        0,
        10,
    ]


def test_launch_at_one_process_runs_here_without_a_group() -> None:
    assert launch(_where, "x", num_processes=1) == [(0, 1, False, "x")]
    with pytest.raises(ValueError, match="deliberate"):
        launch(_raise_value_error, num_processes=1)


def _raise_value_error() -> None:
    msg = "deliberate"
    raise ValueError(msg)


def test_pick_start_method_spawns_importable_functions_and_forks_the_rest() -> None:
    assert pick_start_method(_rank_and_sum, (1.0,)) == "spawn"
    assert pick_start_method(lambda: 0, ()) == "fork"
    assert pick_start_method(_rank_and_sum, (lambda: 0,)) == "fork"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"num_processes": 0},
            ValueError,
            r"launch: num_processes \(0\) must be >= 1",
        ),
        ({"num_processes": 2.0}, TypeError, r"launch: num_processes must be an int"),
        ({"num_processes": 2, "timeout_s": 0}, ValueError, r"timeout_s must be > 0"),
        (
            {"num_processes": 2, "start_method": "thread"},
            ValueError,
            r"start_method must be one of 'spawn', 'fork', 'forkserver'; got 'thread'\. "
            r"Pass None to let launch pick one \(\w+ offers these\)\.",
        ),
    ],
)
def test_launch_refuses_bad_arguments(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        launch(_rank_and_sum, 1.0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("initialised", "match"),
    [
        ("torch.cuda.is_initialized", r"^launch: start_method 'fork' but CUDA is"),
        ("torch.distributed.is_initialized", r"^launch: a default process group is"),
    ],
)
def test_launch_refuses_to_fork_what_a_child_cannot_use(
    initialised: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Refused before any process starts: nothing is forked.
    monkeypatch.setattr(initialised, lambda: True)
    with pytest.raises(RuntimeError, match=match):
        launch(_rank_and_sum, 1.0, num_processes=2, start_method="fork")


_INTERACTIVE = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import funcaccel as fa

    def train(scale):
        ctx = fa.build_context(cpu=True)
        value = torch.tensor([scale * (ctx.process_index + 1)])
        dist.all_reduce(value)
        fa.close_context(ctx)
        return ctx.process_index, value.item()

    print("results:", fa.launch(train, 1.5, num_processes=2, timeout_s=120))
    """
)


def _run_python(args: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=script_env(),
        cwd=REPO,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.distributed
def test_launch_from_an_interactive_session_forks_a_function_of_main() -> None:
    # `python -` reads the session from stdin: __main__ has no file, as in a
    # notebook, so a new interpreter could not import `train`.
    out = _run_python(["-"], stdin=_INTERACTIVE)
    assert "results: [(0, 4.5), (1, 4.5)]" in out


@pytest.mark.distributed
def test_launch_from_a_script_spawns_a_function_of_its_main(tmp_path: Path) -> None:
    script = tmp_path / "notebook_export.py"
    body = _INTERACTIVE.replace("print(", 'if __name__ == "__main__":\n    print(')
    script.write_text(body)
    out = _run_python([str(script)])
    assert "results: [(0, 4.5), (1, 4.5)]" in out
