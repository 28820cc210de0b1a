"""A fake world in this process: torch's ``"fake"`` process group and fake tensors.

``fake_world_ctx(caller, world_size, rank)`` starts the default group with
torch's fake backend (every collective returns at once, nothing is sent), yields
the ``DistributedContext`` of rank ``rank`` in it, and destroys the group on the
way out, whatever happened. ``fake_tensor_mode()`` is torch's ``FakeTensorMode``
that lets plain CPU tensors compute for real: a ``DeviceMesh`` keeps its rank
layout in small integer tensors and reads them back (``nonzero``, ``tolist``),
which fake tensors cannot answer; every tensor born in the mode (parameters,
activations, optimizer state) is still fake, with no storage.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from funcaccel._group import end_process_group
from funcaccel._typing import MixedPrecision
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType

__all__ = ["fake_tensor_mode", "fake_world_ctx"]


@contextmanager
def fake_world_ctx(
    caller: str,
    world_size: int,
    rank: int,
    *,
    mixed_precision: MixedPrecision = "no",
) -> Iterator[DistributedContext]:
    """Start a fake default group of ``world_size``; yield rank ``rank``'s context.

    Raises:
        RuntimeError: a default process group is already initialised in this
            process (the fake group would replace it): plan before
            ``build_context()``, or in another process.
    """
    if dist.is_available() and dist.is_initialized():
        msg = (
            f"{caller}: a default process group is already initialised in this "
            f"process (world_size={dist.get_world_size()}, backend "
            f"{dist.get_backend()!r}); {caller} starts a fake group of its own "
            "and cannot share the process with it. Call it before build_context() "
            "or after close_context(ctx), or in a separate process."
        )
        raise RuntimeError(msg)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _forget_meshes()
    dist.init_process_group("fake", world_size=world_size, rank=rank, store=FakeStore())
    try:
        yield DistributedContext(
            num_processes=world_size,
            process_index=rank,
            local_process_index=rank,
            distributed_type=(
                DistributedType.MULTI_CPU if world_size > 1 else DistributedType.NO
            ),
            backend="fake" if world_size > 1 else None,
            mixed_precision=mixed_precision,
            collective_timeout="off",  # the fake store keeps no counters
        )
    finally:
        end_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions (Python's and C++'s).

    Its entries hold the ``DeviceMesh`` they were computed on, and a mesh of the
    same shape compares equal whatever the rank: a second fake world in this
    process would get rank 0's mesh back from the first one's entries (and slice
    rank 0's shard).
    """
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    clear_python: Callable[[], object] = propagator.propagate_op_sharding.cache_clear
    clear_python()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ fast path's copy of the same cache
        clear_native()


def fake_tensor_mode() -> Any:
    """Return a ``FakeTensorMode`` in which plain CPU tensors still compute."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._pytree import tree_leaves

    aten = torch.ops.aten
    lifts = (aten.lift_fresh.default, aten.lift_fresh_copy.default)

    class _MeshSafeFakeMode(FakeTensorMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: Any = (),
            kwargs: Any = None,
        ) -> Any:
            kwargs = kwargs or {}
            tensors = [
                t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            ]
            real = tensors and not any(
                isinstance(t, FakeTensor) or t.is_meta for t in tensors
            )
            if real and func not in lifts:
                # Only real tensors in: the mesh's bookkeeping, computed for real.
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return _MeshSafeFakeMode(allow_non_fake_inputs=True)
