"""Pipeline parallelism: ``pipeline_step`` over a ``Pipeline`` from ``wrap_model``.

``_schedule.py`` builds torch's schedule for a pipeline (always with
``scale_grads=False``); ``_step.py`` runs a step and applies the exact window
gradient (``pipeline_step``, ``clip_pipeline_grad_norm_``); ``_eval.py`` runs
the pipeline forward only (``pipeline_eval``).
"""

from __future__ import annotations

from funcaccel.pipeline._eval import pipeline_eval
from funcaccel.pipeline._step import clip_pipeline_grad_norm_
from funcaccel.pipeline._step import pipeline_step

__all__ = ["clip_pipeline_grad_norm_", "pipeline_eval", "pipeline_step"]
