"""A plain-text report of the software, devices and launch environment, for bug reports.

``python -m funcaccel env`` prints ``env_report(os.environ)``. The report lists the
versions (funcaccel, torch, CUDA and cuDNN when present, Python, platform), the
torch.distributed backends this build offers, the CUDA device count, the launch
variables found (torchrun's, SLURM's, Open MPI's, MPICH/PMI's), the launcher they
name with the rendezvous address it gives, and the ``DistributedContext`` that ``context_from_env`` would
build from them (or its error, which the report shows instead of raising).
``python -m funcaccel env --mesh 2,2,1`` adds the ``dp_replicate x dp_shard x tp``
mesh this launch would get from ``build_mesh``: its shape and this rank's place.
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Callable
from collections.abc import Mapping
from typing import Final

import torch
import torch.distributed as dist

from funcaccel._version import __version__
from funcaccel.context import LAUNCHER_VARIABLES
from funcaccel.context import context_from_env
from funcaccel.context import read_launch
from funcaccel.mesh import mesh_report_rows

__all__ = ["env_report"]

LAUNCH_VARIABLES: Final[tuple[str, ...]] = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""The variables torchrun sets that decide the context (shown when present,
followed by SLURM's and the MPI launchers' in ``LAUNCHER_VARIABLES``)."""


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _backend_flags() -> str:
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    checks: tuple[tuple[str, Callable[[], bool]], ...] = (
        ("gloo", dist.is_gloo_available),
        ("nccl", dist.is_nccl_available),
        ("mpi", dist.is_mpi_available),
    )
    return ", ".join(f"{name}: {_yes(check())}" for name, check in checks)


def _cuda_lines() -> list[tuple[str, str]]:
    built_with: str | None = torch.version.cuda
    if built_with is None:
        return [("CUDA", "not in this torch build"), ("cuDNN", "not available")]
    available = torch.cuda.is_available()
    state = "available" if available else "built in, but no usable GPU or driver"
    return [("CUDA", f"{built_with} ({state})"), ("cuDNN", _cudnn_version())]


def _installed_version(distribution: str) -> str:
    # Read from the installed metadata: importing DeepSpeed takes seconds.
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cudnn_version() -> str:
    # torch ships torch.backends.cudnn without annotations.
    if not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
        return "not available"
    version: int | None = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    return "not available" if version is None else str(version)


def _launcher_lines(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    try:
        launch = read_launch(environ)
    except (ValueError, TypeError) as error:
        return [("error", f"{type(error).__name__}: {error}")]
    if launch.num_processes == 1:
        return [("launcher", launch.launcher), ("rendezvous", "none (one process)")]
    if launch.rendezvous is None:
        where = f"not set: {launch.rendezvous_note}"
        if launch.launcher == "torchrun":
            where = "MASTER_ADDR/MASTER_PORT not set (torchrun's env:// store)"
    else:
        where = (
            f"{launch.rendezvous[0]}:{launch.rendezvous[1]} ({launch.rendezvous_note})"
        )
    return [("launcher", launch.launcher), ("rendezvous", where)]


def _context_lines(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    try:
        ctx = context_from_env(environ)
    except (ValueError, TypeError, RuntimeError) as error:
        return [("error", f"{type(error).__name__}: {error}")]
    return [
        (field.name, str(getattr(ctx, field.name))) for field in dataclasses.fields(ctx)
    ]


def _mesh_lines(
    environ: Mapping[str, str], sizes: tuple[int, int, int]
) -> list[tuple[str, str]]:
    try:
        ctx = context_from_env(environ)
        return mesh_report_rows(ctx.num_processes, ctx.process_index, sizes)
    except (ValueError, TypeError, RuntimeError) as error:
        return [("error", f"{type(error).__name__}: {error}")]


def _section(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max((len(key) for key, _ in rows), default=0)
    return [title, *(f"  {key.ljust(width)}  {value}" for key, value in rows)]


def env_report(
    environ: Mapping[str, str], *, mesh: tuple[int, int, int] | None = None
) -> str:
    """Return the environment report for ``environ``; nothing is printed or started.

    Only the launch variables in ``environ`` are read (``os.environ`` is not), and
    ``environ`` is not modified. An environment ``context_from_env`` rejects is
    reported in the context section, as ``error: <type>: <message>``.

    With ``mesh=(dp_replicate, dp_shard, tp)`` (``-1`` for the rest, as in
    ``build_mesh``) a ``mesh`` section follows: the resolved shape, this rank's
    coordinates, data-parallel and tensor-parallel ranks, and the ranks of its
    tensor-parallel group; sizes that do not fit the world show the error.
    No process group or ``DeviceMesh`` is built.

    Args:
        environ: a mapping such as ``os.environ``, or a dict in a test.
        mesh: mesh sizes to describe for this launch, or ``None``.

    Returns:
        Several lines of text, ending without a newline.

    >>> report = env_report({"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0"})
    >>> "process_index (5) must be in [0, num_processes=2)" in report
    True
    """
    versions = [
        ("funcaccel", __version__),
        ("torch", torch.__version__),
        *_cuda_lines(),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("platform", platform.platform()),
        ("backends", _backend_flags()),
        ("CUDA devices", str(torch.cuda.device_count())),
        ("deepspeed", _installed_version("deepspeed")),
    ]
    names = (*LAUNCH_VARIABLES, *LAUNCHER_VARIABLES)
    launch = [(name, environ[name]) for name in names if name in environ]
    if not launch:
        launch = [("(none set)", "one process")]
    lines = [
        *_section("versions", versions),
        *_section("launch variables", launch),
        *_section("launcher", _launcher_lines(environ)),
        *_section("context_from_env", _context_lines(environ)),
    ]
    if mesh is not None:
        lines += _section("mesh", _mesh_lines(environ, mesh))
    return "\n".join(lines)
