"""``DeepSpeedOptions`` and the DeepSpeed config ``wrap_model`` builds from them.

A DeepSpeed run is configured once, by a JSON file or dict, or by the few fields
most runs change; ``merged_config`` then adds what funcaccel already knows (the
accumulation steps of the ``GradState``, the precision of the context, the
micro-batch size) and refuses any value that disagrees with them. Nothing here
imports DeepSpeed.

>>> DeepSpeedOptions(zero_stage=3).zero_stage
3
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from typing import Final

from funcaccel._checks import check_choice
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState

__all__ = ["DeepSpeedOptions", "merged_config"]

_STAGES: Final = (1, 2, 3)
_FIELD_TYPES: Final[tuple[tuple[str, tuple[type, ...]], ...]] = (
    ("zero_stage", (int,)),
    ("micro_batch_size", (int,)),
    ("offload_optimizer", (bool,)),
    ("offload_param", (bool,)),
    ("gradient_clipping", (int, float)),
)
_NO_CLIP: Final = "Use None for no clipping."
_POSITIVE: Final = "a finite number > 0"
_OFFLOADS: Final = "3 with offload_param"
_CONFIG_KEYS: Final = (  # field, the config key it sets
    ("zero_stage", "zero_optimization.stage"),
    ("offload_optimizer", "zero_optimization.offload_optimizer"),
    ("offload_param", "zero_optimization.offload_param"),
    ("gradient_clipping", "gradient_clipping"),
    ("micro_batch_size", "train_micro_batch_size_per_gpu"),
)
_NO_ZERO: Final = (
    "For replicated training without ZeRO use wrap_model's DDP path (no deepspeed=)."
)
_STAGE_3: Final = "Set zero_stage=3 or offload_param=False."


def _read_config(config: object) -> dict[str, Any]:
    owner = "DeepSpeedOptions"
    if isinstance(config, Mapping):
        for key in config:
            check_type(owner, "every config key", key, str)
        # A deep copy through JSON: the record must not share the caller's dicts,
        # and DeepSpeed takes only JSON values anyway.
        try:
            copied: dict[str, Any] = json.loads(json.dumps(dict(config)))
        except (TypeError, ValueError) as error:
            fail_type(owner, "config", config, f"a dict of JSON values only ({error})")
        return copied
    if not isinstance(config, (str, os.PathLike)):
        fail_type(owner, "config", config, "a dict, a path to a JSON file, or None")
    path = Path(config)
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        msg = f"{owner}: cannot read the DeepSpeed config file {str(path)!r} ({error}); pass an existing JSON file or a dict."
        raise ValueError(msg) from error
    except ValueError as error:
        msg = f"{owner}: the DeepSpeed config file {str(path)!r} is not valid JSON ({error})."
        raise ValueError(msg) from error
    if not isinstance(loaded, dict):
        fail_value(
            owner, f"the DeepSpeed config file {str(path)!r}", loaded, "a JSON object"
        )
    return loaded


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeepSpeedOptions:
    """Options that make ``wrap_model`` build a DeepSpeed ZeRO engine instead of DDP.

    Give a DeepSpeed ``config`` (a dict, or the path of a JSON file such as
    Accelerate's ``deepspeed_config_file``), the common fields, or both; a field
    that is set and also present in ``config`` must agree with it. ``wrap_model``
    adds ``gradient_accumulation_steps`` (from its ``grad``), ``fp16``/``bf16``
    (from ``ctx.mixed_precision``), ``train_micro_batch_size_per_gpu`` and
    ``train_batch_size``, and ``"zero_allow_untested_optimizer": true`` unless
    ``config`` says otherwise; see ``merged_config``.

    Args:
        config: a DeepSpeed config as a dict (copied) or a JSON file path (read
            now); ``None``: only the fields below.
        zero_stage: ZeRO stage 1, 2 or 3; ``None``: the config's, else 2.
        offload_optimizer: keep optimizer state on the CPU
            (``zero_optimization.offload_optimizer.device = "cpu"``).
        offload_param: keep parameters on the CPU (ZeRO-3 only).
        gradient_clipping: clip the total gradient norm to this (> 0) at every
            step; ``None``: the config's, else no clipping.
        micro_batch_size: samples per micro-batch on one rank (DeepSpeed's
            ``train_micro_batch_size_per_gpu``, used for its throughput figures);
            ``None``: the config's, else 1.

    Raises:
        TypeError: a field of the wrong type, or a config that is not JSON.
        ValueError: an unreadable config file, a stage other than 1-3, offloaded
            parameters below stage 3, a clipping norm or batch size not > 0, or a
            field that disagrees with ``config``.
    """

    config: Mapping[str, Any] | str | os.PathLike[str] | None = None
    zero_stage: int | None = None
    offload_optimizer: bool | None = None
    offload_param: bool | None = None
    gradient_clipping: float | None = None
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        owner = "DeepSpeedOptions"
        read = {} if self.config is None else _read_config(self.config)
        object.__setattr__(self, "config", read)
        for name, kind in _FIELD_TYPES:
            check_type(owner, name, getattr(self, name), kind, optional=True)
        clip, micro = self.gradient_clipping, self.micro_batch_size
        if clip is not None and not (math.isfinite(clip) and clip > 0):
            fail_value(owner, "gradient_clipping", clip, _POSITIVE, _NO_CLIP)
        if micro is not None and micro < 1:
            fail_value(owner, "micro_batch_size", micro, ">= 1")
        zero = read.get("zero_optimization", {})
        if not isinstance(zero, dict):
            fail_value(owner, "config['zero_optimization']", zero, "an object")
        for field, key in _CONFIG_KEYS:
            _agree(owner, field, getattr(self, field), key, _configured(read, key))
        check_choice(owner, "the ZeRO stage", self.stage, _STAGES, hint=_NO_ZERO)
        if self._offload("offload_param") and self.stage != 3:
            fail_value(owner, "the ZeRO stage", self.stage, _OFFLOADS, _STAGE_3)

    @property
    def stage(self) -> int:
        """The ZeRO stage the engine gets: the field, the config's, else 2."""
        if self.zero_stage is not None:
            return self.zero_stage
        assert isinstance(self.config, dict)
        stage = self.config.get("zero_optimization", {}).get("stage", 2)
        assert isinstance(stage, int) or True  # checked in __post_init__
        return stage  # type: ignore[no-any-return]

    def _offload(self, name: str) -> bool:
        value = getattr(self, name)
        if value is not None:
            return bool(value)
        assert isinstance(self.config, dict)
        return _offloaded(self.config.get("zero_optimization", {}), name) or False


def _offloaded(zero: Mapping[str, Any], name: str) -> bool | None:
    section = zero.get(name)
    if section is None:
        return None
    if not isinstance(section, dict):
        return None
    return section.get("device", "none") not in ("none", None)


def _configured(config: dict[str, Any], key: str) -> object:
    """Return the value ``config`` sets at ``key`` (``"section.name"`` or ``"name"``)."""
    section, _, name = key.rpartition(".")
    if not section:
        return config.get(name)
    zero = config.get(section, {})
    return _offloaded(zero, name) if name.startswith("offload") else zero.get(name)


def _agree(owner: str, field: str, value: object, key: str, configured: object) -> None:
    if value is None or configured is None or value == configured:
        return
    msg = (
        f"{owner}: {field}={value!r} disagrees with the config's {key}="
        f"{configured!r}; remove one of them or make them equal."
    )
    raise ValueError(msg)


def _refuse_other(
    caller: str, key: str, configured: object, same: bool, known: object, source: str
) -> None:
    """Refuse a config value other than funcaccel's (``None`` or ``"auto"`` defer)."""
    if configured in (None, "auto") or same:
        return
    msg = (
        f"{caller}: the DeepSpeed config sets {key}={configured!r}, but {source} is "
        f"{known!r}; funcaccel never chooses between them silently: remove {key} "
        f"from the config or change {source}."
    )
    raise ValueError(msg)


def merged_config(
    caller: str, ctx: DistributedContext, options: DeepSpeedOptions, grad: GradState
) -> dict[str, Any]:
    """Return the DeepSpeed config of ``options`` merged with ``ctx`` and ``grad``.

    ``options`` is left unchanged. ``gradient_accumulation_steps`` becomes
    ``grad.accumulation_steps``; ``fp16.enabled`` / ``bf16.enabled`` follow
    ``ctx.mixed_precision``; ``train_batch_size`` is the micro-batch size times
    the accumulation steps times ``ctx.num_processes``; ``gradient_clipping`` is
    ``options.gradient_clipping``, else the config's, else 0 (no clipping; DeepSpeed's
    own default would clip to 1.0). A value already in the
    config that differs is an error naming both.

    Raises:
        ValueError: a config value that disagrees with ``grad``, ``ctx`` or
            the rest of the config.

    >>> from funcaccel.context import DistributedContext
    >>> cfg = merged_config("f", DistributedContext(), DeepSpeedOptions(zero_stage=3),
    ...                     GradState(accumulation_steps=2))
    >>> cfg["gradient_accumulation_steps"], cfg["zero_optimization"]["stage"]
    (2, 3)
    >>> merged_config("f", DistributedContext(),
    ...               DeepSpeedOptions(config={"gradient_accumulation_steps": 4}),
    ...               GradState(accumulation_steps=2))
    Traceback (most recent call last):
    ...
    ValueError: f: the DeepSpeed config sets gradient_accumulation_steps=4, but GradState.accumulation_steps is 2; funcaccel never chooses between them silently: remove gradient_accumulation_steps from the config or change GradState.accumulation_steps.
    """
    assert isinstance(options.config, dict)
    config: dict[str, Any] = json.loads(json.dumps(options.config))
    k, p, mp = grad.accumulation_steps, ctx.num_processes, ctx.mixed_precision
    steps = config.get("gradient_accumulation_steps")
    source = "GradState.accumulation_steps"
    _refuse_other(caller, "gradient_accumulation_steps", steps, steps == k, k, source)
    config["gradient_accumulation_steps"] = k
    for name in ("fp16", "bf16"):
        section, wanted = config.get(name, {}), mp == name
        if not isinstance(section, dict):
            fail_value(caller, f"the DeepSpeed config's {name}", section, "an object")
        on, key = section.get("enabled"), f"{name}.enabled"
        _refuse_other(caller, key, on, bool(on) == wanted, mp, "ctx.mixed_precision")
        config[name] = {**section, "enabled": wanted}
    micro = options.micro_batch_size or config.get("train_micro_batch_size_per_gpu")
    micro = 1 if micro in (None, "auto") else micro
    total, batch = micro * k * p, config.get("train_batch_size")
    source = f"micro-batch size x accumulation steps x processes ({micro} x {k} x {p})"
    _refuse_other(caller, "train_batch_size", batch, batch == total, total, source)
    config.update(train_micro_batch_size_per_gpu=micro, train_batch_size=total)
    config["zero_optimization"] = _zero_section(options, config)
    if options.gradient_clipping is not None:
        config["gradient_clipping"] = options.gradient_clipping
    # DeepSpeed's own default clips every step's norm to 1.0; funcaccel clips only
    # when asked (here or by accumulate_step's max_grad_norm), as on the DDP path.
    config.setdefault("gradient_clipping", 0.0)
    config.setdefault("zero_allow_untested_optimizer", True)
    return config


def _zero_section(options: DeepSpeedOptions, config: dict[str, Any]) -> dict[str, Any]:
    """Return the config's ``zero_optimization`` with the stage and offloads of ``options``."""
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = options.stage
    for name in ("offload_optimizer", "offload_param"):
        value = getattr(options, name)
        if value is not None and _offloaded(zero, name) is None:
            zero[name] = {"device": "cpu" if value else "none"}
    return zero
