"""Where checkpoints lie in a run's directory, and how one becomes complete atomically.

Checkpoints are ``checkpoint-000001``, ``checkpoint-000002``, ... in the run's
directory, next to a pointer file ``latest`` naming the newest. A save writes into
``.checkpoint-N.tmp``; ``commit`` writes ``manifest.json`` last, renames the
directory into place, replaces ``latest`` atomically and only then deletes old
checkpoints and leftover temporary directories, each step fsynced before the next.
A process killed at any moment therefore leaves ``latest`` naming a complete
checkpoint, and every name that looks complete is. Files are written with
``torch.save`` and fsynced, and read back with ``torch.load(weights_only=True)``.

A run directory is untrusted input: only real directories count as checkpoints
(a symlink named ``checkpoint-000007`` is neither listed, loaded nor deleted), and
``latest`` must be a small regular file naming one of them.

>>> checkpoint_dirs(Path("/nonexistent")), latest_checkpoint("/nonexistent")
([], None)
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import stat
import zipfile
from pathlib import Path
from typing import Any
from typing import Final

import torch

from funcaccel._checks import summary
from funcaccel._checks import type_name
from funcaccel.checkpoint._members import DAMAGED
from funcaccel.checkpoint._members import fail_checkpoint
from funcaccel.checkpoint._members import regular_file

__all__ = [
    "LATEST_NAME",
    "MANIFEST_NAME",
    "checkpoint_dirs",
    "commit",
    "file_sizes",
    "fsync_directory",
    "latest_checkpoint",
    "list_checkpoints",
    "prepare",
    "prune",
    "read_torch_file",
    "sha256_of",
    "temporary_dir",
    "write_torch_file",
]

MANIFEST_NAME: Final = "manifest.json"
LATEST_NAME: Final = "latest"
_NAME_RE: Final = re.compile(r"checkpoint-(\d+)")
_CHUNK: Final = 1 << 20
_POINTER_LIMIT: Final = 4096
# caller, the latest file, what is wrong with it
_MSG_POINTER: Final = (
    "{0}: {1} {2}, but funcaccel writes it as a short regular file; "
    + DAMAGED
    + ", or delete {1} to use the newest complete checkpoint."
)
# caller, the latest file, the name it holds, the run directory, the newest complete
_MSG_STALE: Final = (
    "{0}: {1} names {2}, which is not a complete checkpoint in {3}; delete {1} to "
    "use the newest complete one ({4})."
)
_INCOMPLETE: Final = (
    "the checkpoint is incomplete, damaged or crafted. Load an earlier one (see "
    "list_checkpoints)"
)


def _is_real_dir(path: Path) -> bool:
    """Whether ``path`` is a directory itself, not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def checkpoint_dirs(root: Path) -> list[Path]:
    """Return the numbered checkpoint directories in ``root``, complete or not, in order.

    Hidden temporary directories (``.checkpoint-N.tmp``) and symlinks are not
    included.
    """
    if not root.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for path in root.iterdir():
        match = _NAME_RE.fullmatch(path.name)
        if match and _is_real_dir(path):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def temporary_dir(root: Path, name: str) -> Path:
    """Return where checkpoint ``name`` is written before it is committed."""
    return root / f".{name}.tmp"


def prepare(root: Path) -> str:
    """Create ``root`` and an empty temporary directory for the next checkpoint.

    Run on rank 0 only. A temporary directory left by a save that was killed is
    deleted first (it was never complete).

    Returns:
        The new checkpoint's name, one past the highest number in ``root``.
    """
    root.mkdir(parents=True, exist_ok=True)
    # Every name counts, a symlink's or a file's too: the new one must be free.
    taken = [
        int(m.group(1)) for p in root.iterdir() if (m := _NAME_RE.fullmatch(p.name))
    ]
    name = f"checkpoint-{max(taken, default=0) + 1:06d}"
    temporary = temporary_dir(root, name)
    if _is_real_dir(temporary):
        shutil.rmtree(temporary)
    temporary.mkdir()  # an OSError if a symlink or file has the name
    return name


def file_sizes(directory: Path) -> dict[str, int]:
    """Return ``{name: size}`` for the files directly in ``directory`` (fsyncs it)."""
    sizes = {
        p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()
    }
    fsync_directory(directory)
    return sizes


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def commit(root: Path, name: str, manifest: dict[str, object]) -> None:
    """Make checkpoint ``name`` complete and current; run on rank 0 after all wrote.

    In order: write ``manifest.json`` into the temporary directory, rename it to
    ``root/name``, then replace ``root/latest``. Each step is fsynced before the
    next, so a crash leaves ``latest`` naming a complete checkpoint.
    """
    temporary = temporary_dir(root, name)
    _write_synced(temporary / MANIFEST_NAME, json.dumps(manifest, indent=1))
    fsync_directory(temporary)
    os.rename(temporary, root / name)
    fsync_directory(root)
    pending = root / f".{LATEST_NAME}.tmp"
    _write_synced(pending, name + "\n")
    os.replace(pending, root / LATEST_NAME)
    fsync_directory(root)


def prune(root: Path, *, keep_last: int | None) -> None:
    """Delete leftover temporary dirs and all but the newest ``keep_last`` checkpoints.

    Run on rank 0 only after ``commit``: nothing it deletes is current. ``None``
    keeps every checkpoint. Links are never followed: only real directories are
    deleted (``shutil.rmtree`` unlinks a symlink inside one, it does not descend).
    """
    for path in root.iterdir():
        if path.name.startswith(".checkpoint-") and path.name.endswith(".tmp"):
            if _is_real_dir(path):
                shutil.rmtree(path)
    if keep_last is None:
        return
    complete = [p for p in checkpoint_dirs(root) if (p / MANIFEST_NAME).is_file()]
    for old in complete[:-keep_last]:
        # Renamed first, so that a crash never leaves it half-deleted under a name
        # that looks complete.
        doomed = root / f".{old.name}.deleting.tmp"
        os.rename(old, doomed)
        shutil.rmtree(doomed)


def sha256_of(path: Path) -> str:
    """Return the hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_directory(path: Path) -> None:
    """Flush ``path``'s directory entries (new or renamed names) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Return the complete checkpoints in ``directory``, oldest first.

    Complete means its ``manifest.json`` exists (it is written last, before the
    directory gets its final name). Temporary directories of an interrupted save are
    ignored; a missing ``directory`` has none.
    """
    return [
        path
        for path in checkpoint_dirs(Path(directory))
        if (path / MANIFEST_NAME).is_file()
    ]


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """Return the checkpoint ``directory/latest`` names, or ``None`` before the first.

    Without a ``latest`` file (deleted by hand) the newest complete checkpoint is
    returned.

    Raises:
        ValueError: ``latest`` names something that is not a complete checkpoint,
            or is not a small regular file (a symlink, FIFO or device).
    """
    caller = "latest_checkpoint"
    root = Path(directory)
    pointer = root / LATEST_NAME
    complete = list_checkpoints(root)
    if not pointer.is_symlink() and regular_file(pointer) == "is missing":
        return complete[-1] if complete else None
    problem = "is a symlink" if pointer.is_symlink() else regular_file(pointer)
    if problem is None and pointer.stat().st_size > _POINTER_LIMIT:
        problem = f"has {pointer.stat().st_size} bytes"
    if problem is not None:
        raise ValueError(_MSG_POINTER.format(caller, pointer, problem))
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as error:
        msg = f"{caller}: {pointer} is not text ({error.reason}); {DAMAGED}."
        raise ValueError(msg) from error
    # Only a name listed above is returned: a bare checkpoint-N in root, no path.
    newest = complete[-1].name if complete else "there is none"
    if not _NAME_RE.fullmatch(name) or root / name not in complete:
        raise ValueError(
            _MSG_STALE.format(caller, pointer, summary(name), root, newest)
        )
    return root / name


def write_torch_file(obj: object, path: Path) -> tuple[int, str]:
    """Write ``obj`` with ``torch.save`` to a new file and ``fsync`` it.

    Returns:
        The file's size in bytes and its hex SHA-256.
    """
    with path.open("xb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
    return path.stat().st_size, sha256_of(path)


def read_torch_file(path: Path, *, caller: str) -> Any:
    """Read a file written by ``write_torch_file`` onto the CPU, weights only.

    Nothing in the file runs: ``weights_only=True`` unpickles tensors and plain
    values only, and refuses any other object (a crafted file's code included).

    Raises:
        ValueError: the file is missing, not a regular file, truncated or not a
            weights-only torch file; the message names the file.
    """
    problem = regular_file(path)
    if problem is not None:
        fail_checkpoint(caller, f"{path} {problem}", _INCOMPLETE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        EOFError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
    ) as error:
        msg = (
            f"{caller}: {path} cannot be read ({type_name(error)}: "
            f"{(str(error).splitlines() or ['no detail'])[0][:200]}); "
            "the file is truncated, damaged or crafted (only tensors and plain values "
            "are loaded, weights_only=True). Load an earlier checkpoint (see "
            "list_checkpoints)."
        )
        raise ValueError(msg) from error
