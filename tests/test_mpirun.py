"""A real Open MPI launch: ``mpirun -n 2`` trains the digits example as torchrun does.

build_context reads Open MPI's variables (OMPI_COMM_WORLD_RANK / _SIZE /
_LOCAL_RANK); the rendezvous comes from MASTER_ADDR / MASTER_PORT, passed with
``-x``. Skipped, with the reason, where ``mpirun`` is not installed (.ci/run
installs Debian's openmpi-bin where it can).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._scripts import DIGITS_TINY
from tests._scripts import REPO
from tests._scripts import one_digest
from tests._scripts import script_env
from tests._scripts import torchrun_digits_digest

MPIRUN = shutil.which("mpirun")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.distributed
@pytest.mark.skipif(
    MPIRUN is None, reason="mpirun not installed (apt install openmpi-bin)"
)
def test_mpirun_two_processes_train_like_torchrun(tmp_path: Path) -> None:
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("the digits example needs scikit-learn")
    assert MPIRUN is not None
    env = script_env()
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    exported = ["MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "OMP_NUM_THREADS", "PATH"]
    command = [
        MPIRUN, *root, "--oversubscribe", "-n", "2",
        *[arg for name in exported for arg in ("-x", name)],
        sys.executable,
        str(REPO / "examples" / "train_digits.py"),
        *DIGITS_TINY, "--run-dir", str(tmp_path / "mpi-run"),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert one_digest(done.stdout) == torchrun_digits_digest(tmp_path / "torchrun")
