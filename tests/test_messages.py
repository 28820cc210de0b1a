"""Error messages stay short whatever value they report.

A message shows the value it refused as a bounded summary: a whole batch or model
output passed by mistake must not be dumped tensor by tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import save_checkpoint
from funcaccel.context import DistributedContext
from funcaccel.loader import Batch
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.scheduler import maybe_step_scheduler
from funcaccel.tracking import InMemoryTracker
from funcaccel.tracking import log_metrics

ONE = DistributedContext()
LIMIT = 300


class ModelOutput(OrderedDict[str, torch.Tensor]):
    """What a transformers model returns: a dict of (large) tensors."""


def _batch() -> Batch:
    data = {
        "input_ids": torch.arange(100_000).reshape(1_000, 100),
        "labels": list(range(5_000)),
    }
    return Batch(
        data=data, index=0, is_last=False, remainder=0, epoch=0, total_batch_size=8
    )


def _output() -> ModelOutput:
    output = ModelOutput(logits=torch.randn(64, 1_000))
    for layer in range(13):
        output[f"hidden_states_{layer}"] = torch.randn(64, 256)
    return output


def _calls(tmp_path: Path) -> dict[str, Callable[[object], object]]:
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = shard_loader(ONE, DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    return {
        "accumulate_step": lambda value: accumulate_step(
            ONE,
            GradState(),
            model,
            optimizer,
            lambda: value,
        ),
        "maybe_step_scheduler": lambda value: maybe_step_scheduler(
            ONE,
            scheduler,
            value,
        ),
        "iter_batches": lambda value: next(iter(iter_batches(loader, value))),
        "log_metrics": lambda value: log_metrics(
            ONE,
            [InMemoryTracker()],
            value,
            step=0,
        ),
        "save_checkpoint": lambda value: save_checkpoint(
            ONE, tmp_path, models=model, extra={"value": value}
        ),
    }


@pytest.mark.parametrize("make", [_batch, _output], ids=["Batch", "ModelOutput"])
@pytest.mark.parametrize(
    "function",
    [
        "accumulate_step",
        "maybe_step_scheduler",
        "iter_batches",
        "log_metrics",
        "save_checkpoint",
    ],
)
def test_a_huge_value_gives_a_short_message(
    tmp_path: Path, make: Callable[[], object], function: str
) -> None:
    value = make()
    assert len(repr(value)) > 2_000  # what the old messages printed
    with pytest.raises((TypeError, ValueError)) as caught:
        _calls(tmp_path)[function](value)
    message = str(caught.value)
    # A mapping reaches the trackers, which check each value as they log it.
    owners = (
        (function, "InMemoryTracker.log") if function == "log_metrics" else (function,)
    )
    assert message.startswith(tuple(f"{owner}: " for owner in owners)), message
    assert len(message) < LIMIT, message
