"""Shared pytest configuration: Hypothesis profiles and leak checks."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck
from hypothesis import settings

settings.register_profile(
    "default",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci", parent=settings.get_profile("default"), derandomize=True
)
settings.register_profile(
    "thorough", parent=settings.get_profile("default"), max_examples=2000
)
settings.load_profile(os.environ.get("FUNCACCEL_HYPOTHESIS_PROFILE", "default"))

# The suite starts hundreds of interpreters (ranks, examples, torchrun). Where the
# environment forbids bytecode caches (PYTHONDONTWRITEBYTECODE), each of them would
# compile funcaccel and the test modules from source; a cache outside the checkout
# (PYTHONPYCACHEPREFIX mirrors absolute paths, so checkouts cannot collide) lets
# them share one compile. Set once, before any test, for the children only.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    os.environ.setdefault(
        "PYTHONPYCACHEPREFIX",
        str(Path(tempfile.gettempdir(), f"funcaccel-test-pycache-{os.getuid()}")),
    )


# Variables written by the tools, not by funcaccel: pytest sets PYTEST_CURRENT_TEST
# around every test phase, torch's profiler sets TORCHINDUCTOR_CACHE_DIR the first
# time a profiler starts in a process, and MLflow sets its telemetry session id the
# first time a client starts (whichever test that is, in this process).
_SET_BY_TOOLS = frozenset(
    {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_MLFLOW_TELEMETRY_SESSION_ID"}
)


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _SET_BY_TOOLS}


@pytest.fixture(autouse=True)
def _no_leaked_environment() -> Iterator[None]:
    """Fail a test that changes os.environ (funcaccel never writes it)."""
    before = _environment()
    yield
    after = _environment()
    if after != before:
        changed = sorted(
            k for k in set(before) | set(after) if before.get(k) != after.get(k)
        )
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                del os.environ[key]
        pytest.fail(f"the test changed environment variables: {changed}")


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    """Fail a test that leaves a default process group initialised."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left the default process group initialised")


def pytest_configure(config: pytest.Config) -> None:
    """Keep the collection order below when pytest-xdist hands out whole files.

    With ``--dist loadfile`` xdist by default sorts the files by how many tests
    they hold, most first, which put the one-test, two-minute typing file last.
    """
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files holding slow tests first, the mypy-over-torch one first of all.

    With ``-n 2 --dist loadfile`` (the README's test command) each file runs on
    one worker, in collection order; a slow file collected last would leave the
    other worker idle at the end. tests/test_typing_install.py (mypy --strict over
    a script importing torch, about two minutes of one core) is the longest.
    Then come the other files that start processes (``distributed``), so that
    the quick single-process files fill the end. The order is otherwise kept.
    """
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    spawning = {item.path for item in items if item.get_closest_marker("distributed")}
    items.sort(
        key=lambda item: (
            item.path.name != "test_typing_install.py",
            item.path not in slow_files,
            item.path not in spawning,  # files starting processes, before quick ones
        )
    )
