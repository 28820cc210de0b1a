"""Where an export is written and how it replaces the previous one atomically.

``save_model(ctx, model, "out")`` writes into ``.out.export.tmp`` next to ``out``
(same parent, so same file system), then swaps it with ``out``: on Linux in one ``renameat2(RENAME_EXCHANGE)`` call, elsewhere by
renaming ``out`` to ``.out.export.old`` and the new one to ``out``. The previous
export is deleted only after that. A process killed at any moment leaves ``out``
holding either the previous export or the new one, whole; a kill between the two
fallback renames leaves the previous one at ``.out.export.old``, which
``load_model`` reads and the next ``save_model`` puts back first. A durable export
(``save_model(..., durable=True)``) also fsyncs every file and the directory before
the swap and the parent after it, so that a power loss or an operating-system
crash cannot leave the new name holding files whose data never reached the disk.

Files of ``out`` that are not export files (``config.json``, tokenizer files) are
carried into the new directory as hard links (copies where links fail), so a new
export replaces only the weights.

>>> temporary_export(Path("runs/out")).name, previous_export(Path("runs/out")).name
('.out.export.tmp', '.out.export.old')
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Final

from funcaccel.checkpoint._export_plan import EXPORT_FILE_RE
from funcaccel.checkpoint._layout import fsync_directory

__all__ = [
    "commit_export",
    "export_source",
    "prepare_export",
    "previous_export",
    "recover_export",
    "temporary_export",
]

_AT_FDCWD: Final = -100
_RENAME_EXCHANGE: Final = 2


def temporary_export(directory: Path) -> Path:
    """Return where the next export of ``directory`` is written before the swap."""
    return directory.parent / f".{directory.name}.export.tmp"


def previous_export(directory: Path) -> Path:
    """Return where the fallback swap parks the previous export for a moment."""
    return directory.parent / f".{directory.name}.export.old"


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def recover_export(directory: Path) -> None:
    """Put back a previous export a kill left parked at ``.name.export.old``."""
    parked = previous_export(directory)
    if not _exists(directory) and _is_real_dir(parked):
        os.rename(parked, directory)
        fsync_directory(directory.parent)


def export_source(directory: Path) -> Path:
    """Return where the export of ``directory`` lies: itself, or where a kill parked it."""
    parked = previous_export(directory)
    if not _exists(directory) and _is_real_dir(parked):
        return parked
    return directory


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def prepare_export(directory: Path) -> Path:
    """Create an empty temporary directory for a new export of ``directory``.

    Run on the writing rank only. A leftover temporary directory (a killed save) is
    deleted first; the previous export's other files are linked into the new one.

    Raises:
        OSError: ``directory`` exists and is not a directory (or is a symlink), or
            the file system refused.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    recover_export(directory)
    if _exists(directory) and not _is_real_dir(directory):
        msg = f"{directory} exists and is not a directory (or is a symlink)"
        raise NotADirectoryError(msg)
    temporary = temporary_export(directory)
    for leftover in (temporary, previous_export(directory)):
        if _is_real_dir(leftover):
            shutil.rmtree(leftover)
        elif _exists(leftover):
            leftover.unlink()
    temporary.mkdir()
    if _is_real_dir(directory):
        for entry in sorted(directory.iterdir()):
            if EXPORT_FILE_RE.fullmatch(entry.name):
                continue
            target = temporary / entry.name
            if entry.is_symlink():
                os.symlink(os.readlink(entry), target)
            elif entry.is_dir():
                shutil.copytree(
                    entry, target, symlinks=True, copy_function=_link_or_copy
                )
            else:
                _link_or_copy(str(entry), str(target))
    return temporary


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2``); ``False`` where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28, musl)
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    status: int = renameat2(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    return status == 0


def commit_export(directory: Path, temporary: Path, *, durable: bool) -> None:
    """Make the export in ``temporary`` the one at ``directory``.

    With ``durable`` (its files already fsynced) the directories are fsynced too:
    ``temporary`` before the swap, the parent after it.
    """
    if durable:
        fsync_directory(temporary)
    replaced: Path | None = None  # where the previous export is after the swap
    if not _exists(directory):
        os.rename(temporary, directory)
    elif _exchange(temporary, directory):
        replaced = temporary
    else:
        replaced = previous_export(directory)
        os.rename(directory, replaced)
        os.rename(temporary, directory)
    if durable:
        fsync_directory(directory.parent)
    if replaced is not None:
        shutil.rmtree(replaced)
