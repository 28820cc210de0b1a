"""After the README's editable install, a user's own script type-checks against funcaccel.

A fresh virtual environment gets funcaccel the way the README installs it
(`pip install -e <repo>`); torch and mypy come from the environment running the
tests (a `.pth` entry), so the test exercises the install itself without
downloading torch again. mypy then checks a script in a directory outside the
repository, so it can only find funcaccel through what the install left in the new
environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent

USER_SCRIPT: Final = textwrap.dedent(
    """
    from __future__ import annotations

    import torch

    import funcaccel as fa


    def train() -> int:
        ctx: fa.DistributedContext = fa.build_context(environ={})
        model = fa.wrap_model(ctx, torch.nn.Linear(2, 1))
        grad = fa.GradState(accumulation_steps=2)
        del model
        return grad.optimizer_steps
    """
)

WRONG_SCRIPT: Final = USER_SCRIPT.replace(
    "return grad.optimizer_steps", "return grad.no_such_field"
)


def _new_env(path: Path) -> Path:
    # No pip of its own: the running environment's pip installs into it (--python).
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    site = subprocess.run(
        [
            str(python),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # torch, mypy and the build backend's cache come from the running environment.
    Path(site, "outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _mypy(python: Path, *scripts: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"MYPYPATH", "PYTHONPATH"}}
    names = [script.name for script in scripts]
    return subprocess.run(
        [str(python), "-m", "mypy", "--strict", "--no-incremental", *names],
        cwd=scripts[0].parent,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_a_user_script_type_checks_after_the_readme_install(tmp_path: Path) -> None:
    python = _new_env(tmp_path / "env")
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    install = subprocess.run(
        [*pip, "install", "-q", "--no-deps", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    user = tmp_path / "user"
    user.mkdir()
    good = user / "train.py"
    good.write_text(USER_SCRIPT)
    # The check is real: funcaccel's types reach the scripts, so a typo is caught.
    # One mypy run checks both (torch's types are read once).
    bad = user / "wrong.py"
    bad.write_text(WRONG_SCRIPT)
    result = _mypy(python, good, bad)
    assert result.returncode == 1, result.stdout[-2000:]
    lines = result.stdout.splitlines()
    assert [line for line in lines if line.startswith("train.py")] == [], result.stdout
    errors = [line for line in lines if line.startswith("wrong.py")]
    assert any('"GradState" has no attribute "no_such_field"' in e for e in errors)
    assert "in 1 file (checked 2 source files)" in result.stdout
