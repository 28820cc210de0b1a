"""Trackers backed by optional packages, imported only when first used.

Only TensorBoard is offered (``pip install funcaccel[tensorboard]``); import it from
``funcaccel.trackers``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final
from typing import Protocol

from funcaccel._checks import check_bool
from funcaccel._checks import summary
from funcaccel.tracking._values import ConfigValue
from funcaccel.tracking._values import check_open
from funcaccel.tracking._values import check_step
from funcaccel.tracking._values import normalize_config
from funcaccel.tracking._values import normalize_metrics

__all__ = ["TensorBoardTracker"]

_INSTALL_HINT: Final = (
    "the tensorboard package is not installed; install it with "
    "`pip install funcaccel[tensorboard]` (or `pip install tensorboard`)."
)


class _FileWriter(Protocol):
    def add_summary(self, summary: object) -> None: ...


class _SummaryWriter(Protocol):
    """The part of ``torch.utils.tensorboard.SummaryWriter`` the tracker uses."""

    def add_scalar(
        self, tag: str, scalar_value: float, global_step: int | None = None
    ) -> None: ...

    def add_text(
        self, tag: str, text_string: str, global_step: int | None = None
    ) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _open_writer(logdir: Path) -> _SummaryWriter:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(f"TensorBoardTracker: {_INSTALL_HINT}") from error
    try:
        writer: _SummaryWriter = SummaryWriter(log_dir=str(logdir))
    except OSError as error:
        msg = (
            f"TensorBoardTracker: cannot create the event file in {str(logdir)!r}: "
            f"{error}; pass a logdir this process can create and write."
        )
        raise OSError(msg) from error
    return writer


def _write_hparams(writer: _SummaryWriter, config: Mapping[str, ConfigValue]) -> None:
    from torch.utils.tensorboard.summary import hparams

    # TensorBoard's HParams records take no None; it is shown as the text "None".
    plain = {key: "None" if value is None else value for key, value in config.items()}
    # torch ships ``hparams`` without annotations.
    summaries: tuple[object, ...] = hparams(plain, {})  # type: ignore[no-untyped-call]
    # The writer's own event file, which SummaryWriter opens on construction (torch
    # declares the attribute as None), so the record joins the run's scalars.
    file_writer: _FileWriter | None = getattr(writer, "file_writer", None)
    assert file_writer is not None
    for event in summaries:
        file_writer.add_summary(event)


class TensorBoardTracker:
    """Write TensorBoard event files with ``torch.utils.tensorboard.SummaryWriter``.

    Numbers (and bools, as 0/1) are written with ``add_scalar``, strings with
    ``add_text``, both at ``step`` (TensorBoard records ``step=None`` as step 0);
    the configuration is written as an HParams record of the same run (``None`` is
    shown as ``"None"``). The writer, and with it the directory and event file, is
    created on the first call; ``finish()`` flushes and closes it.

    Args:
        logdir: the run directory.
        main_process_only: whether only the main process writes (the default).

    Raises:
        ImportError: tensorboard is not installed (checked on construction, so
            every rank fails early; nothing is imported until the first call).
    """

    __slots__ = ("_finished", "_logdir", "_main_process_only", "_writer")

    name: Final = "tensorboard"

    def __init__(
        self, logdir: str | os.PathLike[str], *, main_process_only: bool = True
    ) -> None:
        if not isinstance(logdir, (str, os.PathLike)):
            msg = (
                f"TensorBoardTracker: logdir must be a str or os.PathLike; got "
                f"{summary(logdir)} ({type(logdir).__name__})."
            )
            raise TypeError(msg)
        check_bool("TensorBoardTracker", "main_process_only", main_process_only)
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError(f"TensorBoardTracker: {_INSTALL_HINT}")
        self._logdir = Path(logdir)
        self._main_process_only = main_process_only
        self._writer: _SummaryWriter | None = None
        self._finished = False

    @property
    def logdir(self) -> Path:
        """The run directory."""
        return self._logdir

    @property
    def main_process_only(self) -> bool:
        """Whether only the main process calls this tracker."""
        return self._main_process_only

    def _ready_writer(self, method: str) -> _SummaryWriter:
        check_open("TensorBoardTracker", method, self._finished)
        if self._writer is None:
            self._writer = _open_writer(self._logdir)
        return self._writer

    def log(self, values: Mapping[str, object], step: int | None = None) -> None:
        """Write each value at ``step``: numbers as scalars, strings as text."""
        check_step("TensorBoardTracker.log", step)
        plain = normalize_metrics(values, caller="TensorBoardTracker.log")
        writer = self._ready_writer("log")
        for key, value in plain.items():
            if isinstance(value, str):
                writer.add_text(key, value, global_step=step)
            else:
                writer.add_scalar(key, float(value), global_step=step)

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Write ``values`` as the run's HParams record."""
        owner = "TensorBoardTracker.store_init_configuration"
        config = normalize_config(values, caller=owner)
        _write_hparams(self._ready_writer("store_init_configuration"), config)

    def finish(self) -> None:
        """Flush and close the writer (if it was ever opened)."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        self._finished = True
