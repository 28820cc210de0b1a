"""Which launcher started this process, and the world its variables describe.

``read_launch(environ)`` looks, in this order, for torchrun's variables
(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), Open MPI's (``OMPI_COMM_WORLD_*``),
MPICH / Intel MPI's PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``) and a
task SLURM's ``srun`` started (``SLURM_PROCID`` in a job step). The first found
decides the world; an MPI launcher wins over SLURM because ``mpirun`` inside an
allocation leaves SLURM's variables of the batch script around. torchrun's
variables set by hand (no ``TORCHELASTIC_RUN_ID``) must agree with the other
launcher present. Nothing else is read and nothing is written.

With ``srun -N 2 --ntasks-per-node=2`` on ``node[07-08]`` in job 4242, the task
with ``SLURM_PROCID=3`` is rank 3 of 4, local rank 1, and every task meets at
``node07:24242`` (the first node; port ``20000 + 4242 % 12000``).

>>> read_launch({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
...     "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "a[7-8]", "SLURM_JOB_ID": "9"}).rendezvous
('a7', '20009')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Final
from typing import Literal
from typing import TypeAlias

import torch
import torch.distributed as dist

from funcaccel._checks import fail_value
from funcaccel.context._env import env_int
from funcaccel.context._env import rendezvous_init_method
from funcaccel.context._slurm_lists import SLURM_PORT_SPAN
from funcaccel.context._slurm_lists import expand_nodelist
from funcaccel.context._slurm_lists import expand_tasks_per_node
from funcaccel.context._slurm_lists import slurm_port
from funcaccel.kwargs import InitProcessGroupKwargs

__all__ = [
    "LAUNCHER_VARIABLES",
    "Launch",
    "Launcher",
    "launch_gpu",
    "launch_init_method",
    "read_launch",
    "refuse_a_larger_group",
]

Launcher: TypeAlias = Literal["torchrun", "slurm", "openmpi", "mpich/pmi", "none"]

_CALLER: Final = "context_from_env"
# Set by torchrun and by funcaccel.launch in the processes they start: their
# torchrun-style variables then describe the workers, whatever SLURM or MPI say
# of the process that started them.
_STARTED_BY: Final = ("TORCHELASTIC_RUN_ID", "FUNCACCEL_LAUNCH")
_NODELISTS: Final = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
LAUNCHER_VARIABLES: Final[tuple[str, ...]] = (
    "TORCHELASTIC_RUN_ID",
    "FUNCACCEL_LAUNCH",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE",
    *_NODELISTS,
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
)
"""The variables of SLURM and the MPI launchers that ``read_launch`` may read."""
_MPI_FIX: Final = (
    "MPI launchers give no rendezvous address: export MASTER_ADDR (the host of "
    "rank 0) and MASTER_PORT (a free port) to every rank, e.g. mpirun -x "
    "MASTER_ADDR=$(hostname) -x MASTER_PORT=29500, or pass "
    "InitProcessGroupKwargs(init_method='tcp://HOST:PORT')."
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """The world one launcher's variables describe, and where its ranks meet.

    ``local_world`` is this node's process count when the launcher says it;
    ``local_source`` names the variable the local rank came from (for
    messages); ``rendezvous`` is ``(address, port)`` when known, and
    ``rendezvous_note`` says where it came from, or what is missing and how to
    give it.
    """

    launcher: Launcher
    num_processes: int
    rank: int
    local_rank: int
    local_world: int | None = None
    local_source: str = "LOCAL_RANK"
    rendezvous: tuple[str, str] | None = None
    rendezvous_note: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class _Found:
    """One launcher's variables: the names read, for messages, and their values."""

    launcher: Launcher
    label: str
    size: tuple[str, int]
    rank: tuple[str, int]
    local: tuple[str, int]
    local_size: tuple[str, int] | None


def _int(environ: Mapping[str, str], name: str, label: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        what = f"an integer (set by {label})"
        fail_value(_CALLER, name, raw, what, "Launch the processes with it unchanged.")


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in environ), None)


def _pick(
    environ: Mapping[str, str], label: str, names: tuple[str, ...], missing: str
) -> tuple[str, int]:
    name = _first(environ, names)
    if name is None:
        present = sorted(k for k in environ if k.startswith(_prefix(label)))
        verb = "is" if len(present) == 1 else "are"
        what = f"set, since {', '.join(present)} {verb}"
        fix = f"{missing} Start every process with the launcher, unchanged."
        fail_value(_CALLER, " or ".join(names), None, what, fix)
    return name, _int(environ, name, label)


def _prefix(label: str) -> str:
    return {"SLURM": "SLURM_", "Open MPI": "OMPI_"}.get(label, "PMI_")


def _is_slurm_task(environ: Mapping[str, str]) -> bool:
    # The batch script itself has SLURM_PROCID=0 but no step: one process.
    step = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS")
    return "SLURM_PROCID" in environ and _first(environ, step) is not None


def _find_other(environ: Mapping[str, str]) -> _Found | None:
    """The variables of Open MPI, else PMI, else a SLURM task; ``None`` if none."""
    if "OMPI_COMM_WORLD_RANK" in environ or "OMPI_COMM_WORLD_SIZE" in environ:
        label, fix = "Open MPI", "mpirun sets them all."
        return _Found(
            "openmpi",
            label,
            _pick(environ, label, ("OMPI_COMM_WORLD_SIZE",), fix),
            _pick(environ, label, ("OMPI_COMM_WORLD_RANK",), fix),
            _pick(environ, label, ("OMPI_COMM_WORLD_LOCAL_RANK",), fix),
            _optional(environ, label, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        )
    if "PMI_RANK" in environ or "PMI_SIZE" in environ:
        label, fix = "MPICH/PMI", "mpiexec (MPICH, Intel MPI) sets them."
        local: tuple[str, ...] = ("MPI_LOCALRANKID",)
        if environ.get("SLURM_PROCID") == environ.get("PMI_RANK"):
            local += ("SLURM_LOCALID",)  # srun --mpi=pmi2 started this task
        return _Found(
            "mpich/pmi",
            label,
            _pick(environ, label, ("PMI_SIZE",), fix),
            _pick(environ, label, ("PMI_RANK",), fix),
            _pick(environ, label, local, fix),
            _optional(environ, label, "MPI_LOCALNRANKS"),
        )
    if not _is_slurm_task(environ):
        return None
    label, fix = "SLURM", "srun sets them in every task."
    size = _pick(environ, label, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), fix)
    rank = _pick(environ, label, ("SLURM_PROCID",), fix)
    local = ("SLURM_LOCALID",)
    if size[1] == 1:
        return _Found("slurm", label, size, rank, (local[0], 0), None)
    return _Found(
        "slurm",
        label,
        size,
        rank,
        _pick(environ, label, local, fix),
        _slurm_local_world(environ),
    )


def _optional(
    environ: Mapping[str, str], label: str, name: str
) -> tuple[str, int] | None:
    return (name, _int(environ, name, label)) if name in environ else None


def _slurm_local_world(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """This node's task count, when SLURM's variables say it without doubt."""
    if "SLURM_NTASKS_PER_NODE" in environ:
        return _optional(environ, "SLURM", "SLURM_NTASKS_PER_NODE")
    name = _first(environ, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if name is None:
        return None
    counts = expand_tasks_per_node(environ[name])
    if len(set(counts)) == 1:
        return name, counts[0]
    node = environ.get("SLURM_NODEID", "")
    if node.isdigit() and int(node) < len(counts):
        return f"{name}[SLURM_NODEID={node}]", counts[int(node)]
    return None


def _check_found(found: _Found) -> None:
    (size_name, size), (rank_name, rank) = found.size, found.rank
    local_name, local = found.local
    fix = f"Start every process with {found.label}'s launcher, unchanged."
    if size < 1:
        fail_value(_CALLER, size_name, size, "at least 1", fix)
    if not 0 <= rank < size:
        fail_value(_CALLER, rank_name, rank, f"in [0, {size_name}={size})", fix)
    if local < 0:
        fail_value(_CALLER, local_name, local, "at least 0", fix)
    if found.local_size is not None:
        local_size_name, local_size = found.local_size
        if not 0 <= local < local_size:
            what = f"in [0, {local_size_name}={local_size})"
            fail_value(_CALLER, local_name, local, what, fix)


def _check_agreement(environ: Mapping[str, str], found: _Found) -> None:
    """torchrun's variables set by hand must say what the real launcher says."""
    pairs = (
        ("WORLD_SIZE", found.size),
        ("RANK", found.rank),
        ("LOCAL_RANK", found.local),
    )
    for name, (other_name, other) in pairs:
        raw = environ.get(name, "").strip()
        if raw.lstrip("-").isdigit() and int(raw) != other:
            msg = (
                f"{_CALLER}: {name}={raw} (torchrun's variable) contradicts "
                f"{other_name}={other} ({found.label}); torchrun did not start this "
                "process (no TORCHELASTIC_RUN_ID) nor funcaccel.launch, so both describe the same run. "
                f"Unset WORLD_SIZE, RANK and LOCAL_RANK (funcaccel reads "
                f"{found.label}'s variables itself) or make them agree."
            )
            raise ValueError(msg)


def _torchrun(environ: Mapping[str, str]) -> Launch:
    """torchrun's variables, read and checked as they always were."""
    world = environ["WORLD_SIZE"]
    if world.strip() == "1":
        return Launch(launcher="torchrun", num_processes=1, rank=0, local_rank=0)
    num_processes = env_int(environ, "WORLD_SIZE")
    rank = env_int(environ, "RANK")
    local_rank = env_int(environ, "LOCAL_RANK")
    local_world: int | None = None
    if "LOCAL_WORLD_SIZE" in environ:
        local_world = env_int(environ, "LOCAL_WORLD_SIZE")
        if not 0 <= local_rank < local_world:
            what = f"in [0, LOCAL_WORLD_SIZE={local_world})"
            fail_value(_CALLER, "LOCAL_RANK", local_rank, what)
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    return Launch(
        launcher="torchrun",
        num_processes=num_processes,
        rank=rank,
        local_rank=local_rank,
        local_world=local_world,
        rendezvous=None if addr is None or port is None else (addr, port),
        rendezvous_note="MASTER_ADDR/MASTER_PORT",
    )


def _slurm_rendezvous(environ: Mapping[str, str]) -> tuple[tuple[str, str], str]:
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    notes = []
    if addr is None:
        name = _first(environ, _NODELISTS)
        if name is None:
            what = "set in a SLURM job step, or MASTER_ADDR given"
            fix = "Set MASTER_ADDR to the host of rank 0."
            fail_value(_CALLER, "SLURM_JOB_NODELIST", None, what, fix)
        addr = next(expand_nodelist(environ[name]))
        notes.append(f"first node of {name}")
    if port is None:
        if "SLURM_JOB_ID" not in environ:
            what = "set in a SLURM job step, or MASTER_PORT given"
            fail_value(_CALLER, "SLURM_JOB_ID", None, what, "Set MASTER_PORT.")
        port = str(slurm_port(_int(environ, "SLURM_JOB_ID", "SLURM")))
        notes.append(f"port 20000 + SLURM_JOB_ID % {SLURM_PORT_SPAN}")
    return (addr, port), "; ".join(notes) or "MASTER_ADDR/MASTER_PORT"


def read_launch(environ: Mapping[str, str]) -> Launch:
    """Return the launcher of this process and the world its variables describe.

    Raises:
        ValueError: a launcher's variables are partial (a rank without a size),
            malformed or out of range (a rank >= the size), torchrun's variables
            set by hand contradict another launcher's, or SLURM's node list
            cannot be read when it gives the rendezvous.
    """
    other = _find_other(environ)
    if "WORLD_SIZE" in environ:
        if other is not None and not any(v in environ for v in _STARTED_BY):
            _check_found(other)
            _check_agreement(environ, other)
        return _torchrun(environ)
    if other is None:
        return Launch(launcher="none", num_processes=1, rank=0, local_rank=0)
    _check_found(other)
    if other.size[1] == 1:
        return Launch(launcher=other.launcher, num_processes=1, rank=0, local_rank=0)
    rendezvous: tuple[str, str] | None = None
    if other.launcher == "slurm":
        rendezvous, note = _slurm_rendezvous(environ)
    else:
        addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
        if addr is not None and port is not None:
            rendezvous = (addr, port)
        note = "MASTER_ADDR/MASTER_PORT" if rendezvous else _MPI_FIX
    return Launch(
        launcher=other.launcher,
        num_processes=other.size[1],
        rank=other.rank[1],
        local_rank=other.local[1],
        local_world=None if other.local_size is None else other.local_size[1],
        local_source=other.local[0],
        rendezvous=rendezvous,
        rendezvous_note=note,
    )


def launch_gpu(launch: Launch, count: int, environ: Mapping[str, str]) -> torch.device:
    """Return the default GPU of ``launch``'s local rank among ``count`` visible.

    ``environ`` is the mapping ``launch`` was read from (for the message only).

    torchrun's ``LOCAL_RANK`` wraps (``LOCAL_RANK % count``), as it always did.
    Under SLURM or MPI a process that sees one GPU uses it (``srun
    --gpus-per-task=1`` shows each task its own as ``cuda:0``); otherwise the
    local rank must name a visible GPU, so that two ranks never share one.

    Raises:
        ValueError: a SLURM or MPI local rank beyond the ``count`` visible GPUs.
    """
    rank = launch.local_rank
    if launch.launcher == "torchrun" or count == 1:
        return torch.device("cuda", rank % count)
    if rank >= count:
        visible = environ.get("CUDA_VISIBLE_DEVICES", "unset")
        what = (
            f"below the {count} GPU(s) this process sees (torch.cuda.device_count(); "
            f"CUDA_VISIBLE_DEVICES={visible})"
        )
        fix = (
            "Start at most one task per GPU on each node (srun --ntasks-per-node, "
            "mpirun --map-by ppr:N:node), or show each task its own GPU (srun "
            "--gpus-per-task=1), or pass device=."
        )
        fail_value(_CALLER, launch.local_source, rank, what, fix)
    return torch.device("cuda", rank)


def launch_init_method(
    kwargs: InitProcessGroupKwargs, environ: Mapping[str, str]
) -> str:
    """Return where the ranks meet: the handler's, torchrun's, or the launcher's.

    SLURM's is derived (``read_launch``); an MPI launcher needs ``MASTER_ADDR``
    and ``MASTER_PORT``. torchrun's rendezvous is read as it always was.

    Raises:
        ValueError: an MPI launcher without ``MASTER_ADDR``/``MASTER_PORT`` and no
            ``init_method``, or torchrun's variables without them in a mapping
            other than ``os.environ``.
    """
    if kwargs.init_method is not None:
        return kwargs.init_method
    launch = read_launch(environ)
    if launch.launcher in ("torchrun", "none"):
        return rendezvous_init_method(kwargs, environ)
    if launch.rendezvous is None:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in environ]
        name = f"{' and '.join(missing)} (under {launch.launcher})"
        what = "set in the environment"
        fail_value("build_context", name, None, what, launch.rendezvous_note)
    addr, port = launch.rendezvous
    if ":" in addr and not addr.startswith("["):
        addr = f"[{addr}]"  # an IPv6 address in a URL
    return f"tcp://{addr}:{port}"


def refuse_a_larger_group(num_processes: int) -> None:
    """Refuse a one-process context inside a larger default group another started.

    Raises:
        RuntimeError: a default group of several ranks is initialised while the
            environment names no launcher of several processes.
    """
    if num_processes > 1 or not dist.is_available() or not dist.is_initialized():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return
    msg = (
        f"build_context: a default process group of world_size={world} (this is "
        f"rank {rank}) is already initialised, but the environment names no "
        "launcher, so the context would describe one process. Set WORLD_SIZE, RANK "
        "and LOCAL_RANK for each rank where the group was started (Ray Train sets "
        "them), or pass build_context(environ=...) a mapping that has them."
    )
    raise RuntimeError(msg)
