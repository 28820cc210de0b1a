"""Sequence packing for causal-LM training: documents into rows of a fixed length.

``pack_documents(documents, seq_len=L)`` reads a stream of tokenised documents and
yields rows of exactly ``L`` tokens, filled one document after another, so that
training wastes no compute on padding (only the stream's very last row is
padded). Each row is a dict of four ``L``-long int64 tensors:

- ``input_ids``: the tokens; ``pad_id`` after the last document of the stream.
- ``labels``: the target of each position in the Hugging Face convention (the
  model shifts: position ``t`` is predicted from positions ``< t``). A segment's
  first position is ``ignore_index``, so no label is ever predicted across a
  document boundary, and padding is ``ignore_index`` too.
- ``position_ids``: ``0, 1, 2, ...`` within each segment, restarting at every
  document (and at every row, where a document continues).
- ``segment_ids``: ``0, 1, 2, ...`` per segment within the row, ``-1`` on padding;
  ``document_attention_mask`` turns it into the causal mask that keeps attention
  inside each document.

A document longer than what is left of a row continues on the next row, whose
first token repeats the last token already placed (as context, with the
``ignore_index`` label), so every token of a document but its first is the
target of exactly one position: ``count_targets(labels)`` is the ``num_items``
of a token-weighted step (``accumulate_step(..., num_items=...)``).

The packed stream is *stateful* (``state_dict`` / ``load_state_dict``): its
position is the number of documents consumed and an offset into the current one,
plus the source's own ``state_dict()`` when the source has one, so a
``shard_loader`` over it resumes in O(1) (docs/data.md#packing).

With ``seq_len=4`` the documents ``[5, 6, 7]`` and ``[8, 9, 10, 11]`` make two
rows: ``[5, 6, 7, 8]`` (labels ``[-100, 6, 7, -100]``) and ``[8, 9, 10, 11]``
(labels ``[-100, 9, 10, 11]``), where the second row's ``8`` is context again.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import Final

import torch
from torch.utils.data import IterableDataset

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._stream_state import resumes_exactly

__all__ = [
    "PackedDocuments",
    "count_targets",
    "document_attention_mask",
    "pack_documents",
]

_WHERE: Final = "pack_documents"
_KEYS: Final = ("docs", "offset", "source")


class PackedDocuments(IterableDataset[dict[str, torch.Tensor]]):
    """The rows of ``pack_documents``; a stateful torch ``IterableDataset``.

    Build it with :func:`pack_documents`, whose arguments are its attributes.
    ``state_dict()`` is the position after the row yielded last;
    ``load_state_dict(state)`` makes the next iteration continue from it (once).
    """

    def __init__(
        self,
        documents: Iterable[Any],
        *,
        seq_len: int,
        pad_id: int,
        ignore_index: int,
        field: str | None,
    ) -> None:
        self.documents = documents
        self.seq_len, self.pad_id = seq_len, pad_id
        self.ignore_index, self.field = ignore_index, field
        self._position: dict[str, Any] = {"docs": 0, "offset": 0, "source": None}
        self._start: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Call the documents' own ``set_epoch(epoch)`` when they have one."""
        set_epoch = getattr(self.documents, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Return the position after the row yielded last (JSON values when the source's are).

        >>> rows = pack_documents([[1, 2, 3], [4, 5]], seq_len=2)
        >>> it = iter(rows); _ = next(it); rows.state_dict()
        {'docs': 0, 'offset': 2, 'source': None}
        """
        return copy.deepcopy(self._position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration continue after ``state`` (from ``state_dict()``).

        Raises:
            TypeError: ``state`` is not such a dict.
            ValueError: a key is missing or unknown, or a count is negative.
        """
        where = "PackedDocuments.load_state_dict"
        what = "the dict state_dict() returned"
        check_type(where, "state", state, dict, what=what)
        if sorted(state) != sorted(_KEYS):
            fail_value(
                where,
                "the keys of state",
                sorted(map(str, state)),
                f"exactly {list(_KEYS)}",
            )
        check_int(where, "state['docs']", state["docs"], 0)
        check_int(where, "state['offset']", state["offset"], 0)
        self._start = copy.deepcopy(state)

    def _tokens(self, document: Any) -> list[int]:
        item = document
        if self.field is not None:
            if not isinstance(document, dict) or self.field not in document:
                what = f"a dict with the key {self.field!r} (field=)"
                fail_type(_WHERE, "each document", document, what)
            item = document[self.field]
        if isinstance(item, torch.Tensor):
            if item.dim() != 1 or item.is_floating_point():
                what = "a 1-D tensor of token ids"
                fail_value(_WHERE, "each document", tuple(item.shape), what)
            return [int(t) for t in item.tolist()]
        if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
            if not all(type(t) is int for t in item):
                fail_type(_WHERE, "each document", item, "a sequence of int token ids")
            return list(item)
        hint = "Tokenise first, or pass field= to name the token list of a dict."
        fail_type(
            _WHERE, "each document", item, "a list or 1-D tensor of token ids", hint
        )

    def _source(self, start: dict[str, Any] | None) -> tuple[Any, Iterator[Any]]:
        """Return the documents object read and its iterator, positioned at ``start``."""
        documents: Any = self.documents
        loadable = resumes_exactly(documents)
        if start is not None and start["source"] is not None and loadable:
            documents = copy.deepcopy(documents)
            documents.load_state_dict(copy.deepcopy(start["source"]))
            return documents, iter(documents)
        iterator = iter(documents)
        for _ in range(0 if start is None else start["docs"]):
            next(iterator, None)  # a source without a state of its own: read and drop
        return documents, iterator

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start, self._start = self._start, None
        source, iterator = self._source(start)
        stateful = resumes_exactly(source)
        docs = 0 if start is None else start["docs"]
        # the first token of the current document not yet placed in a row
        offset = 0 if start is None else start["offset"]
        before: Any = None if start is None else start["source"]  # before document docs
        row = _Row(self.seq_len)
        for document in iterator:
            tokens = self._tokens(document)
            after = source.state_dict() if stateful else None
            # A continued document starts its segment with its last placed token
            # again, as context; a continuation always starts a row (room >= 2), so
            # each row places at least one new token.
            begin, offset = max(offset - 1, 0), 0
            while begin < len(tokens):
                end = row.add(tokens, begin)
                if not row.full:
                    break
                more = end < len(tokens)
                self._position = (
                    {"docs": docs, "offset": end, "source": before}
                    if more
                    else {"docs": docs + 1, "offset": 0, "source": after}
                )
                yield row.tensors(self.pad_id, self.ignore_index)
                row = _Row(self.seq_len)
                if not more:
                    break
                begin = end - 1
            docs, before = docs + 1, after
        self._position = {"docs": docs, "offset": 0, "source": before}
        if not row.empty:
            yield row.tensors(self.pad_id, self.ignore_index)


class _Row:
    """One row being filled: its segments' tokens."""

    def __init__(self, seq_len: int) -> None:
        self.segments: list[list[int]] = []
        self.used, self.seq_len = 0, seq_len

    @property
    def full(self) -> bool:
        return self.used == self.seq_len

    @property
    def empty(self) -> bool:
        return self.used == 0

    def add(self, tokens: list[int], begin: int) -> int:
        """Place ``tokens[begin:]`` as a new segment, as much as fits; return its end."""
        end = min(len(tokens), begin + self.seq_len - self.used)
        self.segments.append(tokens[begin:end])
        self.used += end - begin
        return end

    def tensors(self, pad_id: int, ignore_index: int) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        segments: list[int] = []
        for s, segment in enumerate(self.segments):
            ids += segment
            labels += [ignore_index, *segment[1:]]
            positions += range(len(segment))
            segments += [s] * len(segment)
        pad = self.seq_len - len(ids)
        return {
            "input_ids": torch.tensor(ids + [pad_id] * pad, dtype=torch.int64),
            "labels": torch.tensor(labels + [ignore_index] * pad, dtype=torch.int64),
            "position_ids": torch.tensor(
                positions + list(range(pad)), dtype=torch.int64
            ),
            "segment_ids": torch.tensor(segments + [-1] * pad, dtype=torch.int64),
        }


def pack_documents(
    documents: Iterable[Any],
    *,
    seq_len: int,
    pad_id: int = 0,
    ignore_index: int = -100,
    field: str | None = None,
) -> PackedDocuments:
    """Pack tokenised ``documents`` into rows of ``seq_len`` tokens (a stateful stream).

    ``documents`` is left unchanged (a resume loads a deep copy of it).

    >>> rows = list(pack_documents([[5, 6, 7], [8, 9, 10, 11]], seq_len=4))
    >>> [(r["input_ids"].tolist(), r["labels"].tolist()) for r in rows]
    [([5, 6, 7, 8], [-100, 6, 7, -100]), ([8, 9, 10, 11], [-100, 9, 10, 11])]
    >>> rows[0]["position_ids"].tolist(), rows[0]["segment_ids"].tolist()
    ([0, 1, 2, 0], [0, 0, 0, 1])
    >>> sum(int(count_targets(r["labels"])) for r in rows)  # (3 - 1) + (4 - 1)
    5

    Args:
        documents: An iterable (a torch ``IterableDataset``, a ``datasets``
            stream, a list) of documents: lists or 1-D int tensors of token ids,
            or dicts holding one under ``field``. A source with ``state_dict`` /
            ``load_state_dict`` makes the packed stream resume in O(1).
        seq_len: The row length ``L`` (>= 2).
        pad_id: The token that pads the stream's last row.
        ignore_index: The label of positions that predict nothing.
        field: The key of the token ids when documents are dicts.

    Returns:
        A ``PackedDocuments`` stream of row dicts.

    Raises:
        TypeError: an argument of the wrong type (a document: when it is read).
        ValueError: ``seq_len < 2``.
    """
    if not isinstance(documents, Iterable):
        fail_type(_WHERE, "documents", documents, "an iterable of documents")
    check_int(_WHERE, "seq_len", seq_len, 2)
    if type(pad_id) is not int:
        fail_type(_WHERE, "pad_id", pad_id, "an int token id")
    if type(ignore_index) is not int:
        fail_type(_WHERE, "ignore_index", ignore_index, "an int")
    check_type(_WHERE, "field", field, str, optional=True)
    return PackedDocuments(
        documents,
        seq_len=seq_len,
        pad_id=pad_id,
        ignore_index=ignore_index,
        field=field,
    )


def count_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Return how many positions of ``labels`` are predicted: the ``num_items`` of a step.

    >>> count_targets(torch.tensor([[-100, 6, 7, -100]]))
    tensor(2)
    """
    return (labels != ignore_index).sum()


def document_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Return the causal mask that keeps attention inside each packed document.

    ``mask[..., i, j]`` is true when position ``i`` may attend to ``j``: ``j <= i``
    in the same segment (padding, ``-1``, attends to itself only).

    >>> document_attention_mask(torch.tensor([0, 0, 1])).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    n = segment_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=segment_ids.device).tril()
    padding = (segment_ids < 0).unsqueeze(-1) & torch.eye(
        n, dtype=torch.bool, device=segment_ids.device
    )
    return (same & causal & (segment_ids >= 0).unsqueeze(-1)) | padding
