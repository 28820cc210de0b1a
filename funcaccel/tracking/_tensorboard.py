"""The TensorBoard tracker, which imports tensorboard only when first used.

Install it with ``pip install 'funcaccel[tensorboard]'``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from funcaccel.tracking._base import PlainMetrics
from funcaccel.tracking._base import TrackerBase
from funcaccel.tracking._base import require_package
from funcaccel.tracking._base import tracker_path
from funcaccel.tracking._values import ConfigValue

__all__ = ["TensorBoardTracker"]


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
        msg = (
            f"TensorBoardTracker: cannot import torch.utils.tensorboard ({error}); "
            "install tensorboard with `pip install 'funcaccel[tensorboard]'`."
        )
        raise ImportError(msg) from error
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


class TensorBoardTracker(TrackerBase):
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

    __slots__ = ("_logdir", "_writer")

    def __init__(
        self, logdir: str | os.PathLike[str], *, main_process_only: bool = True
    ) -> None:
        self._logdir = tracker_path("TensorBoardTracker", "logdir", logdir)
        super().__init__(name="tensorboard", main_process_only=main_process_only)
        require_package("TensorBoardTracker", "tensorboard", "tensorboard")
        self._writer: _SummaryWriter | None = None

    @property
    def logdir(self) -> Path:
        """The run directory."""
        return self._logdir

    def _ready_writer(self) -> _SummaryWriter:
        if self._writer is None:
            self._writer = _open_writer(self._logdir)
        return self._writer

    def _write_metrics(self, values: PlainMetrics, step: int | None) -> None:
        """Write each value at ``step``: numbers as scalars, strings as text."""
        writer = self._ready_writer()
        for key, value in values.items():
            if isinstance(value, str):
                writer.add_text(key, value, global_step=step)
            else:
                writer.add_scalar(key, float(value), global_step=step)

    def _write_config(self, values: dict[str, ConfigValue]) -> None:
        """Write ``values`` as the run's HParams record."""
        _write_hparams(self._ready_writer(), values)

    def _close(self) -> None:
        """Flush and close the writer (if it was ever opened)."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
