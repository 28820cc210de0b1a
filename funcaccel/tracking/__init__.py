"""Experiment trackers and the one place that decides which rank calls them.

``_gating.py`` holds the ``Tracker`` protocol and the gated calls; ``_values.py`` the
values trackers accept; ``_base.py`` what every built-in tracker shares; one file per
backend (``_memory.py``, ``_files.py``, ``_tensorboard.py``, ``_mlflow.py``,
``_wandb.py``); ``_by_name.py`` builds them from names, as Accelerate's ``log_with``.
"""

from __future__ import annotations

from funcaccel.tracking._base import TrackerBase
from funcaccel.tracking._by_name import trackers_from_names
from funcaccel.tracking._files import CSVTracker
from funcaccel.tracking._files import JSONLTracker
from funcaccel.tracking._gating import Tracker
from funcaccel.tracking._gating import finish_trackers
from funcaccel.tracking._gating import log_metrics
from funcaccel.tracking._gating import store_config
from funcaccel.tracking._memory import InMemoryTracker
from funcaccel.tracking._memory import LogRecord
from funcaccel.tracking._mlflow import MLflowTracker
from funcaccel.tracking._tensorboard import TensorBoardTracker
from funcaccel.tracking._values import ConfigValue
from funcaccel.tracking._values import MetricValue
from funcaccel.tracking._values import normalize_config
from funcaccel.tracking._values import normalize_metrics
from funcaccel.tracking._wandb import WandbTracker

__all__ = [
    "ConfigValue",
    "CSVTracker",
    "finish_trackers",
    "InMemoryTracker",
    "JSONLTracker",
    "log_metrics",
    "LogRecord",
    "MetricValue",
    "MLflowTracker",
    "normalize_config",
    "normalize_metrics",
    "store_config",
    "TensorBoardTracker",
    "Tracker",
    "TrackerBase",
    "trackers_from_names",
    "WandbTracker",
]
