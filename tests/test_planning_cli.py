"""``python -m funcaccel estimate``: the table, --json, and its errors (in this process)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from torch import nn

from funcaccel.__main__ import main


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip


def test_estimate_prints_the_table_of_a_module_factory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["estimate", f"{__name__}:mlp", "--world-size", "8", "--fsdp"]
    assert main([*argv, "--input-shape", "8,64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "fsdp on 8 ranks (pp x dp_replicate x dp_shard x tp = 1 x 1 x 8 x 1)"
    )
    assert "| **peak + 10 % margin** |" in out and "Not counted:" in out


def test_estimate_json_of_a_transformers_config_with_tp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    argv = ["estimate", f"{__name__}:llama_config", "--world-size", "8", "--fsdp"]
    assert main([*argv, "--tp", "2", "--seq-len", "16", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["strategy"] == "fsdp+tp"
    assert found["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2}
    # The config's tp plan splits q, k, v, o, gate, up, down over tp=2; the
    # norms, embeddings and head are split over dp_shard=4 only (4 bytes each).
    h, f, v, layers = 64, 128, 128, 2
    per_layer = (4 * h * h + 3 * h * f) // 8 + 2 * h // 4
    elements = layers * per_layer + (h + 2 * v * h) // 4
    assert found["ranks"][0]["parameters"] == 4 * elements


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["nocolon", "--world-size", "2"],
            r"the model must be an import path MODULE:NAME",
        ),
        ([f"{__name__}:mlp", "--world-size", "2"], r"--input-shape must be given"),
        (
            [
                f"{__name__}:mlp",
                "--world-size",
                "8",
                "--fsdp",
                "--dp-shard",
                "3",
                "--input-shape",
                "2,64",
            ],
            r"build_mesh: ",
        ),
        (
            [f"{__name__}:chain", "--world-size", "2", "--pp", "2"]
            + ["--input-shape", "2,64", "--schedule", "zigzag"],
            r"PipelineOptions: schedule must be one of",
        ),
    ],
)
def test_estimate_errors_exit_1_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m funcaccel estimate: ")
    assert re.search(message, err), err


def chain() -> nn.Module:
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))


def test_estimate_pipeline_stages_gets_a_column_per_stage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["estimate", f"{__name__}:chain", "--world-size", "4", "--pp", "2"]
    argv += ["--fsdp", "--input-shape", "2,64", "--schedule", "gpipe", "--json"]
    assert main(argv) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["strategy"] == "pp+fsdp"
    assert found["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert [(r["rank"], r["stages"]) for r in found["ranks"]] == [(0, [0]), (2, [1])]
    # Two 64 x 64 layers (and biases) per stage, split over dp_shard=2.
    assert found["ranks"][1]["parameters"] == 4 * 2 * (64 * 64 + 64) // 2
    assert main(["estimate", f"{__name__}:chain", "--world-size", "2", "--pp", "2",
                 "--input-shape", "2,64"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("pp on 2 ranks (pp x dp_replicate x dp_shard x tp = 2 x 1")
    assert "| | rank 0 (stage 0) | rank 1 (stage 1) |" in out


def test_estimate_refuses_pipeline_stages_of_a_transformers_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    argv = ["estimate", f"{__name__}:llama_config", "--world-size", "2", "--pp", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "--pp must be 1 for a transformers model" in err, err
