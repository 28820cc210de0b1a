"""Model wrapping: ``wrap_model`` (DDP, FSDP2) and ``unwrap_model``.

``_wrap.py`` holds DDP wrapping and unwrapping; ``_fsdp.py`` the FSDP2 options and
sharding; ``_deepspeed_options.py`` and ``_deepspeed.py`` the DeepSpeed ZeRO options,
engine and step.
"""

from __future__ import annotations

from funcaccel.model._deepspeed import deepspeed_step
from funcaccel.model._deepspeed import engine_boundary_ctx
from funcaccel.model._deepspeed_options import DeepSpeedOptions
from funcaccel.model._fsdp import FSDPOptions
from funcaccel.model._fsdp import check_optimizers_hold
from funcaccel.model._wrap import inside_compile
from funcaccel.model._wrap import move_optimizer_state_
from funcaccel.model._wrap import unwrap_model
from funcaccel.model._wrap import wrap_model

__all__ = [
    "DeepSpeedOptions",
    "FSDPOptions",
    "deepspeed_step",
    "engine_boundary_ctx",
    "check_optimizers_hold",
    "inside_compile",
    "move_optimizer_state_",
    "unwrap_model",
    "wrap_model",
]
