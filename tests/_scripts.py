"""Run a script of the checkout (example, benchmark) in a fresh interpreter, as a user does.

``run_script`` starts ``python <script>`` (or ``torchrun --standalone`` with several
processes) from the repository root with funcaccel importable from the checkout and
no launcher variables inherited, and kills the whole process group on timeout.
Nothing is retried: a run that trained to the end and then failed at exit fails
its test, as it fails a user's job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parents[1]
# torchrun's variables: a run meant for one process must not inherit a world.
_LAUNCHER_VARS: Final = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "FUNCACCEL_LAUNCH",
    }
)
# A suite run inside a SLURM step or under mpirun: the scripts it starts must not
# read the outer job's variables as their own launch.
_LAUNCHER_PREFIXES: Final = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")


@dataclass(frozen=True)
class Finished:
    """What a script run left: its exit status and its output."""

    command: list[str]
    status: int
    stdout: str
    stderr: str


def script_env() -> dict[str, str]:
    """Return a copy of the environment that imports funcaccel from the checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), env.get("PYTHONPATH")])
    )
    env["OMP_NUM_THREADS"] = "1"  # tiny models: threads only fight over the cores
    return env


def _run(command: list[str], timeout: float) -> Finished:
    # A session of its own, so a hung torchrun is killed with its workers.
    with subprocess.Popen(
        command,
        cwd=REPO,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"{command} did not finish in {timeout:.0f} s:\n{stderr}")
    return Finished(command, process.returncode, stdout, stderr)


def run_script(
    script: Path,
    *args: object,
    processes: int = 1,
    timeout: float = 240.0,
) -> Finished:
    """Run ``script`` with ``args``; return how it finished (the caller checks).

    With ``processes > 1`` it runs under ``torchrun --standalone``.
    """
    launcher = ["-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc_per_node={processes}"]
    command = [sys.executable, *(launcher if processes > 1 else []), str(script)]
    command += [str(arg) for arg in args]
    return _run(command, timeout)


DIGITS_TINY: Final = ("--epochs", "2", "--train-samples", "320", "--batch-size", "16")


def one_digest(stdout: str) -> str:
    """The one ``param_sha256`` a run of the digits example printed (rank 0 only)."""
    digests: list[str] = re.findall(r"^param_sha256: ([0-9a-f]{64})$", stdout, re.M)
    assert len(digests) == 1, stdout[-2000:]  # several: ranks ran as separate runs
    return digests[0]


def torchrun_digits_digest(run_dir: Path) -> str:
    """The digest of the tiny digits run under torchrun at 2 processes."""
    done = run_script(
        REPO / "examples" / "train_digits.py",
        *DIGITS_TINY,
        "--run-dir",
        run_dir,
        processes=2,
        timeout=240,
    )
    assert done.status == 0, done.stderr
    return one_digest(done.stdout)
