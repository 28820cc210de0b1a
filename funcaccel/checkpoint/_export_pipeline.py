"""The whole model of a ``Pipeline``, gathered from its stages, for ``save_model``.

Each rank of a pipeline holds its stages only (sharded by FSDP2 or tensor
parallelism inside them). ``whole_model`` makes every tensor whole
(``full_tensor``, a collective over the stage's data- and tensor-parallel ranks),
gathers the stages over the pipeline ranks and returns, on every rank, a module
holding the whole model's state under its original names (``layers.2.weight``),
in the order of the model's units. ``save_model`` then exports it as any
unsharded model; every rank holds the whole state on the CPU for that time.

With ``pp=2``: rank 0 holds ``embed.*``, ``layers.0.*``; rank 1 ``layers.1.*``,
``head.*``; both get all four groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from funcaccel._dist_types import is_dtensor
from funcaccel.checkpoint._dcp_names import original_name
from funcaccel.model import Pipeline

__all__ = ["whole_model"]


def whole_model(pipe: Pipeline) -> nn.Module:
    """Return a module of buffers holding ``pipe``'s whole model state (collective)."""
    local: dict[str, torch.Tensor] = {}
    for module in pipe.stage_modules:
        for name, value in module.state_dict().items():
            full = value.full_tensor() if is_dtensor(value) else value
            local[original_name(name)] = full.detach().cpu()
    device_mesh = pipe.mesh.device_mesh
    assert device_mesh is not None
    parts: list[dict[str, torch.Tensor] | None] = [None] * pipe.mesh.pp
    dist.all_gather_object(parts, local, group=device_mesh["pp"].get_group())
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        assert part is not None
        merged.update(part)
    root = nn.Module()
    units = [unit for stage in pipe.unit_names for unit in stage]
    for unit in units:  # the model's order: stage 0's units first
        for name in merged:
            if name.startswith(unit + "."):
                _put(root, name, merged[name])
    return root


def _put(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` as the buffer ``name`` (dotted), creating the parents."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_buffer(leaf, tensor)
