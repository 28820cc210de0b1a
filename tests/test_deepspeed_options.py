"""DeepSpeedOptions and merged_config refuse what does not fit; no DeepSpeed needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from funcaccel.grad_state import GradState
from funcaccel.model import DeepSpeedOptions
from funcaccel.model._deepspeed_options import merged_config
from funcaccel.testing import rank_ctx


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (
            {"config": {1: 2}},
            TypeError,
            r"every config key must be a str; got 1 \(int\)",
        ),
        (
            {"config": {"a": {1}}},
            TypeError,
            r"config must be a dict of JSON values only",
        ),
        ({"config": 3}, TypeError, r"config must be a dict, a path to a JSON file, or"),
        ({"zero_stage": "2"}, TypeError, r"zero_stage must be an int or None; got '2'"),
        (
            {"offload_param": 1},
            TypeError,
            r"offload_param must be a bool or None; got 1",
        ),
        (
            {"gradient_clipping": True},
            TypeError,
            r"gradient_clipping must be an int or",
        ),
        (
            {"gradient_clipping": float("inf")},
            ValueError,
            r"gradient_clipping must be a finite number > 0; got inf\. Use None",
        ),
        ({"micro_batch_size": 0}, ValueError, r"micro_batch_size must be >= 1; got 0"),
        (
            {"config": {"zero_optimization": 3}},
            ValueError,
            r"config\['zero_optimization'\] must be an object; got 3\.",
        ),
        (
            {"offload_param": True, "zero_stage": 2},
            ValueError,
            r"the ZeRO stage must be 3 with offload_param; got 2\. Set zero_stage=3",
        ),
        (
            {"config": {"train_micro_batch_size_per_gpu": 4}, "micro_batch_size": 2},
            ValueError,
            r"micro_batch_size=2 disagrees with the config's "
            r"train_micro_batch_size_per_gpu=4",
        ),
    ],
)
def test_deepspeed_options_refuses_fields_that_do_not_fit(
    fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"^DeepSpeedOptions: " + match):
        DeepSpeedOptions(**fields)


def test_deepspeed_options_reads_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"offload_param": {"device": "cpu"}}}')
    with pytest.raises(ValueError, match=r"the ZeRO stage must be 3 with offload"):
        DeepSpeedOptions(config=path)
    assert DeepSpeedOptions(config=path, zero_stage=3).stage == 3
    path.write_text("[1]")
    with pytest.raises(ValueError, match=r"file '.*ds.json' must be a JSON object"):
        DeepSpeedOptions(config=path)


def test_merged_config_refuses_a_batch_size_other_than_funcaccels() -> None:
    options = DeepSpeedOptions(config={"train_batch_size": 5}, micro_batch_size=2)
    with pytest.raises(
        ValueError,
        match=r"^f: the DeepSpeed config sets train_batch_size=5, but micro-batch "
        r"size x accumulation steps x processes \(2 x 3 x 2\) is 12; ",
    ):
        merged_config("f", rank_ctx(2, 0), options, GradState(accumulation_steps=3))
    config = merged_config(
        "f", rank_ctx(2, 0), DeepSpeedOptions(offload_optimizer=True), GradState()
    )
    assert config["train_batch_size"] == 2
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert (config["fp16"], config["bf16"]) == ({"enabled": False}, {"enabled": False})
