"""The device a context computes on when the caller names it: ``device=``.

``context_from_env`` and ``build_context`` take ``device`` as a device
(``"cuda:1"``, ``torch.device("cpu")``) or as a rule from the local rank to a
device (``lambda local_rank: f"cuda:{local_rank + 2}"``). Everything is checked
against what this machine has and against the run's layout before a context is
built: a CUDA device needs CUDA and an index below ``torch.cuda.device_count()``,
``cpu=True`` admits only the CPU, and with the NCCL backend the processes of one
machine need a CUDA device each. ``"cuda"`` without an index is the default
rule's GPU, ``cuda:<LOCAL_RANK % device_count>``; ``"cpu:0"`` is the CPU.

>>> resolve_device("f", "cpu:0", cpu=False, local_rank=0)
device(type='cpu')
>>> resolve_device("f", lambda local_rank: "cpu", cpu=True, local_rank=1)
device(type='cpu')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final
from typing import TypeAlias

import torch

from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import is_int
from funcaccel._checks import summary

__all__ = [
    "DeviceChoice",
    "check_local_devices",
    "resolve_device",
]

DeviceChoice: TypeAlias = (
    str | torch.device | Callable[[int], str | torch.device] | None
)
"""``device=``: a device, a rule from the local rank to one, or ``None`` (default)."""

_WHAT: Final = (
    "a device such as 'cpu', 'cuda' or 'cuda:1', a torch.device, or a rule "
    "local_rank -> device"
)
_RULE_HINT: Final = (
    "Pass a rule by local rank, e.g. device=lambda local_rank: f'cuda:{local_rank}'"
)


def resolve_device(
    caller: str, device: object, *, cpu: bool, local_rank: int
) -> torch.device:
    """Return the ``torch.device`` that ``device`` names for ``local_rank``, checked.

    Raises:
        TypeError: ``device`` (or what its rule returned) is not a str,
            ``torch.device`` or callable.
        ValueError: a device string torch cannot parse, a device type other than
            ``cpu`` and ``cuda``, CUDA where it is not available, an index beyond
            the visible GPUs, a CPU index other than 0, or a CUDA device with
            ``cpu=True``.
    """
    if callable(device) and not isinstance(device, (str, torch.device)):
        name = f"device({local_rank})"
        return _checked(
            caller, name, device(local_rank), cpu=cpu, local_rank=local_rank
        )
    return _checked(caller, "device", device, cpu=cpu, local_rank=local_rank)


def check_local_devices(
    caller: str,
    device: object,
    *,
    cpu: bool,
    local_world: int,
    backend: str | None,
) -> None:
    """Check the devices of this machine's ``local_world`` processes together.

    Every local rank's device is resolved as that rank would resolve it (the
    same ``device`` is passed on each): they must be of one type, and with the
    NCCL backend no two may share a GPU.
    """
    devices = [
        resolve_device(caller, device, cpu=cpu, local_rank=rank)
        for rank in range(local_world)
    ]
    by_rank = [str(d) for d in devices]
    if len({d.type for d in devices}) > 1:
        what = "of one type on every process of this machine"
        fix = f"{_RULE_HINT} that returns one kind of device."
        fail_value(caller, "device (by local rank)", by_rank, what, fix)
    if backend == "nccl" and len(set(by_rank)) < len(by_rank):
        what = (
            f"a different GPU for each of the {local_world} processes on this "
            "machine with the NCCL backend"
        )
        fix = f"{_RULE_HINT}, or InitProcessGroupKwargs(backend='gloo') to share a GPU."
        fail_value(caller, "device (by local rank)", by_rank, what, fix)


def _checked(
    caller: str, name: str, value: object, *, cpu: bool, local_rank: int
) -> torch.device:
    if isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError:
            fail_value(caller, name, value, _WHAT)
    elif isinstance(value, torch.device):
        device = value
    else:
        fail_type(caller, name, value, _WHAT)
    shown = summary(value)
    if device.type == "cpu":
        if device.index not in (None, 0):
            fail_value(caller, name, value, "the CPU: 'cpu' or 'cpu:0'", "Pass 'cpu'.")
        return torch.device("cpu")
    if device.type != "cuda":
        hint = "funcaccel computes on the CPU or on CUDA GPUs."
        fail_value(caller, name, value, "a 'cpu' or 'cuda' device", hint)
    if cpu:
        what = "a CPU device when cpu=True"
        fix = f"Pass cpu=True without a device, or device={shown} without cpu=True."
        fail_value(caller, name, value, what, fix)
    if not torch.cuda.is_available():
        what = "a device this machine has: 'cpu' (torch.cuda.is_available() is False)"
        fix = "Pass device='cpu', or run where a CUDA GPU is visible."
        fail_value(caller, name, value, what, fix)
    count = torch.cuda.device_count()
    index = device.index
    if index is None:
        return torch.device("cuda", local_rank % count)
    assert is_int(index)
    if index >= count:
        what = f"one of the {count} visible GPU(s), cuda:0 to cuda:{count - 1}"
        fix = "CUDA_VISIBLE_DEVICES renumbers the GPUs a process sees from 0."
        fail_value(caller, name, value, what, fix)
    return device
