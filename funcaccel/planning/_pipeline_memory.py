"""Pipeline stages on the fake group: what the neighbouring stages would send, answered here.

torch's ``PipelineStage`` learns at its first step what it receives from the
stages next to it: the stages first vote over the ``pp`` group on whether every
stage was given its shapes up front, then (they were not: ``wrap_model`` builds
the stages without) each sends the next one its output's metadata and, for the
backward, its input gradients' (pickled objects). On the fake group nothing
arrives: a received tensor keeps its zeros and a received object cannot be
unpickled. ``answer_peers_`` answers for the neighbours, in this process: the
vote says "infer" (torch's dynamic mode, as a real run decides: each stage runs
one micro-batch to learn its own outputs), and the metadata a neighbour would
send is that of the whole model's unit outputs on one fake micro-batch
(``unit_output_metas``, run before the model is cut). Everything else runs as
in a real run: the schedule's sends and receives of activations and gradients,
in its own order, go to the fake group, and a receive returns at once into its
fake buffer; so the micro-batches the schedule keeps in flight set the peak.

With ``pp=2`` and stages ``(embed, layers.0)`` and ``(layers.1, head)``, the
stage-1 rank is told that stage 0 sends ``layers.0``'s output (shape, dtype,
``requires_grad``) and the stage-0 rank that stage 1 sends back a gradient of
that shape.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Final

import torch
from torch import nn

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel.context import DistributedContext
from funcaccel.flops import output_loss
from funcaccel.grad_state import GradState
from funcaccel.model import Pipeline
from funcaccel.model import PipelineOptions
from funcaccel.model import wrap_model
from funcaccel.pipeline import pipeline_step
from funcaccel.planning._steps import StepFn

__all__ = [
    "answer_peers_",
    "check_pipeline_arguments",
    "check_schedule",
    "cut_and_step",
    "pipeline_strategy",
    "unit_output_metas",
]


_CALLER: Final = "estimate_memory"
# What answer_peers_ replaces on each torch PipelineStage (torch's own names).
_STAGE_METHODS: Final = (
    "_recv_meta",
    "_send_meta",
    "_warmup_forward_vote",
    "_warmup_backward_result",
)


def check_schedule(schedule: str) -> None:
    """Refuse a pipeline this torch's stages cannot run on the fake group.

    ``answer_peers_`` stands in for four methods of torch's ``PipelineStage``
    (the metadata exchange of its first step); a torch without them would send
    for real, so it is refused rather than estimated wrongly.

    Raises:
        ValueError: this torch's ``PipelineStage`` lacks one of them.
    """
    from torch.distributed.pipelining import PipelineStage

    missing = [name for name in _STAGE_METHODS if not hasattr(PipelineStage, name)]
    if missing:
        fail_value(
            _CALLER,
            "pipeline.schedule",
            schedule,
            f"a schedule whose stages exchange metadata through {_STAGE_METHODS} "
            f"(torch {torch.__version__}'s PipelineStage has no {missing})",
            "Estimate one stage's model (its layers) without pipeline=, or use "
            "the torch release funcaccel is tested with.",
        )


def check_pipeline_arguments(
    pp: int, pipeline: object, batch: object, mixed_precision: object
) -> None:
    """Refuse ``estimate_memory``'s pipeline arguments that cannot be run.

    Raises:
        TypeError: ``pipeline`` is not a ``PipelineOptions``.
        ValueError: ``pp > 1`` without ``pipeline`` or the reverse, a batch
            that is not ``(inputs, targets)`` of ``microbatches`` equal parts,
            mixed precision, or a torch whose stages cannot be answered here
            (``check_schedule``).
    """
    if pipeline is None:
        if pp > 1:
            fail_value(
                _CALLER,
                "pipeline",
                pipeline,
                f"a PipelineOptions with pp={pp} (how the stages are cut and run)",
                "Pass e.g. pipeline=PipelineOptions(microbatches=4), or pp=1.",
            )
        return
    check_type(_CALLER, "pipeline", pipeline, PipelineOptions)
    if pp == 1:
        fail_value(
            _CALLER,
            "pp",
            pp,
            "> 1 with pipeline= (the number of pipeline stages' ranks)",
            "Pass e.g. pp=2, or pipeline=None.",
        )
    assert isinstance(pipeline, PipelineOptions)
    check_schedule(pipeline.schedule)
    parts = list(batch) if isinstance(batch, tuple | list) else []
    if len(parts) != 2 or not all(isinstance(t, torch.Tensor) for t in parts):
        fail_value(
            _CALLER,
            "batch",
            batch,
            "(inputs, targets) with pipeline=, as pipeline_step takes it",
            "Pass one pipeline step's batch of one data-parallel rank, e.g. "
            "(torch.zeros(32, 1024), torch.zeros(32)).",
        )
    rows = [t.shape[0] if t.dim() else 0 for t in parts]
    n = pipeline.microbatches
    if any(r == 0 or r % n for r in rows):
        fail_value(
            _CALLER,
            "the batch's first dimensions (inputs, targets)",
            tuple(rows),
            f"positive multiples of pipeline.microbatches ({n})",
            f"Pass {n} micro-batches' rows, e.g. {n * 8}, or change microbatches.",
        )
    if mixed_precision != "no":
        fail_value(
            _CALLER,
            "mixed_precision",
            mixed_precision,
            "'no' with pipeline= (pipeline_step applies no autocast)",
            "Pass mixed_precision='no', or cast the model's parameters.",
        )


def pipeline_strategy(dp_replicate: int, dp_shard: int, tp: int, fsdp: object) -> str:
    """Name what ``wrap_model(pipeline=)`` builds: ``"pp"``, then what each stage is.

    Inside a stage the data-parallel ranks replicate (FSDP2's ``replicate``,
    not DDP) when ``fsdp`` is ``None``.

    >>> pipeline_strategy(1, 1, 1, None), pipeline_strategy(2, 1, 1, None)
    ('pp', 'pp+replicate')
    >>> pipeline_strategy(1, 16, 1, object()), pipeline_strategy(1, 1, 2, None)
    ('pp+fsdp', 'pp+tp')
    """
    if dp_replicate * dp_shard == 1:
        return "pp" + ("+tp" if tp > 1 else "")
    base = "replicate" if fsdp is None else "hsdp" if dp_replicate > 1 else "fsdp"
    return "pp+" + base + ("+tp" if tp > 1 else "")


def _metas(output: object) -> tuple[Any, ...]:
    from torch.distributed.pipelining._utils import extract_tensor_meta

    outputs = output if isinstance(output, tuple) else (output,)
    return tuple(extract_tensor_meta(t) for t in outputs if isinstance(t, torch.Tensor))


def unit_output_metas(
    model: nn.Module, inputs: torch.Tensor, microbatches: int
) -> dict[str, tuple[Any, ...]]:
    """Run ``model`` (fake) on one micro-batch of ``inputs``; each submodule's output metadata.

    Keys are qualified names (``"layers.1"``); a pipeline's stage ``k`` receives
    the output of the last unit of stage ``k - 1``. Gradients are on, as in
    training, so the metadata says ``requires_grad`` where a real stage's
    output would.
    """
    found: dict[str, tuple[Any, ...]] = {}
    handles = [
        module.register_forward_hook(
            lambda _m, _a, out, name=name: found.__setitem__(name, _metas(out))
        )
        for name, module in model.named_modules()
        if name
    ]
    rows = inputs.shape[0] // microbatches
    try:
        with torch.enable_grad():
            model(inputs[:rows])
    finally:
        for handle in handles:
            handle.remove()
    return found


def answer_peers_(pipe: Pipeline, metas: Mapping[str, tuple[Any, ...]]) -> None:
    """Make each of ``pipe``'s torch stages take its neighbours' answers from ``metas``.

    Changes the stages in place (four methods each, see the module's
    docstring); ``metas`` is ``unit_output_metas`` of the model before the cut.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.pipelining._utils import _derive_grad_metas
    from torch.distributed.pipelining._utils import _StageBackwardMeta
    from torch.distributed.pipelining._utils import _StageForwardMeta

    def sent_by(stage_index: int) -> tuple[Any, ...]:
        """What stage ``stage_index`` outputs: its last unit's output."""
        return metas[pipe.unit_names[stage_index][-1]]

    def infer(*args: object, **kwargs: object) -> torch.Tensor:
        del args, kwargs  # every stage votes "infer"; the vote is not sent
        # A real tensor: the schedule reads the vote back with .item().
        with unset_fake_temporarily():
            return torch.zeros(1, dtype=torch.int32)

    for stage in pipe.stages:
        index = stage.stage_index

        def receive(src: int, index: int = index) -> object:
            if src == index - 1:  # the previous stage's output, forward
                return _StageForwardMeta(forward_metas=sent_by(src))
            # The next stage's input gradients: its input's shape, no grad.
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(sent_by(index)))

        def send(meta: object, dst: int) -> None:
            del meta, dst  # the neighbour is answered by its own receive

        stage._recv_meta = receive
        stage._send_meta = send
        stage._warmup_forward_vote = infer
        stage._warmup_backward_result = infer


def cut_and_step(
    ctx: DistributedContext,
    model: nn.Module,
    fake: object,
    pipeline: PipelineOptions,
    wrap_options: Mapping[str, Any],
    loss_fn: Callable[..., torch.Tensor] | None,
) -> tuple[Pipeline, nn.Module, StepFn]:
    """Cut ``model`` as the run does; one ``pipeline_step`` on ``fake``; what to track.

    ``model`` is whole and fake; ``wrap_model(ctx, model, pipeline=pipeline,
    **wrap_options)`` keeps this rank's stages (changing ``model``'s units in
    place). torch's FSDP2 tracker takes one FSDP2 root: a rank's single stage
    is tracked alone, several stages together (the generic tracker).
    """
    assert isinstance(fake, tuple | list)
    inputs, target = fake
    # Before the cut: what each unit outputs, for the stages' neighbours.
    metas = unit_output_metas(model, inputs, pipeline.microbatches)
    pipe = wrap_model(ctx, model, pipeline=pipeline, **wrap_options)
    assert isinstance(pipe, Pipeline)
    answer_peers_(pipe, metas)

    def compute_loss(output: Any, tgt: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, tgt) if loss_fn else output_loss(output)

    # One untracked step, in an open window (no optimizer step), lets torch's
    # schedule learn its shapes: that first step runs torch.autograd.grad on
    # the stage's inputs, which the trackers' module hooks cannot run under.
    idle = torch.optim.SGD(pipe.parameters(), lr=0.0)
    batch = (inputs, target)
    pipeline_step(ctx, GradState(accumulation_steps=2), pipe, idle, batch, compute_loss)
    idle.zero_grad(set_to_none=True)

    def step(grad: GradState, optimizer: torch.optim.Optimizer) -> GradState:
        _, grad = pipeline_step(ctx, grad, pipe, optimizer, batch, compute_loss)
        return grad

    (tracked,) = pipe.stage_modules if len(pipe.stage_modules) == 1 else (pipe,)
    return pipe, tracked, step
