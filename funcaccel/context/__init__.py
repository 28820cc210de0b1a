"""The distributed context: a frozen value describing the world, built once.

``_context.py`` holds ``DistributedContext`` and the functions that build, check and
close it; ``_group.py`` how the default process group starts and ends (so that
every rank exits cleanly); ``_env.py`` what they read from outside the process.
"""

from __future__ import annotations

from funcaccel.context._context import DistributedContext
from funcaccel.context._context import DistributedType
from funcaccel.context._context import build_context
from funcaccel.context._context import check_context
from funcaccel.context._context import close_context
from funcaccel.context._context import context_from_env
from funcaccel.context._context import effective_backend
from funcaccel.context._context import effective_timeout
from funcaccel.context._context import require_process_group
from funcaccel.context._env import CollectiveTimeout
from funcaccel.context._group import end_process_group
from funcaccel.context._group import start_process_group

__all__ = [
    "CollectiveTimeout",
    "build_context",
    "check_context",
    "close_context",
    "context_from_env",
    "DistributedContext",
    "DistributedType",
    "effective_backend",
    "effective_timeout",
    "end_process_group",
    "require_process_group",
    "start_process_group",
]
