"""The kwargs handlers: fields, defaults, to_kwargs() and validation."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcaccel.kwargs import AutocastKwargs
from funcaccel.kwargs import DDPCommunicationHookType
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.kwargs import InitProcessGroupKwargs
from funcaccel.kwargs import KwargsHandler
from funcaccel.kwargs import ProfileKwargs
from funcaccel.kwargs._profile import supported_activities

EXPECTED_DEFAULTS: dict[type[KwargsHandler], dict[str, object]] = {
    AutocastKwargs: {"enabled": True, "cache_enabled": None},
    DistributedDataParallelKwargs: {
        "dim": 0,
        "broadcast_buffers": True,
        "bucket_cap_mb": 25,
        "find_unused_parameters": False,
        "check_reduction": False,
        "gradient_as_bucket_view": False,
        "static_graph": False,
        "comm_hook": "no",
        "comm_wrapper": "no",
        "comm_state_option": {},
    },
    GradScalerKwargs: {
        "init_scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "enabled": True,
    },
    InitProcessGroupKwargs: {"backend": "nccl", "init_method": None, "timeout": None},
    ProfileKwargs: {
        "activities": None,
        "schedule_option": None,
        "on_trace_ready": None,
        "record_shapes": False,
        "profile_memory": False,
        "with_stack": False,
        "with_flops": False,
        "with_modules": False,
        "output_trace_dir": None,
    },
}


@pytest.mark.parametrize("cls", list(EXPECTED_DEFAULTS))
def test_handler_fields_and_defaults_are_the_documented_ones(
    cls: type[KwargsHandler],
) -> None:
    handler = cls()
    names = [f.name for f in dataclasses.fields(handler)]
    assert names == list(EXPECTED_DEFAULTS[cls])
    for name, default in EXPECTED_DEFAULTS[cls].items():
        assert getattr(handler, name) == default
    assert handler.to_kwargs() == {}


@pytest.mark.parametrize("cls", list(EXPECTED_DEFAULTS))
def test_handlers_are_frozen_and_keyword_only(cls: type[KwargsHandler]) -> None:
    handler = cls()
    first = dataclasses.fields(handler)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(handler, first, getattr(handler, first))
    positional: list[Any] = [getattr(handler, first)]
    with pytest.raises(TypeError):
        cls(*positional)


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (AutocastKwargs(enabled=False), {"enabled": False}),
        (AutocastKwargs(cache_enabled=None), {}),
        (AutocastKwargs(cache_enabled=False), {"cache_enabled": False}),
        (
            DistributedDataParallelKwargs(
                find_unused_parameters=True, comm_hook="power_sgd"
            ),
            {"find_unused_parameters": True},
        ),
        (
            DistributedDataParallelKwargs(
                dim=1,
                broadcast_buffers=False,
                bucket_cap_mb=50,
                check_reduction=True,
                gradient_as_bucket_view=True,
                static_graph=True,
            ),
            {
                "dim": 1,
                "broadcast_buffers": False,
                "bucket_cap_mb": 50,
                "check_reduction": True,
                "gradient_as_bucket_view": True,
                "static_graph": True,
            },
        ),
        (GradScalerKwargs(init_scale=1024), {"init_scale": 1024}),
        (GradScalerKwargs(init_scale=65536.0), {}),
        (GradScalerKwargs(init_scale=65536), {}),
        (
            GradScalerKwargs(
                growth_factor=3.0, backoff_factor=0.25, growth_interval=10
            ),
            {"growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 10},
        ),
        (GradScalerKwargs(enabled=False), {"enabled": False}),
        (InitProcessGroupKwargs(), {}),
        (InitProcessGroupKwargs(backend="gloo"), {"backend": "gloo"}),
        (
            InitProcessGroupKwargs(timeout=timedelta(seconds=600)),
            {"timeout": timedelta(seconds=600)},
        ),
        (
            InitProcessGroupKwargs(init_method="tcp://127.0.0.1:1"),
            {"init_method": "tcp://127.0.0.1:1"},
        ),
        (ProfileKwargs(record_shapes=True), {"record_shapes": True}),
        (
            ProfileKwargs(
                activities=["cpu"],
                schedule_option={"wait": 1, "warmup": 1, "active": 2},
            ),
            {
                "activities": ("cpu",),
                "schedule_option": {"wait": 1, "warmup": 1, "active": 2},
            },
        ),
        (ProfileKwargs(output_trace_dir="traces"), {"output_trace_dir": "traces"}),
    ],
)
def test_to_kwargs_returns_only_non_default_fields(
    handler: KwargsHandler, expected: dict[str, Any]
) -> None:
    assert handler.to_kwargs() == expected
    assert list(handler.to_kwargs()) == list(expected)


def test_to_kwargs_returns_a_fresh_dict_each_time() -> None:
    handler = GradScalerKwargs(init_scale=8.0)
    first = handler.to_kwargs()
    first["init_scale"] = 1.0
    assert handler.to_kwargs() == {"init_scale": 8.0}
    assert handler.init_scale == 8.0


def test_to_kwargs_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert InitProcessGroupKwargs(backend="gloo").to_kwargs() == {"backend": "gloo"}
    assert AutocastKwargs().to_kwargs() == {}


@given(
    init_scale=st.floats(min_value=1e-3, max_value=1e9),
    growth_factor=st.floats(min_value=1.001, max_value=100),
    backoff_factor=st.floats(min_value=1e-3, max_value=0.999),
    growth_interval=st.integers(min_value=1, max_value=10_000),
    enabled=st.booleans(),
)
def test_grad_scaler_kwargs_round_trip_through_to_kwargs(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    enabled: bool,
) -> None:
    handler = GradScalerKwargs(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        enabled=enabled,
    )
    assert GradScalerKwargs(**handler.to_kwargs()) == handler
    # Whatever it returns, torch accepts it.
    scaler = torch.amp.GradScaler("cpu", **handler.to_kwargs())
    assert scaler.is_enabled() == enabled


def test_comm_hook_accepts_strings_and_enum_members_alike() -> None:
    by_string = DistributedDataParallelKwargs(comm_hook="fp16")
    by_member = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    assert by_string == by_member
    assert by_string.comm_hook == "fp16"
    assert by_string.comm_hook is DDPCommunicationHookType.FP16


def test_comm_state_option_is_stored_as_a_copy() -> None:
    options = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 10}
    handler = DistributedDataParallelKwargs(
        comm_hook="power_sgd", comm_state_option=options
    )
    options["matrix_approximation_rank"] = 5
    assert handler.comm_state_option == {
        "matrix_approximation_rank": 2,
        "start_powerSGD_iter": 10,
    }


@pytest.mark.parametrize("hook", ["power_sgd", "batched_power_sgd"])
@pytest.mark.parametrize("wrapper", ["no", "fp16", "bf16"])
def test_power_sgd_hooks_take_any_wrapper(hook: str, wrapper: str) -> None:
    handler = DistributedDataParallelKwargs(comm_hook=hook, comm_wrapper=wrapper)
    assert handler.comm_wrapper == wrapper


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"comm_hook": "fp32"},
            ValueError,
            r"DistributedDataParallelKwargs: comm_hook must be one of 'no', 'fp16', "
            r"'bf16', 'power_sgd', 'batched_power_sgd'; got 'fp32'\.",
        ),
        (
            {"comm_wrapper": "fp16"},
            ValueError,
            r"comm_hook must be 'power_sgd' or 'batched_power_sgd' when "
            r"comm_wrapper='fp16'; got 'no'\.",
        ),
        (
            {"comm_hook": "fp16", "comm_wrapper": "bf16"},
            ValueError,
            r"comm_hook must be 'power_sgd' or 'batched_power_sgd' when "
            r"comm_wrapper='bf16'; got 'fp16'\. Only the PowerSGD hooks take a wrapper",
        ),
        (
            {"comm_hook": "power_sgd", "comm_wrapper": "power_sgd"},
            ValueError,
            r"comm_wrapper must be one of 'no', 'fp16', 'bf16'; got 'power_sgd'",
        ),
        (
            {
                "comm_hook": "fp16",
                "comm_state_option": {"matrix_approximation_rank": 2},
            },
            ValueError,
            r"comm_state_option must be empty with comm_hook='fp16'; got "
            r"\{'matrix_approximation_rank': 2\}\. Only the PowerSGD hooks read it\.",
        ),
        (
            {"comm_hook": "power_sgd", "comm_state_option": {"rank": 2}},
            ValueError,
            r"every key of comm_state_option must be one of "
            r"'matrix_approximation_rank', .*; got 'rank'\.",
        ),
        (
            {"comm_hook": "power_sgd", "comm_state_option": {"start_powerSGD_iter": 1}},
            ValueError,
            r"start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is "
            r"true; got 1\. Set both to False, or start later\.",
        ),
        (
            {
                "comm_hook": "power_sgd",
                "comm_state_option": {"matrix_approximation_rank": 0},
            },
            ValueError,
            r"matrix_approximation_rank'\] must be >= 1; got 0",
        ),
        (
            {"comm_hook": "power_sgd", "comm_state_option": {"warm_start": "yes"}},
            ValueError,
            r"comm_state_option\['warm_start'\] must be a bool; got 'yes'",
        ),
        ({"comm_hook": 3}, TypeError, r"comm_hook must be a str; got 3"),
        ({"comm_state_option": [1]}, TypeError, r"comm_state_option must be a mapping"),
        (
            {"bucket_cap_mb": 0},
            ValueError,
            r"bucket_cap_mb must be a number > 0; got 0",
        ),
        (
            {"bucket_cap_mb": "25"},
            TypeError,
            r"bucket_cap_mb must be a number \(MB\); got '25' \(str\)",
        ),
        ({"dim": -1}, ValueError, r"dim must be an int >= 0; got -1"),
        ({"static_graph": 1}, TypeError, r"static_graph must be a bool; got 1 \(int\)"),
        ({"broadcast_buffers": 0}, TypeError, r"broadcast_buffers must be a bool"),
    ],
)
def test_ddp_kwargs_reject_bad_values(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        DistributedDataParallelKwargs(**kwargs)


def test_power_sgd_start_iter_one_is_fine_without_feedback_or_warm_start() -> None:
    options = {
        "start_powerSGD_iter": 1,
        "use_error_feedback": False,
        "warm_start": False,
    }
    handler = DistributedDataParallelKwargs(
        comm_hook="power_sgd", comm_state_option=options
    )
    assert handler.comm_state_option == options


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"growth_factor": 1.0},
            ValueError,
            r"GradScalerKwargs: growth_factor must be > 1\.0; got 1\.0\. Use e\.g\. 2\.0\.",
        ),
        (
            {"backoff_factor": 1.5},
            ValueError,
            r"backoff_factor must be in \(0, 1\); got 1\.5",
        ),
        (
            {"backoff_factor": 0},
            ValueError,
            r"backoff_factor must be in \(0, 1\); got 0",
        ),
        (
            {"init_scale": 0},
            ValueError,
            r"init_scale must be a finite number > 0; got 0",
        ),
        (
            {"init_scale": float("inf")},
            ValueError,
            r"init_scale must be a finite number",
        ),
        (
            {"growth_interval": 0},
            ValueError,
            r"growth_interval must be an int >= 1; got 0",
        ),
        ({"growth_interval": 2.5}, ValueError, r"growth_interval must be an int >= 1"),
        ({"enabled": "yes"}, TypeError, r"enabled must be a bool; got 'yes' \(str\)"),
    ],
)
def test_grad_scaler_kwargs_reject_bad_values(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        GradScalerKwargs(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"enabled": "yes"},
            TypeError,
            r"AutocastKwargs: enabled must be a bool; got 'yes' \(str\)\.",
        ),
        ({"cache_enabled": 1}, TypeError, r"cache_enabled must be a bool; got 1"),
    ],
)
def test_autocast_kwargs_reject_bad_values(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        AutocastKwargs(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"timeout": 30},
            TypeError,
            r"timeout must be a datetime\.timedelta or None; got 30",
        ),
        ({"timeout": timedelta(0)}, ValueError, r"timeout must be positive"),
        ({"backend": 5}, TypeError, r"backend must be a str or None; got 5"),
        (
            {"backend": ""},
            ValueError,
            r"backend must be non-empty; got ''\. Pass None for the default\.",
        ),
    ],
)
def test_init_process_group_kwargs_reject_bad_values(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        InitProcessGroupKwargs(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"activities": ["gpu"]},
            ValueError,
            r"ProfileKwargs: every activity must be one of 'cpu', 'cuda', 'xpu', 'hpu', "
            r"'mtia'; got 'gpu'\.",
        ),
        ({"activities": "cpu"}, TypeError, r"activities must be a sequence of names"),
        (
            {"schedule_option": {"wait": 1, "warmup": 1}},
            ValueError,
            r"ProfileKwargs: schedule_option must be a mapping with 'wait', 'warmup' "
            r"and 'active'; got \{'wait': 1, 'warmup': 1\}\. Add \['active'\]\.",
        ),
        (
            {"schedule_option": {"wait": 1, "warmup": 1, "active": 1, "cycles": 2}},
            ValueError,
            r"every key of schedule_option must be one of 'wait', .*; got 'cycles'",
        ),
        (
            {"schedule_option": {"wait": -1, "warmup": 1, "active": 1}},
            ValueError,
            r"schedule_option\['wait'\] must be an int >= 0; got -1",
        ),
        (
            {"schedule_option": {"wait": 0, "warmup": 0, "active": 0}},
            ValueError,
            r"schedule_option\['active'\] must be >= 1; got 0",
        ),
        ({"on_trace_ready": 3}, TypeError, r"on_trace_ready must be callable; got 3"),
        ({"with_flops": None}, TypeError, r"with_flops must be a bool; got None"),
        ({"record_shapes": 1}, TypeError, r"record_shapes must be a bool; got 1"),
        ({"output_trace_dir": 7}, TypeError, r"output_trace_dir must be a path"),
    ],
)
def test_profile_kwargs_reject_bad_values(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        ProfileKwargs(**kwargs)


def test_profile_kwargs_store_copies_of_sequences_and_mappings() -> None:
    activities = ["cpu"]
    schedule = {"wait": 0, "warmup": 0, "active": 1}
    handler = ProfileKwargs(activities=activities, schedule_option=schedule)
    activities.append("cuda")
    schedule["active"] = 5
    assert handler.activities == ("cpu",)
    assert handler.schedule_option == {"wait": 0, "warmup": 0, "active": 1}


def test_profile_kwargs_build_returns_an_unstarted_profiler_that_records(
    tmp_path: Path,
) -> None:
    handler = ProfileKwargs(activities=["cpu"], record_shapes=True, with_flops=True)
    profiler = handler.build()
    assert isinstance(profiler, torch.profiler.profile)
    assert profiler.record_shapes and profiler.with_flops
    with profiler:
        with torch.profiler.record_function("funcaccel_label"):
            torch.ones(4, 4) @ torch.ones(4, 4)
    trace = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(trace))
    names = {
        event.get("name") for event in json.loads(trace.read_text())["traceEvents"]
    }
    assert "funcaccel_label" in names


def test_profile_kwargs_build_applies_the_schedule() -> None:
    cycles: list[int] = []
    handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
        on_trace_ready=lambda prof: cycles.append(prof.step_num),
    )
    with handler.build() as profiler:
        for _ in range(6):
            torch.ones(2) + 1
            profiler.step()
    assert cycles == [4]


@pytest.mark.parametrize("activity", ["cuda", "xpu", "hpu", "mtia"])
def test_profile_kwargs_build_refuses_an_activity_this_machine_cannot_profile(
    activity: str,
) -> None:
    supported = {a.name.lower() for a in supported_activities()}
    if activity in supported:
        pytest.skip(f"{activity} can be profiled here")
    with pytest.raises(ValueError, match=rf"activity '{activity}' cannot be profiled"):
        ProfileKwargs(activities=[activity]).build()
