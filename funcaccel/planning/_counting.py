"""What ``estimate_memory`` counts: held bytes, shard evenness, the tracker and its peak.

``held_bytes`` counts a rank's parameters, gradients and optimizer state tensor by
tensor (a ``DTensor`` by its local shard, a tied parameter once);
``build_tracker`` picks torch's memory tracker for the wrapped model and
``peak_parts`` names the parts of its peak snapshot. For ``device="cuda"``
each tensor's (each storage's) bytes are rounded up to CUDA's caching
allocator's 512-byte blocks: ``device_bytes`` for the held tensors,
``device_rounding`` for the tracker's storages during the step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any
from typing import Final

import torch
from torch import nn

from funcaccel._dist_types import is_fsdp_module

__all__ = [
    "DEVICE_KINDS",
    "build_tracker",
    "device_bytes",
    "device_rounding",
    "held_bytes",
    "is_uneven",
    "peak_parts",
    "tracking_repeated_calls",
]

DEVICE_KINDS: Final = ("cpu", "cuda")
"""The device kinds sizes are counted for."""

CUDA_BLOCK: Final = 512
"""CUDA's caching allocator hands out multiples of 512 bytes."""

_PARTS: Final = MappingProxyType(
    {
        "Sharded Param": "parameters (sharded)",
        "Unsharded Param": "parameters (gathered)",
        "Parameter": "parameters",
        "Buffer": "buffers",
        "Sharded Grad": "gradients (sharded)",
        "Unsharded Grad": "gradients (unsharded)",
        "Gradient": "gradients",
        "OptState": "optimizer state",
        "Optstate": "optimizer state",
        "All Gather": "all-gather buffers",
        "Reduce Scatter": "reduce-scatter buffers",
        "Activation": "activations",
        "Inputs": "inputs",
        "Temp": "temporaries",
        "Other": "other",
    }
)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = getattr(tensor, "to_local", None)
    return local() if callable(local) else tensor


def device_bytes(nbytes: int, device: str) -> int:
    """One tensor's ``nbytes`` as ``device`` allocates them.

    >>> device_bytes(4, "cpu"), device_bytes(4, "cuda"), device_bytes(512, "cuda")
    (4, 512, 512)
    """
    if device == "cuda":
        return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
    return nbytes


@contextlib.contextmanager
def device_rounding(device: str) -> Iterator[None]:
    """Within: torch's memory trackers count each storage as ``device`` allocates it.

    The trackers round a storage only when it lives on a CUDA device; the fake
    tensors live on the CPU, so for ``"cuda"`` their per-storage count is
    replaced (and restored on exit) by one that rounds up to 512 bytes.
    """
    if device != "cuda":
        yield
        return
    from torch.distributed._tools.mem_tracker import _WeakRefInfo

    original = _WeakRefInfo._calculate_mem_consumed

    def rounded(info: _WeakRefInfo) -> int:
        return device_bytes(int(info.size * info.element_size), "cuda")

    _WeakRefInfo._calculate_mem_consumed = rounded  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _WeakRefInfo._calculate_mem_consumed = original  # type: ignore[method-assign]


def _nbytes(tensors: Iterable[torch.Tensor], device: str) -> int:
    """The local bytes of ``tensors``, each (tied parameters: one object) once."""
    unique = {id(tensor): tensor for tensor in tensors}
    return sum(
        device_bytes(_local(tensor).numel() * _local(tensor).element_size(), device)
        for tensor in unique.values()
    )


def held_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: str = "cpu"
) -> tuple[int, int, int]:
    """This rank's parameters, their gradients (one per trainable parameter) and
    the optimizer's state tensors, in bytes as ``device`` allocates them."""
    params = list(model.parameters())  # tied parameters once
    grads = _nbytes((p for p in params if p.requires_grad), device)
    state = [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    return _nbytes(params, device), grads, _nbytes(state, device)


def is_uneven(model: nn.Module) -> bool:
    """Whether some parameter's shards differ in size across ranks."""
    for param in model.parameters():
        spec = getattr(param, "_spec", None)
        if spec is None:
            continue
        parts = math.prod(
            spec.mesh.size(dim)
            for dim, placement in enumerate(spec.placements)
            if getattr(placement, "dim", None) is not None  # Shard, _StridedShard
        )
        if _local(param).numel() * parts != param.numel():
            return True
    return False


def build_tracker(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: object
) -> Any:
    module: nn.Module = model  # is_fsdp_module narrows to FSDPModule alone
    if is_fsdp_module(model):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        sharded = FSDPMemTracker(module, optimizer)
        sharded.track_inputs((batch,))
        return sharded
    from torch.distributed._tools.mem_tracker import MemTracker

    plain = MemTracker()
    plain.track_external(module, optimizer)
    return plain


@contextlib.contextmanager
def tracking_repeated_calls(tracker: Any, roots: Iterable[nn.Module]) -> Iterator[None]:
    """Within (entered before ``tracker``): ``roots`` may run forward several times.

    torch's trackers refuse a root module's second forward (they keep one
    iteration's per-module stats), but a pipeline schedule runs its stage once
    per micro-batch. A global forward pre-hook, registered before the
    tracker's own (global hooks run in registration order), forgets the
    root's per-module stats before each forward; the tracker's peak, kept
    apart, is unchanged.
    """
    from torch.nn.modules.module import register_module_forward_pre_hook

    watched = {id(root) for root in roots}
    if not watched:
        yield
        return

    def forget(module: nn.Module, args: object) -> None:
        del args  # only which module runs matters
        if id(module) in watched:
            tracker.memory_tracking.pop(module, None)

    handle = register_module_forward_pre_hook(forget)
    try:
        yield
    finally:
        handle.remove()


def peak_parts(tracker: Any) -> dict[str, int]:
    parts: dict[str, int] = {}
    for per_device in tracker.get_tracker_snapshot("peak").values():
        for kind, count in per_device.items():
            if kind == "Total":
                continue
            name = _PARTS.get(getattr(kind, "value", str(kind)), str(kind))
            parts[name] = parts.get(name, 0) + int(count)
    return parts
