"""``GradState.grad_norm`` from a DeepSpeed ZeRO-2 engine equals DDP's global norm.

The engine runs on CPU (``DS_ACCELERATOR=cpu``) with gloo at 2 ranks, over a
window of 2 micro-steps and a short last one of 1 (its ``k / m`` correction goes
through ZeRO's loss scale, and so into the norm it reports).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from funcaccel import DeepSpeedOptions
from funcaccel import GradState
from funcaccel import accumulate_step
from funcaccel import wrap_model
from funcaccel.context import DistributedContext
from funcaccel.testing import run_ranks

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

K, MICRO, CLIP = 2, 3, 0.01


def _norms(ctx: DistributedContext, model: nn.Module, grad: GradState) -> list[float]:
    opt = getattr(model, "optimizer", None) or torch.optim.SGD(
        model.parameters(), lr=0.1
    )
    gen = torch.Generator().manual_seed(ctx.process_index)
    norms = []
    for step in range(MICRO):
        x, y = torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)
        _, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            lambda: nn.functional.mse_loss(model(x), y),
            end_of_dataloader=step == MICRO - 1,
            max_grad_norm=CLIP,
        )
        if grad.grad_norm is not None:
            norms.append(float(grad.grad_norm))
    return norms


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def _worker(ctx: DistributedContext) -> dict[str, list[float]]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["LOCAL_RANK"] = str(ctx.local_process_index)
    warnings.simplefilter("ignore")  # DeepSpeed's own deprecation and log noise
    ddp = wrap_model(ctx, _net())
    out = {"ddp": _norms(ctx, ddp, GradState(accumulation_steps=K))}
    net = _net()
    grad = GradState(accumulation_steps=K)
    options = DeepSpeedOptions(config={"gradient_clipping": CLIP}, zero_stage=2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = wrap_model(ctx, net, deepspeed=options, optimizers=opt, grad=grad)
    out["zero2"] = _norms(ctx, engine, grad)
    return out


@pytest.mark.distributed
def test_zero2_grad_norm_is_the_global_norm_on_every_rank() -> None:
    results = run_ranks(_worker, 2, start_method="forkserver")
    ddp = results[0]["ddp"]
    assert len(ddp) == 2 and all(n > CLIP for n in ddp)  # both windows clipped
    for rank in results:
        assert rank["ddp"] == ddp  # the same on every rank
        assert rank["zero2"] == results[0]["zero2"]
        torch.testing.assert_close(rank["zero2"], ddp, rtol=1e-5, atol=0.0)
