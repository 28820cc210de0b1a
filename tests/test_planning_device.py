"""estimate_memory(device=...): CUDA's 512-byte blocks per tensor, the kind shown, errors.

Every estimate runs in this process on torch's fake process group and fake
tensors (two DDP ranks: each holds the whole model, so the held parts are the
model's own tensors).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import pytest
import torch
from torch import nn

from funcaccel.__main__ import main
from funcaccel.planning import estimate_memory


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # no state: parameters and gradients


def one_weight() -> nn.Module:
    return nn.Linear(1, 1, bias=False)  # one float32 element: 4 bytes


def row_of_128() -> nn.Module:
    return nn.Linear(128, 1, bias=False)  # 128 float32 elements: 512 bytes


@pytest.mark.parametrize(
    ("build", "width", "cpu", "cuda"),
    [(one_weight, 1, 4, 512), (row_of_128, 128, 512, 512)],
)
def test_cuda_rounds_each_tensor_up_to_512_bytes(
    build: type[nn.Module], width: int, cpu: int, cuda: int
) -> None:
    found = {}
    for kind in ("cpu", "cuda"):
        estimate = estimate_memory(
            build, torch.zeros(2, width), world_size=2, optimizer_fn=_sgd, device=kind
        )
        assert estimate.device == kind
        (rank,) = estimate.ranks
        assert rank.parameters == rank.gradients
        found[kind] = rank.parameters
    assert found == {"cpu": cpu, "cuda": cuda}


def test_cuda_rounds_the_tracked_peak_per_storage() -> None:
    peaks = {
        kind: estimate_memory(
            one_weight, torch.zeros(2, 1), world_size=2, optimizer_fn=_sgd, device=kind
        ).peak
        for kind in ("cpu", "cuda")
    }
    # Every storage the step holds (weight, gradient, input, output ...) is a
    # few bytes on the CPU and a whole 512-byte block on CUDA.
    assert peaks["cpu"] < 512 and peaks["cuda"] % 512 == 0
    assert peaks["cuda"] >= 4 * 512


def test_the_default_is_the_kind_this_process_would_use() -> None:
    estimate = estimate_memory(
        one_weight, torch.zeros(2, 1), world_size=2, optimizer_fn=_sgd
    )
    assert estimate.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_an_unknown_device_kind_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^estimate_memory: .*'tpu'") as error:
        estimate_memory(
            one_weight, torch.zeros(2, 1), world_size=2, optimizer_fn=_sgd,
            device="tpu",
        )  # fmt: skip
    assert "cuda" in str(error.value)


def test_the_cli_shows_the_device_kind(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", f"{__name__}:row_of_128", "--world-size", "2"]
    assert main([*argv, "--input-shape", "2,128", "--device", "cuda"]) == 0
    assert "cuda sizes" in capsys.readouterr().out.splitlines()[0]
    assert main([*argv, "--input-shape", "2,128", "--device", "cuda", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["device"] == "cuda"
    assert found["ranks"][0]["parameters"] == 512
