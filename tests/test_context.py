"""DistributedContext as a value: hand-built, frozen, from an environment, and real."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import re
import socket
import subprocess
import sys
import types
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import funcaccel
from funcaccel.context import CollectiveTimeout
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.context import build_context
from funcaccel.context import close_context
from funcaccel.context import context_from_env
from funcaccel.context import effective_backend
from funcaccel.context import effective_timeout
from funcaccel.context import require_process_group
from funcaccel.kwargs import InitProcessGroupKwargs
from funcaccel.launch import launch
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx


@given(data=st.data(), num_processes=st.integers(min_value=1, max_value=64))
def test_a_hand_built_context_describes_any_rank(
    data: st.DataObject, num_processes: int
) -> None:
    rank = data.draw(st.integers(min_value=0, max_value=num_processes - 1))
    local = data.draw(st.integers(min_value=0, max_value=7))
    kind = DistributedType.NO if num_processes == 1 else DistributedType.MULTI_CPU
    ctx = DistributedContext(
        num_processes=num_processes,
        process_index=rank,
        local_process_index=local,
        distributed_type=kind,
    )
    assert ctx.is_main_process == (rank == 0)
    assert ctx.is_local_main_process == (local == 0)
    assert ctx.is_last_process == (rank == num_processes - 1)
    assert ctx.use_distributed == (num_processes > 1)
    assert ctx.device == torch.device("cpu")
    assert ctx.mixed_precision == "no"


def test_default_context_is_one_cpu_process() -> None:
    ctx = DistributedContext()
    assert (ctx.num_processes, ctx.process_index, ctx.local_process_index) == (1, 0, 0)
    assert ctx.distributed_type is DistributedType.NO
    assert ctx.backend is None
    assert ctx.is_main_process and ctx.is_local_main_process and ctx.is_last_process


def test_context_is_frozen_and_changed_only_by_replace() -> None:
    ctx = DistributedContext()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.process_index = 1  # type: ignore[misc]
    bf16 = dataclasses.replace(ctx, mixed_precision="bf16")
    assert ctx.mixed_precision == "no" and bf16.mixed_precision == "bf16"
    with pytest.raises(ValueError, match=r"process_index \(3\) must be in"):
        dataclasses.replace(ctx, process_index=3)


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        (None, None),
        (3, timedelta(seconds=3)),
        (2.5, timedelta(seconds=2.5)),
        (timedelta(minutes=1), timedelta(minutes=1)),
        ("off", "off"),
    ],
)
def test_collective_timeout_is_stored_as_a_timedelta(
    given: CollectiveTimeout, stored: CollectiveTimeout
) -> None:
    ctx = DistributedContext(collective_timeout=given)
    assert ctx.collective_timeout == stored
    assert ctx == DistributedContext(collective_timeout=stored)
    environ = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    from_env = context_from_env(environ, cpu=True, collective_timeout=given)
    assert from_env.collective_timeout == stored
    one = build_context(cpu=True, environ={}, collective_timeout=given)
    assert one.collective_timeout == stored


def test_context_from_env_names_itself_for_a_bad_collective_timeout() -> None:
    environ = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    with pytest.raises(ValueError, match=r"^context_from_env: collective_timeout must"):
        context_from_env(environ, cpu=True, collective_timeout=-1)


def test_two_contexts_in_one_process_never_affect_each_other() -> None:
    first = context_from_env(
        {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}, cpu=True
    )
    second = context_from_env({}, cpu=True, mixed_precision="bf16")
    hand = rank_ctx(8, 7)
    assert (first.num_processes, first.process_index, first.mixed_precision) == (
        4,
        1,
        "no",
    )
    assert (second.num_processes, second.mixed_precision) == (1, "bf16")
    assert hand.is_last_process and not first.is_last_process
    assert first == context_from_env(
        {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}, cpu=True
    )
    assert hash(first) == hash(
        context_from_env({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}, cpu=True)
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {
                "num_processes": 4,
                "process_index": 4,
                "distributed_type": DistributedType.MULTI_CPU,
            },
            ValueError,
            r"DistributedContext: process_index \(4\) must be in \[0, num_processes=4\)",
        ),
        ({"num_processes": 0}, ValueError, r"num_processes \(0\) must be >= 1"),
        ({"process_index": -1}, ValueError, r"process_index \(-1\) must be in"),
        (
            {"local_process_index": -2},
            ValueError,
            r"local_process_index \(-2\) must be >= 0",
        ),
        ({"num_processes": 2.0}, TypeError, r"num_processes must be an int; got 2\.0"),
        ({"process_index": True}, TypeError, r"process_index must be an int; got True"),
        ({"device": "cpu"}, TypeError, r"device must be a torch\.device; got 'cpu'"),
        (
            {"distributed_type": "NO"},
            TypeError,
            r"distributed_type must be a DistributedType",
        ),
        (
            {"mixed_precision": "fp8"},
            ValueError,
            r"mixed_precision must be one of 'no', 'fp16', 'bf16'; got 'fp8'\. "
            r"fp8 is not supported\.$",
        ),
        (
            {"mixed_precision": "fp32"},
            ValueError,
            r"mixed_precision must be one of 'no', 'fp16', 'bf16'; got 'fp32'\.$",
        ),
        ({"backend": 3}, TypeError, r"backend must be a str or None; got 3"),
        (
            {"collective_timeout": "60"},
            TypeError,
            r"collective_timeout must be a datetime\.timedelta, a number of seconds, "
            r"None \(the process group's timeout\) or 'off'; got '60' \(str\)",
        ),
        (
            {"collective_timeout": "Off"},
            TypeError,
            r"collective_timeout must be .* or 'off'; got 'Off'",
        ),
        ({"collective_timeout": True}, TypeError, r"collective_timeout must be a"),
        ({"collective_timeout": 0}, ValueError, r"collective_timeout must be positive"),
        (
            {"collective_timeout": timedelta(seconds=-1)},
            ValueError,
            r"collective_timeout must be positive",
        ),
        (
            {"collective_timeout": float("inf")},
            ValueError,
            r"collective_timeout must be a finite number of seconds; got inf",
        ),
        (
            {"num_processes": 2},
            ValueError,
            r"distributed_type must be MULTI_CPU with num_processes=2 on device cpu; "
            r"got 'NO'\. Pass distributed_type=DistributedType\.MULTI_CPU\.",
        ),
        (
            {"distributed_type": DistributedType.MULTI_CPU},
            ValueError,
            r"distributed_type must be NO with num_processes=1; got 'MULTI_CPU'",
        ),
        (
            {"num_processes": 2, "distributed_type": DistributedType.MULTI_GPU},
            ValueError,
            r"must be MULTI_CPU with num_processes=2 on device cpu; got 'MULTI_GPU'",
        ),
        (
            {
                "num_processes": 2,
                "distributed_type": DistributedType.MULTI_CPU,
                "device": torch.device("cuda", 0),
            },
            ValueError,
            r"must be MULTI_GPU with num_processes=2 on device cuda:0; got 'MULTI_CPU'",
        ),
    ],
)
def test_context_rejects_bad_fields(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        DistributedContext(**kwargs)


def test_a_cuda_context_can_be_built_by_hand_without_a_gpu() -> None:
    ctx = DistributedContext(
        num_processes=2,
        process_index=1,
        local_process_index=1,
        device=torch.device("cuda", 1),
        distributed_type=DistributedType.MULTI_GPU,
        backend="nccl",
    )
    assert ctx.device.type == "cuda" and ctx.is_last_process


@pytest.mark.parametrize(
    "environ", [{}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": "1", "RANK": "0"}]
)
def test_context_from_env_without_a_world_is_one_process(
    environ: dict[str, str],
) -> None:
    ctx = context_from_env(environ, cpu=True)
    assert ctx == DistributedContext()


def test_context_from_env_reads_torchrun_variables() -> None:
    environ = {
        "WORLD_SIZE": "4",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    snapshot = dict(environ)
    ctx = context_from_env(environ, cpu=True, mixed_precision="bf16")
    assert ctx == DistributedContext(
        num_processes=4,
        process_index=3,
        local_process_index=1,
        distributed_type=DistributedType.MULTI_CPU,
        mixed_precision="bf16",
        backend="gloo",
    )
    assert environ == snapshot


def test_context_from_env_reads_only_the_mapping_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    ctx = context_from_env(
        {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, cpu=True
    )
    assert (ctx.num_processes, ctx.process_index, ctx.mixed_precision) == (2, 0, "no")


def test_context_from_env_honours_a_user_backend() -> None:
    environ = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    ctx = context_from_env(
        environ, cpu=True, init_kwargs=InitProcessGroupKwargs(backend="mpi")
    )
    assert ctx.backend == "mpi"


@pytest.mark.parametrize(
    ("environ", "pattern"),
    [
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"context_from_env: RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, r"context_from_env: LOCAL_RANK is not set"),
        (
            {"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"},
            r"WORLD_SIZE must be an integer; got 'two'",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "x", "LOCAL_RANK": "0"},
            r"RANK must be an integer; got 'x'",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"},
            r"invalid context: DistributedContext: process_index \(2\) must be in",
        ),
        (
            {
                "WORLD_SIZE": "2",
                "RANK": "1",
                "LOCAL_RANK": "3",
                "LOCAL_WORLD_SIZE": "2",
            },
            r"LOCAL_RANK must be in \[0, LOCAL_WORLD_SIZE=2\); got 3",
        ),
        (
            {"WORLD_SIZE": "0", "RANK": "0", "LOCAL_RANK": "0"},
            r"num_processes \(0\) must be >= 1",
        ),
    ],
)
def test_context_from_env_names_a_missing_or_malformed_variable(
    environ: dict[str, str], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        context_from_env(environ, cpu=True)


def test_context_from_env_rejects_unknown_mixed_precision() -> None:
    with pytest.raises(ValueError, match=r"one of 'no', 'fp16', 'bf16'; got 'fp8'"):
        context_from_env({}, mixed_precision="fp8")  # type: ignore[arg-type]


def test_fp16_on_cpu_is_honoured_where_torch_supports_it() -> None:
    ctx = context_from_env({}, cpu=True, mixed_precision="fp16")
    assert ctx.mixed_precision == "fp16"
    with torch.autocast("cpu", dtype=torch.float16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_context_from_env_puts_each_local_rank_on_its_gpu() -> None:
    count = torch.cuda.device_count()
    environ = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    ctx = context_from_env(environ)
    assert ctx.device == torch.device("cuda", 1 % count)
    assert ctx.distributed_type is DistributedType.MULTI_GPU and ctx.backend == "nccl"


# ---- device= ----------------------------------------------------------------

_LOCAL_PAIR = {
    "WORLD_SIZE": "4",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Pretend CUDA has 2 visible GPUs; return the devices set as current."""
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    return current


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    "device",
    ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0), lambda rank: "cpu"],
)
def test_an_explicit_cpu_device_is_the_cpu(device: Any) -> None:
    assert context_from_env({}, device=device) == DistributedContext()
    assert build_context(environ={}, device=device) == DistributedContext()
    ctx = context_from_env(_LOCAL_PAIR, device=device, cpu=True)
    assert ctx.device == torch.device("cpu") and ctx.device.index is None
    assert ctx.distributed_type is DistributedType.MULTI_CPU
    assert ctx.backend == "gloo"


@pytest.mark.usefixtures("no_cuda")
def test_cuda_is_refused_where_it_is_not_available() -> None:
    with pytest.raises(
        ValueError,
        match=r"^context_from_env: device must be a device this machine has: 'cpu' "
        r"\(torch\.cuda\.is_available\(\) is False\); got 'cuda:1'\. Pass "
        r"device='cpu', or run where a CUDA GPU is visible\.$",
    ):
        context_from_env({}, device="cuda:1")
    with pytest.raises(ValueError, match=r"^build_context: device must be a device"):
        build_context(environ={}, device=torch.device("cuda"))
    with pytest.raises(ValueError, match=r"^build_context: device\(1\) must be a dev"):
        build_context(environ=_LOCAL_PAIR, device=lambda rank: f"cuda:{rank}")
    assert not dist.is_initialized()


def test_the_named_gpu_is_used_and_made_current(two_gpus: list[torch.device]) -> None:
    ctx = build_context(environ={}, device="cuda:1")
    assert ctx.device == torch.device("cuda", 1)
    assert ctx.distributed_type is DistributedType.NO and ctx.backend is None
    assert two_gpus == [torch.device("cuda", 1)]
    assert context_from_env({}).device == torch.device("cuda", 0)  # the default
    assert build_context(environ={}).device == torch.device("cuda", 0)
    assert two_gpus == [torch.device("cuda", 1)]  # the default sets nothing
    # "cuda" without an index is the default rule's GPU: LOCAL_RANK % 2.
    environ = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3"}
    ctx = context_from_env(environ, device="cuda")
    assert ctx.device == torch.device("cuda", 1)
    assert ctx.distributed_type is DistributedType.MULTI_GPU and ctx.backend == "nccl"


@pytest.mark.usefixtures("two_gpus")
@pytest.mark.parametrize("device", ["cuda:2", torch.device("cuda", 7)])
def test_a_gpu_index_beyond_the_visible_ones_is_refused(device: Any) -> None:
    with pytest.raises(
        ValueError,
        match=r"^context_from_env: device must be one of the 2 visible GPU\(s\), "
        r"cuda:0 to cuda:1; got .*cuda.*\. CUDA_VISIBLE_DEVICES renumbers the GPUs "
        r"a process sees from 0\.$",
    ):
        context_from_env({}, device=device)


@pytest.mark.usefixtures("two_gpus")
def test_a_rule_gives_each_local_rank_its_device() -> None:
    asked: list[int] = []

    def rule(local_rank: int) -> str:
        asked.append(local_rank)
        return f"cuda:{1 - local_rank}"

    ctx = context_from_env(_LOCAL_PAIR, device=rule)
    assert ctx.device == torch.device("cuda", 0)  # LOCAL_RANK=1
    assert (ctx.process_index, ctx.local_process_index) == (3, 1)
    assert ctx.distributed_type is DistributedType.MULTI_GPU and ctx.backend == "nccl"
    assert asked[0] == 1 and sorted(asked[1:]) == [0, 1]  # then every local rank


@pytest.mark.usefixtures("two_gpus")
def test_local_ranks_sharing_a_gpu_under_nccl_are_refused() -> None:
    message = (
        r"^build_context: device \(by local rank\) must be a different GPU for each "
        r"of the 2 processes on this machine with the NCCL backend; got \['cuda:1', "
        r"'cuda:1'\]\. Pass a rule by local rank, e\.g\. device=lambda local_rank: "
        r"f'cuda:\{local_rank\}', or InitProcessGroupKwargs\(backend='gloo'\) to "
        r"share a GPU\.$"
    )
    with pytest.raises(ValueError, match=message):
        build_context(environ=_LOCAL_PAIR, device="cuda:1")
    with pytest.raises(ValueError, match=r"got \['cuda:0', 'cuda:0'\]"):
        context_from_env(_LOCAL_PAIR, device=lambda rank: "cuda:0")
    gloo = InitProcessGroupKwargs(backend="gloo")
    shared = context_from_env(_LOCAL_PAIR, device="cuda:1", init_kwargs=gloo)
    assert shared.device == torch.device("cuda", 1) and shared.backend == "gloo"
    # Without LOCAL_WORLD_SIZE the other local ranks are unknown: only this one is
    # checked.
    alone = {k: v for k, v in _LOCAL_PAIR.items() if k != "LOCAL_WORLD_SIZE"}
    assert context_from_env(alone, device="cuda:1").device == torch.device("cuda", 1)


@pytest.mark.usefixtures("two_gpus")
def test_local_ranks_on_different_kinds_of_device_are_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"^context_from_env: device \(by local rank\) must be of one type on "
        r"every process of this machine; got \['cpu', 'cuda:1'\]\. Pass a rule by "
        r"local rank, .* that returns one kind of device\.$",
    ):
        context_from_env(
            _LOCAL_PAIR, device=lambda rank: "cpu" if rank == 0 else "cuda:1"
        )


@pytest.mark.usefixtures("two_gpus")
def test_a_gpu_with_cpu_true_is_refused_naming_both() -> None:
    with pytest.raises(
        ValueError,
        match=r"^build_context: device must be a CPU device when cpu=True; got "
        r"'cuda:1'\. Pass cpu=True without a device, or device='cuda:1' without "
        r"cpu=True\.$",
    ):
        build_context(environ={}, device="cuda:1", cpu=True)


@pytest.mark.parametrize(
    ("device", "error", "message"),
    [
        (
            "gpu",
            ValueError,
            r"device must be a device such as 'cpu', 'cuda' or "
            r"'cuda:1', a torch\.device, or a rule local_rank -> device; got 'gpu'\.$",
        ),
        ("cuda:x", ValueError, r"device must be a device such as .*; got 'cuda:x'\.$"),
        (
            "cpu:1",
            ValueError,
            r"device must be the CPU: 'cpu' or 'cpu:0'; got "
            r"'cpu:1'\. Pass 'cpu'\.$",
        ),
        (
            "mps",
            ValueError,
            r"device must be a 'cpu' or 'cuda' device; got 'mps'\. "
            r"funcaccel computes on the CPU or on CUDA GPUs\.$",
        ),
        (3, TypeError, r"device must be a device such as .*; got 3 \(int\)\.$"),
        (
            lambda rank: 0,
            TypeError,
            r"device\(0\) must be a device such as .*; got 0 "
            r"\(int\)\.$",
        ),
    ],
)
def test_a_bad_device_is_refused(
    device: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=r"^context_from_env: " + message):
        context_from_env({}, device=device)


def test_effective_backend_and_timeout_follow_the_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    default = InitProcessGroupKwargs()
    assert effective_backend(default, cpu) == "gloo"
    assert effective_backend(default, cuda) == "nccl"
    assert effective_backend(InitProcessGroupKwargs(backend="gloo"), cuda) == "gloo"
    assert effective_backend(InitProcessGroupKwargs(backend=None), cpu) == "gloo"
    assert effective_timeout(default, "nccl") == timedelta(seconds=600)
    assert effective_timeout(default, "gloo") == timedelta(seconds=1800)
    given_timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=5))
    assert effective_timeout(given_timeout, "nccl") == timedelta(seconds=5)


def test_build_context_with_one_process_starts_nothing() -> None:
    ctx = build_context(environ={}, cpu=True)
    assert ctx == DistributedContext()
    assert not dist.is_initialized()
    close_context(ctx)  # a no-op with one process
    assert not dist.is_initialized()


def test_build_context_reads_the_rendezvous_address_from_the_given_mapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    environ = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}
    with pytest.raises(
        ValueError,
        match=r"build_context: the default rendezvous's MASTER_PORT must be set in "
        r"the environment; got None\. Launch with torchrun",
    ):
        build_context(environ=environ, cpu=True)
    assert not dist.is_initialized()


def test_require_process_group_refuses_a_missing_group() -> None:
    ctx = rank_ctx(2)
    with pytest.raises(
        RuntimeError, match=r"my_function: ctx has num_processes=2 but no"
    ):
        require_process_group(ctx, "my_function")
    require_process_group(DistributedContext(), "my_function")


def _build_for_real(tmp_path: Path) -> dict[str, object]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    environ = {
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }
    kwargs = InitProcessGroupKwargs(
        init_method=f"file://{tmp_path}/build_rendezvous",
        timeout=timedelta(seconds=60),
    )
    env_before = dict(os.environ)
    ctx = build_context(environ=environ, cpu=True, init_kwargs=kwargs)
    try:
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        again = build_context(environ=environ, cpu=True, init_kwargs=kwargs)
        swapped = {**environ, "RANK": str(world_size - 1 - rank)}
        try:
            build_context(environ=swapped, cpu=True, init_kwargs=kwargs)
            mismatch = "no error"
        except RuntimeError as error:
            mismatch = str(error)
        return {
            "ctx": ctx,
            "reused_equal": again == ctx,
            "backend": dist.get_backend(),
            "world": dist.get_world_size(),
            "sum": float(value.item()),
            "mismatch": mismatch,
            "env_unchanged": dict(os.environ) == env_before,
        }
    finally:
        close_context(ctx)
        assert not dist.is_initialized()
        close_context(ctx)


@pytest.mark.distributed
def test_build_context_starts_and_closes_a_real_group(tmp_path: Path) -> None:
    results = launch(
        _build_for_real,
        tmp_path,
        num_processes=2,
        backend=None,  # build_context starts the group
        start_method="forkserver",
        timeout_s=120,
    )
    for rank, result in enumerate(results):
        ctx = result["ctx"]
        assert isinstance(ctx, DistributedContext)
        assert (ctx.num_processes, ctx.process_index) == (2, rank)
        assert (
            ctx.distributed_type is DistributedType.MULTI_CPU and ctx.backend == "gloo"
        )
        assert result["backend"] == "gloo" and result["world"] == 2
        assert result["sum"] == 3.0
        assert result["reused_equal"] is True
        assert "the default process group has world_size=2, rank=" in str(
            result["mismatch"]
        )
        assert result["env_unchanged"] is True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _build_from_mapping(port: int) -> float:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    environ = {
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    ctx = build_context(environ=environ, cpu=True)
    try:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)
        return float(value.item())
    finally:
        close_context(ctx)


@pytest.mark.distributed
def test_build_context_rendezvous_at_the_address_in_the_mapping() -> None:
    results = launch(
        _build_from_mapping,
        _free_port(),
        num_processes=2,
        backend=None,  # build_context starts the group, at the TCP address
        start_method="forkserver",
        timeout_s=120,
    )
    assert results == [1.0, 1.0]


def _context_of_worker(ctx: DistributedContext) -> tuple[int, int, bool, bool]:
    require_process_group(ctx, "test")
    return (
        ctx.process_index,
        ctx.num_processes,
        ctx.is_main_process,
        ctx.is_last_process,
    )


@pytest.mark.distributed
def test_contexts_under_three_real_processes() -> None:
    assert run_ranks(_context_of_worker, 3, start_method="forkserver") == [
        (0, 3, True, False),
        (1, 3, False, False),
        (2, 3, False, True),
    ]


def _funcaccel_modules() -> list[types.ModuleType]:
    modules = [funcaccel]
    # Every module of every package, private helpers included.
    for info in pkgutil.walk_packages(funcaccel.__path__, prefix="funcaccel."):
        if info.name != "funcaccel.__main__":
            modules.append(importlib.import_module(info.name))
    return modules


_IMMUTABLE = (
    int,
    float,
    complex,
    str,
    bytes,
    bool,
    type(None),
    tuple,
    frozenset,
    Enum,
    timedelta,
    types.MappingProxyType,
    types.UnionType,
    re.Pattern,
    torch.dtype,
    torch.device,
)


def _is_frozen_record(value: object) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return bool(getattr(params, "frozen", False))


# torch.compile writes its own globals into the module of each frame it
# compiles (a checkpointed block's forward runs in funcaccel.model._checkpointing):
# a copy of the builtins, the modules its graph imports, the compiled function.
# They are torch's, made at run time, so the scan below skips exactly these
# names; any other global that appears after a run is still reported.
_DYNAMO_GLOBAL = re.compile(
    r"__(builtins_dict___\d+|import_\w+|compiled_fn_\w+|resume_at_\w+)"
)


def _is_mutable_state(name: str, value: object) -> bool:
    if name.startswith("__") and name.endswith("__"):
        return False  # module metadata such as __all__ and __doc__
    if _DYNAMO_GLOBAL.fullmatch(name):
        return False
    if inspect.ismodule(value) or inspect.isclass(value) or callable(value):
        return False
    if type(value).__module__ in {"typing", "typing_extensions", "__future__"}:
        return False  # TypeVar, ParamSpec, aliases, `from __future__` features
    if type(value) is object:
        return False  # a bare sentinel has no state to change
    return not (isinstance(value, _IMMUTABLE) or _is_frozen_record(value))


def _mutable_module_state() -> list[str]:
    return [
        f"{module.__name__}.{name} ({type(value).__name__})"
        for module in _funcaccel_modules()
        for name, value in vars(module).items()
        if _is_mutable_state(name, value)
    ]


def test_no_module_holds_mutable_state() -> None:
    assert _mutable_module_state() == []


def test_no_module_holds_mutable_state_after_a_compiled_checkpointed_step() -> None:
    # Compiling a checkpointed block makes dynamo install its globals in
    # funcaccel.model._checkpointing; whichever test compiled first in this
    # process, the scan must report the same (nothing).
    from funcaccel.model import ActivationCheckpointOptions
    from funcaccel.model import CompileOptions
    from funcaccel.model import _checkpointing
    from funcaccel.model import apply_activation_checkpointing
    from funcaccel.model import compile_blocks

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.linear(x))

    net = torch.nn.Sequential(Block(), Block())
    apply_activation_checkpointing(net, ActivationCheckpointOptions(blocks=[Block]))
    compile_blocks(net, CompileOptions(blocks=[Block], backend="eager"))
    net(torch.ones(2, 3, requires_grad=True)).sum().backward()
    installed = [n for n in vars(_checkpointing) if _DYNAMO_GLOBAL.fullmatch(n)]
    assert any(n.startswith("__builtins_dict___") for n in installed)
    assert _mutable_module_state() == []


def test_importing_funcaccel_reads_and_writes_no_environment_and_starts_nothing() -> (
    None
):
    script = """
import logging, os, sys
import torch, torch.distributed as dist

reads = []
original = os.environ
class Spy(dict):
    def __getitem__(self, key):
        reads.append(key); return original[key]
    def get(self, key, default=None):
        reads.append(key); return original.get(key, default)
    def __contains__(self, key):
        reads.append(key); return key in original
handlers = list(logging.getLogger().handlers)
before = dict(original)
os.environ = Spy(original)
import funcaccel
os.environ = original
assert not dist.is_initialized(), "a process group was started"
assert dict(os.environ) == before, "the environment changed"
assert logging.getLogger().handlers == handlers, "a logging handler was added"
print(sorted(set(reads)))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
