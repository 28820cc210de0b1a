"""The Weights & Biases tracker, which imports wandb only when first used.

Install it with ``pip install 'funcaccel[wandb]'``. The tracker keeps the
``wandb.Run`` that ``wandb.init`` returns and calls that run's own methods, never
the module-wide ``wandb.log`` / ``wandb.config``, so several trackers may live in
one process (``reinit="create_new"``). The mode is passed in the run's settings;
the tracker writes no environment variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final
from typing import Literal
from typing import Protocol
from typing import TypeAlias

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._checks import make_dirs
from funcaccel.tracking._base import PlainMetrics
from funcaccel.tracking._base import TrackerBase
from funcaccel.tracking._base import check_name
from funcaccel.tracking._base import require_package
from funcaccel.tracking._base import tracker_path
from funcaccel.tracking._values import ConfigValue

__all__ = ["WandbTracker"]

WandbMode: TypeAlias = Literal["online", "offline", "disabled"]
_MODES: Final[tuple[WandbMode, ...]] = ("online", "offline", "disabled")

_NOT_OWN: Final = "an argument the tracker does not set itself"
_DROPPED: Final = (
    "W&B drops such records; log steps in increasing order (equal steps are merged "
    "into one row)."
)
# Arguments of wandb.init the tracker sets itself, with where each comes from.
_OWN_ARGUMENTS: Final = MappingProxyType(
    {
        "dir": "the tracker's dir",
        "project": "project=",
        "name": "run_name=",
        "mode": "mode=",
        "settings": "mode=",
        "reinit": "the tracker (each tracker makes its own run)",
        "config": "store_config",
    }
)


class _Config(Protocol):
    def update(self, d: dict[str, ConfigValue], allow_val_change: bool) -> None: ...


class _Settings(Protocol):
    @property
    def sync_dir(self) -> str: ...


class _Run(Protocol):
    """The part of ``wandb.Run`` the tracker uses."""

    @property
    def id(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def config(self) -> _Config: ...

    @property
    def settings(self) -> _Settings: ...

    def log(
        self, data: dict[str, bool | int | float | str], step: int | None
    ) -> None: ...

    def finish(self) -> None: ...


def _check_mode(mode: object) -> WandbMode | None:
    if mode is None:
        return None
    hint = f"Pass one of {list(_MODES)}."
    check_type("WandbTracker", "mode", mode, str, what="a str or None", hint=hint)
    for known in _MODES:
        if mode == known:
            return known
    what = f"one of {list(_MODES)} or None (W&B's own choice: WANDB_MODE, else online)"
    fail_value("WandbTracker", "mode", mode, what)


def _check_init_kwargs(value: object) -> dict[str, object]:
    if value is None:
        return {}
    what = (
        "a mapping of wandb.init arguments, such as "
        "{'entity': 'team', 'tags': ['baseline']}"
    )
    value = check_type("WandbTracker", "init_kwargs", value, Mapping, what=what)
    out: dict[str, object] = {}
    for key, item in value.items():
        check_type("WandbTracker", "every key of init_kwargs", key, str)
        if key in _OWN_ARGUMENTS:
            hint = f"The tracker sets {key!r} from {_OWN_ARGUMENTS[key]}."
            fail_value("WandbTracker", "every key of init_kwargs", key, _NOT_OWN, hint)
        out[key] = item
    return out


class WandbTracker(TrackerBase):
    """Record metrics and the configuration in a Weights & Biases run.

    The run is started on the first call with ``wandb.init(dir=dir,
    project=project, name=run_name, settings=wandb.Settings(mode=mode), ...)``;
    W&B writes it under ``dir/wandb/`` (``offline-run-...`` in offline mode, to be
    uploaded later with ``wandb sync``). ``log`` writes ``values`` to the run's
    history at ``step``; W&B merges calls at the same step into one row and
    counts a step-less call as the next step, so give a ``step`` always or never.
    A ``step`` below the run's current step, which W&B would drop with only a
    printed warning, is a ``ValueError`` here. ``store_init_configuration``
    updates the run's config (later values win). ``finish()`` finishes the run.

    Like every wandb run, the first one starts W&B's service process, which
    wandb records in the ``WANDB_SERVICE`` environment variable until
    ``wandb.teardown()``.

    Args:
        dir: the directory W&B writes the run under.
        project: the W&B project.
        run_name: the run's display name; W&B picks one when ``None``.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; ``None`` (the default)
            leaves it to W&B (``WANDB_MODE``, else online).
        init_kwargs: further ``wandb.init`` arguments, such as ``entity``,
            ``group`` or ``tags`` (copied on construction).
        main_process_only: whether only the main process writes (the default).
            With ``False`` each process makes a run of its own: give each rank
            its own ``run_name``, or a shared ``group`` in ``init_kwargs``.

    Raises:
        ImportError: wandb is not installed (checked on construction, so every
            rank fails early; nothing is imported until the first call).
    """

    __slots__ = (
        "_dir",
        "_init_kwargs",
        "_mode",
        "_next_step",
        "_project",
        "_run",
        "_run_name",
    )

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        project: str = "funcaccel",
        run_name: str | None = None,
        mode: WandbMode | None = None,
        init_kwargs: Mapping[str, object] | None = None,
        main_process_only: bool = True,
    ) -> None:
        self._dir = tracker_path("WandbTracker", "dir", dir)
        self._project = check_name("WandbTracker", "project", project, "funcaccel")
        self._run_name = (
            None
            if run_name is None
            else check_name("WandbTracker", "run_name", run_name, "funcaccel")
        )
        self._mode = _check_mode(mode)
        self._init_kwargs = _check_init_kwargs(init_kwargs)
        super().__init__(name="wandb", main_process_only=main_process_only)
        require_package("WandbTracker", "wandb", "wandb")
        self._run: _Run | None = None
        self._next_step = 0

    @property
    def dir(self) -> Path:
        """The directory W&B writes the run under (in its ``wandb/`` folder)."""
        return self._dir

    @property
    def project(self) -> str:
        """The W&B project."""
        return self._project

    @property
    def run_id(self) -> str | None:
        """The W&B run's id, or ``None`` before the first call."""
        return None if self._run is None else self._run.id

    @property
    def run_dir(self) -> Path | None:
        """The run's own directory (holding ``run-<id>.wandb``), or ``None`` before
        the first call."""
        return None if self._run is None else Path(self._run.settings.sync_dir)

    def _ready_run(self) -> _Run:
        if self._run is not None:
            return self._run
        import wandb

        # wandb.init falls back to a temporary directory, with only a printed
        # warning, when ``dir`` cannot be written; fail here instead, naming it.
        make_dirs("WandbTracker", "dir", self._dir)
        settings: object = (
            wandb.Settings() if self._mode is None else wandb.Settings(mode=self._mode)
        )
        # Bound as a plain callable: init_kwargs are the user's, checked by W&B.
        init: Callable[..., _Run] = wandb.init
        run = init(
            dir=str(self._dir),
            project=self._project,
            name=self._run_name,
            settings=settings,
            reinit="create_new",
            **self._init_kwargs,
        )
        self._run, self._next_step = run, run.step
        return run

    def _write_metrics(self, values: PlainMetrics, step: int | None) -> None:
        """Write ``values`` to the run's history at ``step``."""
        run = self._ready_run()
        if step is not None and step < self._next_step:
            what = f">= the run's current step {self._next_step}"
            fail_value("WandbTracker.log", "step", step, what, _DROPPED)
        run.log(values, step=step)
        self._next_step = self._next_step + 1 if step is None else step

    def _write_config(self, values: dict[str, ConfigValue]) -> None:
        """Update the run's config with ``values``; later values win."""
        self._ready_run().config.update(values, allow_val_change=True)

    def _close(self) -> None:
        """Finish the run (if it was ever started)."""
        if self._run is not None:
            self._run.finish()
