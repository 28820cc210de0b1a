"""``wrap_model(..., pipeline=...)``: this rank's pipeline stages, built and wrapped.

``build_pipeline`` cuts the model's units into stages (``_pipeline_options``),
keeps the stages of this rank's pipeline coordinate, gives a ``meta`` model
storage for those only, applies tensor parallelism and then FSDP2 / HSDP (or
replication) over the data-parallel dimensions inside each stage, and hands
each to torch's ``PipelineStage`` on the mesh's ``"pp"`` group. The result is a
``Pipeline``: an ``nn.Module`` holding the stage modules, which knows its
stages, options and mesh; ``pipeline_step`` runs the schedule on it.

With 4 ranks, ``build_mesh(ctx, pp=2)`` (``dp_shard=2``) and
``PipelineOptions(microbatches=4, split_points=("layers.2",))`` on ``embed,
layers.0 .. layers.3, head``: ranks 0 and 1 hold FSDP shards of stage 0
(``embed, layers.0, layers.1``), ranks 2 and 3 of stage 1.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Final

from torch import nn

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import check_mesh
from funcaccel.model._checkpointing import apply_activation_checkpointing
from funcaccel.model._compile_blocks import compile_blocks
from funcaccel.model._compile_options import ActivationCheckpointOptions
from funcaccel.model._compile_options import CompileOptions
from funcaccel.model._fsdp import FSDPOptions
from funcaccel.model._fsdp import check_fsdp_options
from funcaccel.model._mesh import _check_plan
from funcaccel.model._mesh import shard_over_dp
from funcaccel.model._meta import has_meta_tensors
from funcaccel.model._meta import materialize_
from funcaccel.model._meta import place_
from funcaccel.model._pipeline_chain import check_chain
from funcaccel.model._pipeline_options import PipelineOptions
from funcaccel.model._pipeline_options import cut_units
from funcaccel.model._pipeline_options import model_units
from funcaccel.model._pipeline_options import stage_indices

__all__ = ["Pipeline", "StageModule", "build_pipeline"]

_CALLER: Final = "wrap_model"
FastStep = tuple[ActivationCheckpointOptions | None, CompileOptions | None]
_PP_MESH: Final = "a ParallelMesh with pp > 1 (from build_mesh(ctx, pp=...))"


class StageModule(nn.Module):
    """One pipeline stage: some of a model's units, under their original names.

    Its forward applies the units in order, each to the previous one's output;
    its ``state_dict`` keys are the model's (``"layers.2.weight"``).
    """

    def __init__(self, units: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.unit_names: tuple[str, ...] = tuple(name for name, _ in units)
        for name, unit in units:
            parent, _, leaf = name.rpartition(".")
            if not parent:
                self.add_module(leaf, unit)
                continue
            if parent not in self._modules:
                self.add_module(parent, nn.ModuleDict())
            container = self._modules[parent]
            assert isinstance(container, nn.ModuleDict)
            container[leaf] = unit

    def forward(self, x: Any) -> Any:
        """Apply the stage's units in order."""
        for name in self.unit_names:
            x = self.get_submodule(name)(x)
        return x


class LossSlot:
    """The loss function torch's schedule calls, set by each step before it runs.

    A schedule keeps its stages' set-up (shapes, buffers) from its first step;
    building a new one per step would run that set-up again, and with FSDP2 the
    set-up clears the gradients accumulated so far. So one schedule serves every
    step and the step's loss function is put in this slot.
    """

    def __init__(self) -> None:
        self.fn: Callable[[Any, Any], Any] | None = None

    def __call__(self, output: Any, target: Any) -> Any:
        """Call the step's loss function."""
        fn = self.fn
        assert fn is not None, "pipeline_step sets the loss function first"
        return fn(output, target)


class Pipeline(nn.Module):
    """This rank's pipeline stages (wrapped), their torch ``PipelineStage``s and layout.

    Build one with ``wrap_model(ctx, model, mesh=..., pipeline=...)``; train it
    with ``pipeline_step``. ``parameters()`` are this rank's (its stages',
    sharded as wrapped); ``stage_modules[i]`` runs stage ``stage_indices[i]``
    of ``num_stages``. Calling it directly is an error: a stage's input comes
    from another rank.
    """

    def __init__(
        self,
        *,
        modules: list[nn.Module],
        stages: tuple[Any, ...],
        stage_indices: tuple[int, ...],
        num_stages: int,
        options: PipelineOptions,
        mesh: ParallelMesh,
        unit_names: tuple[tuple[str, ...], ...],
    ) -> None:
        super().__init__()
        self.stage_modules = nn.ModuleList(modules)
        self.stages = stages
        self.stage_indices = stage_indices
        self.num_stages = num_stages
        self.options = options
        self.mesh = mesh
        self.unit_names = unit_names
        self.loss_slot = LossSlot()
        self.schedule: Any = None  # torch's schedule, built by the first step
        # (inputs shape, dtype, targets shape, dtype) of the first step's batch.
        self.batch_layout: tuple[Any, ...] | None = None

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank runs stage 0 (which takes the batch's inputs)."""
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank runs the last stage (which computes the loss)."""
        return self.num_stages - 1 in self.stage_indices

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refuse: a pipeline runs through ``pipeline_step`` or ``pipeline_eval``."""
        del args, kwargs  # never run
        msg = "Pipeline: a pipelined model cannot be called directly (its stages run on several ranks); use pipeline_step(ctx, grad, pipe, optimizers, batch, loss_fn) to train or pipeline_eval(ctx, pipe, batch) to evaluate."
        raise RuntimeError(msg)


def _check(
    ctx: DistributedContext,
    model: nn.Module,
    options: object,
    mesh: object,
    tp_plan: object,
    fsdp: FSDPOptions | None,
) -> tuple[PipelineOptions, ParallelMesh]:
    what = "a PipelineOptions or None"
    opts = check_type(_CALLER, "pipeline", options, PipelineOptions, what=what)
    if mesh is None:
        fix = "Pass mesh=build_mesh(ctx, pp=...) too."
        fail_value(_CALLER, "mesh", mesh, f"{_PP_MESH} with pipeline=", fix)
    layout = check_mesh(_CALLER, ctx, mesh)
    if layout.pp == 1:
        fix = "Build the mesh with pp > 1, or pass pipeline=None."
        fail_value(_CALLER, "mesh", layout, f"{_PP_MESH} with pipeline=", fix)
    _check_plan(_CALLER, layout, tp_plan, model)
    if fsdp is None and layout.dp_shard > 1:
        what = f"an FSDPOptions on a mesh with dp_shard > 1 (shape {layout.shape})"
        fix = "Pass fsdp=FSDPOptions(), or build the mesh with dp_shard=1."
        fail_value(_CALLER, "fsdp", fsdp, what, fix)
    if fsdp is not None:
        if layout.dp_size == 1:
            what = f"None on a mesh with one data-parallel rank (shape {layout.shape})"
            fail_value(_CALLER, "fsdp", fsdp, what, "Pass fsdp=None.")
        check_fsdp_options(_CALLER, ctx, fsdp, shard_size=layout.dp_shard)
    own = [n for n, _ in model.named_parameters(recurse=False)]
    own += [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        what = "no parameters or buffers of its own (only inside its units)"
        fix = "Move them into a child module (a unit of some stage)."
        fail_value(_CALLER, "the model's root", own, what, fix)
    check_chain(_CALLER, model, model_units(model))
    require_process_group(ctx, _CALLER)
    if layout.device_mesh is None:
        msg = f"{_CALLER}: the mesh (shape {layout.shape}) has no DeviceMesh: it was built by hand or before the process group started; build it with build_mesh(ctx, ...) after build_context()."
        raise RuntimeError(msg)
    return opts, layout


def _materialize_mine_(
    ctx: DistributedContext,
    units: list[tuple[str, nn.Module]],
    mine: set[str],
    init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Give this rank's meta units storage, drawing the others' values and dropping them.

    Every unit is initialised in order so that the global RNG advances as when
    building the model whole: this rank's units get the values they would have
    there. Another stage's unit holds its full values only until the next unit.
    """
    for name, unit in units:
        if not has_meta_tensors(unit):
            continue
        materialize_(unit, ctx.device, init_fn)
        if name not in mine:
            unit.to("meta")


def _has_blocks(module: nn.Module, classes: Sequence[type[nn.Module]]) -> bool:
    return not classes or any(isinstance(m, tuple(classes)) for m in module.modules())


def _fast_stage_(module: nn.Module, fast: FastStep) -> None:
    """Checkpoint, then compile, the stage's blocks in place (a stage without any is left)."""
    checkpointing, compile = fast
    if checkpointing is not None and _has_blocks(module, checkpointing.blocks):
        apply_activation_checkpointing(module, checkpointing)
    if compile is not None and _has_blocks(module, compile.blocks):
        compile_blocks(module, compile)


def _wrap_stage(
    ctx: DistributedContext,
    module: StageModule,
    mesh: ParallelMesh,
    tp_plan: Mapping[str, Any] | None,
    fsdp: FSDPOptions | None,
    fast: FastStep,
) -> nn.Module:
    device_mesh = mesh.device_mesh
    assert device_mesh is not None
    if mesh.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        assert tp_plan is not None
        names = {name for name, _ in module.named_modules()}
        plan = {k: v for k, v in tp_plan.items() if "*" in k or k in names}
        parallelize_module(module, device_mesh["tp"], plan)
    _fast_stage_(module, fast)
    if mesh.dp_size == 1:
        return module
    return shard_over_dp(ctx, module, mesh, device_mesh, fsdp)


def build_pipeline(
    ctx: DistributedContext,
    model: nn.Module,
    options: object,
    mesh: object,
    tp_plan: Mapping[str, Any] | None,
    fsdp: FSDPOptions | None,
    init_fn: Callable[[nn.Module], None] | None,
    fast: FastStep = (None, None),
) -> Pipeline:
    """Cut ``model`` into stages and build this rank's, wrapped; see ``wrap_model``.

    In each stage: tensor parallelism, activation checkpointing and in-place
    compilation of its blocks (``fast``), then FSDP2 / replication.

    Raises:
        TypeError: ``options`` or ``mesh`` of the wrong type.
        ValueError: no pp mesh, a cut that names no unit or leaves a stage
            empty, a root with tensors of its own, what TP / FSDP2 refuse.
        RuntimeError: no process group or no ``DeviceMesh``.
    """
    opts, layout = _check(ctx, model, options, mesh, tp_plan, fsdp)
    units = model_units(model)
    num_stages = layout.pp * opts.stages_per_rank
    cuts = cut_units([n for n, _ in units], opts.split_points, num_stages)
    indices = stage_indices(
        opts.schedule,
        pp=layout.pp,
        pp_rank=layout.pp_rank,
        stages_per_rank=opts.stages_per_rank,
    )
    mine = {name for i in indices for name in cuts[i]}
    if has_meta_tensors(model):
        _materialize_mine_(ctx, units, mine, init_fn)
    by_name = dict(units)
    from torch.distributed.pipelining import PipelineStage

    device_mesh = layout.device_mesh
    assert device_mesh is not None
    group = device_mesh["pp"].get_group()
    modules, stages = [], []
    for index in indices:
        stage = StageModule([(name, by_name[name]) for name in cuts[index]])
        place_(stage, ctx.device)
        wrapped = _wrap_stage(ctx, stage, layout, tp_plan, fsdp, fast)
        modules.append(wrapped)
        stages.append(
            PipelineStage(wrapped, index, num_stages, ctx.device, group=group)
        )
    return Pipeline(
        modules=modules,
        stages=tuple(stages),
        stage_indices=indices,
        num_stages=num_stages,
        options=opts,
        mesh=layout,
        unit_names=cuts,
    )
