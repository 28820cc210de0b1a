"""What ``context_from_env`` and ``build_context`` read from outside the process.

torchrun's variables come from the ``environ`` mapping the caller passes (nothing
here reads ``os.environ`` on its own); ``check_mixed_precision`` asks torch whether
the chosen device can run the mode, so the failure names the device instead of
surfacing in the first forward pass.

>>> env_int({"WORLD_SIZE": "2", "RANK": "1"}, "RANK")
1
>>> rendezvous_init_method(InitProcessGroupKwargs(), {"MASTER_ADDR": "h", "MASTER_PORT": "1"})
'tcp://h:1'
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Final
from typing import Literal
from typing import TypeAlias

import torch

from funcaccel._checks import check_choice
from funcaccel._checks import check_duration
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._typing import MIXED_PRECISION_MODES
from funcaccel.kwargs import InitProcessGroupKwargs

__all__ = [
    "CollectiveTimeout",
    "check_collective_timeout",
    "check_mixed_precision",
    "check_mode",
    "env_int",
    "rendezvous_init_method",
]

# How long funcaccel's collectives wait for every rank: a duration, None (the
# process group's own timeout) or "off".
CollectiveTimeout: TypeAlias = timedelta | float | Literal["off"] | None

_FROM_ENV: Final = "context_from_env"
_FIX_RDZV: Final = (
    "Launch with torchrun or pass InitProcessGroupKwargs(init_method=...)."
)


def check_collective_timeout(caller: str, value: object) -> timedelta | str | None:
    """Return ``value`` as a positive ``timedelta``, ``"off"`` or ``None``.

    >>> check_collective_timeout("f", 2), check_collective_timeout("f", "off")
    (datetime.timedelta(seconds=2), 'off')
    """
    if value == "off" and isinstance(value, str):
        return "off"
    name = "collective_timeout"
    if isinstance(value, str):
        what = "a datetime.timedelta, a number of seconds, None (the process group's timeout) or 'off'"
        fail_type(caller, name, value, what)
    if isinstance(value, float) and not math.isfinite(value):
        hint = (
            "Pass 'off' to turn the check off, or None for the process group's timeout."
        )
        fail_value(caller, name, value, "a finite number of seconds", hint)
    return check_duration(caller, "collective_timeout", value)


def env_int(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name)
    if raw is None:
        msg = (
            f"context_from_env: {name} is not set but WORLD_SIZE={environ.get('WORLD_SIZE')!r}; "
            "launch with torchrun, which sets RANK, WORLD_SIZE and LOCAL_RANK."
        )
        raise ValueError(msg)
    try:
        return int(raw)
    except ValueError:
        msg = f"context_from_env: {name} must be an integer; got {raw!r}."
        raise ValueError(msg) from None


def check_mode(caller: str, value: object) -> None:
    """Check that ``value`` is one of the mixed-precision modes ``"no"``, ``"fp16"``, ``"bf16"``."""
    hint = "fp8 is not supported." if value == "fp8" else ""
    check_choice(caller, "mixed_precision", value, MIXED_PRECISION_MODES, hint=hint)


def check_mixed_precision(mixed_precision: str, device: torch.device) -> None:
    """Check the mode, and that ``device`` can run it (no silent fp32 fallback)."""
    check_mode("context_from_env", mixed_precision)
    problem, fix = _unsupported(mixed_precision, device)
    what, where = f"a mode {device} runs with torch {torch.__version__}", _FROM_ENV
    if problem is not None:
        fail_value(where, "mixed_precision", mixed_precision, what, problem + fix)


def _unsupported(mode: str, device: torch.device) -> tuple[str | None, str]:
    """Return why ``device`` cannot run ``mode`` (``None`` if it can) and the fix."""
    if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        return f"{name} has no bfloat16", "; use mixed_precision='fp16' or 'no'."
    problem = _cpu_fp16_problem() if mode == "fp16" and device.type == "cpu" else None
    why = None if problem is None else f"CPU float16 autocast fails here ({problem})"
    return why, "; use mixed_precision='bf16' or 'no'."


def _cpu_fp16_problem() -> str | None:
    if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):
        return "torch.amp.GradScaler is missing"
    try:
        torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.ones(2, 2) @ torch.ones(2, 2)
    except (RuntimeError, TypeError, ValueError) as error:
        return str(error)
    if out.dtype != torch.float16:
        return f"autocast produced {out.dtype}, not torch.float16"
    return None


def rendezvous_init_method(
    kwargs: InitProcessGroupKwargs, environ: Mapping[str, str]
) -> str:
    """The rendezvous: the handler's, else MASTER_ADDR/MASTER_PORT from ``environ``.

    Reading ``os.environ`` itself, torch's ``env://`` also joins the store that
    torchrun's agent keeps; for any other mapping the address is spelled out.
    """
    if kwargs.init_method is not None:
        return kwargs.init_method
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in environ]
    name = "the default rendezvous's " + " and ".join(missing)
    if missing:
        fail_value("build_context", name, None, "set in the environment", _FIX_RDZV)
    if environ is os.environ:
        return "env://"
    return f"tcp://{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
