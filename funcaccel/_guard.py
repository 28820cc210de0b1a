"""Fail within a bound, naming the call, when a collective is called on only some ranks.

A collective that only some ranks call (``save_checkpoint`` under
``if ctx.is_main_process``) would wait in the backend for the process group's
timeout and end in the backend's error, which names neither the funcaccel call nor
the fact that it is collective. So every funcaccel function that communicates
calls ``guard_collective`` right before its first message; by default the bound is
the process group's own timeout (``ctx.collective_timeout=None``), a shorter one can
be set, and ``collective_timeout="off"`` skips the check.

The check costs a constant number of operations on the process group's key-value
store per rank and call, whatever the world size (the store every backend
rendezvoused through):

1. ``add`` to this rank's call counter gives the call's number ``n``;
2. ``compare_set`` of the call's name under ``n``: the first rank to arrive writes
   its name, every later one reads it back; a rank reading another name has
   reached a different collective and settles the decision "mismatch" at once;
3. ``add`` to the arrival count of ``n``: the rank that makes it ``world_size``
   settles the decision "arrived" (and deletes call ``n - 1``'s keys, which every
   rank has finished with once all reached ``n``);
4. ``wait`` for the decision (at most the bound) and ``get`` it. A rank that runs
   out of time settles "rank r gave up", naming the ranks whose counters show they
   never reached ``n`` (read only on this failure path).

Every rank that reaches the call reads the same decision (``compare_set`` settles
it once), so a rank arriving after another gave up raises too instead of entering
a collective nobody else will join. No tensor moves and the backend is not
touched, but a failed guard leaves the ranks disagreeing on how many collectives
they have made: treat the ``RuntimeError`` as the end of the run (fix the call,
then restart), not as something to retry.

On a failure, and only then, each rank that raises first writes a report,
``rank<r>.txt`` under ``ctx.hang_report_dir`` (by default
``funcaccel-hang-<parent pid>`` under ``tempfile.gettempdir()``): its rank, the
call and its number, the time and the Python stack of every thread. A rank that
gave up waiting also reads, for each missing rank, its counter and the call name
recorded under that number, and names them as that rank's last known call. An
``OSError`` while writing the report is told in the error, never raised instead.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any
from typing import Final
from typing import Protocol

from torch.distributed import distributed_c10d as c10d

from funcaccel._checks import summary
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group

__all__ = ["KeyValueStore", "guard_collective", "hang_report_dir", "settle_arrival"]

_PREFIX: Final = "funcaccel/collective_guard/"
_ARRIVED: Final = "arrived"
_CALLER_LIMIT: Final = 60
# How long a rank that learnt of a mismatch waits for the others' call names.
_LISTING_WAIT: Final = timedelta(seconds=10)
_AFTER_FAILURE: Final = (
    "The ranks now disagree on how many collectives they have made, so later "
    "collectives may fail or hang: end the run (close_context) instead of "
    "continuing."
)


class KeyValueStore(Protocol):
    """What the guard needs of a store (torch's ``Store`` classes have it)."""

    def add(self, key: str, value: int, /) -> int: ...
    def compare_set(self, key: str, expected: str, desired: str, /) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def set(self, key: str, value: str, /) -> None: ...
    def check(self, keys: list[str], /) -> bool: ...
    def delete_key(self, key: str, /) -> bool: ...


def _group_timeout(store: c10d.Store) -> timedelta:
    # The default store was made with the group's timeout (init_process_group
    # passes it on); its stubs do not declare the attribute.
    timeout: object = getattr(store, "timeout", None)
    return timeout if isinstance(timeout, timedelta) else c10d.default_pg_timeout


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g} s"


def guard_collective(ctx: DistributedContext, caller: str) -> None:
    """Return once every rank has reached this same collective, or raise.

    Does nothing with one process or with ``ctx.collective_timeout="off"``; waits
    at most ``ctx.collective_timeout``, or the process group's timeout when that
    is ``None`` (the default). Call it right before the first message a collective
    sends, after every check a single rank could fail (a rank that raises before
    the guard is then named as missing, instead of leaving the others in the
    collective). The guard is itself a barrier: no rank returns before every rank
    called it.

    With 2 ranks and ``collective_timeout=3``: rank 0 calls ``save_checkpoint``
    and rank 1 does not; after 3 s rank 0 raises ``save_checkpoint: a collective
    call; rank 1 did not reach it within 3 s ...``. Had rank 1 called ``gather``
    instead, both would raise at once, naming both calls.

    Args:
        ctx: the distributed context; its ``collective_timeout`` bounds the wait.
        caller: the public function about to communicate, as the messages name it.

    Raises:
        RuntimeError: no matching process group; a rank did not reach the call
            within the bound (or another gave up before this one arrived); or
            ranks reached different collectives. The ranks' collective counts then
            disagree, so the process group should not be used again.
    """
    if ctx.num_processes == 1 or ctx.collective_timeout == "off":
        return
    require_process_group(ctx, caller)
    # The default group's store is the one rendezvous every backend shares; torch
    # offers no public accessor for it, so this is the one place that reaches it.
    base = c10d._get_default_store()
    timeout = ctx.collective_timeout
    if not isinstance(timeout, timedelta):  # None: the group's own timeout
        timeout = _group_timeout(base)
    store = c10d.PrefixStore(_PREFIX, base)
    rank, world = ctx.process_index, ctx.num_processes
    settled, number = settle_arrival(store, rank, world, caller, timeout)
    if settled is None:
        return
    report = write_hang_report(hang_report_dir(ctx), rank, caller, number)
    if settled["kind"] == "missing":
        last = last_known_calls(store, settled["missing"], number)
        _raise_missing(rank, caller, timeout, settled, last_calls=last, report=report)
    _raise_mismatch(store, rank, world, caller, number, timeout, report=report)


def hang_report_dir(ctx: DistributedContext) -> Path:
    """Return where a failed collective check writes this rank's report.

    ``ctx.hang_report_dir`` when set, else ``funcaccel-hang-<parent pid>`` under
    ``tempfile.gettempdir()``: the ranks a launcher starts on one machine share
    their parent (torchrun's agent, ``srun``'s step daemon, ``mpirun``'s), so
    they share the directory.
    """
    if ctx.hang_report_dir is not None:
        return Path(ctx.hang_report_dir)
    return Path(tempfile.gettempdir()) / f"funcaccel-hang-{os.getppid()}"


def write_hang_report(directory: Path, rank: int, caller: str, number: int) -> str:
    """Write ``directory/rank<rank>.txt``; return a sentence for the error.

    The file holds the rank, the call and its number, the time (UTC) and the
    stack of every thread of this process. The sentence names the file, or,
    when writing it raised an ``OSError``, says so (the error is not raised:
    it must not hide the failed collective).
    """
    path = directory / f"rank{rank}.txt"
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = [
        f"rank: {rank}",
        f"call: {caller}",
        f"call number: {number}",
        f"time: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        f"pid: {os.getpid()}",
    ]
    for ident, frame in sys._current_frames().items():
        lines.append(f"\nthread {names.get(ident, '?')} (id {ident}):")
        lines.append("".join(traceback.format_stack(frame)).rstrip("\n"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    except OSError as error:
        return (
            f"Writing this rank's report to {path} failed ({summary(error)}); set "
            "ctx.hang_report_dir to a writable directory."
        )
    return (
        f"This rank's call and every thread's stack are in {path} (each rank whose "
        f"check fails writes rank<r>.txt in {directory}; set ctx.hang_report_dir "
        "to choose it)."
    )


def last_known_calls(store: KeyValueStore, ranks: list[int], number: int) -> str:
    """Describe each rank's last guarded call from its counter and that call's name.

    ``number`` is the call the ranks were waited for. The name is the one
    recorded under the rank's count (the first arriver's); it stays in the store
    while the rank has not reached the next call. A rank whose count reached
    ``number`` since arrived late, and is said to have.

    >>> from torch.distributed import HashStore
    >>> store = HashStore()
    >>> _ = store.add("count/1", 1)
    >>> store.set("name/1", "gather")
    >>> last_known_calls(store, [1, 2], 2)
    'rank 1: gather (call 1); rank 2: no funcaccel collective yet'
    """
    parts = []
    for r in ranks:
        count = store.add(f"count/{r}", 0)
        if count == 0:
            parts.append(f"rank {r}: no funcaccel collective yet")
            continue
        if count >= number:
            parts.append(f"rank {r}: arrived after the wait ran out (call {count})")
            continue
        key = f"name/{count}"
        name = store.get(key).decode() if store.check([key]) else "?"
        parts.append(f"rank {r}: {name} (call {count})")
    return "; ".join(parts)


def settle_arrival(
    store: KeyValueStore, rank: int, world: int, caller: str, timeout: timedelta
) -> tuple[dict[str, Any] | None, int]:
    """Arrive at this rank's next guarded call; return the decision and its number.

    The decision is ``None`` when every rank arrived with the same call, else a
    dict: ``{"kind": "mismatch", "rank": r}`` (rank ``r`` found another call's
    name) or ``{"kind": "missing", "rank": r, "missing": [...]}`` (rank ``r`` gave
    up waiting; ``missing`` the ranks that had not arrived). Five store operations
    per rank on the way through (``add``, ``compare_set``, ``add``, ``wait``,
    ``get``), four more on the rank that arrives last.
    """
    name = caller[:_CALLER_LIMIT]
    number = store.add(f"count/{rank}", 1)
    decision_key = f"decision/{number}"
    first = store.compare_set(f"name/{number}", "", name).decode()
    if first != name:
        mismatch = json.dumps({"kind": "mismatch", "rank": rank})
        store.compare_set(decision_key, "", mismatch)
    elif store.add(f"arrived/{number}", 1) == world:
        store.compare_set(decision_key, "", _ARRIVED)
        if number > 1:  # every rank is done with the call before
            for key in ("name", "arrived", "decision"):
                store.delete_key(f"{key}/{number - 1}")
    try:
        store.wait([decision_key], timeout)
    except RuntimeError:  # the store's timeout (DistStoreError on TCPStore)
        counts = [store.add(f"count/{r}", 0) for r in range(world)]
        missing = [r for r, count in enumerate(counts) if count < number]
        gave_up = json.dumps({"kind": "missing", "rank": rank, "missing": missing})
        store.compare_set(decision_key, "", gave_up)
    decision = store.get(decision_key).decode()
    settled: dict[str, Any] | None = (
        None if decision == _ARRIVED else json.loads(decision)
    )
    return settled, number


def _raise_mismatch(
    store: KeyValueStore,
    rank: int,
    world: int,
    caller: str,
    number: int,
    timeout: timedelta,
    *,
    report: str,
) -> None:
    # The failure path only: each rank writes its call's name, then lists every
    # rank's (a rank that does not write in time shows as "?").
    keys = [f"who/{number}/{r}" for r in range(world)]
    store.set(keys[rank], caller[:_CALLER_LIMIT])
    try:
        store.wait(keys, min(timeout, _LISTING_WAIT))
    except RuntimeError:
        pass
    names = [store.get(key).decode() if store.check([key]) else "?" for key in keys]
    listing = ", ".join(f"rank {r}: {name}" for r, name in enumerate(names))
    msg = (
        f"{caller}: a collective call, but the ranks reached different "
        f"collectives ({listing}); call the same funcaccel collectives in the "
        f"same order on every rank. {report} {_AFTER_FAILURE}"
    )
    raise RuntimeError(msg)


def _raise_missing(
    rank: int,
    caller: str,
    timeout: timedelta,
    decision: dict[str, Any],
    *,
    last_calls: str,
    report: str,
) -> None:
    gave_up, missing = decision["rank"], decision["missing"]
    if missing:
        ranks = ", ".join(map(str, missing))
        plural = "s" if len(missing) > 1 else ""
        what = f"rank{plural} {ranks} did not reach it within {_seconds(timeout)}"
    else:
        what = f"a rank reached it only after {_seconds(timeout)}"
    if rank in missing:
        what += f" (this rank arrived after rank {gave_up} gave up waiting)"
    msg = (
        f"{caller}: a collective call; {what}: call {caller} on every rank (not "
        "under `if ctx.is_main_process`), or raise collective_timeout if a rank is "
        "legitimately that much slower. "
        + (f"Last known funcaccel calls: {last_calls}. " if last_calls else "")
        + f"{report} {_AFTER_FAILURE}"
    )
    raise RuntimeError(msg)
