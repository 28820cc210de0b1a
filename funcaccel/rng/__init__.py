"""Random-number generators: sync across ranks, capture and restore for checkpoints.

``_sync.py`` sets every rank's generators to rank 0's state (what ``shard_loader``
uses); ``_capture.py`` captures and restores this process's generators.
"""

from __future__ import annotations

from funcaccel.rng._capture import capture_rng_state
from funcaccel.rng._capture import restore_rng_state
from funcaccel.rng._sync import sync_rng_states

__all__ = [
    "capture_rng_state",
    "restore_rng_state",
    "sync_rng_states",
]
