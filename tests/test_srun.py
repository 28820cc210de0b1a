"""A real SLURM launch: ``srun -n 2`` trains the digits example as torchrun does.

build_context reads the step's variables (SLURM_PROCID, SLURM_NTASKS,
SLURM_STEP_ID, the node list, the job id for the port). Needs a running
controller (.ci/start_slurm.sh starts a one-node one where it can); skipped,
naming the reason, otherwise.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._scripts import DIGITS_TINY
from tests._scripts import REPO
from tests._scripts import one_digest
from tests._scripts import script_env
from tests._scripts import torchrun_digits_digest


def _no_slurm() -> str | None:
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "SLURM's srun is not installed (.ci/start_slurm.sh installs it)"
    try:
        done = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    if done.returncode != 0 or not {"idle", "mix"} & set(done.stdout.split()):
        return f"no idle SLURM node: {(done.stdout + done.stderr).strip()[:200]}"
    return None


@pytest.mark.distributed
def test_srun_two_tasks_train_like_torchrun(tmp_path: Path) -> None:
    reason = _no_slurm()
    if reason is not None:
        pytest.skip(reason)
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("the digits example needs scikit-learn")
    command = [
        "srun", "-n", "2", "--export=ALL",
        sys.executable, str(REPO / "examples" / "train_digits.py"),
        *DIGITS_TINY, "--run-dir", str(tmp_path / "srun-run"),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    # One run of 2 tasks: only task 0 prints.
    assert one_digest(done.stdout) == torchrun_digits_digest(tmp_path / "torchrun")
