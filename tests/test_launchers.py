"""Tests for reading SLURM's and the MPI launchers' variables (context/_launchers.py)."""

from __future__ import annotations

import importlib.util
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.context import build_context
from funcaccel.context import context_from_env
from funcaccel.context import read_launch
from funcaccel.context._launchers import launch_gpu
from funcaccel.context._launchers import launch_init_method
from funcaccel.context._slurm_lists import SLURM_PORT_BASE
from funcaccel.context._slurm_lists import SLURM_PORT_SPAN
from funcaccel.context._slurm_lists import expand_nodelist
from funcaccel.context._slurm_lists import expand_tasks_per_node
from funcaccel.context._slurm_lists import slurm_port
from funcaccel.kwargs import InitProcessGroupKwargs
from funcaccel.launch import launch
from tests._scripts import DIGITS_TINY
from tests._scripts import REPO
from tests._scripts import one_digest
from tests._scripts import script_env
from tests._scripts import torchrun_digits_digest

# Task 3 of `srun -N 2 --ntasks-per-node=2` in job 4242 on node[07-08].
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "node[07-08]",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}
PMI = {
    "PMI_RANK": "1",
    "PMI_SIZE": "2",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "2",
    "MASTER_ADDR": "h0",
    "MASTER_PORT": "29401",
}
TORCHRUN = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}


def _without(environ: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in names}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x1,y[001,003]", ["x1", "y001", "y003"]),
    ],
)
def test_expand_nodelist_reads_slurms_compressed_forms(
    nodelist: str, hosts: list[str]
) -> None:
    assert list(expand_nodelist(nodelist)) == hosts


@pytest.mark.parametrize(
    "nodelist", ["node[01-04", "node]1[", "n[4-2]", "n[a-b]", "a,,b", "", "n[[1]]"]
)
def test_a_malformed_nodelist_is_refused(nodelist: str) -> None:
    with pytest.raises(ValueError, match=r"must be a SLURM node list such as"):
        list(expand_nodelist(nodelist))


@pytest.mark.parametrize(
    ("text", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])],
)
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize(("job", "port"), [(0, 20000), (4242, 24242), (24001, 20001)])
def test_slurm_port_is_unprivileged_and_below_the_ephemeral_range(
    job: int, port: int
) -> None:
    assert slurm_port(job) == port
    assert 1024 < slurm_port(job) < 32768


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (SLURM, ("slurm", 4, 3, 1, 2, ("node07", "24242"))),
        (
            {**SLURM, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "1234"},
            ("slurm", 4, 3, 1, 2, ("10.1.1.1", "1234")),
        ),
        ({**SLURM, "MASTER_PORT": "1234"}, ("slurm", 4, 3, 1, 2, ("node07", "1234"))),
        (
            # The step's own counts and node list win over the job's.
            {
                **SLURM,
                "SLURM_STEP_NUM_TASKS": "6",
                "SLURM_STEP_NODELIST": "c[3-5]",
                "SLURM_NTASKS_PER_NODE": "2",
            },
            ("slurm", 6, 3, 1, 2, ("c3", "24242")),
        ),
        (
            {**_without(SLURM, "SLURM_JOB_NODELIST"), "SLURM_NODELIST": "a[1-2],b3"},
            ("slurm", 4, 3, 1, 2, ("a1", "24242")),
        ),
        (
            {**SLURM, "SLURM_TASKS_PER_NODE": "3,1", "SLURM_LOCALID": "0"},
            ("slurm", 4, 3, 0, 1, ("node07", "24242")),
        ),
        (OMPI, ("openmpi", 4, 2, 0, 2, ("10.0.0.1", "29400"))),
        (PMI, ("mpich/pmi", 2, 1, 1, 2, ("h0", "29401"))),
        (
            # srun --mpi=pmi2: PMI's rank, SLURM's local rank.
            {
                **_without(PMI, "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                **SLURM,
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
            },
            ("mpich/pmi", 2, 1, 0, None, ("h0", "29401")),
        ),
        (
            # mpirun inside the batch script: MPI's variables, not the batch step's.
            {**OMPI, **_without(SLURM, "SLURM_STEP_ID"), "SLURM_PROCID": "0"},
            ("openmpi", 4, 2, 0, 2, ("10.0.0.1", "29400")),
        ),
        (
            # torchrun under SLURM: its variables describe the workers.
            {**SLURM, **TORCHRUN, "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "r"},
            ("torchrun", 8, 3, 1, None, None),
        ),
        (
            # funcaccel.launch's workers inside a one-task SLURM step.
            {
                **SLURM,
                "SLURM_NTASKS": "1",
                "SLURM_PROCID": "0",
                **TORCHRUN,
                "WORLD_SIZE": "8",
                "FUNCACCEL_LAUNCH": "1",
            },
            ("torchrun", 8, 3, 1, None, None),
        ),
        (
            # Set by hand in agreement with SLURM: read as torchrun's.
            {**SLURM, **TORCHRUN, "MASTER_ADDR": "m", "MASTER_PORT": "1"},
            ("torchrun", 4, 3, 1, None, ("m", "1")),
        ),
    ],
)
def test_read_launch_reads_each_launchers_variables(
    environ: dict[str, str],
    expected: tuple[str, int, int, int, int | None, tuple[str, str] | None],
) -> None:
    got = read_launch(environ)
    assert (
        got.launcher,
        got.num_processes,
        got.rank,
        got.local_rank,
        got.local_world,
        got.rendezvous,
    ) == expected
    ctx = context_from_env(environ, cpu=True)
    assert (ctx.num_processes, ctx.process_index, ctx.local_process_index) == (
        expected[1],
        expected[2],
        expected[3],
    )
    assert ctx.distributed_type is DistributedType.MULTI_CPU


@pytest.mark.parametrize(
    ("environ", "launcher"),
    [
        ({}, "none"),
        # salloc's shell, or a login node inside an allocation: no task.
        (_without(SLURM, "SLURM_PROCID", "SLURM_STEP_ID"), "none"),
        # The batch script itself: SLURM_PROCID=0 but no step.
        ({**_without(SLURM, "SLURM_STEP_ID"), "SLURM_PROCID": "0"}, "none"),
        # srun -n 1 python train.py.
        ({**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "slurm"),
        (
            {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "2"},
            "slurm",
        ),
        ({**OMPI, "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, "openmpi"),
        ({"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0"}, "mpich/pmi"),
        ({"WORLD_SIZE": "1"}, "torchrun"),
    ],
)
def test_one_process_cases(environ: dict[str, str], launcher: str) -> None:
    launch_ = read_launch(environ)
    assert (launch_.launcher, launch_.num_processes) == (launcher, 1)
    ctx = context_from_env(environ, cpu=True)
    assert ctx == DistributedContext()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {**SLURM, **TORCHRUN, "WORLD_SIZE": "8"},
            r"WORLD_SIZE=8 \(torchrun's variable\) contradicts SLURM_NTASKS=4",
        ),
        (
            {**SLURM, **TORCHRUN, "SLURM_NTASKS": "8"},
            r"WORLD_SIZE=4 \(torchrun's variable\) contradicts SLURM_NTASKS=8 \(SLURM\);"
            r" torchrun did not start this process .* Unset WORLD_SIZE, RANK and "
            r"LOCAL_RANK \(funcaccel reads SLURM's variables itself\) or make them agree",
        ),
        (
            {**SLURM, **TORCHRUN, "RANK": "0"},
            r"RANK=0 \(torchrun's variable\) contradicts SLURM_PROCID=3 \(SLURM\)",
        ),
        (
            {**OMPI, **TORCHRUN, "RANK": "2", "LOCAL_RANK": "1"},
            r"LOCAL_RANK=1 \(torchrun's variable\) contradicts "
            r"OMPI_COMM_WORLD_LOCAL_RANK=0 \(Open MPI\)",
        ),
        (
            {**PMI, **TORCHRUN, "WORLD_SIZE": "1"},
            r"WORLD_SIZE=1 \(torchrun's variable\) contradicts PMI_SIZE=2 \(MPICH/PMI\)",
        ),
        (
            {**SLURM, "SLURM_PROCID": "4"},
            r"SLURM_PROCID must be in \[0, SLURM_NTASKS=4\); got 4\. Start every "
            r"process with SLURM's launcher",
        ),
        (
            {**SLURM, "SLURM_LOCALID": "2"},
            r"SLURM_LOCALID must be in \[0, SLURM_TASKS_PER_NODE=2\); got 2",
        ),
        (
            {**SLURM, "SLURM_NTASKS_PER_NODE": "1"},
            r"SLURM_LOCALID must be in \[0, SLURM_NTASKS_PER_NODE=1\); got 1",
        ),
        ({**SLURM, "SLURM_NTASKS": "0"}, r"SLURM_NTASKS must be at least 1; got 0"),
        (
            _without(SLURM, "SLURM_NTASKS"),
            r"SLURM_STEP_NUM_TASKS or SLURM_NTASKS must be set, since .*SLURM_PROCID",
        ),
        (
            _without(SLURM, "SLURM_LOCALID"),
            r"SLURM_LOCALID must be set, since .*; got None\. srun sets them",
        ),
        (
            {**SLURM, "SLURM_PROCID": "three"},
            r"SLURM_PROCID must be an integer \(set by SLURM\); got 'three'",
        ),
        (
            _without(SLURM, "SLURM_JOB_NODELIST"),
            r"SLURM_JOB_NODELIST must be set in a SLURM job step, or MASTER_ADDR given",
        ),
        (
            _without(SLURM, "SLURM_JOB_ID"),
            r"SLURM_JOB_ID must be set in a SLURM job step, or MASTER_PORT given",
        ),
        (
            {**SLURM, "SLURM_JOB_NODELIST": "node[07-"},
            r"the SLURM node list must be a SLURM node list .*; got 'node\[07-'\. "
            r"Set MASTER_ADDR",
        ),
        (
            {**SLURM, "SLURM_TASKS_PER_NODE": "2(x)"},
            r"SLURM_TASKS_PER_NODE must be SLURM's tasks per node",
        ),
        (
            _without(OMPI, "OMPI_COMM_WORLD_SIZE"),
            r"OMPI_COMM_WORLD_SIZE must be set, since OMPI_COMM_WORLD_LOCAL_RANK, "
            r"OMPI_COMM_WORLD_LOCAL_SIZE, OMPI_COMM_WORLD_RANK are",
        ),
        (
            {**OMPI, "OMPI_COMM_WORLD_RANK": "-1"},
            r"OMPI_COMM_WORLD_RANK must be in \[0, OMPI_COMM_WORLD_SIZE=4\); got -1",
        ),
        (
            {**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
            r"OMPI_COMM_WORLD_LOCAL_RANK must be in \[0, "
            r"OMPI_COMM_WORLD_LOCAL_SIZE=2\); got 2",
        ),
        (
            _without(PMI, "MPI_LOCALRANKID"),
            r"MPI_LOCALRANKID must be set, since PMI_RANK, PMI_SIZE are",
        ),
        ({**PMI, "PMI_RANK": "2"}, r"PMI_RANK must be in \[0, PMI_SIZE=2\); got 2"),
    ],
)
def test_a_partial_or_contradictory_environment_is_refused(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=r"^context_from_env: " + message):
        read_launch(environ)
    with pytest.raises(ValueError, match=message):
        context_from_env(environ, cpu=True)


@pytest.mark.parametrize(
    ("environ", "count", "device"),
    [
        (SLURM, 2, "cuda:1"),
        (SLURM, 1, "cuda:0"),  # srun --gpus-per-task=1: each task sees its own GPU
        (OMPI, 4, "cuda:0"),
        ({**TORCHRUN, "LOCAL_RANK": "5"}, 4, "cuda:1"),  # torchrun's rule, unchanged
    ],
)
def test_each_local_rank_gets_its_gpu(
    environ: dict[str, str], count: int, device: str
) -> None:
    assert launch_gpu(read_launch(environ), count, environ) == torch.device(device)


def test_a_local_rank_beyond_the_visible_gpus_is_refused() -> None:
    environ = {
        **SLURM,
        "SLURM_LOCALID": "3",
        "SLURM_TASKS_PER_NODE": "4(x1)",
        "CUDA_VISIBLE_DEVICES": "4,5",
    }
    with pytest.raises(
        ValueError,
        match=r"^context_from_env: SLURM_LOCALID must be below the 2 GPU\(s\) this "
        r"process sees .*CUDA_VISIBLE_DEVICES=4,5\); got 3\. Start at most one task",
    ):
        launch_gpu(read_launch(environ), 2, environ)


@pytest.mark.parametrize(("count", "device"), [(2, "cuda:1"), (1, "cuda:0")])
def test_context_from_env_puts_a_slurm_task_on_its_gpu(
    monkeypatch: pytest.MonkeyPatch, count: int, device: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    ctx = context_from_env(SLURM)
    assert (ctx.device, ctx.distributed_type, ctx.backend) == (
        torch.device(device),
        DistributedType.MULTI_GPU,
        "nccl",
    )
    crowded = {**SLURM, "SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "3"}
    if count > 1:
        with pytest.raises(ValueError, match=r"SLURM_LOCALID must be below the 2 GPU"):
            context_from_env(crowded)
    assert context_from_env(crowded, cpu=True).device == torch.device("cpu")


@pytest.mark.parametrize(
    ("environ", "init_method"),
    [
        (SLURM, "tcp://node07:24242"),
        ({**SLURM, "MASTER_ADDR": "fe80::1"}, "tcp://[fe80::1]:24242"),
        (OMPI, "tcp://10.0.0.1:29400"),
        (PMI, "tcp://h0:29401"),
        ({**TORCHRUN, "MASTER_ADDR": "m", "MASTER_PORT": "2"}, "tcp://m:2"),
    ],
)
def test_launch_init_method(environ: dict[str, str], init_method: str) -> None:
    assert launch_init_method(InitProcessGroupKwargs(), environ) == init_method
    given = InitProcessGroupKwargs(init_method="file:///tmp/x")
    assert launch_init_method(given, environ) == "file:///tmp/x"


@pytest.mark.parametrize("missing", [("MASTER_ADDR",), ("MASTER_ADDR", "MASTER_PORT")])
def test_an_mpi_launch_without_a_rendezvous_says_how_to_give_one(
    missing: tuple[str, ...],
) -> None:
    environ = _without(OMPI, *missing)
    with pytest.raises(
        ValueError,
        match=rf"^build_context: {' and '.join(missing)} \(under openmpi\) must be set "
        r"in the environment; got None\. MPI launchers give no rendezvous address: "
        r"export MASTER_ADDR .* mpirun -x MASTER_ADDR=\$\(hostname\)",
    ):
        build_context(environ=environ, cpu=True)
    assert not dist.is_initialized()


def _adopt_a_group_started_elsewhere(
    rendezvous: str,
) -> tuple[DistributedContext, float, list[str]]:
    """In a ``launch`` worker: start the group as Ray Train would, then build."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
    )
    ctx = build_context(cpu=True)
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed)
    errors = []
    for environ in ({}, {**os.environ, "RANK": str(1 - rank)}):
        try:
            build_context(environ=environ, cpu=True)
        except RuntimeError as error:
            errors.append(str(error))
    return ctx, summed.item(), errors


@pytest.mark.distributed
def test_build_context_adopts_a_group_another_framework_started(
    tmp_path: Path,
) -> None:
    results = launch(
        _adopt_a_group_started_elsewhere,
        str(tmp_path / "rendezvous"),
        num_processes=2,
        backend=None,
        start_method="forkserver",
        timeout_s=120,
    )
    for rank, (ctx, summed, errors) in enumerate(results):
        assert ctx == DistributedContext(
            num_processes=2,
            process_index=rank,
            local_process_index=rank,
            distributed_type=DistributedType.MULTI_CPU,
            backend="gloo",
        )
        assert summed == 3.0
        assert len(errors) == 2
        assert errors[0].startswith(
            f"build_context: a default process group of world_size=2 (this is rank "
            f"{rank}) is already initialised, but the environment names no launcher"
        )
        assert errors[1] == (
            f"build_context: the default process group has world_size=2, rank={rank} "
            f"but ctx has num_processes=2, process_index={1 - rank}; pass the "
            "context of this group."
        )


_STUB_SRUN = """#!/bin/bash
# A stand-in for srun: start 2 local tasks with SLURM's variables, wait for both.
while [[ "$1" == -* ]]; do shift; done
pids=()
for task in 0 1; do
    SLURM_PROCID=$task SLURM_LOCALID=$task SLURM_NODEID=0 SLURM_STEP_ID=0 \\
    SLURM_NTASKS=2 SLURM_TASKS_PER_NODE=2 SLURM_JOB_NODELIST=127.0.0.1 \\
    SLURM_JOB_ID={job_id} "$@" > "{out}/task$task.out" 2> "{out}/task$task.err" &
    pids+=($!)
done
status=0
for pid in "${{pids[@]}}"; do wait "$pid" || status=1; done
exit $status
"""


def _sbatch_script() -> str:
    text = (REPO / "docs" / "clusters.md").read_text(encoding="utf-8")
    blocks: list[str] = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)
    scripts = [b for b in blocks if "#SBATCH" in b and "srun --kill" in b]
    assert len(scripts) == 1, blocks
    return scripts[0]


def _free_slurm_port() -> int:
    """A job id whose derived port is free here now."""
    for _ in range(50):
        port = random.randrange(SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port - SLURM_PORT_BASE + 7 * SLURM_PORT_SPAN
    pytest.skip("no free port in the SLURM range")


def test_the_sbatch_script_of_the_docs_parses() -> None:
    done = subprocess.run(
        ["bash", "-n"],
        input=_sbatch_script(),
        text=True,
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.distributed
def test_the_sbatch_script_trains_like_torchrun_under_a_stub_srun(
    tmp_path: Path,
) -> None:
    if importlib.util.find_spec("sklearn") is None:  # importing it sets KMP_* here
        pytest.skip("the digits example needs scikit-learn")
    script = tmp_path / "train.sbatch"
    script.write_text(_sbatch_script(), encoding="utf-8")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    job_id = _free_slurm_port()
    srun.write_text(_STUB_SRUN.format(job_id=job_id, out=tmp_path), encoding="utf-8")
    srun.chmod(0o755)
    env = script_env()
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent)])
    env["PATH"] += os.pathsep + os.environ.get("PATH", "")
    args = [*DIGITS_TINY, "--run-dir", str(tmp_path / "slurm-run")]
    done = subprocess.run(
        ["bash", str(script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    outs = [(tmp_path / f"task{t}.out").read_text() for t in (0, 1)]
    errs = [(tmp_path / f"task{t}.err").read_text() for t in (0, 1)]
    assert done.returncode == 0, (done.stderr, errs)
    assert outs[1] == ""  # only the main process prints
    assert one_digest(outs[0]) == torchrun_digits_digest(tmp_path / "torchrun")


def _launched_inside_one_slurm_task() -> tuple[str | None, str, int]:
    # A funcaccel.launch worker started from a one-task srun step: SLURM's
    # variables describe the parent, the torchrun-style ones this worker.
    environ = {**os.environ, **SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    got = read_launch(environ)
    return os.environ.get("FUNCACCEL_LAUNCH"), got.launcher, got.num_processes


def test_launch_workers_inside_a_slurm_task_read_their_own_variables() -> None:
    results = launch(
        _launched_inside_one_slurm_task,
        num_processes=2,
        backend=None,
        start_method="forkserver",
        timeout_s=120,
    )
    assert results == [("1", "torchrun", 2)] * 2
