"""Tests for build_profiler: per-rank Chrome traces, schedule cycles, rank choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.profiler

from funcaccel.context import DistributedContext
from funcaccel.kwargs import ProfileKwargs
from funcaccel.profiler import build_profiler
from funcaccel.profiler import profiler_trace_path
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

# torch warns once per process when a second schedule window starts without
# acc_events; funcaccel writes each window to its own file, so the warning is moot.
_ONE_WINDOW_AT_A_TIME = pytest.mark.filterwarnings(
    "ignore:Warning. Profiler clears events at the end of each cycle"
)
SCHEDULE = {"wait": 1, "warmup": 1, "active": 2}


def _labels(path: Path, prefix: str = "step") -> set[str]:
    """Return the record_function labels starting with ``prefix`` in a trace."""
    with path.open() as handle:
        trace = json.load(handle)
    names = {str(event.get("name", "")) for event in trace["traceEvents"]}
    return {name for name in names if name.startswith(prefix)}


def _run_steps(prof: torch.profiler.profile | None, n: int) -> None:
    """Run ``n`` labelled iterations, stepping the profiler after each."""
    for i in range(n):
        with torch.profiler.record_function(f"step{i}"):
            torch.ones(4) @ torch.ones(4)
        if prof is not None:
            prof.step()


def test_profiler_trace_path_names_rank_and_cycle(tmp_path: Path) -> None:
    assert profiler_trace_path(tmp_path, 3) == tmp_path / "profile_3.json"
    assert profiler_trace_path(tmp_path, 3, 0) == tmp_path / "profile_3_cycle0.json"


def test_build_profiler_writes_rank_trace_with_user_labels(tmp_path: Path) -> None:
    out = tmp_path / "traces" / "nested"
    with build_profiler(
        DistributedContext(), ProfileKwargs(output_trace_dir=out)
    ) as prof:
        assert isinstance(prof, torch.profiler.profile)
        with torch.profiler.record_function("my_label"):
            torch.ones(8) @ torch.ones(8)
    assert sorted(p.name for p in out.iterdir()) == ["profile_0.json"]
    assert _labels(out / "profile_0.json", "my_") == {"my_label"}


def test_build_profiler_names_file_after_process_index(tmp_path: Path) -> None:
    kwargs = ProfileKwargs(output_trace_dir=str(tmp_path))
    with build_profiler(rank_ctx(3, 2), kwargs):
        _run_steps(None, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["profile_2.json"]


def test_build_profiler_defaults_to_cpu_activity_on_cpu() -> None:
    with build_profiler(DistributedContext()) as prof:
        assert prof.activities == {torch.profiler.ProfilerActivity.CPU}


def test_build_profiler_keeps_user_activities() -> None:
    kwargs = ProfileKwargs(activities=["cpu"], record_shapes=True)
    with build_profiler(DistributedContext(), kwargs) as prof:
        assert prof.activities == {torch.profiler.ProfilerActivity.CPU}
        assert prof.record_shapes is True


def test_build_profiler_adds_cuda_activity_for_cuda_context() -> None:
    ctx = DistributedContext(device=torch.device("cuda", 0))
    if torch.cuda.is_available():
        with build_profiler(ctx) as prof:
            assert torch.profiler.ProfilerActivity.CUDA in prof.activities
    else:
        # The CUDA activity was asked for, and this machine cannot profile it.
        with pytest.raises(ValueError, match=r"activity 'cuda' cannot be profiled"):
            build_profiler(ctx)


def test_build_profiler_without_trace_dir_writes_nothing(tmp_path: Path) -> None:
    with build_profiler(DistributedContext()) as prof:
        with torch.profiler.record_function("my_label"):
            torch.ones(2) @ torch.ones(2)
    names = {event.key for event in prof.key_averages()}
    assert "my_label" in names
    assert list(tmp_path.iterdir()) == []


def test_build_profiler_exports_nothing_when_body_raises(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    kwargs = ProfileKwargs(output_trace_dir=out)
    with pytest.raises(KeyError, match="boom"):
        with build_profiler(DistributedContext(), kwargs):
            _run_steps(None, 1)
            raise KeyError("boom")
    assert not out.exists()


def test_build_profiler_exports_nothing_when_scheduled_body_raises(
    tmp_path: Path,
) -> None:
    kwargs = ProfileKwargs(schedule_option=SCHEDULE, output_trace_dir=tmp_path)
    with pytest.raises(RuntimeError, match="mid-window"):
        with build_profiler(DistributedContext(), kwargs) as prof:
            _run_steps(prof, 3)  # steps 0-2: wait, warmup, first active step
            raise RuntimeError("mid-window")
    assert list(tmp_path.iterdir()) == []


@_ONE_WINDOW_AT_A_TIME
def test_build_profiler_writes_one_file_per_completed_cycle(tmp_path: Path) -> None:
    option = {**SCHEDULE, "repeat": 2}
    kwargs = ProfileKwargs(schedule_option=option, output_trace_dir=tmp_path)
    with build_profiler(DistributedContext(), kwargs) as prof:
        _run_steps(prof, 10)  # windows: steps 2-3 and 6-7; 8, 9 after repeat ends
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["profile_0.json", "profile_0_cycle0.json", "profile_0_cycle1.json"]
    assert _labels(tmp_path / "profile_0_cycle0.json") == {"step2", "step3"}
    assert _labels(tmp_path / "profile_0_cycle1.json") == {"step6", "step7"}
    # No window was open at the end: the final file is the last completed one.
    assert _labels(tmp_path / "profile_0.json") == {"step6", "step7"}


@_ONE_WINDOW_AT_A_TIME
def test_build_profiler_final_trace_holds_window_cut_short(tmp_path: Path) -> None:
    kwargs = ProfileKwargs(schedule_option=SCHEDULE, output_trace_dir=tmp_path)
    with build_profiler(DistributedContext(), kwargs) as prof:
        _run_steps(prof, 7)  # a window at 2-3, then 6 opens the next one
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["profile_0.json", "profile_0_cycle0.json"]
    assert _labels(tmp_path / "profile_0_cycle0.json") == {"step2", "step3"}
    assert _labels(tmp_path / "profile_0.json") == {"step6"}


def test_build_profiler_rejects_schedule_that_recorded_nothing(tmp_path: Path) -> None:
    kwargs = ProfileKwargs(
        schedule_option={"wait": 5, "warmup": 1, "active": 1},
        output_trace_dir=tmp_path,
    )
    with pytest.raises(ValueError, match=r"ended at profiler step 2, before the first"):
        with build_profiler(DistributedContext(), kwargs) as prof:
            _run_steps(prof, 2)
    assert list(tmp_path.iterdir()) == []


def test_build_profiler_calls_user_handler_instead_of_cycle_files(
    tmp_path: Path,
) -> None:
    seen: list[int] = []

    def handler(prof: torch.profiler.profile) -> None:
        seen.append(prof.step_num)

    kwargs = ProfileKwargs(
        schedule_option={**SCHEDULE, "repeat": 1},
        on_trace_ready=handler,
        output_trace_dir=tmp_path,
    )
    with build_profiler(DistributedContext(), kwargs) as prof:
        _run_steps(prof, 5)
    assert seen == [4]
    assert [p.name for p in tmp_path.iterdir()] == ["profile_0.json"]
    assert _labels(tmp_path / "profile_0.json") == {"step2", "step3"}


def test_build_profiler_skips_ranks_not_chosen(tmp_path: Path) -> None:
    kwargs = ProfileKwargs(output_trace_dir=tmp_path)
    with build_profiler(rank_ctx(2, 0), kwargs, ranks=[1]) as prof:
        assert prof is None
        _run_steps(prof, 1)
    assert list(tmp_path.iterdir()) == []
    with build_profiler(rank_ctx(2, 1), kwargs, ranks={1}) as chosen:
        assert isinstance(chosen, torch.profiler.profile)
    assert [p.name for p in tmp_path.iterdir()] == ["profile_1.json"]


def test_build_profiler_reports_uncreatable_trace_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    kwargs = ProfileKwargs(output_trace_dir=blocker / "traces")
    with pytest.raises(
        OSError, match=r"build_profiler: cannot create output_trace_dir"
    ):
        with build_profiler(DistributedContext(), kwargs):
            pass


@pytest.mark.parametrize(
    ("ranks", "error", "match"),
    [
        (
            [2],
            ValueError,
            r"every item of ranks \(2\) must be in \[0, num_processes=2\)\.",
        ),
        (
            [-1],
            ValueError,
            r"every item of ranks \(-1\) must be in \[0, num_processes=2\)",
        ),
        ("0", TypeError, r"ranks must be a collection of ints .* got '0'"),
        (0, TypeError, r"ranks must be a collection .* got 0 \(int\)"),
        ([True], TypeError, r"every item of ranks must be an int; got True \(bool\)"),
    ],
)
def test_build_profiler_rejects_bad_ranks(
    ranks: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        build_profiler(rank_ctx(2, 0), ranks=ranks)


def test_build_profiler_rejects_wrong_argument_types() -> None:
    with pytest.raises(TypeError, match=r"build_profiler: ctx must be a Distributed"):
        build_profiler("cpu")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"kwargs must be a ProfileKwargs .*dict"):
        build_profiler(DistributedContext(), {"record_shapes": True})  # type: ignore[call-overload]


def _profile_every_rank(ctx: DistributedContext, out: Path) -> list[str]:
    with build_profiler(ctx, ProfileKwargs(output_trace_dir=out / "all")):
        with torch.profiler.record_function(f"my_label_rank{ctx.process_index}"):
            torch.ones(8) @ torch.ones(8)
    cycles = ProfileKwargs(schedule_option=SCHEDULE, output_trace_dir=out / "cycles")
    with build_profiler(ctx, cycles) as prof:
        _run_steps(prof, 4)
    chosen = ProfileKwargs(output_trace_dir=out / "chosen")
    with build_profiler(ctx, chosen, ranks=[1]) as maybe:
        _run_steps(maybe, 1)
        return [type(maybe).__name__]


@pytest.mark.distributed
def test_build_profiler_on_two_processes_writes_one_trace_per_rank(
    tmp_path: Path,
) -> None:
    yielded = run_ranks(_profile_every_rank, 2, tmp_path, start_method="forkserver")
    assert yielded == [["NoneType"], ["profile"]]
    all_dir = tmp_path / "all"
    assert sorted(p.name for p in all_dir.iterdir()) == [
        "profile_0.json",
        "profile_1.json",
    ]
    for rank in (0, 1):
        assert _labels(all_dir / f"profile_{rank}.json", "my_") == {
            f"my_label_rank{rank}"
        }
        assert _labels(tmp_path / "cycles" / f"profile_{rank}_cycle0.json") == {
            "step2",
            "step3",
        }
    assert sorted(p.name for p in (tmp_path / "cycles").iterdir()) == [
        "profile_0.json",
        "profile_0_cycle0.json",
        "profile_1.json",
        "profile_1_cycle0.json",
    ]
    assert [p.name for p in (tmp_path / "chosen").iterdir()] == ["profile_1.json"]


def test_build_profiler_exports_final_trace_after_user_handler_saved_it(
    tmp_path: Path,
) -> None:
    user_file = tmp_path / "user.json"

    def save_it(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(user_file))

    kwargs = ProfileKwargs(on_trace_ready=save_it, output_trace_dir=tmp_path / "out")
    with build_profiler(DistributedContext(), kwargs):
        _run_steps(None, 2)
    assert _labels(user_file) == {"step0", "step1"}
    assert _labels(tmp_path / "out" / "profile_0.json") == {"step0", "step1"}
