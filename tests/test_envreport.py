"""Tests for env_report and ``python -m funcaccel env``."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
import torch.distributed as dist

import funcaccel
from funcaccel.__main__ import main
from funcaccel.context import context_from_env
from funcaccel.envreport import env_report

REPO = Path(__file__).resolve().parents[1]
TWO_RANKS = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}


def _section(report: str, title: str) -> dict[str, str]:
    """Parse one section of the report into {key: value}."""
    lines = report.splitlines()
    start = lines.index(title) + 1
    rows: dict[str, str] = {}
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        key, _, value = line.strip().partition("  ")
        rows[key] = value.strip()
    return rows


def test_env_report_lists_versions_and_devices() -> None:
    versions = _section(env_report({}), "versions")
    assert versions["funcaccel"] == funcaccel.__version__
    assert versions["torch"] == torch.__version__
    assert versions["Python"].startswith(platform.python_version())
    assert versions["platform"] == platform.platform()
    assert versions["CUDA devices"] == str(torch.cuda.device_count())
    expected_backends = (
        f"gloo: {'yes' if dist.is_gloo_available() else 'no'}, "
        f"nccl: {'yes' if dist.is_nccl_available() else 'no'}, "
        f"mpi: {'yes' if dist.is_mpi_available() else 'no'}"
    )
    assert versions["backends"] == expected_backends
    if torch.version.cuda is None:
        assert versions["CUDA"] == "not in this torch build"
        assert versions["cuDNN"] == "not available"
    else:
        assert versions["CUDA"].startswith(torch.version.cuda)
        cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
        assert versions["cuDNN"] == ("not available" if cudnn is None else str(cudnn))


def test_env_report_shows_the_context_the_environment_gives() -> None:
    environ = MappingProxyType(dict(TWO_RANKS))
    report = env_report(environ)
    ctx = context_from_env(environ)
    shown = _section(report, "context_from_env")
    assert shown == {f.name: str(getattr(ctx, f.name)) for f in dataclasses.fields(ctx)}
    assert shown["process_index"] == "1" and shown["num_processes"] == "2"
    assert _section(report, "launch variables") == TWO_RANKS
    assert dict(environ) == TWO_RANKS


def test_env_report_shows_a_context_error_instead_of_raising() -> None:
    report = env_report({"WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    shown = _section(report, "context_from_env")
    assert shown == {
        "error": "ValueError: context_from_env: RANK is not set but WORLD_SIZE='2'; "
        "launch with torchrun, which sets RANK, WORLD_SIZE and LOCAL_RANK."
    }


def test_env_report_reads_the_given_mapping_not_os_environ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    report = env_report({})
    assert _section(report, "launch variables") == {"(none set)": "one process"}
    assert _section(report, "context_from_env")["num_processes"] == "1"


def test_main_env_prints_the_report_of_os_environ(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in TWO_RANKS.items():
        monkeypatch.setenv(name, value)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out == env_report(os.environ) + "\n"


def test_main_rejects_an_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bogus"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_python_dash_m_funcaccel_env_runs() -> None:
    environ = {**os.environ, **TWO_RANKS, "RANK": "7"}
    done = subprocess.run(
        [sys.executable, "-m", "funcaccel", "env"],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert _section(done.stdout, "versions")["torch"] == torch.__version__
    error = _section(done.stdout, "context_from_env")["error"]
    assert "process_index (7) must be in [0, num_processes=2)" in error


def test_env_report_shows_cuda_and_cudnn_of_a_cuda_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Simulate a CUDA build on a machine without a usable GPU.
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    versions = _section(env_report({}), "versions")
    assert versions["CUDA"] == "12.4 (built in, but no usable GPU or driver)"
    assert versions["cuDNN"] == "90100"


def test_env_report_shows_this_ranks_place_in_a_mesh() -> None:
    environ = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2"}
    assert "mesh" not in env_report(environ).splitlines()
    shown = _section(env_report(environ, mesh=(1, -1, 2)), "mesh")
    assert shown == {
        "shape": "dp_replicate=1 x dp_shard=2 x tp=2",
        "coordinates": "(0, 1, 0)",
        "dp_rank": "1 of 2",
        "tp_rank": "0 of 2",
        "tp group": "[2, 3]",
    }
    hsdp = _section(env_report(environ, mesh=(2, 2, 1)), "mesh")
    assert (hsdp["coordinates"], hsdp["dp_rank"]) == ("(1, 0, 0)", "2 of 4")
    error = _section(env_report(environ, mesh=(3, 1, 1)), "mesh")["error"]
    assert error.startswith("ValueError: build_mesh: dp_replicate * dp_shard * tp")
    assert "(product 3)" in error


def test_main_env_mesh_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in TWO_RANKS.items():
        monkeypatch.setenv(name, value)
    assert main(["env", "--mesh", "1,1,-1"]) == 0
    out = capsys.readouterr().out
    assert out == env_report(os.environ, mesh=(1, 1, -1)) + "\n"
    assert _section(out, "mesh")["tp_rank"] == "1 of 2"
    with pytest.raises(SystemExit) as exit_info:
        main(["env", "--mesh", "2,two"])
    assert exit_info.value.code == 2
    assert "expected three integers DP_REPLICATE,DP_SHARD,TP" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("environ", "launcher", "rendezvous"),
    [
        ({}, "none", "none (one process)"),
        (
            TWO_RANKS,
            "torchrun",
            "MASTER_ADDR/MASTER_PORT not set (torchrun's env:// store)",
        ),
        (
            {
                "SLURM_JOB_ID": "4242",
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "1",
                "SLURM_JOB_NODELIST": "gpu[07-08]",
            },
            "slurm",
            "gpu07:24242 (first node of SLURM_JOB_NODELIST; "
            "port 20000 + SLURM_JOB_ID % 12000)",
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            },
            "openmpi",
            "not set: MPI launchers give no rendezvous address: export MASTER_ADDR",
        ),
    ],
)
def test_env_report_names_the_launcher_and_its_rendezvous(
    environ: dict[str, str], launcher: str, rendezvous: str
) -> None:
    report = env_report(environ)
    shown = _section(report, "launcher")
    assert shown["launcher"] == launcher
    assert shown["rendezvous"].startswith(rendezvous)
    assert _section(report, "launch variables") == (
        environ or {"(none set)": "one process"}
    )
    assert "error" not in _section(report, "context_from_env")


def test_env_report_shows_a_contradiction_in_both_sections() -> None:
    environ = {**TWO_RANKS, "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    environ |= {"SLURM_STEP_ID": "0", "SLURM_LOCALID": "0"}
    report = env_report(environ)
    expected = (
        "ValueError: context_from_env: RANK=1 (torchrun's variable) contradicts "
        "SLURM_PROCID=0 (SLURM)"
    )
    assert _section(report, "launcher")["error"].startswith(expected)
    assert _section(report, "context_from_env")["error"].startswith(expected)
