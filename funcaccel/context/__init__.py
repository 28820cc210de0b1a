"""The distributed context: a frozen value describing the world, built once.

``_context.py`` holds ``DistributedContext`` and the functions that build, check and
close it (the process group itself starts and ends in the private
``funcaccel._group``, so that every rank exits cleanly); ``_env.py`` what they read
from outside the process; ``_launchers.py`` which launcher (torchrun, SLURM,
Open MPI, MPICH/PMI) started it and the world its variables describe; ``_device.py`` the check of a ``device=`` the caller names.
"""

from __future__ import annotations

from funcaccel.context._context import DistributedContext
from funcaccel.context._context import DistributedType
from funcaccel.context._context import build_context
from funcaccel.context._context import close_context
from funcaccel.context._context import context_from_env
from funcaccel.context._context import effective_backend
from funcaccel.context._context import effective_timeout
from funcaccel.context._context import require_process_group
from funcaccel.context._device import DeviceChoice
from funcaccel.context._env import CollectiveTimeout
from funcaccel.context._launchers import LAUNCHER_VARIABLES
from funcaccel.context._launchers import Launch
from funcaccel.context._launchers import Launcher
from funcaccel.context._launchers import read_launch

__all__ = [
    "LAUNCHER_VARIABLES",
    "CollectiveTimeout",
    "DeviceChoice",
    "build_context",
    "close_context",
    "context_from_env",
    "DistributedContext",
    "DistributedType",
    "effective_backend",
    "effective_timeout",
    "Launch",
    "Launcher",
    "read_launch",
    "require_process_group",
]
