"""Pipeline parallelism: ``wrap_model(..., pipeline=)`` and ``pipeline_step``, exact.

Every distributed run trains a small float64 chain for 3 pipeline steps with
``accumulation_steps=2`` (one full window, then a short one closed by the end
of the data) and compares the final parameters, to 1e-10, with a one-process
reference that never heard of pipelines: plain SGD on the window's mean loss
(or its summed item losses over the window's item count).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any
from typing import Final
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from funcaccel import ActivationCheckpointOptions
from funcaccel import CompileOptions
from funcaccel import FSDPOptions
from funcaccel import GradState
from funcaccel import Pipeline
from funcaccel import PipelineOptions
from funcaccel import broadcast_object
from funcaccel import build_mesh
from funcaccel import gather_for_metrics
from funcaccel import pipeline_eval
from funcaccel import pipeline_step
from funcaccel import save_model
from funcaccel import wait_for_everyone
from funcaccel import wrap_model
from funcaccel.context import DistributedContext
from funcaccel.model._pipeline_options import cut_units
from funcaccel.model._pipeline_options import model_units
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

F64: Final = torch.float64
STEPS: Final = 3
K: Final = 2
MICRO: Final = 4
PER_RANK: Final = 8  # rows per data-parallel rank and step
LR: Final = 0.1
TIMEOUT: Final = 300


class Chain(nn.Module):
    """embed, layers.0 .. layers.3, head: a chain of six units."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6, dtype=F64)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(6, 8, dtype=F64), nn.Tanh(), nn.Linear(8, 6, dtype=F64)
            )
            for _ in range(4)
        )
        self.head = nn.Linear(6, 2, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


def _data(dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches: inputs, and targets (2 values + an item mask)."""
    gen = torch.Generator().manual_seed(7)
    rows = PER_RANK * dp_size
    out = []
    for step in range(STEPS):
        x = torch.randn(rows, 4, generator=gen, dtype=F64)
        y = torch.randn(rows, 2, generator=gen, dtype=F64)
        mask = (torch.rand(rows, 1, generator=gen) < 0.6).to(F64)
        if step == 0:
            mask[:2] = 0.0  # data-parallel rank 0's first micro-batch: no items
        out.append((x, torch.cat([y, mask], dim=1)))
    return out


def _mean_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target[:, :2]) ** 2).mean()


def _summed_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (((out - target[:, :2]) ** 2).sum(1) * target[:, 2]).sum()


def _reference(
    dp_size: int, tokens: bool, clip: float | None = None
) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data, losses, norms = _data(dp_size), [], []
    for start in range(0, STEPS, K):
        window = data[start : start + K]
        if tokens:
            total = sum(float(t[:, 2].sum()) for _, t in window)
            parts = [_summed_loss(model(x), t) for x, t in window]
            loss = torch.stack(parts).sum() / total
        else:
            parts = [_mean_loss(model(x), t) for x, t in window]
            loss = torch.stack(parts).sum() / len(window)
        for x, t in window:  # rank 0's shown loss per step
            x0, t0 = x[:PER_RANK], t[:PER_RANK]
            with torch.no_grad():
                if tokens:  # a step without items shows its summed loss (0)
                    items = float(t0[:, 2].sum())
                    summed = float(_summed_loss(model(x0), t0))
                    losses.append(summed / items if items else summed)
                else:
                    losses.append(float(_mean_loss(model(x0), t0)))
        torch.autograd.backward(loss)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        if start == 0:  # evaluated between the two windows
            with torch.no_grad():
                x0, t0 = data[0]
                out = model(x0)
                evaluated = float(_mean_loss(out[:PER_RANK], t0[:PER_RANK]))
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params["output"] = out
    losses.append(evaluated)
    return params, losses, norms


class Run(NamedTuple):
    """One training run: the mesh, the options and what to check."""

    sizes: dict[str, int]
    options: PipelineOptions
    tokens: bool = False
    meta: bool = False
    fsdp: FSDPOptions | None = None
    tp_plan: dict[str, Any] | None = None
    clip: float | None = None
    fast: tuple[Any, Any] = (None, None)  # activation checkpointing, compile
    export: bool = False  # save_model the trained pipeline, read it back


def _train(ctx: DistributedContext, run: Run) -> dict[str, Any]:
    sizes, options, tokens, meta, fsdp, tp_plan, clip, (ac, compiled), export = run
    mesh = build_mesh(ctx, **sizes)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = Chain()
    else:
        model = Chain()
    pipe = wrap_model(
        ctx,
        model,
        mesh=mesh,
        pipeline=options,
        fsdp=fsdp,
        tp_plan=tp_plan,
        activation_checkpointing=ac,
        compile=compiled,
    )
    assert isinstance(pipe, Pipeline)
    if compiled is not None:  # every block of this rank's stage compiled
        assert all(
            getattr(m, "_compiled_call_impl", None) is not None
            for m in pipe.modules()
            if isinstance(m, nn.Sequential)
        )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    grad, losses, norms = GradState(accumulation_steps=K), [], []
    evaluated: Any = None
    rows = slice(mesh.dp_rank * PER_RANK, (mesh.dp_rank + 1) * PER_RANK)
    for step, (x, t) in enumerate(_data(mesh.dp_size)):
        batch = (x[rows], t[rows])
        items = int(t[rows][:, 2].sum()) if tokens else None
        loss_fn = _summed_loss if tokens else _mean_loss
        loss, grad = pipeline_step(
            ctx,
            grad,
            pipe,
            opt,
            batch,
            loss_fn,
            num_items=items,
            end_of_dataloader=step == STEPS - 1,
            max_grad_norm=clip,
        )
        losses.append(float(loss))
        if grad.grad_norm is not None:
            norms.append(float(grad.grad_norm))
        if step == 0 and "zero_bubble" not in options.schedule:
            with pytest.raises(ValueError, match=r"an open accumulation window"):
                pipeline_eval(ctx, pipe, batch, _mean_loss)
        if step == K - 1:  # between the windows; training goes on after it
            x0, t0 = _data(mesh.dp_size)[0]
            if "zero_bubble" in options.schedule:
                with pytest.raises(
                    ValueError, match=r"pipeline_eval: pipe.options.schedule"
                ):
                    pipeline_eval(ctx, pipe, (x0[rows], t0[rows]), _mean_loss)
            else:
                out, eval_loss = pipeline_eval(
                    ctx, pipe, (x0[rows], t0[rows]), _mean_loss
                )
                gathered = gather_for_metrics(ctx, out, batch=None, mesh=mesh)
                evaluated = (
                    out,
                    float(eval_loss) if eval_loss is not None else None,
                    gathered,
                )
    params = {}
    for module in pipe.stage_modules:
        for name, value in module.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            params[name] = full.detach().clone()
    exported = None
    if export:  # the whole model from the stages' shards, by rank 0
        with tempfile.TemporaryDirectory() as tmp:
            where = Path(broadcast_object(ctx, tmp))  # rank 0's directory
            save_model(ctx, pipe, where / "export")
            if ctx.is_main_process:
                exported = load_file(where / "export" / "model.safetensors")
            wait_for_everyone(ctx)
    return {
        "exported": exported,
        "params": params,
        "losses": losses,
        "norms": norms,
        "eval": evaluated,
        "dp_rank": mesh.dp_rank,
        "steps": grad.optimizer_steps,
        "stages": pipe.stage_indices,
    }


def _check(
    results: list[dict[str, Any]], dp_size: int, tokens: bool, clip: float | None
) -> None:
    expected, ref_losses, ref_norms = _reference(dp_size, tokens, clip)
    ref_out, ref_eval = expected.pop("output"), ref_losses.pop()
    assert len(ref_norms) == (2 if clip else 0)
    got: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["steps"] == 2
        got.update(r["params"])
        if r["dp_rank"] == 0:  # the same loss on every stage and tp rank
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-10, abs=1e-12)
        # The global norm over every stage, dp and tp rank, on every rank.
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-10)
        if r["eval"] is None:  # refused for zero-bubble schedules
            continue
        out, loss, gathered = r["eval"]
        # Forward only: the global batch's outputs through gather_for_metrics.
        torch.testing.assert_close(gathered, ref_out, rtol=0, atol=1e-10)
        rows = slice(r["dp_rank"] * PER_RANK, (r["dp_rank"] + 1) * PER_RANK)
        torch.testing.assert_close(out, ref_out[rows], rtol=0, atol=1e-10)
        if r["dp_rank"] == 0:
            assert loss == pytest.approx(ref_eval, rel=1e-10)
    assert sorted(got) == sorted(expected)
    exported = results[0]["exported"]
    if exported is not None:  # save_model: the whole model, under its own names
        assert sorted(exported) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(exported[name], value, rtol=0, atol=1e-10)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-10, msg=name)


def _runs(ctx: DistributedContext, runs: list[Run]) -> list[dict[str, Any]]:
    out = [_train(ctx, run) for run in runs]
    if ctx.num_processes == 2:
        _refuse_uneven_counts(ctx)
    return out


def _refuse_uneven_counts(ctx: DistributedContext) -> None:
    """Stages passing different num_items for one batch: an error on every rank."""
    mesh = build_mesh(ctx, pp=2)
    torch.manual_seed(0)
    pipe = wrap_model(ctx, Chain(), mesh=mesh, pipeline=PipelineOptions(microbatches=2))
    assert isinstance(pipe, Pipeline)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    x, t = _data(1)[0]
    with pytest.raises(ValueError, match=r"num_items must be the same on every stage"):
        pipeline_step(
            ctx, GradState(), pipe, opt, (x, t), _summed_loss,
            num_items=5 + ctx.process_index,
        )  # fmt: skip


INTERLEAVED: Final = PipelineOptions(
    microbatches=MICRO, schedule="interleaved_1f1b", stages_per_rank=2
)
SCHEDULES_2: Final = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("interleaved_zero_bubble", 2),
    ("zbv_zero_bubble", 2),
]


@pytest.mark.distributed
def test_every_schedule_at_pp2_equals_the_one_process_reference() -> None:
    runs = [
        Run(
            {"pp": 2},
            PipelineOptions(microbatches=MICRO, schedule=s, stages_per_rank=k),
        )
        for s, k in SCHEDULES_2
    ]
    cut = PipelineOptions(microbatches=MICRO, split_points=("layers.3",))
    runs.append(Run({"pp": 2}, cut, tokens=True, meta=True))
    zbv = PipelineOptions(
        microbatches=MICRO, schedule="zbv_zero_bubble", stages_per_rank=2
    )
    runs.append(Run({"pp": 2}, zbv, tokens=True, clip=0.5))
    # Each stage's blocks checkpointed, then compiled in place (aot_eager).
    blocks = (nn.Sequential,)
    fast = (
        ActivationCheckpointOptions(blocks=blocks),
        CompileOptions(blocks=blocks, backend="aot_eager"),
    )
    runs.append(Run({"pp": 2}, PipelineOptions(microbatches=MICRO), fast=fast))
    per_rank = run_ranks(_runs, 2, runs, timeout_s=TIMEOUT, start_method="forkserver")
    for i, run in enumerate(runs):
        _check([per_rank[r][i] for r in range(2)], 1, run.tokens, run.clip)
    assert per_rank[0][5]["stages"] == (0, 3) and per_rank[1][5]["stages"] == (1, 2)


@pytest.mark.distributed
def test_pp2_with_fsdp_and_with_tp_at_4_ranks_equals_the_reference() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(4):
        plan[f"layers.{i}.0"] = ColwiseParallel()
        plan[f"layers.{i}.2"] = RowwiseParallel()
    one = PipelineOptions(microbatches=MICRO, schedule="1f1b")
    runs = [
        Run({"pp": 2, "dp_shard": 2}, one, meta=True, fsdp=FSDPOptions()),
        Run({"pp": 2, "dp_shard": 2}, one, True, True, FSDPOptions(), clip=0.5),
        Run({"pp": 2, "dp_shard": 2}, one, meta=True, fsdp=FSDPOptions(), export=True),
        Run({"pp": 2, "dp_shard": 1, "tp": 2}, one, True, True, None, plan, 0.5),
        Run({"pp": 2, "dp_shard": 1, "tp": 2}, one, tp_plan=plan),
        # Replication inside each stage (fsdp=None, dp_replicate=2).
        Run({"pp": 2, "dp_replicate": 2, "dp_shard": 1}, one, True, True),
        # Two stages per rank of an interleaved schedule, each FSDP2-sharded.
        Run({"pp": 2, "dp_shard": 2}, INTERLEAVED, True, True, FSDPOptions(), clip=0.5),
    ]
    per_rank = run_ranks(_runs, 4, runs, timeout_s=TIMEOUT, start_method="forkserver")
    for i, run in enumerate(runs):
        dp_size = run.sizes["dp_shard"] * run.sizes.get("dp_replicate", 1)
        _check([per_rank[r][i] for r in range(4)], dp_size, run.tokens, run.clip)


@pytest.mark.distributed
def test_pp2_with_hsdp_2x2_inside_each_stage_at_8_ranks_equals_the_reference() -> None:
    # HSDP in each stage needs pp x dp_replicate x dp_shard = 2 x 2 x 2 ranks.
    one = PipelineOptions(microbatches=MICRO, schedule="1f1b")
    sizes = {"pp": 2, "dp_replicate": 2, "dp_shard": 2}
    runs = [
        Run(sizes, one, meta=True, fsdp=FSDPOptions()),
        Run(sizes, INTERLEAVED, True, True, FSDPOptions(), clip=0.5),
    ]
    per_rank = run_ranks(_runs, 8, runs, timeout_s=TIMEOUT, start_method="forkserver")
    for i, run in enumerate(runs):
        _check([per_rank[r][i] for r in range(8)], 4, run.tokens, run.clip)


def test_pipeline_options_refuse_bad_values() -> None:
    with pytest.raises(
        ValueError, match=r"PipelineOptions: schedule must be one of .*got 'zb'"
    ):
        PipelineOptions(microbatches=2, schedule="zb")
    with pytest.raises(ValueError, match=r"microbatches \(0\) must be >= 1"):
        PipelineOptions(microbatches=0)
    with pytest.raises(
        ValueError, match=r"stages_per_rank must be 1 with schedule='1f1b'.*got 2"
    ):
        PipelineOptions(microbatches=2, stages_per_rank=2)
    with pytest.raises(
        ValueError, match=r"stages_per_rank must be 2 with 'zbv_zero_bubble'.*got 3"
    ):
        PipelineOptions(microbatches=2, schedule="zbv_zero_bubble", stages_per_rank=3)
    with pytest.raises(
        ValueError, match=r">= 2 with schedule='interleaved_1f1b'.*got 1"
    ):
        PipelineOptions(microbatches=2, schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match=r"split_points must be distinct"):
        PipelineOptions(microbatches=2, split_points=("head", "head"))
    with pytest.raises(TypeError, match=r"split_points must be a tuple"):
        PipelineOptions(microbatches=2, split_points=["head"])  # type: ignore[arg-type]


def test_the_cut_names_its_stages_and_refuses_a_bad_one() -> None:
    names = [n for n, _ in model_units(Chain())]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert cut_units(names, (), 4) == (
        ("embed", "layers.0"),
        ("layers.1", "layers.2"),
        ("layers.3",),
        ("head",),
    )
    assert cut_units(names, ("layers.3",), 2)[1] == ("layers.3", "head")
    with pytest.raises(
        ValueError, match=r"every split point must be a unit .*got 'layers.9'"
    ):
        cut_units(names, ("layers.9",), 2)
    with pytest.raises(ValueError, match=r"each stage non-empty; got \('embed',\)"):
        cut_units(names, ("embed",), 2)
    with pytest.raises(ValueError, match=r"each stage non-empty"):
        cut_units(names, ("head", "layers.1"), 3)
    with pytest.raises(ValueError, match=r"must be 2 unit names for 3 stages"):
        cut_units(names, ("head",), 3)
    with pytest.raises(ValueError, match=r">= 7 units for 7 stages"):
        cut_units(names, (), 7)


def test_wrap_model_refuses_a_pipeline_without_a_pp_mesh() -> None:
    ctx = rank_ctx(1, 0)
    opts = PipelineOptions(microbatches=2)
    with pytest.raises(
        ValueError, match=r"wrap_model: mesh must be a ParallelMesh with pp > 1"
    ):
        wrap_model(ctx, Chain(), pipeline=opts)
    with pytest.raises(
        ValueError, match=r"wrap_model: mesh must be a ParallelMesh with pp > 1"
    ):
        wrap_model(ctx, Chain(), mesh=build_mesh(ctx), pipeline=opts)
    with pytest.raises(ValueError, match=r"optimizers must be \(\) with pipeline="):
        net = Chain()
        wrap_model(
            ctx, net, pipeline=opts, optimizers=torch.optim.SGD(net.parameters())
        )
    with pytest.raises(TypeError, match=r"pipeline must be a PipelineOptions"):
        wrap_model(ctx, Chain(), mesh=build_mesh(ctx), pipeline="1f1b")  # type: ignore[arg-type]


def test_pipeline_step_refuses_what_it_cannot_apply() -> None:
    bf16 = DistributedContext(mixed_precision="bf16")
    batch = (torch.zeros(4, 4, dtype=F64), torch.zeros(4, 3, dtype=F64))
    opt = torch.optim.SGD(Chain().parameters())
    with pytest.raises(
        ValueError, match=r"pipeline_step: ctx.mixed_precision must be 'no'"
    ):
        pipeline_step(bf16, GradState(), None, opt, batch, _mean_loss)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"pipeline_eval: ctx.mixed_precision must be 'no'"
    ):
        pipeline_eval(bf16, None, batch)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pipeline_step: pipe must be a Pipeline"):
        net: Any = Chain()  # not a Pipeline
        pipeline_step(DistributedContext(), GradState(), net, opt, batch, _mean_loss)


class _Residual(Chain):
    """Chain's units, but each block adds its input: not the chain a stage runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        out: torch.Tensor = self.head(x)
        return out


class _Branching(Chain):
    """A forward that depends on the data: cannot be traced, so not checkable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = self.embed(x)
        out: torch.Tensor = self.head(x)
        return out


class _Reordered(Chain):
    """Every unit once, each on the previous output, but layers.1 before layers.0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for index in (1, 0, 2, 3):
            x = self.layers[index](x)
        out: torch.Tensor = self.head(x)
        return out


def test_wrap_model_refuses_a_pipeline_of_a_model_that_is_not_its_chain() -> None:
    ctx = rank_ctx(2, 0)
    mesh = build_mesh(ctx, pp=2)
    opts = PipelineOptions(microbatches=2)
    chain = r"wrap_model: pipeline= runs the model's units one after the other in place of _Residual.forward, but _Residual.forward also does call_function <built-in function add>"
    with pytest.raises(ValueError, match=chain):
        wrap_model(ctx, _Residual(), mesh=mesh, pipeline=opts)
    with pytest.raises(
        ValueError,
        match=r"_Branching.forward, which could not be checked to be that chain \(torch.fx could not trace it: TraceError",
    ):
        wrap_model(ctx, _Branching(), mesh=mesh, pipeline=opts)
    with pytest.raises(
        ValueError, match=r"calls the units \['embed', 'layers.1', 'layers.0'"
    ):
        wrap_model(ctx, _Reordered(), mesh=mesh, pipeline=opts)
    # The true chain passes the check and stops at the missing process group.
    with pytest.raises(RuntimeError, match=r"wrap_model"):
        wrap_model(ctx, Chain(), mesh=mesh, pipeline=opts)
