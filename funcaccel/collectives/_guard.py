"""Fail fast, naming the call, when a collective is called on only some ranks.

A collective that only some ranks call (``save_checkpoint`` under
``if ctx.is_main_process``) waits for the process group's timeout, 30 minutes on
gloo, and then fails with the backend's error, which names neither the funcaccel
call nor the fact that it is collective. With ``ctx.collective_timeout`` set, every
funcaccel function that communicates calls ``guard_collective`` right before its
first message:

1. each rank counts its guarded calls in the process group's key-value store (the
   one every backend rendezvoused through, so NCCL and gloo alike) and writes the
   name of this call under its number;
2. it waits, at most ``ctx.collective_timeout``, for every rank's name under the
   same number;
3. one decision per call is settled atomically (``compare_set``): "everyone
   arrived" by the first rank that saw every name, or "rank 0 gave up; ranks
   [1] missing" by the first that ran out of time. Every rank that reaches the
   call reads the same decision, so a rank arriving after another gave up raises
   too instead of entering a collective nobody else will join;
4. with everyone arrived, every rank compares the names, so ranks that reached
   different collectives (rank 0 ``save_checkpoint``, rank 1 ``gather``) all raise.

No tensor moves and the backend is not touched, but a failed guard leaves the ranks
disagreeing on how many collectives they have made: treat the ``RuntimeError`` as
the end of the run (fix the call, then restart), not as something to retry.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Final

from torch.distributed import distributed_c10d as c10d

from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group

__all__ = ["guard_collective"]

_PREFIX: Final = "funcaccel/collective_guard/"
_ARRIVED: Final = "arrived"
_CALLER_LIMIT: Final = 60
_AFTER_FAILURE: Final = (
    "The ranks now disagree on how many collectives they have made, so later "
    "collectives may fail or hang: end the run (close_context) instead of "
    "continuing."
)


def _store() -> c10d.Store:
    # The default group's store is the one rendezvous every backend shares; torch
    # offers no public accessor for it, so this is the one place that reaches it.
    return c10d.PrefixStore(_PREFIX, c10d._get_default_store())


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g} s"


def guard_collective(ctx: DistributedContext, caller: str) -> None:
    """Return once every rank has reached this same collective, or raise.

    Does nothing with one process or when ``ctx.collective_timeout`` is ``None``.
    Call it right before the first message a collective sends, after every check
    a single rank could fail (a rank that raises before the guard is then named
    as missing, instead of leaving the others in the collective). While the guard
    is on it is itself a barrier: no rank returns before every rank called it.

    With 2 ranks and ``collective_timeout=3``: rank 0 calls
    ``save_checkpoint`` and rank 1 does not; after 3 s rank 0 raises
    ``save_checkpoint: a collective call; rank 1 did not reach it within 3 s ...``.
    Had rank 1 called ``gather`` instead, both would raise, naming both calls.

    Args:
        ctx: the distributed context; its ``collective_timeout`` bounds the wait.
        caller: the public function about to communicate, as the messages name it.

    Raises:
        RuntimeError: no matching process group; a rank did not reach the call
            within the bound (or another gave up before this one arrived); or
            ranks reached different collectives. The ranks' collective counts then
            disagree, so the process group should not be used again.
    """
    timeout = ctx.collective_timeout
    if timeout is None or ctx.num_processes == 1:
        return
    assert isinstance(timeout, timedelta)  # DistributedContext normalises it
    require_process_group(ctx, caller)
    store = _store()
    rank, world = ctx.process_index, ctx.num_processes
    number = store.add(f"count/{rank}", 1)
    keys = [f"call/{number}/{r}" for r in range(world)]
    store.set(keys[rank], caller[:_CALLER_LIMIT])
    try:
        store.wait(keys, timeout)
        proposal = _ARRIVED
    except RuntimeError:  # the store's timeout (DistStoreError on TCPStore)
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        proposal = json.dumps({"rank": rank, "missing": missing})
    decision = store.compare_set(f"decision/{number}", "", proposal).decode()
    if decision != _ARRIVED:
        _raise_missing(ctx, caller, timeout, json.loads(decision))
    callers = [value.decode() for value in store.multi_get(keys)]
    if any(name != callers[0] for name in callers):
        listing = ", ".join(f"rank {r}: {name}" for r, name in enumerate(callers))
        msg = (
            f"{caller}: a collective call, but the ranks reached different "
            f"collectives ({listing}); call the same funcaccel collectives in the "
            f"same order on every rank. {_AFTER_FAILURE}"
        )
        raise RuntimeError(msg)
    if number > 2:
        # Every rank has finished call number - 2: each has written its name for
        # number - 1, which it does only after returning from the call before.
        store.delete_key(f"call/{number - 2}/{rank}")
        if ctx.is_main_process:
            store.delete_key(f"decision/{number - 2}")


def _raise_missing(
    ctx: DistributedContext, caller: str, timeout: timedelta, decision: object
) -> None:
    assert isinstance(decision, dict)
    gave_up, missing = decision["rank"], decision["missing"]
    if missing:
        ranks = ", ".join(map(str, missing))
        plural = "s" if len(missing) > 1 else ""
        what = f"rank{plural} {ranks} did not reach it within {_seconds(timeout)}"
    else:
        what = f"a rank reached it only after {_seconds(timeout)}"
    if ctx.process_index in missing:
        what += f" (this rank arrived after rank {gave_up} gave up waiting)"
    msg = (
        f"{caller}: a collective call; {what}: call {caller} on every rank (not "
        "under `if ctx.is_main_process`), or raise collective_timeout if a rank is "
        f"legitimately that much slower. {_AFTER_FAILURE}"
    )
    raise RuntimeError(msg)
