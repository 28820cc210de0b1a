"""The error messages the docs quote are the ones the code raises.

A page's ``## Errors`` table quotes each message in its first cell, as
```` `ValueError: function: message` ````, with ``...`` standing for text left out.
For the pages in ``CHECKED_PAGES`` every quoted message has a trigger here that
raises it; the test compares type and text, so a message changed in the code (or
mistyped in the docs) fails until both agree again.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest
import torch
import torch.distributed as dist
from torch import nn

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.model import FSDPOptions
from funcaccel.model import check_optimizers_hold
from funcaccel.model import wrap_model
from funcaccel.scheduler import maybe_step_scheduler

DOCS: Final = Path(__file__).resolve().parent.parent / "docs"
CHECKED_PAGES: Final = ("accumulate.md", "model.md")
_ROW: Final = re.compile(r"^\| `(\w+Error: [^`]+)` \|", re.M)

ONE: Final = DistributedContext()


def _world(n: int, backend: str | None = None) -> DistributedContext:
    return DistributedContext(
        num_processes=n,
        process_index=0,
        distributed_type=DistributedType.MULTI_CPU,
        backend=backend,
    )


def _step(ctx: DistributedContext = ONE, **kwargs: object) -> object:
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = kwargs.pop("loss", lambda: model(torch.ones(1, 1)).sum())
    return accumulate_step(ctx, GradState(), model, optimizer, loss, **kwargs)  # type: ignore[arg-type]


def _schedule(
    ctx: DistributedContext, plateau: bool = False, **kwargs: object
) -> object:
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler: object = (
        torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        if plateau
        else torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    )
    return maybe_step_scheduler(ctx, scheduler, GradState(), **kwargs)  # type: ignore[arg-type]


def _stale_fsdp_optimizer(tmp_path: Path) -> None:
    # accumulate_step runs this check with several processes; one gloo process
    # is enough to build a real FSDP2 module here.
    from torch.distributed.fsdp import fully_shard

    init = f"file://{tmp_path}/rendezvous"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        net = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        fully_shard(net)
        check_optimizers_hold([net], [optimizer], "accumulate_step")
    finally:
        dist.destroy_process_group()


Trigger = Callable[[Path], object]
TRIGGERS: Final[dict[str, Trigger]] = {
    # accumulate.md
    "ValueError: accumulate_step: ctx.mixed_precision is 'fp16' but scaler=None; "
    "fp16 needs a grad scaler: pass scaler=build_grad_scaler(ctx).": lambda _: _step(
        DistributedContext(mixed_precision="fp16")
    ),
    "ValueError: accumulate_step: loss_fn() must return a scalar loss; got a tensor "
    "of shape (2, 1). Reduce it first, e.g. with .mean().": lambda _: _step(
        loss=lambda: nn.Linear(1, 1)(torch.ones(2, 1))
    ),
    "TypeError: accumulate_step: loss_fn() must return the loss of one micro-batch "
    "as a torch.Tensor; got 1.0 (float).": lambda _: _step(loss=lambda: 1.0),
    "ValueError: accumulate_step: the loss from loss_fn() does not require grad; "
    "...": lambda _: _step(loss=lambda: torch.ones(())),
    "TypeError: accumulate_step: end_of_dataloader must be a bool; got 1 (int). "
    "Pass batch.is_last.": lambda _: _step(end_of_dataloader=1),
    "ValueError: accumulate_step: max_grad_norm must be > 0; got 0. "
    "Use e.g. 1.0.": lambda _: _step(max_grad_norm=0),
    "ValueError: GradState: accumulation_steps must be >= 1; got 0.": lambda _: (
        GradState(accumulation_steps=0)
    ),
    "ValueError: GradState: sync_gradients (True) must be true exactly when "
    "micro_step == 0; got micro_step=1. Pass sync_gradients=False.": lambda _: (
        GradState(accumulation_steps=2, micro_step=1)
    ),
    "ValueError: maybe_step_scheduler: ReduceLROnPlateau steps on a metric but "
    "metrics=None; ...": lambda _: _schedule(ONE, plateau=True),
    "ValueError: maybe_step_scheduler: metrics=1.0 is only used by "
    "ReduceLROnPlateau, not StepLR; drop metrics.": lambda _: _schedule(
        ONE, metrics=1.0
    ),
    "ValueError: maybe_step_scheduler: with 2 processes an update counts 1 "
    "scheduler step if the loader splits each batch across processes "
    "(split_batches=True) and 2 if not, ...": lambda _: _schedule(_world(2)),
    "RuntimeError: accumulate_step: ctx has num_processes=2 but no default "
    "process group is initialised; ...": lambda _: _step(_world(2)),
    # model.md
    "ValueError: wrap_model: comm_hook='bf16' needs a CUDA (NCCL) or XPU (XCCL) "
    "device, but ctx.device is cpu (backend 'gloo'), ...": lambda _: wrap_model(
        _world(2, "gloo"),
        nn.Linear(1, 1),
        DistributedDataParallelKwargs(comm_hook="bf16"),
    ),
    "ValueError: wrap_model: model is already wrapped (DataParallel); pass "
    "unwrap_model(model), or use the wrapped model as it is.": lambda _: wrap_model(
        ONE, nn.DataParallel(nn.Linear(1, 1))
    ),
    "ValueError: wrap_model: ddp_kwargs only configure DDP, but fsdp was given; "
    "...": lambda _: wrap_model(
        ONE, nn.Linear(1, 1), DistributedDataParallelKwargs(), fsdp=FSDPOptions()
    ),
    "ValueError: accumulate_step: optimizer holds none of the model's parameters: "
    "...": _stale_fsdp_optimizer,
    "ValueError: wrap_model: FSDPOptions.reshard_after_forward=3 must divide the "
    "world size (4); ...": lambda _: wrap_model(
        _world(4), nn.Linear(1, 1), fsdp=FSDPOptions(reshard_after_forward=3)
    ),
    "TypeError: FSDPOptions: shard_modules must hold nn.Module subclasses; got "
    "Linear(...). Pass the class (e.g. nn.Linear), not an instance.": lambda _: (
        FSDPOptions(shard_modules=[nn.Linear(1, 1)])  # type: ignore[list-item]
    ),
    "TypeError: wrap_model: model must be a torch.nn.Module; got generator. "
    "...": lambda _: wrap_model(ONE, nn.Linear(1, 1).parameters()),  # type: ignore[arg-type]
    "RuntimeError: wrap_model: ctx has num_processes=2 but no default process "
    "group is initialised; ...": lambda _: wrap_model(_world(2), nn.Linear(1, 1)),
}


def _quoted() -> list[str]:
    return [
        quote
        for page in CHECKED_PAGES
        for quote in _ROW.findall((DOCS / page).read_text(encoding="utf-8"))
    ]


def _matches(quote: str, real: str) -> bool:
    """Whether ``real`` reads as ``quote`` with each ``...`` standing for any text."""
    first, *middle, last = quote.split("...") if "..." in quote else (quote, "")
    if "..." not in quote:
        return real == quote
    if not (real.startswith(first) and real.endswith(last)):
        return False
    position = len(first)
    for part in middle:
        found = real.find(part, position)
        if found < 0:
            return False
        position = found + len(part)
    return position <= len(real) - len(last)


def test_matches_reads_dots_as_any_text() -> None:
    assert _matches("E: f: got x(...). Fix.", "E: f: got x(a=1). Fix.")
    assert _matches("E: f: got 1; ...", "E: f: got 1; pass 2.")
    assert not _matches("E: f: got 1; ...", "E: g: got 1; pass 2.")
    assert not _matches("E: f: got 1.", "E: f: got 1. More.")


def test_every_quoted_message_has_a_trigger() -> None:
    quoted = _quoted()
    assert len(quoted) >= 15  # the tables are found
    assert sorted(set(quoted) - TRIGGERS.keys()) == []
    assert sorted(TRIGGERS.keys() - set(quoted)) == []


@pytest.mark.parametrize("quote", list(TRIGGERS), ids=lambda q: q[:60])
def test_quoted_message_is_the_one_raised(quote: str, tmp_path: Path) -> None:
    kind = quote.split(":", 1)[0]
    with pytest.raises(Exception) as caught:
        TRIGGERS[quote](tmp_path)
    real = f"{type(caught.value).__name__}: {caught.value}"
    assert type(caught.value).__name__ == kind, real
    assert _matches(quote, real), real
