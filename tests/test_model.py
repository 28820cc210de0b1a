"""wrap_model / unwrap_model / move_optimizer_state_: DDP, comm hooks, FSDP2, placement.

Multi-process checks run few spawns: each worker builds many wrapped models and
returns what it saw; the test compares against plain PyTorch computed here.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from funcaccel.context import DistributedContext
from funcaccel.kwargs import DDPCommunicationHookType
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.launch import LaunchError
from funcaccel.model import FSDPOptions
from funcaccel.model import move_optimizer_state_
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

WORLD: int = 2
STEPS: int = 4
LR: float = 0.1
Params = dict[str, torch.Tensor]


class _Net(nn.Module):
    """Two linear layers and a buffer that DDP may broadcast."""

    marker: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 3)
        self.register_buffer("marker", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(torch.tanh(self.first(x)))
        return out


def _make_net(dtype: torch.dtype = torch.float64) -> _Net:
    torch.manual_seed(0)
    return _Net().to(dtype)


def _data(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(8, 4, generator=generator, dtype=dtype)
    ys = torch.randn(8, 3, generator=generator, dtype=dtype)
    return xs, ys


def _params(model: nn.Module) -> Params:
    """Full copies of the user module's parameters (gathered when FSDP-sharded)."""
    out: Params = {}
    for name, param in unwrap_model(model).named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = tensor.detach().clone()
    return out


def _train(
    model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, steps: int = STEPS
) -> list[Params]:
    """SGD on the mean squared error; the parameters after every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for _ in range(steps):
        optimizer.zero_grad()
        torch.autograd.backward(F.mse_loss(model(xs).to(ys.dtype), ys))
        optimizer.step()
        history.append(_params(model))
    return history


def _reference(
    dtype: torch.dtype = torch.float64, *, compress: torch.dtype | None = None
) -> list[Params]:
    """Plain single-process training: full batch, or per-rank grads averaged.

    With ``compress``, each rank's gradient is cast to ``compress`` and divided by
    the world size, the halves are summed in that dtype and cast back, as the
    fp16 compression hook does over the wire.
    """
    net = _make_net(dtype)
    xs, ys = _data(dtype)
    if compress is None:
        return _train(net, xs, ys)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    history = []
    for _ in range(STEPS):
        local = []
        for rank in range(WORLD):
            optimizer.zero_grad()
            torch.autograd.backward(F.mse_loss(net(xs[rank::WORLD]), ys[rank::WORLD]))
            local.append(
                [p.grad.clone() for p in net.parameters() if p.grad is not None]
            )
        for param, *grads in zip(net.parameters(), *local, strict=True):
            total = sum(g.to(compress) / WORLD for g in grads)
            assert isinstance(total, torch.Tensor)
            param.grad = total.to(dtype)
        optimizer.step()
        history.append(_params(net))
    return history


def _max_diff(left: Params, right: Params) -> float:
    assert left.keys() == right.keys()
    return max(float((left[k] - right[k]).abs().max()) for k in left)


def _local_batch(
    ctx: DistributedContext, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = _data(dtype)
    return xs[ctx.process_index :: ctx.num_processes], ys[
        ctx.process_index :: ctx.num_processes
    ]


def _compiled(model: nn.Module) -> nn.Module:
    """``torch.compile`` without compiling anything until the first call."""
    compiled = torch.compile(model, backend="eager")
    assert isinstance(compiled, nn.Module)
    return compiled


def _hook_names(model: nn.Module) -> list[str]:
    assert isinstance(model, DistributedDataParallel)
    return [hook.__name__ for hook, _ in model._comm_hooks]


HOOK_CASES: dict[str, DistributedDataParallelKwargs] = {
    "fp16_str": DistributedDataParallelKwargs(comm_hook="fp16"),
    "fp16_enum": DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16),
    "power_sgd": DistributedDataParallelKwargs(
        comm_hook="power_sgd",
        comm_state_option={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
    ),
    "fp16_power_sgd": DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType.POWER_SGD,
        comm_wrapper="fp16",
        comm_state_option={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
    ),
}
BATCHED = DistributedDataParallelKwargs(
    comm_hook="batched_power_sgd",
    comm_state_option={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
)
ALL_FIELDS = DistributedDataParallelKwargs(
    dim=1,
    broadcast_buffers=False,
    bucket_cap_mb=1,
    find_unused_parameters=True,
    check_reduction=True,
    gradient_as_bucket_view=True,
    static_graph=True,
)


def _ddp_attributes(ddp: nn.Module) -> dict[str, Any]:
    assert isinstance(ddp, DistributedDataParallel)
    return {
        "dim": ddp.dim,
        "forward_sync_buffers": ddp.forward_sync_buffers,
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
        "device_ids": ddp.device_ids,
        "output_device": ddp.output_device,
    }


def _ddp_worker(ctx: DistributedContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rank = float(ctx.process_index)
    # Every DistributedDataParallelKwargs field reaches DDP.
    for label, kwargs in (("all_fields", ALL_FIELDS), ("default", None)):
        net = _make_net()
        net.marker.fill_(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = wrap_model(ctx, net, kwargs)
        out[label] = _ddp_attributes(ddp)
        out[f"{label}_marker"] = float(net.marker)
        out[f"{label}_warnings"] = [str(w.message) for w in caught]
        out[f"{label}_unwrapped"] = unwrap_model(ddp) is net
        out[f"{label}_forward_patched"] = "forward" in vars(net)
        out[f"{label}_trained"] = _train(
            ddp, *_local_batch(ctx, torch.float64), steps=1
        )
    # DDP training equals plain full-batch training.
    out["ddp_history"] = _train(
        wrap_model(ctx, _make_net()), *_local_batch(ctx, torch.float64)
    )
    # Each hook kind registers and trains.
    for label, kwargs in HOOK_CASES.items():
        ddp = wrap_model(ctx, _make_net(torch.float32), kwargs)
        out[f"hook_{label}"] = _hook_names(ddp)
        out[f"history_{label}"] = _train(ddp, *_local_batch(ctx, torch.float32))
    out["hook_batched"] = _hook_names(
        wrap_model(ctx, _make_net(torch.float32), BATCHED)
    )
    # A module with nothing to train is returned as is.
    frozen = _make_net().requires_grad_(False)
    out["frozen_is_same"] = wrap_model(ctx, frozen) is frozen
    # Wrapping twice is refused; unwrap goes through compile and DDP, nested.
    ddp = wrap_model(ctx, _make_net())
    try:
        wrap_model(ctx, ddp)
    except ValueError as error:
        out["rewrap_error"] = str(error)
    net = _make_net()
    inner = _compiled(net)
    ddp = wrap_model(ctx, inner)
    nested = _compiled(ddp)
    out["nested_types"] = [type(m).__name__ for m in (nested, ddp, inner)]
    out["nested_unwrapped"] = unwrap_model(nested) is net
    return out


@pytest.fixture(scope="module")
def ddp_results() -> list[dict[str, Any]]:
    return run_ranks(_ddp_worker, WORLD, start_method="forkserver")


@pytest.mark.distributed
def test_wrap_model_passes_every_ddp_field(ddp_results: list[dict[str, Any]]) -> None:
    for result in ddp_results:
        assert result["all_fields"] == {
            "dim": 1,
            "forward_sync_buffers": False,
            "bucket_bytes_cap": 1024 * 1024,
            "find_unused_parameters": True,
            "gradient_as_bucket_view": True,
            "static_graph": True,
            "device_ids": None,
            "output_device": None,
        }
        # check_reduction is not stored by DDP; torch deprecates it, and
        # broadcast_buffers too, so each field that reached DDP shows its warning.
        messages = " ".join(result["all_fields_warnings"])
        assert "check_reduction" in messages
        assert "broadcast_buffers" in messages
        assert result["default"] == {
            "dim": 0,
            "forward_sync_buffers": True,
            "bucket_bytes_cap": 25 * 1024 * 1024,
            "find_unused_parameters": False,
            "gradient_as_bucket_view": False,
            "static_graph": False,
            "device_ids": None,
            "output_device": None,
        }
        assert result["default_warnings"] == []
        assert result["all_fields_unwrapped"] and result["default_unwrapped"]
        assert not result["all_fields_forward_patched"]
        assert not result["default_forward_patched"]
    # broadcast_buffers=False keeps each rank's buffer; the default copies rank 0's.
    assert [r["all_fields_marker"] for r in ddp_results] == [0.0, 1.0]
    assert [r["default_marker"] for r in ddp_results] == [0.0, 0.0]
    # Both configurations train to the same full-batch step.
    expected = _reference()[0]
    for result in ddp_results:
        for label in ("all_fields", "default"):
            assert _max_diff(result[f"{label}_trained"][0], expected) < 1e-12


@pytest.mark.distributed
def test_wrap_model_ddp_training_equals_full_batch(
    ddp_results: list[dict[str, Any]],
) -> None:
    expected = _reference()
    for result in ddp_results:
        for got, want in zip(result["ddp_history"], expected, strict=True):
            assert _max_diff(got, want) < 1e-12
    # The run moved the parameters (the comparison is not between two no-ops).
    assert _max_diff(expected[-1], _params(_make_net())) > 1e-3


@pytest.mark.distributed
def test_wrap_model_registers_fp16_hook_for_str_and_enum(
    ddp_results: list[dict[str, Any]],
) -> None:
    compressed = _reference(torch.float32, compress=torch.float16)
    exact = _reference(torch.float32)
    # The emulation is sensitive enough to tell compressed from exact gradients.
    assert _max_diff(compressed[-1], exact[-1]) > 1e-6
    for result in ddp_results:
        for label in ("fp16_str", "fp16_enum"):
            assert result[f"hook_{label}"] == ["fp16_compress_hook"]
            for got, want in zip(result[f"history_{label}"], compressed, strict=True):
                assert _max_diff(got, want) < 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("label", "hook_name", "compress"),
    [
        ("power_sgd", "powerSGD_hook", None),
        ("fp16_power_sgd", "fp16_compress_wrapper_hook", torch.float16),
    ],
)
def test_wrap_model_power_sgd_hooks_train(
    ddp_results: list[dict[str, Any]],
    label: str,
    hook_name: str,
    compress: torch.dtype | None,
) -> None:
    # Baseline: exact all-reduce, or all-reduce in float16 under the fp16 wrapper.
    baseline = _reference(torch.float32, compress=compress)
    rank0, rank1 = (r[f"history_{label}"] for r in ddp_results)
    assert ddp_results[0][f"hook_{label}"] == [hook_name]
    # Steps before start_powerSGD_iter=2 all-reduce the full gradient.
    for step in (0, 1):
        assert _max_diff(rank0[step], baseline[step]) < 1e-6
    # From then on the rank-1 approximation is used: the run departs from the
    # baseline, yet the ranks stay identical and the parameters keep moving.
    for step in (2, 3):
        assert _max_diff(rank0[step], baseline[step]) > 1e-3
    for got0, got1 in zip(rank0, rank1, strict=True):
        assert _max_diff(got0, got1) == 0.0
    assert _max_diff(rank0[-1], rank0[-2]) > 1e-4
    assert all(torch.isfinite(t).all() for t in rank0[-1].values())


@pytest.mark.distributed
def test_wrap_model_registers_batched_power_sgd(
    ddp_results: list[dict[str, Any]],
) -> None:
    assert [r["hook_batched"] for r in ddp_results] == [["batched_powerSGD_hook"]] * 2


@pytest.mark.distributed
def test_wrap_model_leaves_frozen_and_refuses_wrapped(
    ddp_results: list[dict[str, Any]],
) -> None:
    for result in ddp_results:
        assert result["frozen_is_same"]
        assert result["rewrap_error"].startswith("wrap_model: model is already wrapped")


@pytest.mark.distributed
def test_unwrap_model_through_nested_compile_and_ddp(
    ddp_results: list[dict[str, Any]],
) -> None:
    for result in ddp_results:
        assert result["nested_types"] == [
            "OptimizedModule",
            "DistributedDataParallel",
            "OptimizedModule",
        ]
        assert result["nested_unwrapped"]


def _batched_train_worker(ctx: DistributedContext) -> None:
    ddp = wrap_model(ctx, _make_net(torch.float32), BATCHED)
    _train(ddp, *_local_batch(ctx, torch.float32))


@pytest.mark.distributed
@pytest.mark.xfail(
    strict=True,
    raises=LaunchError,
    reason=(
        f"torch {torch.__version__}: batched_powerSGD_hook passes a 2-D matrix to "
        "_orthogonalize, which asserts 3-D, on the first step after "
        "start_powerSGD_iter (an upstream bug in torch, not in funcaccel)"
    ),
)
def test_wrap_model_batched_power_sgd_trains() -> None:
    run_ranks(_batched_train_worker, WORLD, start_method="forkserver")


FSDP_CASES: dict[str, FSDPOptions] = {
    "reshard": FSDPOptions(shard_modules=(nn.Linear,)),
    "keep": FSDPOptions(shard_modules=[nn.Linear], reshard_after_forward=False),
    "root_only": FSDPOptions(),
    "torch_rule": FSDPOptions(shard_modules=(nn.Linear,), reshard_after_forward=None),
}
BF16_POLICY = FSDPOptions(
    shard_modules=(nn.Linear,),
    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
)


def _registered_after_forward(model: nn.Module, net: _Net, xs: torch.Tensor) -> str:
    """The class of a parameter registered between forward and backward."""
    out = model(xs)
    kind = type(net.first.weight).__name__
    torch.autograd.backward(out.sum())
    return kind


def _fsdp_worker(ctx: DistributedContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    xs, ys = _local_batch(ctx, torch.float64)
    out["ddp"] = _train(wrap_model(ctx, _make_net()), xs, ys)
    for label, options in FSDP_CASES.items():
        net = _make_net()
        model = wrap_model(ctx, net, fsdp=options)
        out[f"same_{label}"] = model is net and unwrap_model(model) is net
        out[f"forward_patched_{label}"] = "forward" in vars(net)
        out[f"units_{label}"] = [
            n for n, m in net.named_modules() if isinstance(m, FSDPModule)
        ]
        weight = net.first.weight
        assert isinstance(weight, DTensor)
        out[f"local_{label}"] = weight.to_local().clone()
        out[f"after_forward_{label}"] = _registered_after_forward(model, net, xs)
        out[f"history_{label}"] = _train(model, xs, ys)
    net = _make_net(torch.float32)
    model = wrap_model(ctx, net, fsdp=BF16_POLICY)
    xs32, ys32 = _local_batch(ctx, torch.float32)
    out["bf16_output_dtype"] = model(xs32).dtype
    out["bf16_param_dtype"] = net.first.weight.dtype
    out["bf16_history"] = _train(model, xs32, ys32)
    frozen = _make_net().requires_grad_(False)
    out["frozen_same"] = wrap_model(ctx, frozen, fsdp=FSDPOptions()) is frozen
    out["frozen_is_fsdp"] = isinstance(frozen, FSDPModule)
    return out


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict[str, Any]]:
    return run_ranks(_fsdp_worker, WORLD, start_method="forkserver")


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(FSDP_CASES))
def test_wrap_model_fsdp_matches_ddp(
    fsdp_results: list[dict[str, Any]], label: str
) -> None:
    expected = _reference()
    for result in fsdp_results:
        assert result[f"same_{label}"]
        assert not result[f"forward_patched_{label}"]
        for got, ddp, want in zip(
            result[f"history_{label}"], result["ddp"], expected, strict=True
        ):
            assert _max_diff(got, ddp) < 1e-10
            assert _max_diff(got, want) < 1e-10


@pytest.mark.distributed
def test_wrap_model_fsdp_shards_chosen_modules(
    fsdp_results: list[dict[str, Any]],
) -> None:
    init = _make_net().first.weight.detach()
    for rank, result in enumerate(fsdp_results):
        assert result["units_reshard"] == ["", "first", "second"]
        assert result["units_keep"] == ["", "first", "second"]
        assert result["units_root_only"] == [""]
        # Rank 0 holds rows 0..3 of the 8-row weight, rank 1 rows 4..7.
        for label in FSDP_CASES:
            assert torch.equal(result[f"local_{label}"], init[4 * rank : 4 * rank + 4])


@pytest.mark.distributed
def test_wrap_model_fsdp_reshard_after_forward_reaches_torch(
    fsdp_results: list[dict[str, Any]],
) -> None:
    for result in fsdp_results:
        assert result["after_forward_reshard"] == "DTensor"
        assert result["after_forward_keep"] == "Parameter"
        # torch's rule (None) reshards non-root units like True.
        assert result["after_forward_torch_rule"] == "DTensor"


@pytest.mark.distributed
def test_wrap_model_fsdp_bf16_policy_trains(fsdp_results: list[dict[str, Any]]) -> None:
    exact = _reference(torch.float32)
    initial = _params(_make_net(torch.float32))
    rank0, rank1 = (r["bf16_history"] for r in fsdp_results)
    assert fsdp_results[0]["bf16_output_dtype"] == torch.bfloat16
    assert fsdp_results[0]["bf16_param_dtype"] == torch.float32
    assert _max_diff(rank0[-1], initial) > 1e-2
    assert _max_diff(rank0[-1], rank1[-1]) == 0.0
    # Close to float32 training, as bfloat16 compute allows, but not identical.
    assert 0.0 < _max_diff(rank0[-1], exact[-1]) < 5e-2


@pytest.mark.distributed
def test_wrap_model_fsdp_leaves_frozen(
    fsdp_results: list[dict[str, Any]],
) -> None:
    for result in fsdp_results:
        assert result["frozen_same"] and not result["frozen_is_fsdp"]


CPU2 = rank_ctx(2, 1)


def test_wrap_model_one_process_returns_the_module_on_the_device() -> None:
    net = _make_net()
    assert wrap_model(DistributedContext(), net) is net
    # A meta-device context shows the move without a GPU: in place, same object.
    meta = DistributedContext(device=torch.device("meta"))
    bf16 = DistributedDataParallelKwargs(comm_hook="bf16")
    assert wrap_model(meta, net, bf16, fsdp=None) is net  # hooks unused at p=1
    assert {p.device.type for p in net.parameters()} == {"meta"}
    assert net.marker.device.type == "meta"
    assert "forward" not in vars(net)
    other = _make_net()
    assert wrap_model(meta, other, fsdp=FSDPOptions()) is other
    assert not isinstance(other, FSDPModule)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            DistributedDataParallelKwargs(comm_hook="bf16"),
            r"^wrap_model: ddp_kwargs.comm_hook must be 'fp16' or 'no' on cpu \(backend "
            r"'gloo'\), which cannot all-reduce bfloat16; got 'bf16'\. 'bf16' needs a CUDA",
        ),
        (
            DistributedDataParallelKwargs(
                comm_hook=DDPCommunicationHookType.BF16,
            ),
            r"ddp_kwargs.comm_hook must be 'fp16' or 'no' on cpu \(backend 'gloo'\)",
        ),
        (
            DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="bf16"),
            r"wrap_model: ddp_kwargs.comm_wrapper must be 'fp16' or 'no' on cpu .*'bf16'",
        ),
    ],
)
def test_wrap_model_refuses_bf16_compression_on_cpu(
    kwargs: DistributedDataParallelKwargs, match: str
) -> None:
    # Raised before the process-group check and before torch's own TypeError.
    with pytest.raises(ValueError, match=match):
        wrap_model(CPU2, _make_net(), kwargs)


@pytest.mark.parametrize("ctx", [DistributedContext(), CPU2])
def test_wrap_model_refuses_fsdp_with_ddp_kwargs(ctx: DistributedContext) -> None:
    kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    with pytest.raises(
        ValueError,
        match=r"wrap_model: ddp_kwargs only configure DDP.*find_unused_parameters=True.*Pass ddp_kwargs=None",
    ):
        wrap_model(ctx, _make_net(), kwargs, fsdp=FSDPOptions())
    hook_only = DistributedDataParallelKwargs(comm_hook="fp16")
    with pytest.raises(ValueError, match=r"ddp_kwargs only configure DDP"):
        wrap_model(ctx, _make_net(), hook_only, fsdp=FSDPOptions())
    # Default kwargs too: one process refuses what several would.
    with pytest.raises(ValueError, match=r"ddp_kwargs only configure DDP.*fsdp=None"):
        wrap_model(
            ctx, _make_net(), DistributedDataParallelKwargs(), fsdp=FSDPOptions()
        )


def test_wrap_model_needs_a_process_group_with_several_processes() -> None:
    net = _make_net()
    with pytest.raises(
        RuntimeError, match=r"wrap_model: ctx has num_processes=2 but no default"
    ):
        wrap_model(CPU2, net)
    with pytest.raises(RuntimeError, match=r"wrap_model: ctx has num_processes=2"):
        wrap_model(CPU2, net, fsdp=FSDPOptions())
    assert type(net) is _Net


def test_wrap_model_checks_reshard_after_forward_against_the_world() -> None:
    with pytest.raises(
        ValueError,
        match=r"wrap_model: FSDPOptions.reshard_after_forward must be a divisor of the "
        r"world size \(2\); got 3\. Use a divisor of 2, or True/False\.",
    ):
        wrap_model(CPU2, _make_net(), fsdp=FSDPOptions(reshard_after_forward=3))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            ("ctx", _Net()),
            r"wrap_model: ctx must be a DistributedContext; got 'ctx' \(str\)",
        ),
        (
            (DistributedContext(), {"w": 1}),
            r"wrap_model: model must be a torch.nn.Module; got \{'w': 1\} \(dict\)\. Pass the module itself",
        ),
        (
            (DistributedContext(), _Net(), {"dim": 1}),
            r"wrap_model: ddp_kwargs must be a DistributedDataParallelKwargs or None; got \{'dim': 1\}",
        ),
    ],
)
def test_wrap_model_rejects_wrong_types(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        wrap_model(*args)


def test_wrap_model_rejects_wrong_fsdp_type() -> None:
    with pytest.raises(
        TypeError, match=r"wrap_model: fsdp must be an FSDPOptions or None; got True"
    ):
        wrap_model(DistributedContext(), _Net(), fsdp=True)  # type: ignore[arg-type]


def test_wrap_model_refuses_deepspeed_arguments_that_do_not_fit() -> None:
    from funcaccel import DeepSpeedOptions
    from funcaccel import GradState

    one = DistributedContext()
    with pytest.raises(
        ValueError,
        match=r"wrap_model: deepspeed must be a DeepSpeedOptions when scheduler= or "
        r"grad= is given .*; got None\. Pass deepspeed=DeepSpeedOptions",
    ):
        wrap_model(one, _Net(), grad=GradState())
    with pytest.raises(
        TypeError, match=r"wrap_model: deepspeed must be a DeepSpeedOptions or None; "
    ):
        wrap_model(one, _Net(), deepspeed=3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"wrap_model: fsdp must be None with deepspeed= .*; got FSDPOptions\(",
    ):
        wrap_model(one, _Net(), deepspeed=DeepSpeedOptions(), fsdp=FSDPOptions())


@pytest.mark.parametrize("compiled", [False, True])
def test_wrap_model_refuses_an_already_wrapped_module(compiled: bool) -> None:
    wrapped = nn.DataParallel(_Net())
    given = _compiled(wrapped) if compiled else wrapped
    with pytest.raises(
        ValueError,
        match=r"wrap_model: model is already wrapped \(DataParallel\); pass unwrap_model",
    ):
        wrap_model(DistributedContext(), given)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"shard_modules": "Linear"},
            TypeError,
            r"FSDPOptions: shard_modules must be a sequence .* got 'Linear'",
        ),
        (
            {"shard_modules": (nn.Linear(1, 1),)},
            TypeError,
            r"FSDPOptions: every item of shard_modules must be an nn.Module subclass; "
            r"got Linear\(in_features=1.*Pass the class",
        ),
        ({"shard_modules": (int,)}, TypeError, r"got <class 'int'>"),
        (
            {"reshard_after_forward": "yes"},
            TypeError,
            r"FSDPOptions: reshard_after_forward must be a bool, an int or None; got 'yes' \(str\)",
        ),
        (
            {"reshard_after_forward": 0},
            ValueError,
            r"FSDPOptions: reshard_after_forward must be an int >= 1 .*; got 0\.",
        ),
        (
            {"mp_policy": {"param_dtype": torch.bfloat16}},
            TypeError,
            r"FSDPOptions: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None; got \{'param_dtype'",
        ),
    ],
)
def test_fsdp_options_validates_fields(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        FSDPOptions(**kwargs)


def test_fsdp_options_is_frozen_and_stores_a_tuple() -> None:
    options = FSDPOptions(shard_modules=[nn.Linear, nn.Conv1d], reshard_after_forward=2)
    assert options.shard_modules == (nn.Linear, nn.Conv1d)
    with pytest.raises(AttributeError):
        options.reshard_after_forward = False  # type: ignore[misc]


def test_unwrap_model_returns_the_innermost_module() -> None:
    net = _Net()
    assert unwrap_model(net) is net
    assert unwrap_model(nn.DataParallel(nn.DataParallel(net))) is net
    # A container holding the module is not a wrapper.
    holder = nn.Sequential(net)
    assert unwrap_model(holder) is holder
    with pytest.raises(
        TypeError, match=r"unwrap_model: model must be a torch.nn.Module; got 3 \(int\)"
    ):
        unwrap_model(3)  # type: ignore[arg-type]


def _adam_state(net: nn.Module, **options: Any) -> dict[str, Any]:
    """An Adam state dict after one step, saved and loaded back as a checkpoint."""
    optimizer = torch.optim.Adam(net.parameters(), lr=LR, **options)
    xs, ys = _data(torch.float32)
    torch.autograd.backward(F.mse_loss(net(xs), ys))
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _to_meta_in_place(net: nn.Module) -> None:
    """Move parameters to the meta device keeping their identity, as .to does."""
    with torch.no_grad():
        for param in net.parameters():
            moved = nn.Parameter(param.detach().to("meta"))
            torch.utils.swap_tensors(param, moved)  # type: ignore[no-untyped-call]


def test_move_optimizer_state_follows_parameters_moved_in_place() -> None:
    saved = _adam_state(_make_net(torch.float32))
    net = _make_net(torch.float32)
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    optimizer.load_state_dict(saved)
    optimizer.state[net.first.weight]["note"] = "kept"
    net.double()  # the parameters change dtype in place; the state does not
    assert move_optimizer_state_(optimizer) == 2 * 4  # exp_avg, exp_avg_sq x 4
    for index, param in enumerate(net.parameters()):
        state = optimizer.state[param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float64
            assert torch.equal(state[key], saved["state"][index][key].double())
        assert state["step"].dtype == torch.float32  # torch never casts "step"
    assert optimizer.state[net.first.weight]["note"] == "kept"
    assert move_optimizer_state_(optimizer) == 0
    _to_meta_in_place(net)
    assert move_optimizer_state_(optimizer) == 2 * 4
    for param in net.parameters():
        state = optimizer.state[param]
        assert state["exp_avg"].device.type == "meta"
        assert state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu"


def test_move_optimizer_state_moves_step_of_capturable_groups() -> None:
    saved = _adam_state(_make_net(torch.float32))
    net = _make_net(torch.float32)
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    optimizer.load_state_dict(saved)
    # load_state_dict restores the saved group options; turn capturable on after.
    optimizer.param_groups[0]["capturable"] = True
    _to_meta_in_place(net)
    assert move_optimizer_state_(optimizer) == 3 * 4
    for param in net.parameters():
        step = optimizer.state[param]["step"]
        assert (step.device.type, step.dtype) == ("meta", torch.float32)


def test_move_optimizer_state_rejects_a_non_optimizer() -> None:
    with pytest.raises(
        TypeError,
        match=r"move_optimizer_state_: optimizer must be a torch.optim.Optimizer; got \{\} \(dict\)",
    ):
        move_optimizer_state_({})  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wrap_model_and_optimizer_state_on_cuda() -> None:
    ctx = DistributedContext(device=torch.device("cuda", 0))
    net = _make_net(torch.float32)
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    optimizer.load_state_dict(_adam_state(_make_net(torch.float32)))
    assert wrap_model(ctx, net) is net
    assert {p.device for p in net.parameters()} == {ctx.device}
    assert move_optimizer_state_(optimizer) == 2 * 4
    for param in net.parameters():
        assert optimizer.state[param]["exp_avg"].device == ctx.device
        assert optimizer.state[param]["exp_avg_sq"].device == ctx.device
    xs, ys = _data(torch.float32)
    torch.autograd.backward(F.mse_loss(net(xs.to(ctx.device)), ys.to(ctx.device)))
    optimizer.step()
