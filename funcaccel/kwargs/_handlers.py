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
from funcaccel._checks import check_choice
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._checks import is_bool
from funcaccel._checks import is_int
from funcaccel._checks import is_real
from funcaccel.kwargs._base import KwargsHandler
from funcaccel.kwargs._base import check_flags

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
# The hooks that can wrap PowerSGD, in the order the error message lists them.
_WRAPPERS: Final = ("no", "fp16", "bf16")
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


_DDP_FLAGS: Final = (
    "broadcast_buffers",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
)
_HOOK_NAMES: Final = tuple(hook.value for hook in DDPCommunicationHookType)
_STATE_KEYS: Final = tuple(POWER_SGD_STATE_KEYS)
_POWER_SGD: Final = "'power_sgd' or 'batched_power_sgd'"
_NO_WRAPPER: Final = (
    "Only the PowerSGD hooks take a wrapper; else keep comm_wrapper='no'."
)
_ONLY_POWER_SGD: Final = "Only the PowerSGD hooks read it."
_FEEDBACK_START: Final = "> 1 when use_error_feedback or warm_start is true"
_START_FIX: Final = "Set both to False, or start later."


def _as_hook(owner: str, name: str, value: object) -> DDPCommunicationHookType:
    # str() gives a member's value (the enum's __str__), so both spellings pass.
    text = str(check_type(owner, name, value, str))
    return DDPCommunicationHookType(check_choice(owner, name, text, _HOOK_NAMES))


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
            fail_value(owner, "dim", self.dim, "an int >= 0")
        check_type(
            owner,
            "bucket_cap_mb",
            self.bucket_cap_mb,
            (int, float),
            what="a number (MB)",
        )
        if not self.bucket_cap_mb > 0:
            fail_value(owner, "bucket_cap_mb", self.bucket_cap_mb, "a number > 0")
        check_flags(owner, self, _DDP_FLAGS)
        hook = _as_hook(owner, "comm_hook", self.comm_hook)
        wrapper = _as_hook(owner, "comm_wrapper", self.comm_wrapper)
        check_choice(owner, "comm_wrapper", wrapper.value, _WRAPPERS)
        if wrapper is not DDPCommunicationHookType.NO and hook not in _POWER_SGD_HOOKS:
            what = f"{_POWER_SGD} when comm_wrapper={wrapper.value!r}"
            fail_value(owner, "comm_hook", hook.value, what, _NO_WRAPPER)
        check_type(
            owner,
            "comm_state_option",
            self.comm_state_option,
            Mapping,
            what="a mapping",
        )
        options = dict(self.comm_state_option)
        if options and hook not in _POWER_SGD_HOOKS:
            what = f"empty with comm_hook={hook.value!r}"
            fail_value(owner, "comm_state_option", options, what, _ONLY_POWER_SGD)
        _check_power_sgd_options(owner, options)
        object.__setattr__(self, "comm_hook", hook)
        object.__setattr__(self, "comm_wrapper", wrapper)
        object.__setattr__(self, "comm_state_option", options)


def _check_power_sgd_options(owner: str, options: Mapping[str, Any]) -> None:
    for key, value in options.items():
        check_choice(owner, "every key of comm_state_option", key, _STATE_KEYS)
        kind = POWER_SGD_STATE_KEYS[key]
        ok = {"int": is_int, "real": is_real, "bool": is_bool}[kind](value)
        if not ok or (kind != "bool" and value < 0):
            what = "a bool" if kind == "bool" else "a number >= 0"
            fail_value(owner, f"comm_state_option[{key!r}]", value, what)
    rank = options.get("matrix_approximation_rank", 1)
    if rank < 1:
        fail_value(
            owner, "comm_state_option['matrix_approximation_rank']", rank, ">= 1"
        )
    start = options.get("start_powerSGD_iter", 1000)
    feedback = options.get("use_error_feedback", True) or options.get(
        "warm_start", True
    )
    if feedback and start <= 1:
        fail_value(owner, "start_powerSGD_iter", start, _FEEDBACK_START, _START_FIX)


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
        scale, growth, backoff = (
            self.init_scale,
            self.growth_factor,
            self.backoff_factor,
        )
        if not is_real(scale) or not (math.isfinite(scale) and scale > 0):
            fail_value(owner, "init_scale", scale, "a finite number > 0")
        if not is_real(growth) or not (math.isfinite(growth) and growth > 1.0):
            fail_value(owner, "growth_factor", growth, "> 1.0", "Use e.g. 2.0.")
        if not is_real(backoff) or not 0.0 < backoff < 1.0:
            fail_value(owner, "backoff_factor", backoff, "in (0, 1)", "Use e.g. 0.5.")
        if not is_int(self.growth_interval) or self.growth_interval < 1:
            fail_value(owner, "growth_interval", self.growth_interval, "an int >= 1")
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
            value = check_type(owner, name, getattr(self, name), str, optional=True)
            if value == "":
                fail_value(
                    owner, name, value, "non-empty", "Pass None for the default."
                )
        hint = "Use e.g. timedelta(seconds=600)."
        what = "a datetime.timedelta or None"
        timeout = check_type(
            owner,
            "timeout",
            self.timeout,
            timedelta,
            what=what,
            hint=hint,
            optional=True,
        )
        if timeout is not None and timeout <= timedelta(0):
            fail_value(owner, "timeout", timeout, "positive")
