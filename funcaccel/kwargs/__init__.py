"""Frozen option records (kwargs handlers) that feed torch constructors.

``KwargsHandler`` is the base (``_base.py``); ``ProfileKwargs`` and its helpers live in
``_profile.py``; the other four handlers in ``_handlers.py``.
"""

from __future__ import annotations

from funcaccel.kwargs._base import KwargsHandler
from funcaccel.kwargs._handlers import AutocastKwargs
from funcaccel.kwargs._handlers import DDPCommunicationHookType
from funcaccel.kwargs._handlers import DistributedDataParallelKwargs
from funcaccel.kwargs._handlers import GradScalerKwargs
from funcaccel.kwargs._handlers import InitProcessGroupKwargs
from funcaccel.kwargs._profile import ProfileKwargs

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
]
