"""Profile a block of training code on chosen ranks and write Chrome traces per rank.

``build_profiler(ctx, kwargs)`` returns a context manager that starts the
``torch.profiler.profile`` that ``ProfileKwargs.build()`` describes and yields it. With
``output_trace_dir`` set, each rank writes its own files there (no barrier, no
communication), named by ``profiler_trace_path``:

- ``profile_<rank>.json``: written after the body exits normally (docs/profiler.md#semantics-profiling-and-trace-files); with
  2 ranks, ``profile_0.json`` and ``profile_1.json``.
- ``profile_<rank>_cycle<N>.json``: with a ``schedule_option`` and no user
  ``on_trace_ready``, one file per active window completed by ``prof.step()``,
  ``N`` counting the windows from 0 in each ``build_profiler`` call.

How the two interact with a schedule. torch keeps only the most recent window and
hands it to ``on_trace_ready`` when ``prof.step()`` leaves the window's last active
step, or when the profiler stops inside a window (cut short). The cycle files hold
the completed windows; ``profile_<rank>.json`` holds the most recent trace torch
produced: the window the end of the body cut short when there is one (it appears in
no cycle file), else the last completed window (a copy of the last cycle file).
Call ``prof.step()`` at the end of every iteration, as torch expects. With
``wait=1, warmup=1, active=2`` and 7 iterations, ``profile_0_cycle0.json`` holds
iterations 2-3 and ``profile_0.json`` iteration 6. A body that ends before the
schedule's first active step has recorded nothing, and ``build_profiler`` raises
``ValueError`` rather than write an empty trace.

A user ``on_trace_ready`` gets every trace torch produces, as without funcaccel, and
replaces the cycle files; when it saves the trace itself (torch saves a trace only
once), the final file is written by torch's Python exporter, with the same events.

When the body raises, nothing more is written: no ``profile_<rank>.json`` and no
cycle file for the window open at that moment; cycle files already written stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Iterator
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from typing import Final
from typing import overload

import torch
import torch.autograd.profiler
import torch.profiler

from funcaccel._checks import check_index
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import make_dirs
from funcaccel._checks import summary
from funcaccel._ctx_checks import check_context
from funcaccel.context import DistributedContext
from funcaccel.kwargs import ProfileKwargs

__all__ = ["build_profiler", "profiler_trace_path"]

_OWNER: Final = "build_profiler"


def profiler_trace_path(
    trace_dir: str | os.PathLike[str], process_index: int, cycle: int | None = None
) -> Path:
    """Return where ``build_profiler`` writes a rank's trace (or one schedule cycle).

    Args:
        trace_dir: the ``output_trace_dir`` of the ``ProfileKwargs``.
        process_index: the rank that writes the file.
        cycle: the 0-based index of a completed schedule window, or ``None`` for the
            trace written when the body ends.

    Returns:
        ``<trace_dir>/profile_<process_index>.json``, or
        ``<trace_dir>/profile_<process_index>_cycle<cycle>.json``.

    >>> profiler_trace_path("traces", 1).as_posix()
    'traces/profile_1.json'
    >>> profiler_trace_path("traces", 0, cycle=2).as_posix()
    'traces/profile_0_cycle2.json'
    """
    suffix = "" if cycle is None else f"_cycle{cycle}"
    return Path(trace_dir) / f"profile_{process_index}{suffix}.json"


@dataclasses.dataclass(slots=True, kw_only=True)
class _TraceSink:
    """The ``on_trace_ready`` of one ``build_profiler`` call: it writes cycle files
    and keeps the latest trace for the final export.

    Mutable by nature (torch calls it once per window); it lives only as long as the
    context manager that created it.
    """

    trace_dir: Path
    process_index: int
    write_cycles: bool
    user_handler: Callable[[torch.profiler.profile], Any] | None
    cycles_written: int = 0
    latest: torch.autograd.profiler.profile | None = None
    latest_file: Path | None = None
    stopping: bool = False
    abandoned: bool = False

    def __call__(self, prof: torch.profiler.profile) -> None:
        if self.user_handler is not None:
            self.user_handler(prof)
        if self.abandoned:
            return
        if self.write_cycles and not self.stopping:
            path = profiler_trace_path(
                self.trace_dir, self.process_index, self.cycles_written
            )
            make_dirs(_OWNER, "output_trace_dir", self.trace_dir)
            prof.export_chrome_trace(str(path))
            self.cycles_written += 1
            # torch saves a trace once; the final file will be a copy of this one.
            self.latest, self.latest_file = None, path
        else:
            # Hold the window's own recorder: torch replaces ``prof.profiler`` when
            # the next window starts, but the old one keeps its results.
            self.latest, self.latest_file = prof.profiler, None


def _export_final(
    sink: _TraceSink, prof: torch.profiler.profile, schedule: Mapping[str, int] | None
) -> None:
    path = profiler_trace_path(sink.trace_dir, sink.process_index)
    if sink.latest_file is not None:
        shutil.copyfile(sink.latest_file, path)
        return
    if sink.latest is None:
        msg = (
            f"{_OWNER}: nothing was recorded to export to {str(path)!r}: the body "
            f"ended at profiler step {prof.step_num}, before the first active step "
            f"of schedule_option={summary(schedule)}; call prof.step() once per iteration "
            "and run more iterations, or lower wait, warmup or skip_first."
        )
        raise ValueError(msg)
    make_dirs(_OWNER, "output_trace_dir", sink.trace_dir)
    try:
        # torch ships the recorder's export method without annotations.
        sink.latest.export_chrome_trace(str(path))  # type: ignore[no-untyped-call]
    except RuntimeError:
        # The user's on_trace_ready already saved this trace (torch's own saver
        # runs once per trace); torch's Python exporter writes the same events.
        sink.latest.export_chrome_trace(str(path), use_python_export=True)  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def _profiling_ctx(
    prof: torch.profiler.profile,
    sink: _TraceSink | None,
    schedule: Mapping[str, int] | None,
) -> Iterator[torch.profiler.profile]:
    with prof:
        try:
            yield prof
        except BaseException:
            if sink is not None:
                sink.abandoned = True
            raise
        # Whatever torch delivers from here on comes from stopping the profiler.
        if sink is not None:
            sink.stopping = True
    if sink is not None:
        _export_final(sink, prof, schedule)


def _check_ranks(ctx: DistributedContext, ranks: Collection[int]) -> frozenset[int]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Collection):
        what = "a collection of ints such as [0] or None for all ranks"
        fail_type(_OWNER, "ranks", ranks, what)
    for rank in ranks:
        check_type(_OWNER, "every item of ranks", rank, int)
        n = ctx.num_processes
        check_index(_OWNER, "every item of ranks", rank, "num_processes", n)
    return frozenset(ranks)


@overload
def build_profiler(
    ctx: DistributedContext, kwargs: ProfileKwargs | None = None, *, ranks: None = None
) -> AbstractContextManager[torch.profiler.profile]: ...


@overload
def build_profiler(
    ctx: DistributedContext,
    kwargs: ProfileKwargs | None = None,
    *,
    ranks: Collection[int],
) -> AbstractContextManager[torch.profiler.profile | None]: ...


def build_profiler(
    ctx: DistributedContext,
    kwargs: ProfileKwargs | None = None,
    *,
    ranks: Collection[int] | None = None,
) -> AbstractContextManager[torch.profiler.profile | None]:
    """Return a context manager that profiles its body on the chosen ranks.

    On a profiling rank, entering it starts the profiler ``kwargs.build()`` returns
    and yields it (call ``prof.step()`` at the end of each iteration when a schedule
    is set); leaving it stops the profiler and, with ``output_trace_dir`` set and a
    normal exit, writes ``profile_<process_index>.json`` there (see the module
    docstring for the schedule's per-cycle files). Other ranks get a context that
    does nothing and yields ``None``. No rank waits for another.

    Activities default to CPU, plus CUDA when ``ctx.device`` is a CUDA device; a
    user ``on_trace_ready`` is still called for every trace torch produces.

    With ``ranks=[0]`` on 2 processes, rank 0 yields a running profiler and writes
    ``profile_0.json``; rank 1 yields ``None`` and writes nothing.

    Args:
        ctx: the distributed context; its ``process_index`` names the files.
        kwargs: the profiler options; ``ProfileKwargs()`` when ``None``.
        ranks: the ranks that profile; all when ``None``.

    Returns:
        A single-use context manager yielding the started profiler, or ``None`` on a
        rank not in ``ranks``.

    Raises:
        TypeError: ``ctx``, ``kwargs`` or ``ranks`` of the wrong type.
        ValueError: a rank out of range, an activity this machine cannot profile,
            or (on exit) a schedule that never reached an active step.
        OSError: ``output_trace_dir`` cannot be created.
    """
    check_context(_OWNER, ctx)
    if kwargs is None:
        kwargs = ProfileKwargs()
    what = "a ProfileKwargs or None"
    kwargs = check_type(_OWNER, "kwargs", kwargs, ProfileKwargs, what=what)
    if ranks is not None and ctx.process_index not in _check_ranks(ctx, ranks):
        return contextlib.nullcontext(None)
    if kwargs.activities is None:
        on_cuda = ctx.device.type == "cuda"
        kwargs = dataclasses.replace(
            kwargs, activities=("cpu", "cuda") if on_cuda else ("cpu",)
        )
    sink = None
    if kwargs.output_trace_dir is not None:
        sink = _TraceSink(
            trace_dir=Path(kwargs.output_trace_dir),
            process_index=ctx.process_index,
            write_cycles=(
                kwargs.schedule_option is not None and kwargs.on_trace_ready is None
            ),
            user_handler=kwargs.on_trace_ready,
        )
        kwargs = dataclasses.replace(kwargs, on_trace_ready=sink)
    return _profiling_ctx(kwargs.build(), sink, kwargs.schedule_option)
