"""Planning a run before launching it: memory estimates and dry runs at any world size.

``estimate_memory`` (``_memory.py``) runs one training step of the user's model
at a world size on torch's fake process group and fake tensors, in this process
(``_fake_world.py``), and returns a ``MemoryEstimate`` (``_estimate.py``);
``dry_run`` (``_dry_run.py``) runs the user's training function for some ranks of
a world on the fake group and compares the collectives they call.
"""

from __future__ import annotations

from funcaccel.planning._dry_run import DryRunError
from funcaccel.planning._dry_run import DryRunReport
from funcaccel.planning._dry_run import dry_run
from funcaccel.planning._estimate import NOT_COUNTED
from funcaccel.planning._estimate import MemoryEstimate
from funcaccel.planning._estimate import RankMemory
from funcaccel.planning._from_path import estimate_from_path
from funcaccel.planning._memory import estimate_memory

__all__ = [
    "NOT_COUNTED",
    "DryRunError",
    "DryRunReport",
    "MemoryEstimate",
    "RankMemory",
    "dry_run",
    "estimate_from_path",
    "estimate_memory",
]
