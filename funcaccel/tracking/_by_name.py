"""``trackers_from_names``: the built-in trackers by name, as Accelerate's ``log_with``."""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final
from typing import NamedTuple

from funcaccel._checks import check_choice
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel.context import DistributedContext
from funcaccel.tracking._base import TrackerBase
from funcaccel.tracking._base import check_name
from funcaccel.tracking._base import tracker_path
from funcaccel.tracking._files import CSVTracker
from funcaccel.tracking._files import JSONLTracker
from funcaccel.tracking._mlflow import MLflowTracker
from funcaccel.tracking._tensorboard import TensorBoardTracker
from funcaccel.tracking._wandb import WandbTracker
from funcaccel.tracking._wandb_ready import wandb_can_start

__all__ = ["trackers_from_names"]


class _Entry(NamedTuple):
    package: str | None  # the optional package it needs (also the pip extra)
    build: Callable[[Path, str], TrackerBase]  # (project_dir, project_name) -> tracker


_TRACKERS: Final[Mapping[str, _Entry]] = MappingProxyType(
    {
        "jsonl": _Entry(None, lambda root, _: JSONLTracker(root / "metrics.jsonl")),
        "csv": _Entry(None, lambda root, _: CSVTracker(root / "metrics.csv")),
        "tensorboard": _Entry(
            "tensorboard", lambda root, _: TensorBoardTracker(root / "tensorboard")
        ),
        "mlflow": _Entry(
            "mlflow",
            lambda root, project: MLflowTracker(
                root / "mlflow.db", experiment_name=project
            ),
        ),
        "wandb": _Entry(
            "wandb", lambda root, project: WandbTracker(root, project=project)
        ),
    }
)
_ALL: Final = "all"
_CHOICES: Final = (*_TRACKERS, _ALL)
_ALL_HINT: Final = "'all' is every one whose package is installed."
_MSG_WANDB_LEFT_OUT: Final = (
    "trackers_from_names: 'all' leaves W&B out: wandb is installed but finds no API "
    "key and no offline mode here, so its first call would fail ('No API key "
    "configured'). To include it, run `wandb login` or set WANDB_API_KEY (online), "
    "or set WANDB_MODE=offline (runs kept under project_dir/wandb/ for `wandb "
    "sync`)."
)
_ONCE: Final = "a list naming each tracker once"


def _installed(package: str | None) -> bool:
    return package is None or importlib.util.find_spec(package) is not None


def _names(names_or_all: object) -> list[str]:
    """Return the names asked for, in order, each once; checked against the table."""
    valid = f"{[*_TRACKERS, _ALL]}"
    if isinstance(names_or_all, str):
        asked: list[object] = [names_or_all]
    elif isinstance(names_or_all, Iterable) and not isinstance(names_or_all, bytes):
        asked = list(names_or_all)
    else:
        what = f"a tracker name or a list of them, from {valid}"
        fail_type("trackers_from_names", "names_or_all", names_or_all, what)
    names: list[str] = []
    for index, name in enumerate(asked):
        hint = f"Pass tracker names from {valid}."
        where = f"names_or_all[{index}]"
        name = check_type("trackers_from_names", where, name, str, hint=hint)
        check_choice("trackers_from_names", where, name, _CHOICES, hint=_ALL_HINT)
        if name in names:
            hint = f"{name!r} is named twice."
            fail_value("trackers_from_names", "names_or_all", asked, _ONCE, hint)
        names.append(name)
    return names


def trackers_from_names(
    ctx: DistributedContext,
    names_or_all: str | Iterable[str],
    project_dir: str | os.PathLike[str],
    *,
    project_name: str = "funcaccel",
    environ: Mapping[str, str] | None = None,
) -> list[TrackerBase]:
    """Build the built-in trackers named, each writing under ``project_dir``.

    The names are those of Accelerate's ``log_with``: ``"jsonl"``
    (``project_dir/metrics.jsonl``), ``"csv"`` (``project_dir/metrics.csv``),
    ``"tensorboard"`` (``project_dir/tensorboard/``), ``"mlflow"``
    (``project_dir/mlflow.db``, experiment ``project_name``) and ``"wandb"``
    (``project_dir/wandb/``, project ``project_name``); ``"all"`` is every one of
    them that can run here, in that order: its package is installed and, for
    W&B, wandb finds an API key or an offline mode (``WANDB_API_KEY``, ``wandb
    login``'s netrc entry, ``WANDB_MODE=offline`` ...). W&B left out for want of
    a key is a ``UserWarning`` on the main process naming how to enable it
    (Accelerate keeps it, and the run fails at ``wandb.init``); a ``"wandb"``
    named explicitly is always built. Trackers come back in the order named;
    each is main-process-only with its defaults, and none touches the disk
    before its first gated call, so every rank calls this with the same
    arguments and gets the same list.

    >>> from funcaccel.context import DistributedContext
    >>> [t.name for t in trackers_from_names(DistributedContext(), ["csv", "jsonl"], "runs")]
    ['csv', 'jsonl']

    Args:
        ctx: the run's context.
        names_or_all: a tracker name, a list of them, or ``"all"``.
        project_dir: the directory every tracker writes under.
        project_name: the W&B project and the MLflow experiment.
        environ: where ``"all"`` looks for W&B's key and mode; ``os.environ``
            when ``None`` (read only when ``"all"`` is asked and wandb is
            installed).

    Raises:
        TypeError: ``ctx``, ``names_or_all``, ``project_dir`` or ``environ`` of
            the wrong type.
        ValueError: an unknown name, or one named twice.
        ImportError: a named tracker's package is not installed (checked before
            any tracker is built).
    """
    check_context("trackers_from_names", ctx)
    check_name("trackers_from_names", "project_name", project_name, "exp1")
    names = _names(names_or_all)
    root = tracker_path("trackers_from_names", "project_dir", project_dir)
    what = "a mapping such as os.environ, or None"
    env = check_type(
        "trackers_from_names", "environ", environ, Mapping, what=what, optional=True
    )
    for name in names:
        package = None if name == _ALL else _TRACKERS[name].package
        if not _installed(package):
            msg = (
                f"trackers_from_names: tracker {name!r} needs the {package} package, "
                f"which is not installed; install it with `pip install "
                f"'funcaccel[{package}]'`, or leave {name!r} out."
            )
            raise ImportError(msg)
    if _ALL in names:
        names = [name for name, entry in _TRACKERS.items() if _installed(entry.package)]
        if "wandb" in names and not wandb_can_start(os.environ if env is None else env):
            names.remove("wandb")
            if ctx.is_main_process:
                warnings.warn(_MSG_WANDB_LEFT_OUT, UserWarning, stacklevel=2)
    return [_TRACKERS[name].build(root, project_name) for name in names]
