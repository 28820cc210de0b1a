"""apply_activation_checkpointing / ActivationCheckpointOptions, and with FSDP2.

Each check compares a checkpointed model with the same model, same seeds, without
checkpointing (float64, eager): the gradients must be bit for bit equal, dropout
included (the RNG state is restored for the recomputation), while fewer tensors
are saved for backward (proof that the checkpoint ran).
"""

from __future__ import annotations

import copy
import functools
from typing import Any
from typing import Literal

import pytest
import torch
from torch import nn

from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.model import ActivationCheckpointOptions
from funcaccel.model import CompileOptions
from funcaccel.model import FSDPOptions
from funcaccel.model import apply_activation_checkpointing
from funcaccel.model import compile_blocks
from funcaccel.model import wrap_fsdp
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks
from tests._fast_step_models import Block
from tests._fast_step_models import TinyNet
from tests._fast_step_models import batches
from tests._fast_step_models import loss_of

F64 = torch.float64
CheckpointMode = Literal["full", "selective"]


def _grads_and_saved(model: nn.Module, seed: int) -> tuple[list[torch.Tensor], int]:
    """Gradients of one backward (dropout drawn from ``seed``) and tensors saved."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return tensor

    batch = batches(1, 6)[0]
    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, batch)
    torch.autograd.backward(loss)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], saved


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (ActivationCheckpointOptions(blocks=[Block]), ["blocks.0", "blocks.1"]),
        (
            ActivationCheckpointOptions(blocks=[Block], every_n=2),
            ["blocks.1"],
        ),
        (
            ActivationCheckpointOptions(blocks=[Block], mode="selective"),
            ["blocks.0", "blocks.1"],
        ),
        (
            ActivationCheckpointOptions(
                blocks=[Block],
                mode="selective",
                save_ops=[torch.ops.aten.addmm.default],
            ),
            ["blocks.0", "blocks.1"],
        ),
        (ActivationCheckpointOptions(), [""]),
    ],
    ids=["full", "every-2nd", "selective", "selective-addmm", "whole-model"],
)
def test_checkpointing_gives_bit_equal_gradients_with_dropout(
    options: ActivationCheckpointOptions, expected: list[str]
) -> None:
    torch.manual_seed(0)
    plain = TinyNet(blocks=2, dropout=0.3).to(F64)
    checkpointed = copy.deepcopy(plain)
    names = apply_activation_checkpointing(checkpointed, options)
    assert names == expected
    reference, saved_plain = _grads_and_saved(plain, seed=7)
    grads, saved = _grads_and_saved(checkpointed, seed=7)
    assert len(grads) == len(reference) == 14
    for got, want in zip(grads, reference, strict=True):
        assert torch.equal(got, want)
    # Fewer tensors kept for backward: the checkpoint really ran.
    assert saved < saved_plain


def test_checkpointing_keeps_names_and_copies_recompute_their_own_forward() -> None:
    torch.manual_seed(0)
    net = TinyNet(blocks=2).to(F64)
    keys = list(net.state_dict())
    apply_activation_checkpointing(net, ActivationCheckpointOptions(blocks=[Block]))
    assert list(net.state_dict()) == keys
    assert type(net.blocks[0]) is Block
    twin = copy.deepcopy(net)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    x = batches(1, 3)[0][0]
    # The copy's checkpointed forward uses the copy's parameters, not net's.
    assert not torch.equal(twin(x), net(x))
    assert torch.equal(twin(x), copy.deepcopy(twin)(x))


def test_checkpointing_refuses_wrong_orders_and_bad_options() -> None:
    opts = ActivationCheckpointOptions(blocks=[Block])
    net = TinyNet(blocks=2)
    compile_blocks(net, CompileOptions(blocks=[Block], backend="eager"))
    with pytest.raises(
        ValueError, match=r"'blocks.0' is already compiled .*must come first"
    ):
        apply_activation_checkpointing(net, opts)
    net = TinyNet(blocks=2)
    apply_activation_checkpointing(net, opts)
    with pytest.raises(ValueError, match=r"'blocks.0' is already checkpointed"):
        apply_activation_checkpointing(net, opts)
    with pytest.raises(
        ValueError, match=r"no module of model \(Sequential\) is a Block"
    ):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), opts)
    inner: nn.Module = torch.compile(nn.Linear(2, 2), backend="eager")  # type: ignore[assignment]
    wrapped = nn.Sequential(inner)
    with pytest.raises(ValueError, match=r"'0' is a torch.compile wrapper"):
        apply_activation_checkpointing(wrapped, ActivationCheckpointOptions())
    odd = nn.Linear(2, 2)
    odd.__dict__["forward"] = lambda x: x
    with pytest.raises(ValueError, match=r"has a forward set on the instance"):
        apply_activation_checkpointing(odd, ActivationCheckpointOptions())
    with pytest.raises(
        TypeError, match=r"options must be an ActivationCheckpointOptions"
    ):
        apply_activation_checkpointing(net, CompileOptions())  # type: ignore[arg-type]


def test_options_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match=r"every_n \(0\) must be >= 1"):
        ActivationCheckpointOptions(every_n=0)
    with pytest.raises(ValueError, match=r"mode must be one of 'full', 'selective'"):
        ActivationCheckpointOptions(mode="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"save_ops must be empty with mode='full'"):
        ActivationCheckpointOptions(save_ops=[torch.ops.aten.mm.default])
    with pytest.raises(TypeError, match=r"every item of blocks must be an nn.Module"):
        ActivationCheckpointOptions(blocks=[Block(2)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"blocks must be a sequence of nn.Module"):
        ActivationCheckpointOptions(blocks=Block)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"every item of save_ops must be an OpOverload"
    ):
        ActivationCheckpointOptions(mode="selective", save_ops=["mm"])  # type: ignore[list-item]


def _fsdp_worker(ctx: DistributedContext, mode: CheckpointMode) -> dict[str, Any]:
    """FSDP2 with and without checkpointing on the same data and dropout seeds."""
    data = batches(6, 4)
    results: dict[str, Any] = {}
    for checkpoint in (False, True):
        torch.manual_seed(0)
        net = TinyNet(blocks=2, dropout=0.2).to(F64)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ac = (
            ActivationCheckpointOptions(blocks=[Block], mode=mode)
            if checkpoint
            else None
        )
        model = wrap_model(
            ctx,
            net,
            fsdp=FSDPOptions(shard_modules=[Block]),
            optimizers=opt,
            activation_checkpointing=ac,
        )
        grad = GradState(accumulation_steps=2)
        losses = []
        for i in range(ctx.process_index, len(data), ctx.num_processes):
            torch.manual_seed(100 + i)
            loss, grad = accumulate_step(
                ctx, grad, model, opt, functools.partial(loss_of, model, data[i])
            )
            losses.append(loss.item())
        full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
        results[f"ac={checkpoint}"] = (losses, full)
    try:
        apply_activation_checkpointing(model, ActivationCheckpointOptions())
    except ValueError as err:
        results["refused"] = str(err)
    other = wrap_fsdp(ctx, TinyNet(blocks=2))
    try:
        apply_activation_checkpointing(other, ActivationCheckpointOptions())
    except ValueError as err:
        results["refused_whole"] = str(err)
    return results


def _fsdp_modes(ctx: DistributedContext) -> dict[str, dict[str, Any]]:
    """Both modes in one spawned run."""
    modes: tuple[CheckpointMode, ...] = ("full", "selective")
    return {mode: _fsdp_worker(ctx, mode) for mode in modes}


@pytest.fixture(scope="module")
def fsdp_runs() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_fsdp_modes, 2, timeout_s=240, start_method="forkserver")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_under_fsdp2_changes_no_bit(
    fsdp_runs: list[dict[str, dict[str, Any]]], mode: CheckpointMode
) -> None:
    ranks = [run[mode] for run in fsdp_runs]
    for result in ranks:
        plain_losses, plain_params = result["ac=False"]
        ac_losses, ac_params = result["ac=True"]
        assert plain_losses == ac_losses and len(ac_losses) == 3
        for got, want in zip(ac_params, plain_params, strict=True):
            assert torch.equal(got, want)
        assert "already wrapped (FSDP2" in result["refused"]
        assert "already wrapped (FSDP2" in result["refused_whole"]
    # Both ranks end with the same full parameters (they were trained together).
    for got, want in zip(ranks[0]["ac=True"][1], ranks[1]["ac=True"][1], strict=True):
        assert torch.equal(got, want)
