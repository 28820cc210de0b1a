"""Start a function on several local gloo processes and collect their results.

``launch(fn, *args, num_processes=N)`` is the notebook and test counterpart of
``torchrun --nproc_per_node N``: it starts ``N`` processes on this machine, gives
each a default process group (gloo, through a ``file://`` rendezvous in a fresh
temporary directory, so no port is chosen) and torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), calls ``fn(*args)`` in each
and returns the list of their return values, indexed by rank. ``build_context()``
inside ``fn`` finds the group already started and reuses it.

With ``num_processes=2``, ``launch(fn, 10)`` runs ``fn(10)`` twice: on rank 0 with
``RANK=0``, on rank 1 with ``RANK=1``; if they return ``"a"`` and ``"b"`` the call
returns ``["a", "b"]``. If rank 1 raises, rank 0 is killed and ``LaunchError``
names rank 1 and carries its traceback.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from io import BytesIO
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Final
from typing import Literal
from typing import TypeVar

import torch
import torch.distributed as dist
from typing_extensions import TypeVarTuple
from typing_extensions import Unpack

from funcaccel._checks import check_choice
from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._group import end_process_group
from funcaccel._group import start_process_group

__all__ = ["LaunchError", "StartMethod", "launch", "pick_start_method"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

StartMethod = Literal["spawn", "fork", "forkserver"]
_START_METHODS: Final = ("spawn", "fork", "forkserver")
_POLL_S: Final = 0.02
_TRACEBACK_CHARS: Final = 8_000
# pick_start_method, where fork is needed and missing.
_SENDABLE: Final = "importable by a new interpreter, with picklable arguments"
_FIX: Final = (
    "Define fn in a module (a .py file), not interactively, a lambda or a closure."
)
# A fork server imports these once; every child forked from it starts with them.
_FORKSERVER_PRELOAD: Final = ("torch", "torch.distributed", "funcaccel")


class LaunchError(RuntimeError):
    """A rank raised, or exited without returning; the other ranks were killed.

    Attributes:
        rank: the rank that failed first.
        traceback_text: its formatted traceback ("" when it died without one).
    """

    def __init__(self, message: str, *, rank: int, traceback_text: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one rank wrote back: a pickled result, or its failure."""

    rank: int
    ok: bool
    payload: bytes  # the pickled result, or the pickled exception ("" if it won't)
    traceback_text: str
    summary: str  # "ValueError: message" for a failure
    finished_at: float


def _check_arguments(
    fn: object, num_processes: object, timeout_s: object, start_method: object
) -> None:
    if not callable(fn):
        fail_type("launch", "fn", fn, "callable")
    check_int("launch", "num_processes", num_processes, 1)
    what = "a number of seconds or None"
    timeout: float | None = check_type(
        "launch", "timeout_s", timeout_s, (int, float), what=what, optional=True
    )
    if timeout is not None and (not timeout > 0 or math.isnan(timeout)):
        fail_value("launch", "timeout_s", timeout, "> 0 (or None for no limit)")
    if start_method is not None:
        # The methods this platform offers, in launch's order of preference.
        offered = set(multiprocessing.get_all_start_methods())
        methods = [method for method in _START_METHODS if method in offered]
        hint = f"Pass None to let launch pick one ({sys.platform} offers these)."
        check_choice("launch", "start_method", start_method, methods, hint=hint)


class _MainFinder(pickle.Pickler):
    """A pickler that notes whether anything is pickled by reference to ``__main__``."""

    def __init__(self) -> None:
        super().__init__(BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.uses_main = False

    def persistent_id(self, obj: object) -> None:
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            if getattr(obj, "__module__", None) == "__main__":
                self.uses_main = True
        return None


def _is_interactive_main() -> bool:
    """Whether ``__main__`` has no file a fresh interpreter could import (REPL, notebook)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)  # "<stdin>" for `python -`
    return not isinstance(path, str) or not os.path.isfile(path)


def pick_start_method(
    fn: Callable[..., object], args: tuple[object, ...]
) -> StartMethod:
    """Return how ``launch`` starts processes for ``fn(*args)`` by default.

    ``"spawn"`` (a fresh interpreter per rank, safe with threads and CUDA) when
    ``fn`` and ``args`` pickle and nothing in them is defined in an interactive
    ``__main__`` (a REPL, ``python -c``, ``python -`` or a notebook, whose
    ``__main__`` a new interpreter cannot import); otherwise ``"fork"``, where the
    children inherit ``fn`` and ``args`` without pickling (lambdas and closures
    work too).

    >>> import math
    >>> pick_start_method(math.sqrt, (4.0,))
    'spawn'
    >>> pick_start_method(lambda: 1, ())
    'fork'

    Raises:
        ValueError: fork is needed but this platform has none (Windows); define
            ``fn`` in a module and pass picklable arguments.
    """
    finder = _MainFinder()
    try:
        finder.dump((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError):
        needs_fork = True
    else:
        needs_fork = finder.uses_main and _is_interactive_main()
    if not needs_fork:
        return "spawn"
    name = getattr(fn, "__qualname__", fn)
    if "fork" not in multiprocessing.get_all_start_methods():
        fail_value(
            "launch", "fn", name, f"{_SENDABLE} ({sys.platform} has no fork)", _FIX
        )
    return "fork"


def _cuda_initialized() -> bool:
    # The one call of torch's untyped is_initialized.
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _group_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# What a forked child would inherit and could not use, and the fix for each.
_FORK_HAZARDS: Final = (
    (
        _cuda_initialized,
        "launch: start_method 'fork' but CUDA is already initialised in this "
        "process, and a forked child cannot use it; restart the kernel and call "
        "launch before any CUDA call, or define fn in a module so 'spawn' is used.",
    ),
    (
        _group_initialized,
        "launch: a default process group is initialised in this process, and a "
        "forked child would inherit it; call torch.distributed."
        "destroy_process_group() first, or use start_method='spawn'.",
    ),
)


def _check_fork_is_safe() -> None:
    for hazard, message in _FORK_HAZARDS:
        if hazard():
            raise RuntimeError(message)


def _outcome_path(rundir: Path, rank: int) -> Path:
    return rundir / f"rank_{rank}.outcome.pkl"


def _write_outcome(rundir: Path, outcome: _Outcome) -> None:
    path = _outcome_path(rundir, outcome.rank)
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(outcome))
    os.replace(partial, path)  # the parent never reads half a file


def _failure(rank: int, error: BaseException) -> _Outcome:
    try:
        payload = pickle.dumps(error)
        pickle.loads(payload)  # some exceptions pickle but do not load back
    except Exception:  # any failure means: send the text only
        payload = b""
    return _Outcome(
        rank=rank,
        ok=False,
        payload=payload,
        traceback_text=traceback.format_exc(),
        summary=f"{type(error).__name__}: {error}",
        finished_at=time.time(),
    )


def _child(
    rank: int,
    num_processes: int,
    rundir: Path,
    backend: str | None,
    fn: Callable[..., object],
    args: tuple[object, ...],
) -> None:
    """Run in each child: set torchrun's variables, join the group, call ``fn``."""
    # This process's own environment, as torchrun gives it; the parent's is untouched.
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(num_processes),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(num_processes),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(num_processes),
            # These variables describe this process even inside a SLURM or MPI
            # task (build_context then does not compare them with those).
            "FUNCACCEL_LAUNCH": "1",
        }
    )
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: no oversubscription
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    try:
        if backend is not None:  # None: fn starts its own group
            start_process_group(
                backend,
                init_method=f"file://{rundir}/rendezvous",
                rank=rank,
                world_size=num_processes,
            )
        result = fn(*args)
        outcome = _Outcome(
            rank=rank,
            ok=True,
            payload=pickle.dumps(result),
            traceback_text="",
            summary="",
            finished_at=time.time(),
        )
    except BaseException as error:  # reported to the parent
        outcome = _failure(rank, error)
    finally:
        end_process_group()  # as close_context: the group's threads end here
    _write_outcome(rundir, outcome)


def _read_outcome(rundir: Path, rank: int) -> _Outcome | None:
    path = _outcome_path(rundir, rank)
    if not path.exists():
        return None
    outcome: _Outcome = pickle.loads(path.read_bytes())
    return outcome


def _kill(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5.0)


def _bounded(text: str) -> str:
    if len(text) <= _TRACEBACK_CHARS:
        return text
    return "... (cut)\n" + text[-_TRACEBACK_CHARS:]


def _raise_failure(failures: list[_Outcome], num_processes: int) -> None:
    first = min(failures, key=lambda o: (o.finished_at, o.rank))
    others = [o for o in failures if o is not first]
    also = "".join(f"\n(rank {o.rank} also failed: {o.summary})" for o in others)
    msg = (
        f"launch: rank {first.rank} of {num_processes} raised {first.summary}; the "
        f"other ranks were stopped.{also}\n\nTraceback on rank {first.rank}:\n"
        f"{_bounded(first.traceback_text)}"
    )
    error = LaunchError(msg, rank=first.rank, traceback_text=first.traceback_text)
    cause: object = pickle.loads(first.payload) if first.payload else None
    raise error from (cause if isinstance(cause, BaseException) else None)


def _how_it_ended(rank: int, code: int | None, num_processes: int) -> str:
    how = (
        f"was killed by signal {-code}"
        if code is not None and code < 0
        else (f"exited with code {code}")
    )
    hint = " (SIGKILL: out of memory?)" if code == -9 else ""
    return f"launch: rank {rank} of {num_processes} {how}{hint}"


def _exit_message(rank: int, code: int | None, num_processes: int) -> str:
    return (
        f"{_how_it_ended(rank, code, num_processes)} before returning a result "
        "(os._exit, sys.exit or a crash in native code); the other ranks were "
        "stopped."
    )


def _wait(
    processes: list[BaseProcess],
    rundir: Path,
    deadline: float | None,
    timeout_s: float | None,
) -> list[_Outcome]:
    """Wait for every rank's outcome; kill all and raise on a failure or the deadline."""
    n = len(processes)
    outcomes: dict[int, _Outcome] = {}
    while len(outcomes) < n:
        for rank, process in enumerate(processes):
            if rank in outcomes:
                continue
            exited = not process.is_alive()  # read first: the file may come last
            outcome = _read_outcome(rundir, rank)
            if outcome is not None:
                outcomes[rank] = outcome
            elif exited:
                _kill(processes)
                msg = _exit_message(rank, process.exitcode, n)
                raise LaunchError(msg, rank=rank, traceback_text="")
        failures = [o for o in outcomes.values() if not o.ok]
        if failures:
            _kill(processes)
            # A rank blocked in a collective with the failed one may fail too;
            # collect what arrived so the first failure (the cause) is reported.
            for rank in range(n):
                if rank not in outcomes and (late := _read_outcome(rundir, rank)):
                    failures += [late] if not late.ok else []
            _raise_failure(failures, n)
        if deadline is not None and time.monotonic() > deadline:
            _kill(processes)
            waiting = [r for r in range(n) if r not in outcomes]
            msg = (
                f"launch: ranks {waiting} of {n} did not return within timeout_s="
                f"{timeout_s} s and were killed (a hang: a collective that only some "
                "ranks called, or uneven inputs without join_uneven_inputs?); raise "
                "timeout_s if the work needs longer."
            )
            raise TimeoutError(msg)
        time.sleep(_POLL_S)
    return [outcomes[rank] for rank in range(n)]


def _wait_for_exits(
    processes: list[BaseProcess], deadline: float | None, timeout_s: float | None
) -> None:
    """Wait for every rank to exit; raise if one failed after returning its result.

    A rank that returned and then died at interpreter exit (a crash in native
    code during teardown) is a failed job under torchrun too, so it is reported,
    not hidden; one that does not exit is waited for up to the ``timeout_s``
    deadline.
    """
    n = len(processes)
    for process in processes:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        process.join(timeout=left)
    hanging = [rank for rank, p in enumerate(processes) if p.exitcode is None]
    if hanging:
        plural = "s" if len(hanging) > 1 else ""
        msg = (
            f"launch: rank{plural} {hanging} of {n} returned their results but did "
            f"not exit within timeout_s={timeout_s} s (a hang at interpreter exit: "
            "a thread or process group still alive?) and were killed."
        )
        raise TimeoutError(msg)
    for rank, process in enumerate(processes):
        if process.exitcode != 0:
            msg = (
                f"{_how_it_ended(rank, process.exitcode, n)} after returning its "
                "result (a crash at interpreter exit); under torchrun this job "
                "would fail too."
            )
            raise LaunchError(msg, rank=rank, traceback_text="")


def launch(
    fn: Callable[[Unpack[Ts]], T],
    *args: Unpack[Ts],
    num_processes: int,
    timeout_s: float | None = None,
    start_method: StartMethod | None = None,
    backend: str | None = "gloo",
) -> list[T]:
    """Run ``fn(*args)`` on ``num_processes`` local processes; return their results.

    For a notebook or a test: each child gets torchrun's variables (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` ...) and a default process group on
    ``backend`` (none with ``None``), so ``build_context()`` inside ``fn`` returns
    that rank's context. This process's environment is not changed. A rank that
    raises or dies fails the call at once with a ``LaunchError`` naming it; the
    other ranks are killed, so nothing hangs.

    With 2 processes, ``launch(train, cfg, num_processes=2)`` runs ``train(cfg)``
    on rank 0 and rank 1 and returns ``[rank 0's result, rank 1's result]``. With
    one process and no ``start_method``, ``fn`` runs here, with no group:

    >>> launch(abs, -3, num_processes=1)
    [3]

    The start method (``"spawn"`` when ``fn`` can be imported by a new
    interpreter, else ``"fork"``; ``"forkserver"`` on request), the group, the
    failures and the timeout: docs/launch.md#launch-several-processes-from-a-notebook-or-a-test.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a value out of range, or a start method this platform lacks.
        RuntimeError: fork with CUDA or a process group initialised here.
        LaunchError: a rank raised (its traceback in the message, its exception
            as ``__cause__`` when it pickles) or died.
        TimeoutError: ``timeout_s`` passed first.
    """
    _check_arguments(fn, num_processes, timeout_s, start_method)
    if num_processes == 1 and start_method is None:
        return [fn(*args)]
    method: StartMethod = start_method or pick_start_method(fn, args)
    if method == "fork":
        _check_fork_is_safe()
    context = multiprocessing.get_context(method)
    if method == "forkserver":  # read when the server starts, ignored after
        context.set_forkserver_preload(list(_FORKSERVER_PRELOAD))
    rundir = Path(tempfile.mkdtemp(prefix="funcaccel-launch-"))
    processes: list[BaseProcess] = []
    try:
        for rank in range(num_processes):
            process = context.Process(  # type: ignore[attr-defined]
                target=_child,
                args=(rank, num_processes, rundir, backend, fn, args),
                name=f"funcaccel-rank-{rank}",
            )
            try:
                process.start()
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                msg = (
                    f"launch: cannot send fn or its arguments to a {method!r} child: "
                    f"{error}; define fn in a module with picklable arguments, or "
                    "leave start_method=None."
                )
                raise TypeError(msg) from error
            processes.append(process)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outcomes = _wait(processes, rundir, deadline, timeout_s)
        _wait_for_exits(processes, deadline, timeout_s)
        results: list[T] = [pickle.loads(o.payload) for o in outcomes]
        return results
    finally:
        _kill(processes)
        shutil.rmtree(rundir, ignore_errors=True)
