"""Checkpoints of pipelined models: saved on one layout, resumed on another, exactly.

Four steps of SGD with momentum (so the optimizer's state matters) on the
float64 chain of ``tests/test_pipeline.py``; a checkpoint after step 2. Every
run, unbroken or resumed on another layout, must end with the parameters of one
process that trained the four steps without stopping (within 1e-10).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from typing import Final

import pytest
import torch

from funcaccel import FSDPOptions
from funcaccel import GradState
from funcaccel import PipelineOptions
from funcaccel import accumulate_step
from funcaccel import build_mesh
from funcaccel import latest_checkpoint
from funcaccel import load_checkpoint
from funcaccel import pipeline_step
from funcaccel import save_checkpoint
from funcaccel import save_model
from funcaccel import wrap_model
from funcaccel.context import DistributedContext
from funcaccel.model import Pipeline
from funcaccel.testing import run_ranks
from tests.test_pipeline import PER_RANK
from tests.test_pipeline import Chain
from tests.test_pipeline import _data
from tests.test_pipeline import _mean_loss

STEPS: Final = 4
SAVE_AFTER: Final = 2
TIMEOUT: Final = 300
CUTS: Final = {
    "pp2_at_layers3": PipelineOptions(microbatches=4, split_points=("layers.3",)),
    "pp2_at_layers1": PipelineOptions(microbatches=4, split_points=("layers.1",)),
    "pp2_interleaved": PipelineOptions(
        microbatches=4, schedule="interleaved_1f1b", stages_per_rank=2
    ),
}


def _sgd(params: Any) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[:PER_RANK], t[:PER_RANK]) for x, t in _data(1)] + [
        (x[PER_RANK:], t[PER_RANK:]) for x, t in _data(2)[:1]
    ]


def _one_process(
    save_to: Path | None = None, resume_from: Path | None = None
) -> dict[str, torch.Tensor]:
    """Plain torch on the whole model; a checkpoint through funcaccel."""
    ctx = DistributedContext()
    torch.manual_seed(0)
    model = Chain()
    opt = _sgd(model.parameters())
    start = 0
    if resume_from is not None:
        load_checkpoint(ctx, resume_from, models=model, optimizers=opt)
        start = SAVE_AFTER
    for step in range(start, STEPS):
        x, t = _batches()[step]
        torch.autograd.backward(_mean_loss(model(x), t))
        opt.step()
        opt.zero_grad()
        if save_to is not None and step + 1 == SAVE_AFTER:
            save_checkpoint(ctx, save_to, models=model, optimizers=opt)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pipelined(
    ctx: DistributedContext,
    options: PipelineOptions,
    save_to: Path | None,
    resume_from: Path | None,
) -> dict[str, torch.Tensor]:
    mesh = build_mesh(ctx, pp=2)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Chain()
    pipe = wrap_model(ctx, model, mesh=mesh, pipeline=options)
    assert isinstance(pipe, Pipeline)
    opt = _sgd(pipe.parameters())
    grad, start = GradState(), 0
    if resume_from is not None:
        loaded = load_checkpoint(ctx, resume_from, models=pipe, optimizers=opt)
        assert loaded.grad is not None
        grad, start = loaded.grad, SAVE_AFTER
    for step in range(start, STEPS):
        _, grad = pipeline_step(ctx, grad, pipe, opt, _batches()[step], _mean_loss)
        if save_to is not None and step + 1 == SAVE_AFTER:
            save_checkpoint(ctx, save_to, models=pipe, optimizers=opt, grad=grad)
    if save_to is not None:  # the whole model, under its own names
        save_model(ctx, pipe, save_to / "export")
    return {
        name: value.detach().clone()
        for module in pipe.stage_modules
        for name, value in module.state_dict().items()
    }


def _fsdp(
    ctx: DistributedContext, resume_from: Path | None, save_to: Path | None = None
) -> dict[str, torch.Tensor]:
    """Plain FSDP2 over the 2 ranks (pp=1), each reading half of every batch."""
    torch.manual_seed(0)
    model = wrap_model(ctx, Chain(), fsdp=FSDPOptions())
    opt = _sgd(model.parameters())
    grad, start = GradState(), 0
    if resume_from is not None:
        loaded = load_checkpoint(ctx, resume_from, models=model, optimizers=opt)
        assert loaded.grad is not None
        grad, start = loaded.grad, SAVE_AFTER
    half = PER_RANK // 2
    rows = slice(ctx.process_index * half, (ctx.process_index + 1) * half)
    for step in range(start, STEPS):
        x, t = _batches()[step]

        def loss_fn(
            x: torch.Tensor = x[rows], t: torch.Tensor = t[rows]
        ) -> torch.Tensor:
            return _mean_loss(model(x), t)

        _, grad = accumulate_step(ctx, grad, model, opt, loss_fn)
        if save_to is not None and step + 1 == SAVE_AFTER:
            save_checkpoint(ctx, save_to, models=model, optimizers=opt, grad=grad)
    return {
        name: value.full_tensor().detach().clone()
        for name, value in model.state_dict().items()
    }


def _on_2_ranks(ctx: DistributedContext, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["unbroken"] = _pipelined(ctx, CUTS["pp2_at_layers3"], tmp / "pp2", None)
    saved = latest_checkpoint(tmp / "pp2")
    assert saved is not None
    for name, options in CUTS.items():
        out[f"pp2->{name}"] = _pipelined(ctx, options, None, saved)
    out["pp2->fsdp pp=1"] = _fsdp(ctx, saved)
    out["fsdp pp=1"] = _fsdp(ctx, None, save_to=tmp / "fsdp")
    fsdp = latest_checkpoint(tmp / "fsdp")
    assert fsdp is not None
    out["fsdp pp=1->pp2"] = _pipelined(ctx, CUTS["pp2_at_layers1"], None, fsdp)
    one = latest_checkpoint(tmp / "one")
    assert one is not None
    with pytest.raises(ValueError, match=r"holds whole .* is a Pipeline"):
        _pipelined(ctx, CUTS["pp2_at_layers1"], None, one)
    return out


def _merge(per_rank: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for out in per_rank:
        merged.update(out[key])
    return merged


@pytest.mark.distributed
def test_a_pipeline_checkpoint_resumes_on_other_cuts_and_in_one_process(
    tmp_path: Path,
) -> None:
    expected = _one_process(save_to=tmp_path / "one")
    per_rank = run_ranks(
        _on_2_ranks, 2, tmp_path, timeout_s=TIMEOUT, start_method="forkserver"
    )
    pp2 = latest_checkpoint(tmp_path / "pp2")
    assert pp2 is not None
    runs = {key: _merge(per_rank, key) for key in per_rank[0]}
    runs["pp2->one process"] = _one_process(resume_from=pp2)
    from safetensors.torch import load_file

    runs["save_model of the pp2 pipeline"] = load_file(
        tmp_path / "pp2" / "export" / "model.safetensors"
    )
    for run, params in runs.items():
        assert sorted(params) == sorted(expected), run
        for name, value in expected.items():
            torch.testing.assert_close(
                params[name], value, rtol=0, atol=1e-10, msg=f"{run}: {name}"
            )


def test_the_checkpoint_names_are_the_models_own() -> None:
    from funcaccel.checkpoint._dcp_names import original_name

    assert original_name("stage_modules.0.layers.2.0.weight") == "layers.2.0.weight"
    assert original_name("param_groups.stage_modules.11.head.bias.lr") == (
        "param_groups.head.bias.lr"
    )
    assert original_name("my_stage_modules.0.x") == "my_stage_modules.0.x"
