"""A fake world in this process: torch's ``"fake"`` process group and fake tensors.

``fake_world_ctx(caller, world_size, rank)`` starts the default group with
torch's fake backend (every collective returns at once, nothing is sent), yields
the ``DistributedContext`` of rank ``rank`` in it, and destroys the group on the
way out, whatever happened. ``fake_tensor_mode()`` is torch's ``FakeTensorMode``
that lets plain CPU tensors compute for real: a ``DeviceMesh`` keeps its rank
layout in small integer tensors and reads them back (``nonzero``, ``tolist``),
which fake tensors cannot answer; every tensor born in the mode (parameters,
activations, optimizer state) is still fake, with no storage.
``fake_tensor_mode(user_code=True)``, the dry run's, also lets ``Module.to``
move fake parameters and answers reads of fake values with placeholders
(``PLACEHOLDERS``); ``host_objects_ctx()`` pickles the objects of object
collectives on real bytes. ``recording_mode(calls)`` lists the collectives a
dry run makes.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from types import MappingProxyType
from typing import Any
from typing import Final

import torch
import torch.distributed as dist

from funcaccel._group import end_process_group
from funcaccel._typing import MixedPrecision
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType

__all__ = [
    "INDEX_LIMIT",
    "PLACEHOLDERS",
    "fake_tensor_mode",
    "fake_world_ctx",
    "host_objects_ctx",
    "recording_mode",
]

# The most elements an integer tensor made from no tensor may have and be real
# under fake_tensor_mode(user_code=True) (128 MiB of int64).
INDEX_LIMIT: Final = 1 << 24
# What a read of a fake tensor's value (.item(), float(t), bool(t), int(t))
# returns under fake_tensor_mode(user_code=True), by kind of dtype: the values of a
# healthy step (no overflow found, no NaN, a micro-batch with items in it).
PLACEHOLDERS: Final[Mapping[str, bool | float | int]] = MappingProxyType(
    {"bool": False, "floating": 0.0, "integer": 1}
)


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
    # init_process_group wraps sys.excepthook to prefix "[rank<r>]:" to
    # tracebacks, and the wrapper outlives the group: put the caller's back.
    excepthook = sys.excepthook
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
        sys.excepthook = excepthook


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


def fake_tensor_mode(*, user_code: bool = False) -> Any:
    """Return a ``FakeTensorMode`` in which plain CPU tensors still compute.

    With ``user_code`` (the dry run, which runs the user's own function) two
    more things work on fake tensors. ``Module.to`` (``.float()``, ``.cuda()``
    ...): torch's ``Module._apply`` swaps each fake parameter with
    ``torch.utils.swap_tensors``, which refuses a tensor that has a weak
    reference, and the mode's converter keeps one, in its memo, to every
    ``detach()`` output, so to every ``nn.Parameter``; here a ``detach()``
    output is dropped from the memo (it is fresh: nothing looks it up again).
    A read of a fake value (``aten._local_scalar_dense``: ``.item()``,
    ``float(t)``, ``bool(t)``, ``.tolist()``) that torch's mode does not know
    (it knows the small constants it tracks, such as an optimizer's step
    count) returns ``PLACEHOLDERS``' value for the dtype instead of raising.
    An integer (or bool) tensor of at most ``INDEX_LIMIT`` elements made from
    no tensor (``torch.arange``, ``torch.randperm``, ``torch.randint``,
    ``torch.tensor([...])``) is real, so that a sampler's indices and token ids
    are real values and are read as such.
    """
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
            if not tensors and _in_mesh_code():
                real = True  # a DeviceMesh's rank layout
            if real and func not in lifts:
                # Only real tensors in: the mesh's bookkeeping, computed for real.
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            if user_code and (func in lifts or not tensors):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                if not _is_index(out):
                    return out
                # An integer tensor made from nothing (a sampler's permutation,
                # positions, token ids): real, so indices index for real.
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            if user_code and func is aten._local_scalar_dense.default:
                read = tensors[0]
                if isinstance(read, FakeTensor) and read.constant is None:
                    return _placeholder(read.dtype)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if user_code and func is aten.detach.default:
                _forget(self, out)
            return out

    return _MeshSafeFakeMode(allow_non_fake_inputs=True)


def _is_index(out: object) -> bool:
    return (
        isinstance(out, torch.Tensor)
        and not out.is_floating_point()
        and not out.is_complex()
        and out.numel() <= INDEX_LIMIT
    )


def _placeholder(dtype: torch.dtype) -> bool | float | int:
    if dtype == torch.bool:
        return PLACEHOLDERS["bool"]
    if dtype.is_floating_point or dtype.is_complex:
        return PLACEHOLDERS["floating"]
    return PLACEHOLDERS["integer"]


def _forget(mode: Any, out: object) -> None:
    """Drop the converter's weak reference to ``out`` (so ``swap_tensors`` takes it)."""
    if not weakref.getweakrefcount(out):
        return
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo
    for key in [key for key, value in memo.items() if value is out]:
        del memo[key]


@contextmanager
def host_objects_ctx() -> Iterator[None]:
    """Pickle the objects of object collectives on real bytes while this is open.

    ``all_gather_object``, ``broadcast_object_list`` and the rest turn an object
    into a byte tensor and back in two helpers of ``distributed_c10d``; under a
    fake-tensor mode the bytes would be fake (the storage torch makes from the
    pickle lands on ``meta``) and could not be unpickled, so the helpers run
    with the fake mode set aside. The helpers are put back on the way out.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import distributed_c10d as c10d

    def on_host(helper: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(helper)
        def run(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return helper(*args, **kwargs)

        return run

    names = ("_object_to_tensor", "_tensor_to_object")
    saved = {name: getattr(c10d, name) for name in names}
    for name, helper in saved.items():
        setattr(c10d, name, on_host(helper))
    try:
        yield
    finally:
        for name, helper in saved.items():
            setattr(c10d, name, helper)


def recording_mode(calls: list[tuple[str, str]]) -> Any:
    """A dispatch mode that appends each collective to ``calls`` as ``(name, where)``.

    ``where`` is the innermost caller outside torch and funcaccel. On the fake
    group an all-gather leaves its outputs as they were; here they get this
    rank's input, as if every peer had sent the same (so that an object
    collective unpickles what this rank sent).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.namespace in _COLLECTIVES:
                name = func.__name__.split(".")[0]
                calls.append((name, _caller()))
                if name.startswith("allgather"):
                    _echo(args)
            return out

    return _Recorder()  # type: ignore[no-untyped-call]


_COLLECTIVES: Final = frozenset({"c10d", "_c10d_functional"})
_OWN: Final = (
    str(Path(torch.__file__).parent),
    str(Path(__file__).parent.parent),
    str(Path(contextlib.__file__).parent),
)


_MESH_FILES: Final = ("device_mesh.py", "_mesh_layout.py", "distributed_c10d.py")


def _in_mesh_code() -> bool:
    """Whether a ``DeviceMesh`` or process-group function is building this tensor."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_MESH_FILES):
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """``file:line in function`` of the innermost frame outside torch and funcaccel."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_OWN):
            return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    return "an unknown caller"


def _echo(args: Any) -> None:
    """Fill an all-gather's outputs with this rank's input (fake peers send the same)."""
    outputs, inputs = args[0], args[1]
    if isinstance(outputs, list) and isinstance(inputs, list):
        for per_input, source in zip(outputs, inputs, strict=False):
            for out in per_input if isinstance(per_input, list) else [per_input]:
                if out.shape == source.shape:
                    out.copy_(source)
