"""Frozen option records ("kwargs handlers") that feed torch constructors.

Each handler is a keyword-only frozen dataclass validated on construction, so a bad
value fails where it is written, not deep inside torch. ``to_kwargs()`` returns a
fresh dict holding only the fields whose value differs from the declared default,
ready to be splatted into the torch call the handler feeds. The base,
``KwargsHandler``, is in ``_base.py`` and ``ProfileKwargs`` in ``_profile.py``;
``funcaccel.kwargs`` exports all of them.

>>> GradScalerKwargs(init_scale=1024).to_kwargs()
{'init_scale': 1024}
>>> DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16").to_kwargs()
{'find_unused_parameters': True}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from datetime import timedelta
from enum import Enum
from types import MappingProxyType
from typing import Any
from typing import ClassVar
from typing import Final

from funcaccel._checks import check_bool
from funcaccel._checks import is_bool
from funcaccel._checks import is_int
from funcaccel._checks import is_real
from funcaccel._checks import summary
from funcaccel._checks import type_name
from funcaccel.kwargs._base import KwargsHandler

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AutocastKwargs(KwargsHandler):
    """Options for ``torch.autocast`` (used by ``autocast_ctx``).

    Args:
        enabled: whether autocast is active inside the context.
        cache_enabled: torch's weight-cast cache; ``None`` keeps torch's default.
    """

    enabled: bool = True
    cache_enabled: bool | None = None

    def __post_init__(self) -> None:
        check_bool("AutocastKwargs", "enabled", self.enabled)
        if self.cache_enabled is not None:
            check_bool("AutocastKwargs", "cache_enabled", self.cache_enabled)


class DDPCommunicationHookType(str, Enum):
    """DDP gradient communication hooks (and compression wrappers) by name."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


_POWER_SGD_HOOKS: Final = frozenset(
    {DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD}
)
_WRAPPERS: Final = frozenset(
    {
        DDPCommunicationHookType.NO,
        DDPCommunicationHookType.FP16,
        DDPCommunicationHookType.BF16,
    }
)
# The keyword arguments of torch's PowerSGDState (besides process_group), with the
# kind of value each takes: "int" (>= 0), "real" (>= 0) or "bool".
POWER_SGD_STATE_KEYS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "matrix_approximation_rank": "int",
        "start_powerSGD_iter": "int",
        "min_compression_rate": "real",
        "use_error_feedback": "bool",
        "warm_start": "bool",
        "orthogonalization_epsilon": "real",
        "random_seed": "int",
        "compression_stats_logging_frequency": "int",
        "batch_tensors_with_same_shape": "bool",
    }
)


def _as_hook(owner: str, name: str, value: object) -> DDPCommunicationHookType:
    valid = ", ".join(repr(h.value) for h in DDPCommunicationHookType)
    if not isinstance(value, str):
        msg = (
            f"{owner}: {name} must be a str; got {summary(value)} ({type_name(value)})."
        )
        raise TypeError(msg)
    try:
        return DDPCommunicationHookType(value)
    except ValueError:
        msg = f"{owner}: {name} must be one of {valid}; got {summary(value)}."
        raise ValueError(msg) from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DistributedDataParallelKwargs(KwargsHandler):
    """Options for ``DistributedDataParallel`` and its communication hook.

    ``comm_hook`` / ``comm_wrapper`` take a ``DDPCommunicationHookType`` or its
    string value (stored as the enum member, which compares equal to the string);
    they and ``comm_state_option`` are used by ``wrap_model`` to register a hook and
    never appear in ``to_kwargs()``.

    >>> DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="fp16").comm_wrapper
    <DDPCommunicationHookType.FP16: 'fp16'>
    """

    _NOT_FORWARDED: ClassVar[frozenset[str]] = frozenset(
        {"comm_hook", "comm_wrapper", "comm_state_option"}
    )

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int | float = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        owner = "DistributedDataParallelKwargs"
        if not is_int(self.dim) or self.dim < 0:
            msg = f"{owner}: dim must be an int >= 0; got {summary(self.dim)}."
            raise ValueError(msg)
        if not is_real(self.bucket_cap_mb):
            msg = (
                f"{owner}: bucket_cap_mb must be a number (MB); got "
                f"{summary(self.bucket_cap_mb)} ({type_name(self.bucket_cap_mb)})."
            )
            raise TypeError(msg)
        if not self.bucket_cap_mb > 0:
            msg = f"{owner}: bucket_cap_mb must be a number > 0; got {summary(self.bucket_cap_mb)}."
            raise ValueError(msg)
        for name in (
            "broadcast_buffers",
            "find_unused_parameters",
            "check_reduction",
            "gradient_as_bucket_view",
            "static_graph",
        ):
            check_bool(owner, name, getattr(self, name))
        hook = _as_hook(owner, "comm_hook", self.comm_hook)
        wrapper = _as_hook(owner, "comm_wrapper", self.comm_wrapper)
        if wrapper not in _WRAPPERS:
            msg = (
                f"{owner}: comm_wrapper must be one of 'no', 'fp16', 'bf16'; "
                f"got {wrapper.value!r}."
            )
            raise ValueError(msg)
        if wrapper is not DDPCommunicationHookType.NO and hook not in _POWER_SGD_HOOKS:
            msg = (
                f"{owner}: comm_wrapper={wrapper.value!r} needs comm_hook 'power_sgd' "
                f"or 'batched_power_sgd'; got comm_hook={hook.value!r}."
            )
            raise ValueError(msg)
        if not isinstance(self.comm_state_option, Mapping):
            msg = (
                f"{owner}: comm_state_option must be a mapping; got "
                f"{summary(self.comm_state_option)} ({type_name(self.comm_state_option)})."
            )
            raise TypeError(msg)
        options = dict(self.comm_state_option)
        if options and hook not in _POWER_SGD_HOOKS:
            msg = (
                f"{owner}: comm_state_option is only used by the PowerSGD hooks; "
                f"got comm_hook={hook.value!r}."
            )
            raise ValueError(msg)
        _check_power_sgd_options(owner, options)
        object.__setattr__(self, "comm_hook", hook)
        object.__setattr__(self, "comm_wrapper", wrapper)
        object.__setattr__(self, "comm_state_option", options)


def _check_power_sgd_options(owner: str, options: Mapping[str, Any]) -> None:
    for key, value in options.items():
        kind = POWER_SGD_STATE_KEYS.get(key)
        if kind is None:
            valid = ", ".join(POWER_SGD_STATE_KEYS)
            msg = (
                f"{owner}: unknown comm_state_option key {key!r}; valid keys: {valid}."
            )
            raise ValueError(msg)
        ok = {"int": is_int, "real": is_real, "bool": is_bool}[kind](value)
        if not ok or (kind != "bool" and value < 0):
            msg = (
                f"{owner}: comm_state_option[{key!r}] must be "
                f"{'a bool' if kind == 'bool' else 'a number >= 0'}; got {summary(value)}."
            )
            raise ValueError(msg)
    if options.get("matrix_approximation_rank", 1) < 1:
        msg = (
            f"{owner}: comm_state_option['matrix_approximation_rank'] must be >= 1; "
            f"got {summary(options['matrix_approximation_rank'])}."
        )
        raise ValueError(msg)
    start = options.get("start_powerSGD_iter", 1000)
    feedback = options.get("use_error_feedback", True) or options.get(
        "warm_start", True
    )
    if feedback and start <= 1:
        msg = (
            f"{owner}: start_powerSGD_iter must be > 1 when use_error_feedback or "
            f"warm_start is true; got {start}."
        )
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GradScalerKwargs(KwargsHandler):
    """Options for ``torch.amp.GradScaler`` (built by ``build_grad_scaler``)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        owner = "GradScalerKwargs"
        if not is_real(self.init_scale) or not (
            math.isfinite(self.init_scale) and self.init_scale > 0
        ):
            msg = f"{owner}: init_scale must be a finite number > 0; got {summary(self.init_scale)}."
            raise ValueError(msg)
        if not is_real(self.growth_factor) or not (
            math.isfinite(self.growth_factor) and self.growth_factor > 1.0
        ):
            msg = (
                f"{owner}: growth_factor must be > 1.0; got {summary(self.growth_factor)}. "
                "Use e.g. 2.0."
            )
            raise ValueError(msg)
        if not is_real(self.backoff_factor) or not 0.0 < self.backoff_factor < 1.0:
            msg = (
                f"{owner}: backoff_factor must be in (0, 1); got "
                f"{summary(self.backoff_factor)}. Use e.g. 0.5."
            )
            raise ValueError(msg)
        if not is_int(self.growth_interval) or self.growth_interval < 1:
            msg = (
                f"{owner}: growth_interval must be an int >= 1; got "
                f"{summary(self.growth_interval)}."
            )
            raise ValueError(msg)
        check_bool(owner, "enabled", self.enabled)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class InitProcessGroupKwargs(KwargsHandler):
    """Options for ``torch.distributed.init_process_group`` (used by ``build_context``).

    The default backend ``"nccl"`` becomes ``"gloo"`` on a CPU context; a ``None``
    timeout becomes 600 s for NCCL and 1800 s for other backends (see
    ``effective_backend`` / ``effective_timeout`` in ``funcaccel.context``).
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        owner = "InitProcessGroupKwargs"
        for name in ("backend", "init_method"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                msg = f"{owner}: {name} must be a str or None; got {summary(value)} ({type_name(value)})."
                raise TypeError(msg)
            if value == "":
                msg = f"{owner}: {name} must not be empty; pass None for the default."
                raise ValueError(msg)
        if self.timeout is not None:
            if not isinstance(self.timeout, timedelta):
                msg = (
                    f"{owner}: timeout must be a datetime.timedelta or None; got "
                    f"{summary(self.timeout)} ({type_name(self.timeout)}). Use e.g. "
                    "timedelta(seconds=600)."
                )
                raise TypeError(msg)
            if self.timeout <= timedelta(0):
                msg = f"{owner}: timeout must be positive; got {summary(self.timeout)}."
                raise ValueError(msg)
