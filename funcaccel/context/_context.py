"""The distributed context: a frozen value describing this process's place in the run.

``DistributedContext`` replaces a process-wide singleton: it is built once
(``build_context`` reads torchrun's environment) and passed as the first argument to
every function that needs to know the world. Pure code can build one by hand for any
rank, without starting a process group:

>>> ctx = DistributedContext(
...     num_processes=4, process_index=2, distributed_type=DistributedType.MULTI_CPU
... )
>>> ctx.is_main_process, ctx.is_last_process, ctx.use_distributed
(False, False, True)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from datetime import timedelta
from enum import Enum
from typing import Final

import torch
import torch.distributed as dist

from funcaccel._checks import check_index
from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._group import end_process_group
from funcaccel._group import start_process_group
from funcaccel._typing import MixedPrecision
from funcaccel.context._device import DeviceChoice
from funcaccel.context._device import check_local_devices
from funcaccel.context._device import resolve_device
from funcaccel.context._env import CollectiveTimeout
from funcaccel.context._env import check_collective_timeout
from funcaccel.context._env import check_mixed_precision
from funcaccel.context._env import check_mode
from funcaccel.context._launchers import launch_gpu
from funcaccel.context._launchers import launch_init_method
from funcaccel.context._launchers import read_launch
from funcaccel.context._launchers import refuse_a_larger_group
from funcaccel.kwargs import InitProcessGroupKwargs

__all__ = [
    "DistributedContext",
    "DistributedType",
    "build_context",
    "close_context",
    "context_from_env",
    "effective_backend",
    "effective_timeout",
    "require_process_group",
]

NCCL_DEFAULT_TIMEOUT: Final = timedelta(seconds=600)
OTHER_DEFAULT_TIMEOUT: Final = timedelta(seconds=1800)


class DistributedType(str, Enum):
    """How the run is distributed."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DistributedContext:
    """Where this process stands in the run; built once, never changed.

    Args:
        num_processes: the world size (>= 1).
        process_index: this process's global rank, in ``[0, num_processes)``.
        local_process_index: rank on this machine (>= 0).
        device: the ``torch.device`` this process computes on.
        distributed_type: ``NO`` exactly when ``num_processes == 1``; ``MULTI_GPU``
            needs a CUDA device and ``MULTI_CPU`` a CPU one.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        backend: the torch.distributed backend, or ``None`` with one process.
        collective_timeout: how long a funcaccel collective waits for every rank
            to call it before raising a ``RuntimeError`` that names the call and
            the missing ranks (a ``timedelta`` or seconds; stored as a
            ``timedelta``). ``None``, the default, bounds it by the process
            group's own timeout; ``"off"`` skips the check (a call only some ranks
            make then waits in the backend and ends in its error).
        hang_report_dir: where a rank whose collective check fails writes
            ``rank<r>.txt`` (its call, call number, the time and every thread's
            stack); a directory as a ``str``, or ``None``, the default, for
            ``funcaccel-hang-<parent pid>`` under ``tempfile.gettempdir()``. The
            error names the file. Set it with ``dataclasses.replace``.

    Raises:
        ValueError: a field out of range or inconsistent with another.
        TypeError: a field of the wrong type.
    """

    num_processes: int = 1
    process_index: int = 0
    local_process_index: int = 0
    device: torch.device = dataclasses.field(
        default_factory=lambda: torch.device("cpu")
    )
    distributed_type: DistributedType = DistributedType.NO
    mixed_precision: MixedPrecision = "no"
    backend: str | None = None
    collective_timeout: CollectiveTimeout = None
    hang_report_dir: str | None = None

    def __post_init__(self) -> None:
        owner = "DistributedContext"
        p = check_int(owner, "num_processes", self.num_processes, 1)
        rank = check_type(owner, "process_index", self.process_index, int)
        check_index(owner, "process_index", rank, "num_processes", p)
        check_int(owner, "local_process_index", self.local_process_index, 0)
        hint = "Use e.g. torch.device('cpu')."
        check_type(
            owner, "device", self.device, torch.device, what="a torch.device", hint=hint
        )
        check_type(owner, "distributed_type", self.distributed_type, DistributedType)
        check_mode(owner, self.mixed_precision)
        check_type(owner, "backend", self.backend, str, optional=True)
        _check_type_consistency(self)
        timeout = check_collective_timeout(owner, self.collective_timeout)
        object.__setattr__(self, "collective_timeout", timeout)
        hint = "Pass a directory as a str (str(path)), or None for the default."
        check_type(
            owner,
            "hang_report_dir",
            self.hang_report_dir,
            str,
            hint=hint,
            optional=True,
        )

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is rank 0 on its machine."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """Whether this is the highest global rank."""
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """Whether there is more than one process."""
        return self.num_processes > 1


def _check_type_consistency(ctx: DistributedContext) -> None:
    """``NO`` exactly with one process; else ``MULTI_GPU`` on CUDA, ``MULTI_CPU`` on CPU."""
    kind, p, device = ctx.distributed_type, ctx.num_processes, ctx.device
    several = {"cuda": DistributedType.MULTI_GPU, "cpu": DistributedType.MULTI_CPU}
    expected = DistributedType.NO if p == 1 else several.get(device.type)
    name = "MULTI_GPU or MULTI_CPU" if expected is None else expected.name
    what = f"{name} with num_processes={p}" + (f" on device {device}" if p > 1 else "")
    fix = f"Pass distributed_type=DistributedType.{name}."
    if expected is None:
        fix = "Use a CUDA device (MULTI_GPU) or a CPU one (MULTI_CPU)."
    if kind is not expected:
        fail_value("DistributedContext", "distributed_type", kind.name, what, fix)


def effective_backend(init_kwargs: InitProcessGroupKwargs, device: torch.device) -> str:
    """Return the backend a group on ``device`` uses: gloo when "nccl" was left on CPU.

    >>> effective_backend(InitProcessGroupKwargs(), torch.device("cpu"))
    'gloo'
    >>> effective_backend(InitProcessGroupKwargs(backend="mpi"), torch.device("cpu"))
    'mpi'
    """
    backend = init_kwargs.backend
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type == "cpu":
        return "gloo"
    return backend


def effective_timeout(init_kwargs: InitProcessGroupKwargs, backend: str) -> timedelta:
    """Return the group timeout: the given one, else 600 s for NCCL, 1800 s otherwise.

    >>> effective_timeout(InitProcessGroupKwargs(), "gloo").total_seconds()
    1800.0
    """
    if init_kwargs.timeout is not None:
        return init_kwargs.timeout
    return NCCL_DEFAULT_TIMEOUT if backend == "nccl" else OTHER_DEFAULT_TIMEOUT


def context_from_env(
    environ: Mapping[str, str],
    *,
    mixed_precision: MixedPrecision = "no",
    cpu: bool = False,
    init_kwargs: InitProcessGroupKwargs | None = None,
    collective_timeout: CollectiveTimeout = None,
    device: DeviceChoice = None,
) -> DistributedContext:
    """Build the context the launcher's variables in ``environ`` describe; start nothing.

    Reads torchrun's ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` (and, for a check,
    ``LOCAL_WORLD_SIZE``), else SLURM's, Open MPI's or MPICH/PMI's (``read_launch``,
    docs/clusters.md); ``environ`` is not modified. With none of them, or
    ``WORLD_SIZE`` ``"1"``, the context is a single process.

    Args:
        environ: a mapping such as ``os.environ`` or a dict in a test.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        cpu: force the CPU even when CUDA is available.
        init_kwargs: decides the backend (see ``effective_backend``).
        collective_timeout: the context's ``collective_timeout`` (seconds or a
            ``timedelta``; ``None``: the group's timeout; ``"off"``).
        device: this process's device instead of the default one: ``"cuda:1"``,
            ``"cpu"``, a ``torch.device``, or a rule from the local rank to a
            device (``lambda local_rank: f"cuda:{local_rank + 2}"``, given
            ``LOCAL_RANK``, or 0 with one process). ``"cuda"`` without an index
            is ``cuda:<LOCAL_RANK % device_count>``; ``"cpu:0"`` is the CPU.

    Returns:
        The context; its device is ``device`` when given, else
        ``cuda:<LOCAL_RANK % device_count>`` when CUDA is available and ``cpu`` is
        false, else ``cpu``.

    Raises:
        TypeError: ``device`` (or its rule's result) is not a device.
        ValueError: a missing, malformed or contradictory variable (torchrun's
            set by hand against SLURM's or MPI's; a SLURM or MPI local rank
            beyond the visible GPUs); a mixed-precision mode the
            device cannot run; a device this machine does not have (CUDA where
            it is not available, an index beyond the visible GPUs), a CUDA
            device with ``cpu=True``, or, when ``LOCAL_WORLD_SIZE`` is set, the
            local ranks' devices of mixed types or sharing a GPU under NCCL.

    >>> env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    >>> ctx = context_from_env(env, cpu=True)
    >>> ctx.process_index, ctx.distributed_type.value, ctx.backend
    (1, 'MULTI_CPU', 'gloo')
    >>> context_from_env({}, device="cpu:0").device
    device(type='cpu')
    """
    return _from_env(
        "context_from_env",
        environ,
        mixed_precision=mixed_precision,
        cpu=cpu,
        init_kwargs=init_kwargs,
        collective_timeout=collective_timeout,
        device=device,
    )


def _from_env(
    caller: str,
    environ: Mapping[str, str],
    *,
    mixed_precision: MixedPrecision,
    cpu: bool,
    init_kwargs: InitProcessGroupKwargs | None,
    collective_timeout: CollectiveTimeout,
    device: DeviceChoice,
) -> DistributedContext:
    """``context_from_env``, with ``device=`` errors under ``caller``'s name."""
    # Checked first: a bad timeout is the caller's, not the environment's.
    check_collective_timeout("context_from_env", collective_timeout)
    use_cuda = torch.cuda.is_available() and not cpu
    launch = read_launch(environ)
    if launch.num_processes == 1:
        if device is not None:
            chosen = resolve_device(caller, device, cpu=cpu, local_rank=0)
        else:
            chosen = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        check_mixed_precision(mixed_precision, chosen)
        return DistributedContext(
            device=chosen,
            mixed_precision=mixed_precision,
            collective_timeout=collective_timeout,
        )
    num_processes, rank = launch.num_processes, launch.rank
    local_rank, local_world = launch.local_rank, launch.local_world
    if device is not None:
        chosen = resolve_device(caller, device, cpu=cpu, local_rank=local_rank)
    elif use_cuda:
        chosen = launch_gpu(launch, torch.cuda.device_count(), environ)
    else:
        chosen = torch.device("cpu")
    check_mixed_precision(mixed_precision, chosen)
    backend = effective_backend(init_kwargs or InitProcessGroupKwargs(), chosen)
    if device is not None and local_world is not None and num_processes > 1:
        check_local_devices(
            caller, device, cpu=cpu, local_world=local_world, backend=backend
        )
    several = (
        DistributedType.MULTI_GPU
        if chosen.type == "cuda"
        else DistributedType.MULTI_CPU
    )
    try:
        return DistributedContext(
            num_processes=num_processes,
            process_index=rank,
            local_process_index=local_rank,
            device=chosen,
            distributed_type=several if num_processes > 1 else DistributedType.NO,
            mixed_precision=mixed_precision,
            backend=backend if num_processes > 1 else None,
            collective_timeout=collective_timeout,
        )
    except ValueError as error:
        msg = f"context_from_env: the environment gives an invalid context: {error}"
        raise ValueError(msg) from error


def require_process_group(ctx: DistributedContext, caller: str) -> None:
    """Check that a default group matching ``ctx`` is initialised when it must be.

    Nothing is needed with one process.

    Raises:
        RuntimeError: ``ctx.num_processes > 1`` and no default group is initialised,
            or its world size or rank differ from the context's.
    """
    if ctx.num_processes == 1:
        return
    if not dist.is_available() or not dist.is_initialized():
        msg = (
            f"{caller}: ctx has num_processes={ctx.num_processes} but no default "
            "process group is initialised; build the context with build_context() "
            "under torchrun."
        )
        raise RuntimeError(msg)
    world, rank = dist.get_world_size(), dist.get_rank()
    if (world, rank) != (ctx.num_processes, ctx.process_index):
        msg = (
            f"{caller}: the default process group has world_size={world}, rank={rank} "
            f"but ctx has num_processes={ctx.num_processes}, "
            f"process_index={ctx.process_index}; pass the context of this group."
        )
        raise RuntimeError(msg)


def build_context(
    *,
    mixed_precision: MixedPrecision = "no",
    cpu: bool = False,
    init_kwargs: InitProcessGroupKwargs | None = None,
    environ: Mapping[str, str] | None = None,
    collective_timeout: CollectiveTimeout = None,
    device: DeviceChoice = None,
) -> DistributedContext:
    """Build the context from torchrun's environment and start the process group.

    With several processes, or a CUDA ``device`` given, this sets the current
    CUDA device (on GPU). With several processes it then calls
    ``torch.distributed.init_process_group`` with the effective backend, the
    handler's ``init_method`` (when ``None``: ``MASTER_ADDR``/``MASTER_PORT`` from
    ``environ``, through ``"env://"`` for ``os.environ``) and timeout, unless a
    default group with the same world size and rank already exists (it is reused).
    With one process nothing is started. No environment variable is written.

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        cpu: force the CPU even when CUDA is available.
        init_kwargs: options for ``init_process_group``.
        environ: where to read torchrun's variables; ``os.environ`` when ``None``.
        collective_timeout: bound the wait of every funcaccel collective for the
            other ranks (see ``DistributedContext``); ``None``, the default,
            bounds it by the group's timeout, ``"off"`` skips the check.
        device: this process's device instead of the default one (checked):
            ``"cuda:1"``, ``"cpu"``, a ``torch.device``, or a rule from the local
            rank to a device, e.g. ``lambda local_rank: f"cuda:{local_rank + 2}"``
            (see ``context_from_env``).

    Returns:
        The context; end the group with ``close_context(ctx)``.

    Raises:
        TypeError, ValueError: see ``context_from_env`` (``device`` errors name
            ``build_context``).
        RuntimeError: an initialised default group does not match the environment.
    """
    kwargs = init_kwargs or InitProcessGroupKwargs()
    env = os.environ if environ is None else environ
    ctx = _from_env(
        "build_context",
        env,
        mixed_precision=mixed_precision,
        cpu=cpu,
        init_kwargs=kwargs,
        collective_timeout=collective_timeout,
        device=device,
    )
    if ctx.num_processes == 1:
        refuse_a_larger_group(ctx.num_processes)
        if device is not None and ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        return ctx
    if dist.is_initialized():
        require_process_group(ctx, "build_context")
        return ctx
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    backend = ctx.backend or effective_backend(kwargs, ctx.device)
    init_method = launch_init_method(kwargs, env)
    start_process_group(
        backend,
        init_method=init_method,
        timeout=effective_timeout(kwargs, backend),
        world_size=ctx.num_processes,
        rank=ctx.process_index,
    )
    return ctx


def close_context(ctx: DistributedContext) -> None:
    """End the default process group ``ctx`` runs in (a no-op with one process).

    Safe to call twice; call it at the end of a script started by torchrun, after
    the training function that held the models has returned. The group and its
    threads end here, not at interpreter exit: unreachable objects (a DDP module
    in a reference cycle) are collected first, and torch's references that would
    keep the group alive are released (see docs/context.md, "Ending the run").
    """
    if ctx.num_processes > 1:
        end_process_group()
