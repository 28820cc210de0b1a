"""SLURM's compressed lists, and the rendezvous port of a job.

SLURM writes node lists as ``node[01-04,07]`` or ``a[1-2],b3`` (zero padding
kept) and tasks per node as ``2(x3),1``; the port every task of a job meets on is
derived from the job id, so that no task has to tell the others.

>>> list(expand_nodelist("node[01-03,07],gpu5"))
['node01', 'node02', 'node03', 'node07', 'gpu5']
>>> expand_tasks_per_node("2(x3),1")
[2, 2, 2, 1]
>>> slurm_port(4242)
24242
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final
from typing import NoReturn

from funcaccel._checks import fail_value

__all__ = [
    "SLURM_PORT_BASE",
    "SLURM_PORT_SPAN",
    "expand_nodelist",
    "expand_tasks_per_node",
    "slurm_port",
]

_CALLER: Final = "context_from_env"
SLURM_PORT_BASE: Final = 20000
SLURM_PORT_SPAN: Final = 12000
"""The SLURM port is ``20000 + job_id % 12000``: unprivileged, below Linux's
ephemeral range (32768 and up), the same on every task of a job."""


def expand_nodelist(text: str) -> Iterator[str]:
    """Yield the hosts of a SLURM node list such as ``a[1-2,07],b3``, in order.

    Zero padding is kept (``n[08-10]`` gives n08, n09, n10); several bracket
    groups in one name multiply out. Raises ``ValueError`` on malformed text.
    """
    for name in _split_top(text):
        yield from _expand_name(text, name)


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            _bad_nodelist(text)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    if depth != 0 or any(not part.strip() for part in parts):
        _bad_nodelist(text)
    return [part.strip() for part in parts]


def _expand_name(text: str, name: str) -> Iterator[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", name)
    if match is None:
        if "[" in name or "]" in name:
            _bad_nodelist(text)
        yield name
        return
    head, ranges, tail = match.groups()
    for item in ranges.split(","):
        bounds = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if bounds is None:
            _bad_nodelist(text)
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(high) < int(low):
            _bad_nodelist(text)
        for number in range(int(low), int(high) + 1):
            for rest in _expand_name(text, tail):
                yield f"{head}{number:0{len(low)}d}{rest}"


def _bad_nodelist(text: str) -> NoReturn:
    what = "a SLURM node list such as 'node[01-04,07]' or 'a[1-2],b3'"
    fix = "Set MASTER_ADDR to the host of rank 0."
    fail_value(_CALLER, "the SLURM node list", text, what, fix)


def expand_tasks_per_node(text: str) -> list[int]:
    """Return SLURM's tasks per node, ``"2(x3),1"`` meaning ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            what = "SLURM's tasks per node, e.g. '2(x3),1'"
            fail_value(_CALLER, "SLURM_TASKS_PER_NODE", text, what)
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_port(job_id: int) -> int:
    """Return the rendezvous port of SLURM job ``job_id``: ``20000 + job_id % 12000``."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
