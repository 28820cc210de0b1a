"""Every count and flag funcaccel sends travels on ``comm_device(ctx)``.

NCCL moves only CUDA tensors, so a count built on the CPU whatever ``comm_device``
says works under gloo and fails only under NCCL. These checks make the difference
visible on two gloo ranks on CPU: ``comm_device`` is patched, in every funcaccel
module that holds it by name, to return a stand-in device (``meta``); a torch
function mode builds on the CPU, as a ``_OnComm`` tensor, whatever is asked for on
that device (``device=`` of a factory, or ``Tensor.to``); and the collectives
funcaccel calls record, for each tensor they are given, ``"comm"`` for such a
tensor or else the device it lives on. The real collective then runs on the same
storage, so the step goes on as it would.

With 2 ranks, a window of rank 0 with 1 + 2 + 3 items and rank 1 with 0 + 0 + 4
sends one all-reduce of ``[6]`` and ``[4]``, recorded as
``("all_reduce", ["comm"])`` on both; a count built with ``torch.tensor(n)`` would
be recorded as ``("all_reduce", ["cpu"])``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import Final
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

from funcaccel import _primitives
from funcaccel._deepspeed_step import deepspeed_step
from funcaccel._guard import guard_collective
from funcaccel._primitives import all_reduce_ints
from funcaccel._primitives import exchange_codes
from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.collectives import any_process
from funcaccel.context import DistributedContext
from funcaccel.testing import run_ranks
from tests.test_deepspeed_step import K as ENGINE_K
from tests.test_deepspeed_step import _Engine

_STAND_IN: Final = torch.device("meta")
# The tensor collectives funcaccel calls; barriers carry no tensor, and the object
# collectives move their pickles to the device themselves.
_COLLECTIVES: Final = ("all_reduce", "broadcast", "all_gather")
# Per collective call: its name and, per tensor, "comm" or the device it is on.
Sent = list[tuple[str, list[str]]]
# Items per micro-step of each rank: windows of 6 and 4 items, 10 in all.
_ITEMS: Final = ((1, 2, 3), (0, 0, 4))


class _OnComm(torch.Tensor):
    """A CPU tensor that was asked for on the (stand-in) communication device."""


def _is_stand_in(device: object) -> bool:
    return isinstance(device, (torch.device, str)) and torch.device(device) == _STAND_IN


class _BuildOnStandIn(TorchFunctionMode):
    """Build on the CPU, as ``_OnComm``, what is asked for on the stand-in device."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        del types  # no subclass of ours needs special dispatch
        kwargs = dict(kwargs or {})
        if _is_stand_in(kwargs.get("device")):
            kwargs["device"] = "cpu"
            return func(*args, **kwargs).as_subclass(_OnComm)
        if func is torch.Tensor.to and len(args) > 1 and _is_stand_in(args[1]):
            moved = func(args[0], "cpu", *args[2:], **kwargs)
            return moved.as_subclass(_OnComm)
        return func(*args, **kwargs)


def _recording(name: str, real: Callable[..., Any], sent: Sent) -> Callable[..., Any]:
    """Return ``real``, recording where each tensor it is given lives."""

    def collective(*args: Any, **kwargs: Any) -> Any:
        seen: list[str] = []

        def unwrap(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                seen.append("comm" if isinstance(value, _OnComm) else str(value.device))
                # A plain view of the same storage: the result lands in place.
                return value.as_subclass(torch.Tensor)
            if isinstance(value, list):
                return [unwrap(item) for item in value]
            return value

        plain_args = [unwrap(value) for value in args]
        plain_kwargs = {key: unwrap(value) for key, value in kwargs.items()}
        sent.append((name, seen))
        return real(*plain_args, **plain_kwargs)

    return collective


@contextlib.contextmanager
def _stand_in_comm_device() -> Iterator[Sent]:
    """Make ``meta`` the communication device; yield the record of what is sent."""
    sent: Sent = []
    real = _primitives.comm_device
    with contextlib.ExitStack() as stack:
        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", "")
            if name.startswith("funcaccel") and (
                getattr(module, "comm_device", None) is real
            ):
                stack.enter_context(
                    mock.patch.object(module, "comm_device", lambda ctx: _STAND_IN)
                )
        for name in _COLLECTIVES:
            recording = _recording(name, getattr(dist, name), sent)
            stack.enter_context(mock.patch.object(dist, name, recording))
        stack.enter_context(_BuildOnStandIn())
        yield sent


# --- what each rank runs -------------------------------------------------------------


def _control(ctx: DistributedContext) -> Sent:
    """One all-reduce of a tensor on the communication device, one of a CPU one."""
    with _stand_in_comm_device() as sent:
        on_comm = torch.ones(1, device=_primitives.comm_device(ctx))
        dist.all_reduce(on_comm)
        dist.all_reduce(torch.ones(1))
    return sent


def _helper(ctx: DistributedContext) -> dict[str, Any]:
    r = ctx.process_index
    with (
        mock.patch.object(
            _primitives, "guard_collective", wraps=guard_collective
        ) as guard,
        _stand_in_comm_device() as sent,
    ):
        sums = all_reduce_ints(ctx, [3 + r, r], caller="helper_test")
        codes = exchange_codes(ctx, r + 1, caller="codes_test")
        anyone = any_process(ctx, r == 1)
    return {
        "sums": sums,
        "codes": codes,
        "any": anyone,
        "guarded": [call.args[1] for call in guard.call_args_list],
        "sent": sent,
    }


def _ddp_window(ctx: DistributedContext) -> dict[str, Any]:
    """A token-weighted window of 3 micro-steps of a DDP model."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grad = GradState(accumulation_steps=3)
    with _stand_in_comm_device() as sent:
        for step, n in enumerate(_ITEMS[ctx.process_index]):
            x = torch.ones(max(n, 1), 2)
            _, grad = accumulate_step(
                ctx, grad, model, opt, lambda: model(x).sum(),
                end_of_dataloader=step == 2, num_items=n,
            )  # fmt: skip
    return {"sent": sent, "steps": grad.optimizer_steps}


def _deepspeed_window(ctx: DistributedContext) -> dict[str, Any]:
    """A token-weighted window of a stand-in DeepSpeed engine (k = 3)."""
    engine = _Engine(1024.0, overflow_on_step=False)
    weight = torch.ones(2, requires_grad=True)
    grad = GradState(accumulation_steps=ENGINE_K)
    with _stand_in_comm_device() as sent:
        for step, n in enumerate(_ITEMS[ctx.process_index]):
            _, grad = deepspeed_step(
                ctx, grad, engine, engine.optimizer, lambda: (weight * 2.0).sum(),
                end_of_dataloader=step == 2, scaler=None, max_grad_norm=None,
                autocast_kwargs=None, num_items=n,
            )  # fmt: skip
    return {"sent": sent, "scales": engine.scales_seen}


def _scenarios(ctx: DistributedContext) -> dict[str, Any]:
    return {
        "control": _control(ctx),
        "helper": _helper(ctx),
        "ddp": _ddp_window(ctx),
        "deepspeed": _deepspeed_window(ctx),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, 2, start_method="forkserver")


# --- the checks ----------------------------------------------------------------------

ONE_COUNT: Final = [("all_reduce", ["comm"])]


@pytest.mark.distributed
def test_the_stand_in_tells_a_cpu_tensor_from_one_on_the_comm_device(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in two_ranks:
        assert rank["control"] == [("all_reduce", ["comm"]), ("all_reduce", ["cpu"])]


@pytest.mark.distributed
def test_all_reduce_ints_sums_on_the_comm_device_after_the_guard(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in two_ranks:
        helper = rank["helper"]
        assert helper["sums"] == [7, 1]
        assert helper["codes"] == [1, 2]
        assert helper["any"] is True
        assert helper["guarded"] == ["helper_test", "codes_test", "any_process"]
        assert helper["sent"] == ONE_COUNT * 3


@pytest.mark.distributed
def test_a_token_weighted_ddp_window_sends_its_count_on_the_comm_device(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in two_ranks:
        assert rank["ddp"] == {"sent": ONE_COUNT, "steps": 1}


@pytest.mark.distributed
def test_a_token_weighted_deepspeed_window_sends_its_count_on_the_comm_device(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in two_ranks:
        # 10 items over 2 ranks: the step runs with the scale divided by 2 / 10.
        assert rank["deepspeed"] == {"sent": ONE_COUNT, "scales": [1024.0 * 5]}


def test_all_reduce_ints_with_one_process_returns_a_new_list_and_sends_nothing() -> (
    None
):
    values = [3, 0]
    with _stand_in_comm_device() as sent:
        out = all_reduce_ints(DistributedContext(), values, caller="helper_test")
    assert out == [3, 0] and out is not values
    assert sent == []
