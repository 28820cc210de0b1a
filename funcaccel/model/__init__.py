"""Model wrapping: ``wrap_model`` and the strategy functions it composes; ``unwrap_model``.

``wrap_model`` (``_wrap.py``) checks its arguments once and picks a strategy, each
a public function in its own file: ``wrap_ddp`` (``_ddp.py``), ``wrap_fsdp``
(``_fsdp.py``, with ``FSDPOptions``), ``wrap_mesh`` (``_mesh.py``, tensor and
hybrid parallelism on a ``ParallelMesh``), ``wrap_deepspeed`` (``_deepspeed.py``,
with ``DeepSpeedOptions`` in ``_deepspeed_options.py``) and ``materialize_meta``
(``_meta.py``) for a model built on the ``meta`` device. ``_wrappers.py`` knows
which modules are wrappers (``unwrap_model``); ``_rebind.py`` re-points
optimizers at the parameters sharding replaced. The fast step's pieces:
``CompileOptions`` / ``ActivationCheckpointOptions`` (``_compile_options.py``),
``apply_activation_checkpointing`` (``_checkpointing.py``), ``compile_blocks``
(``_compile_blocks.py``), ``compile_report`` (``_compile_report.py``), their
order checks (``_fast_order.py``) and their place in ``wrap_model``
(``_fast_step.py``).
"""

from __future__ import annotations

from funcaccel.model._checkpointing import apply_activation_checkpointing
from funcaccel.model._compile_blocks import compile_blocks
from funcaccel.model._compile_options import ActivationCheckpointOptions
from funcaccel.model._compile_options import CompileOptions
from funcaccel.model._compile_report import CompileReport
from funcaccel.model._compile_report import compile_report
from funcaccel.model._ddp import wrap_ddp
from funcaccel.model._deepspeed import wrap_deepspeed
from funcaccel.model._deepspeed_options import DeepSpeedOptions
from funcaccel.model._fsdp import FSDPOptions
from funcaccel.model._fsdp import wrap_fsdp
from funcaccel.model._mesh import wrap_mesh
from funcaccel.model._meta import materialize_meta
from funcaccel.model._pipeline import Pipeline
from funcaccel.model._pipeline_options import PipelineOptions
from funcaccel.model._wrap import move_optimizer_state_
from funcaccel.model._wrap import wrap_model
from funcaccel.model._wrappers import unwrap_model

__all__ = [
    "ActivationCheckpointOptions",
    "CompileOptions",
    "CompileReport",
    "DeepSpeedOptions",
    "FSDPOptions",
    "apply_activation_checkpointing",
    "compile_blocks",
    "compile_report",
    "materialize_meta",
    "Pipeline",
    "PipelineOptions",
    "move_optimizer_state_",
    "unwrap_model",
    "wrap_ddp",
    "wrap_deepspeed",
    "wrap_fsdp",
    "wrap_mesh",
    "wrap_model",
]
