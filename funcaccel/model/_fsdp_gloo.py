"""FSDP2's gradient reduce-scatter on gloo (CPU) without two extra full-size buffers.

In backward, FSDP2 copies each unit's unsharded gradients into one flat
reduce-scatter input (the unit's full gradient size), reduce-scatters it into
this rank's shard and then, by default, on every device:

* gloo implements ``reduce_scatter_tensor`` as a **clone** of that input,
  all-reduced, of which each rank copies its own chunk: a second buffer of the
  input's size for the length of the collective;
* FSDP2 keeps the input alive until the *next* unit's post-backward (at least one
  is kept: ``set_reduce_scatter_max_input_buffers`` accepts no less than 1), so
  that CUDA's caching allocator does not hand its block to a kernel on another
  stream while the collective may still be reading it. On CPU there are no
  streams, the gloo collective has finished when the call returns, and the kept
  buffer only adds to the next unit's backward, when that unit's unsharded
  parameters and gradients and the next all-gather are alive too.

``GlooReduceScatter`` is installed by ``wrap_model`` on every FSDP2 unit whose
group runs gloo on CPU (``FSDPModule.set_custom_reduce_scatter``). It all-reduces
FSDP2's input **in place** (the buffer is FSDP2's scratch, allocated for this
collective alone and not read afterwards), copies this rank's chunk into the
output, and then releases the input's storage. The traffic and the arithmetic are
gloo's own (an all-reduce with the same op, then the rank's chunk), so the
gradients are bitwise the same; at the backward peak a rank holds two buffers of
the largest unit's gradient size less. Any other case (an async call, another
backend or device) is passed to torch's default reduce-scatter unchanged.

With 2 ranks and a unit whose flat gradient has 8 elements: rank 0's input
``[a0..a7]`` and rank 1's ``[b0..b7]`` are all-reduced in place to
``[(a0+b0)/2, ..., (a7+b7)/2]`` (``op=AVG``, as FSDP2 asks for float32), rank 0
copies elements 0-3 into its output and rank 1 elements 4-7, and both inputs then
hold no storage.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from funcaccel._dist_types import is_fsdp_module

__all__ = ["gloo_reduce_scatter_class", "install_gloo_reduce_scatter"]


@functools.cache
def gloo_reduce_scatter_class() -> type[Any] | None:
    """Return the ``GlooReduceScatter`` class, or ``None`` where this torch lacks
    FSDP2's custom reduce-scatter (then FSDP2's default is kept)."""
    try:
        # FSDP2's default reduce-scatter, which ``GlooReduceScatter`` extends and
        # falls back to; torch offers it under this module only.
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultReduceScatter,
        )
    except ImportError:  # pragma: no cover - torch without custom comms
        return None

    class GlooReduceScatter(DefaultReduceScatter):
        """FSDP2's reduce-scatter, done in place and released at once on gloo (CPU)."""

        # FSDP2's interface (``ReduceScatter``) returns ``Work | None``, which
        # torch's default narrows to ``Work``; FSDP2 ignores the value.
        def __call__(  # type: ignore[override]
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: dist.ReduceOp | dist.ReduceOp.RedOpType,
            async_op: bool = False,
        ) -> dist.Work | None:
            if (
                async_op
                or input_tensor.device.type != "cpu"
                or dist.get_backend(group) != "gloo"
            ):
                work: dist.Work | None = super().__call__(
                    output_tensor, input_tensor, group, op, async_op
                )
                return work
            # What gloo's reduce_scatter_tensor does, on FSDP2's own scratch
            # buffer instead of a clone of it.
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
            # The collective is over: nothing reads the input again, although
            # FSDP2 keeps a reference to it until the next unit's post-backward.
            input_tensor.untyped_storage().resize_(0)
            return None

    return GlooReduceScatter


def install_gloo_reduce_scatter(
    model: nn.Module, device: torch.device, groups: Sequence[dist.ProcessGroup]
) -> int:
    """Give every FSDP2 unit of ``model`` the ``GlooReduceScatter``, on CPU with gloo.

    ``groups`` are the process groups of the mesh the units shard over; nothing is
    installed unless ``device`` is the CPU and every group runs gloo (the class
    falls back to torch's default per call anyway).

    Returns:
        How many units received it.
    """
    cls = gloo_reduce_scatter_class()
    if cls is None or device.type != "cpu":
        return 0
    if not all(dist.get_backend(group) == "gloo" for group in groups):
        return 0
    comm = cls()
    count = 0
    for module in model.modules():
        setter = getattr(module, "set_custom_reduce_scatter", None)
        if is_fsdp_module(module) and callable(setter):
            setter(comm)
            count += 1
    return count
