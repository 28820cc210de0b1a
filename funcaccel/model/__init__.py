"""Model wrapping: ``wrap_model`` and the strategy functions it composes; ``unwrap_model``.

``wrap_model`` (``_wrap.py``) checks its arguments once and picks a strategy, each
a public function in its own file: ``wrap_ddp`` (``_ddp.py``), ``wrap_fsdp``
(``_fsdp.py``, with ``FSDPOptions``), ``wrap_mesh`` (``_mesh.py``, tensor and
hybrid parallelism on a ``ParallelMesh``), ``wrap_deepspeed`` (``_deepspeed.py``,
with ``DeepSpeedOptions`` in ``_deepspeed_options.py``) and ``materialize_meta``
(``_meta.py``) for a model built on the ``meta`` device. ``_wrappers.py`` knows
which modules are wrappers (``unwrap_model``); ``_rebind.py`` re-points
optimizers at the parameters sharding replaced.
"""

from __future__ import annotations

from funcaccel.model._ddp import wrap_ddp
from funcaccel.model._deepspeed import wrap_deepspeed
from funcaccel.model._deepspeed_options import DeepSpeedOptions
from funcaccel.model._fsdp import FSDPOptions
from funcaccel.model._fsdp import wrap_fsdp
from funcaccel.model._mesh import wrap_mesh
from funcaccel.model._meta import materialize_meta
from funcaccel.model._wrap import move_optimizer_state_
from funcaccel.model._wrap import wrap_model
from funcaccel.model._wrappers import unwrap_model

__all__ = [
    "DeepSpeedOptions",
    "FSDPOptions",
    "materialize_meta",
    "move_optimizer_state_",
    "unwrap_model",
    "wrap_ddp",
    "wrap_deepspeed",
    "wrap_fsdp",
    "wrap_mesh",
    "wrap_model",
]
