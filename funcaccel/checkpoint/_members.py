"""The names a checkpoint directory gives, checked before anything is opened.

A checkpoint is untrusted input: its manifest lists file names, ``latest`` names a
checkpoint, DCP's metadata names shard files. A name is accepted only when it is a
plain relative path inside the checkpoint (no ``..``, ``.`` or empty part, not
absolute, no backslash or NUL) and, on disk, resolves inside the checkpoint
directory to a regular file. So a crafted ``../../x``, ``/dev/zero``, a symlink to
another directory or a FIFO is refused before it is read, hashed or deleted (a
FIFO or device would otherwise hang the load).

>>> check_member_name("f", "dcp/__0_0.distcp")
'dcp/__0_0.distcp'
>>> check_member_name("f", "../x")
Traceback (most recent call last):
...
ValueError: f: the checkpoint names '../x', which is not a plain relative path inside it ...
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Final
from typing import NoReturn

from funcaccel._checks import summary

__all__ = [
    "DAMAGED",
    "EARLIER",
    "check_member_name",
    "fail_checkpoint",
    "member_path",
    "regular_file",
]

DAMAGED: Final = "the checkpoint is damaged or crafted; load one you trust"
EARLIER: Final = (
    "the checkpoint is damaged (or crafted), load an earlier one (see list_checkpoints)"
)
_NAME_LIMIT: Final = 255


def check_member_name(caller: str, name: object, *, where: str = "") -> str:
    """Return ``name`` if it is a plain relative path (``/``-separated) inside a checkpoint.

    Pure: nothing on disk is looked at. ``where`` says who gave the name, for the
    message ("the manifest of ckpt/checkpoint-000001").

    Raises:
        ValueError: not a str, empty, too long, absolute, or with a ``..``, ``.`` or
            empty part, a backslash or a NUL.
    """
    if isinstance(name, str) and _is_plain(name):
        return name
    giver = f"{where or 'the checkpoint'} names {summary(name)}"
    fail_checkpoint(
        caller,
        f"{giver}, which is not a plain relative path inside it (no '..', not absolute)",
    )


def fail_checkpoint(caller: str, what: str, fix: str = DAMAGED) -> NoReturn:
    """Raise the ``ValueError`` of a checkpoint or export that cannot be used.

    The message is ``"{caller}: {what}; {fix}."``: ``what`` names the file and
    what is wrong with it, ``fix`` what to do (by default, that the checkpoint is
    damaged or crafted and one to trust should be loaded).

    >>> fail_checkpoint("f", "ckpt/latest is a FIFO")
    Traceback (most recent call last):
    ValueError: f: ckpt/latest is a FIFO; the checkpoint is damaged or crafted; load one you trust.
    """
    msg = f"{caller}: {what}; {fix}."
    raise ValueError(msg)


def _is_plain(name: str) -> bool:
    # An absolute name starts with an empty part; "a//b" and "a/" have one too.
    return (
        len(name) <= _NAME_LIMIT
        and "\\" not in name
        and "\x00" not in name
        and all(part not in ("", ".", "..") for part in name.split("/"))
    )


def member_path(root: Path, name: str, *, caller: str, where: str = "") -> Path:
    """Return ``root / name`` after checking it stays inside ``root`` on disk.

    ``name`` is checked as by ``check_member_name``; then the path with every
    symlink resolved must lie inside ``root`` (resolved too). The file need not
    exist; see ``regular_file``.

    Raises:
        ValueError: ``name`` is not a plain relative path, or a symlink on the way
            leads out of ``root``.
    """
    check_member_name(caller, name, where=where)
    path = root / name
    inside = root.resolve()
    giver = f"{where or 'the checkpoint'} names {summary(name)}"
    if not path.resolve().is_relative_to(inside):
        fail_checkpoint(caller, f"{giver}, which is a link out of {root}")
    return path


def regular_file(path: Path) -> str | None:
    """Return ``None`` if ``path`` is a regular file, else what it is instead.

    Symlinks are followed (``member_path`` has checked where they lead); a FIFO,
    device, socket or directory is never opened.

    >>> regular_file(Path("/nonexistent"))
    'is missing'
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is missing"
    if stat.S_ISREG(mode):
        return None
    kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
    return f"is {kind}, not a regular file"
