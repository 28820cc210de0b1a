"""Training-state checkpoints: atomic saves, exact resume, verified loads.

``_save_load.py`` holds the public functions; ``_layout.py`` where checkpoints lie and
how one becomes complete atomically; ``_manifest.py`` what a checkpoint holds;
``_formats.py`` how torch objects reach the disk (one file per object, or
torch.distributed.checkpoint for FSDP2); ``_agree.py`` the checks ranks agree on;
``_rank_part.py`` each rank's own part (``rank_objects``, ``rank_extra``,
``rank_map``); ``_resume_grad.py`` the ``GradState`` a resumed run continues with
(``accumulation_steps=``).
"""

from __future__ import annotations

from funcaccel.checkpoint._async import PendingCheckpoint
from funcaccel.checkpoint._export import load_model
from funcaccel.checkpoint._export import save_model
from funcaccel.checkpoint._layout import latest_checkpoint
from funcaccel.checkpoint._layout import list_checkpoints
from funcaccel.checkpoint._manifest import SCHEMA_VERSION
from funcaccel.checkpoint._manifest import CheckpointMeta
from funcaccel.checkpoint._manifest import FileEntry
from funcaccel.checkpoint._save_load import LoadedState
from funcaccel.checkpoint._save_load import load_checkpoint
from funcaccel.checkpoint._save_load import read_checkpoint_meta
from funcaccel.checkpoint._save_load import save_checkpoint
from funcaccel.checkpoint._save_load import save_checkpoint_async

__all__ = [
    "CheckpointMeta",
    "FileEntry",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model",
    "LoadedState",
    "PendingCheckpoint",
    "read_checkpoint_meta",
    "save_checkpoint",
    "save_checkpoint_async",
    "save_model",
    "SCHEMA_VERSION",
]
