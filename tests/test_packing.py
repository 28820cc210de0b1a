"""Sequence packing: no label across a document, every target once, O(1) resume.

Documents are drawn with tokens that name them (``1000 * (d + 1) + i`` is token
``i`` of document ``d``), so every predicted pair (context token, label) says
which document and which position it belongs to. Properties (Hypothesis): each
label's context is its predecessor in the same document; every token of every
document but its first is the target of exactly one position over the epoch;
``count_targets`` equals that count; rows are exactly ``seq_len`` long; resuming
from any row's ``state_dict()`` yields the rest of the rows, reading no document
before the current one when the source has a state of its own. A packed stream
through ``shard_loader`` resumes in O(1), and a one-process token-weighted step
over packed rows gives the gradient of the summed per-token loss of the
documents, computed here document by document.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.packing import count_targets
from funcaccel.packing import document_attention_mask
from funcaccel.packing import pack_documents
from funcaccel.testing import rank_ctx

IGNORE = -100


def _docs(lengths: list[int]) -> list[list[int]]:
    return [[1000 * (d + 1) + i for i in range(n)] for d, n in enumerate(lengths)]


class Documents(IterableDataset[dict[str, list[int]]]):
    """The documents as a stateful stream of dicts; reports each document read."""

    def __init__(
        self, docs: list[list[int]], on_read: Callable[[int], None] | None = None
    ) -> None:
        self.docs, self.on_read, self.start, self.at = docs, on_read, 0, 0

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        self.at, self.start = self.start, 0
        while self.at < len(self.docs):
            self.at += 1
            if self.on_read is not None:
                self.on_read(self.at - 1)
            yield {"input_ids": self.docs[self.at - 1]}

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["at"]


def _rows(stream: Any) -> list[dict[str, list[int]]]:
    return [{k: v.tolist() for k, v in row.items()} for row in stream]


def _targets(rows: list[dict[str, list[int]]]) -> list[tuple[int, int]]:
    """Every (context, label) pair predicted; checks each stays inside a document."""
    pairs = []
    for row in rows:
        ids, labels, segments = row["input_ids"], row["labels"], row["segment_ids"]
        assert labels[0] == IGNORE  # nothing predicts a row's first position
        for t in range(1, len(ids)):
            if labels[t] == IGNORE:
                continue
            assert segments[t] == segments[t - 1] >= 0
            assert labels[t] == ids[t]
            pairs.append((ids[t - 1], labels[t]))
    return pairs


lengths = st.lists(st.integers(0, 12), max_size=12)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths, seq_len=st.integers(2, 9))
def test_packed_labels_predict_every_document_token_once_and_never_across(
    lengths: list[int], seq_len: int
) -> None:
    docs = _docs(lengths)
    rows = _rows(pack_documents(docs, seq_len=seq_len))
    pairs = _targets(rows)
    # Each label's context is its predecessor in the same document.
    assert all(label == context + 1 for context, label in pairs)
    expected = Counter(t for doc in docs for t in doc[1:])
    assert Counter(label for _, label in pairs) == expected  # exactly once
    total = sum(int(count_targets(torch.tensor(r["labels"]))) for r in rows)
    assert total == sum(max(n - 1, 0) for n in lengths) == len(pairs)
    assert all(len(r["input_ids"]) == seq_len for r in rows)
    # Padding only at the very end; position ids restart with every segment.
    for row in rows[:-1]:
        assert -1 not in row["segment_ids"]
    for row in rows:
        for t, (seg, pos) in enumerate(
            zip(row["segment_ids"], row["position_ids"], strict=True)
        ):
            same = t > 0 and row["segment_ids"][t - 1] == seg
            assert pos == (row["position_ids"][t - 1] + 1 if same else 0)
    # Every token of the stream is in some row (a continued one twice at most).
    placed = Counter(
        t
        for r in rows
        for t, s in zip(r["input_ids"], r["segment_ids"], strict=True)
        if s >= 0
    )
    assert set(placed) == {t for doc in docs for t in doc}


@settings(max_examples=60, deadline=None)
@given(lengths=lengths, seq_len=st.integers(2, 9), stateful=st.booleans())
def test_a_packed_stream_resumes_from_any_rows_state(
    lengths: list[int], seq_len: int, stateful: bool
) -> None:
    docs = _docs(lengths)
    source: Any = Documents(docs) if stateful else [{"input_ids": d} for d in docs]
    packed = pack_documents(source, seq_len=seq_len, field="input_ids")
    rows, states = [], []
    for row in packed:
        rows.append({k: v.tolist() for k, v in row.items()})
        states.append(json.loads(json.dumps(packed.state_dict())))
    for k, state in enumerate(states):
        reads: list[int] = []
        again: Any = Documents(docs, reads.append) if stateful else source
        resumed = pack_documents(again, seq_len=seq_len, field="input_ids")
        resumed.load_state_dict(state)
        assert _rows(resumed) == rows[k + 1 :], k
        if stateful and reads:
            # Only the current document and the ones after it are read.
            assert reads == list(range(state["docs"], len(docs)))
    # A load applies to one iteration; the next one starts over.
    assert _rows(packed) == rows


def test_document_attention_mask_keeps_attention_inside_each_document() -> None:
    docs = _docs([3, 5, 2])
    row = next(iter(pack_documents(docs, seq_len=7)))
    mask = document_attention_mask(row["segment_ids"])
    segments = row["segment_ids"].tolist()
    for i in range(7):
        for j in range(7):
            assert bool(mask[i, j]) == (j <= i and segments[i] == segments[j])
    batch = torch.stack([row["segment_ids"], row["segment_ids"]])
    assert torch.equal(document_attention_mask(batch)[1], mask)


def test_pack_documents_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match=r"pack_documents: seq_len \(1\) must be >= 2"):
        pack_documents([[1, 2]], seq_len=1)
    with pytest.raises(
        TypeError,
        match=r"pack_documents: each document must be a list or 1-D tensor of token ids; got 'abc' \(str\)\. Tokenise first",
    ):
        list(pack_documents(["abc"], seq_len=4))
    with pytest.raises(
        TypeError,
        match=r"pack_documents: each document must be a dict with the key 'input_ids'",
    ):
        list(pack_documents([[1, 2]], seq_len=4, field="input_ids"))
    with pytest.raises(
        ValueError,
        match=r"pack_documents: each document must be a 1-D tensor of token ids; got \(2, 2\)",
    ):
        list(pack_documents([torch.zeros(2, 2, dtype=torch.int64)], seq_len=4))
    with pytest.raises(
        ValueError,
        match=r"PackedDocuments.load_state_dict: the keys of state must be exactly",
    ):
        pack_documents([[1, 2]], seq_len=4).load_state_dict({"docs": 0})


LENGTHS = [7, 3, 11, 1, 6, 9, 4, 2, 8, 5]


def test_a_packed_stream_through_shard_loader_resumes_without_reading_earlier_documents() -> (
    None
):
    docs = _docs(LENGTHS)

    def loader(p: int, rank: int, reads: list[int]) -> Any:
        packed = pack_documents(
            Documents(docs, reads.append), seq_len=6, field="input_ids"
        )
        return shard_loader(
            rank_ctx(p, rank), DataLoader(packed, batch_size=1), dispatch_batches=False
        )

    for p in (1, 2):
        for rank in range(p):
            unbroken = list(iter_batches(loader(p, rank, [])))
            for k in range(1, len(unbroken)):
                reads: list[int] = []
                state = unbroken[k - 1].state
                assert state.stream_state is not None
                resumed = list(iter_batches(loader(p, rank, reads), state))
                ids = [b.data["input_ids"].tolist() for b in resumed]
                assert ids == [b.data["input_ids"].tolist() for b in unbroken[k:]]
                packed_state = state.stream_state["source"]
                first = packed_state["docs"]
                assert reads[: len(docs) - first] == list(range(first, len(docs)))


def _reference_grads(
    model: nn.Module, docs: list[list[int]], vocab: int
) -> list[torch.Tensor]:
    """The gradient of the mean per-token loss over all documents, one document at a time."""
    model.zero_grad()
    total = sum(len(d) - 1 for d in docs)
    for doc in docs:
        ids = torch.tensor([t % vocab for t in doc])
        logits: torch.Tensor = model(ids[:-1])
        loss = F.cross_entropy(logits, ids[1:], reduction="sum") / total
        torch.autograd.backward(loss)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


class _Bigram(nn.Module):
    """A next-token model that reads only the current token (attention-free)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, vocab, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.table(ids)
        return out


def test_token_weighted_steps_over_packed_rows_equal_the_per_document_gradient() -> (
    None
):
    vocab = 16
    docs = [[t % vocab for t in doc] for doc in _docs(LENGTHS)]
    torch.manual_seed(0)
    model = _Bigram(vocab)
    reference = copy.deepcopy(model)
    want = _reference_grads(reference, docs, vocab)
    rows = list(pack_documents(docs, seq_len=6))
    ctx = DistributedContext()
    grad = GradState(accumulation_steps=len(rows))
    seen: list[torch.Tensor] = []

    class Capture(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # record the applied gradient
            seen.extend(
                p.grad.clone() for p in model.parameters() if p.grad is not None
            )
            return None

    opt = Capture(model.parameters(), lr=0.1)
    for i, row in enumerate(rows):
        ids, labels = row["input_ids"].unsqueeze(0), row["labels"].unsqueeze(0)

        def loss() -> torch.Tensor:
            logits = model(ids)[:, :-1]
            return F.cross_entropy(
                logits.reshape(-1, vocab),
                labels[:, 1:].reshape(-1),
                ignore_index=IGNORE,
                reduction="sum",
            )

        _, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            loss,
            num_items=count_targets(labels),
            end_of_dataloader=i == len(rows) - 1,
        )
    assert len(seen) == len(want)
    for ours, theirs in zip(seen, want, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
