"""Whether a stream's own ``state_dict()`` resumes it exactly: a leaf both the loader and packing ask.

A stream with ``state_dict()`` and ``load_state_dict(state)`` resumes where the
state says; one kind does not: a ``datasets.IterableDataset`` shuffled through a
buffer (``.shuffle(buffer_size=...)``) saves no buffer content, so a resume
refills the buffer and silently loses the samples it held (``datasets`` says so
in its ``state_dict`` documentation). Such a stream is read as a stream without
a state: its resume replays the skipped samples, exactly.
"""

from __future__ import annotations

from typing import Final

__all__ = ["resumes_exactly"]

# datasets' class of a buffer-shuffled stream, found along its chain of example
# iterables (the attributes ``_ex_iterable``, then ``ex_iterable`` /
# ``ex_iterables``): no public API says whether a stream shuffles through a buffer.
_LOSSY: Final = frozenset({"BufferShuffledExamplesIterable"})


def _lossy(node: object, depth: int = 0) -> bool:
    if node is None or depth > 64:
        return False
    if type(node).__name__ in _LOSSY:
        return True
    inner = getattr(node, "ex_iterables", None)
    children = list(inner) if isinstance(inner, (list, tuple)) else []
    children.append(getattr(node, "ex_iterable", None))
    return any(_lossy(child, depth + 1) for child in children)


def resumes_exactly(stream: object) -> bool:
    """Whether ``stream`` has ``state_dict`` / ``load_state_dict`` that resume it exactly.

    >>> class Counter:
    ...     def state_dict(self): return {}
    ...     def load_state_dict(self, state): pass
    >>> resumes_exactly(Counter()), resumes_exactly([1, 2])
    (True, False)
    """
    stateful = callable(getattr(stream, "state_dict", None)) and callable(
        getattr(stream, "load_state_dict", None)
    )
    if not stateful:
        return False
    chain = getattr(stream, "_ex_iterable", None)
    if chain is None and type(stream).__module__.split(".")[0] == "datasets":
        # A datasets stream whose chain cannot be read (a datasets release that
        # renamed it) may shuffle through a buffer: replaying is exact, loading
        # might not be.
        return False
    return not _lossy(chain)
