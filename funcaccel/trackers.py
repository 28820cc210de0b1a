"""The built-in trackers under their earlier import path.

``funcaccel.trackers`` names the same classes as ``funcaccel.tracking`` (where they
live now) so that scripts written as ``from funcaccel.trackers import JSONLTracker``
keep working.
"""

from __future__ import annotations

from funcaccel.tracking import CSVTracker
from funcaccel.tracking import JSONLTracker
from funcaccel.tracking import MLflowTracker
from funcaccel.tracking import TensorBoardTracker
from funcaccel.tracking import WandbTracker

__all__ = [
    "CSVTracker",
    "JSONLTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandbTracker",
]
