"""Token-weighted accumulation: ``accumulate_step(..., num_items=n)``.

The references are plain PyTorch written here: each window's per-token losses are
summed over the whole global window, divided by its token count, and backpropagated
once (docs/accumulate.md, "Token-weighted accumulation"). One process with ``k=4``,
two with ``k=2`` and four with ``k=1`` run the same global windows of variable-length
"sequences" and must all end where the reference ends.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.accumulate import advance_grad_state
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import save_checkpoint
from funcaccel.context import DistributedContext
from funcaccel.grad_state import check_num_items
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.testing import run_ranks

ONE = DistributedContext()
F64 = torch.float64
IGNORE = -100
TOKENS = 3  # positions per sequence
CLASSES = 3
BS = 2  # sequences per micro-batch
WINDOW = 4  # micro-batches per global window: p * k for every world size here
M = 14  # global micro-batches: windows {0-3}, {4-7} (no tokens), {8-11}, {12, 13}
ZERO = (1, 3, 4, 5, 6, 7)  # micro-batches whose sequences are all padding
Batch = tuple[torch.Tensor, torch.Tensor]


# --- data, model and the plain-PyTorch reference -----------------------------------


def _net(seed: int = 0, dtype: torch.dtype = F64) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, CLASSES)).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=dtype) * 0.7)
    return net


def _sgd(params: Any) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _corpus(seed: int = 0, dtype: torch.dtype = F64) -> Batch:
    """``M * BS`` sequences of random length 0..TOKENS (padding labelled IGNORE)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M * BS, TOKENS, 3, generator=gen, dtype=dtype)
    labels = torch.randint(0, CLASSES, (M * BS, TOKENS), generator=gen)
    lengths = torch.randint(0, TOKENS + 1, (M * BS,), generator=gen)
    for b in ZERO:
        lengths[b * BS : (b + 1) * BS] = 0
    labels[torch.arange(TOKENS) >= lengths[:, None]] = IGNORE
    return x, labels


def _micro(data: Batch, b: int) -> Batch:
    """Global micro-batch ``b``; past the data, a batch of padding only."""
    x, labels = data
    if b >= M:
        return torch.zeros_like(x[:BS]), torch.full_like(labels[:BS], IGNORE)
    return x[b * BS : (b + 1) * BS], labels[b * BS : (b + 1) * BS]


def _summed_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).float() if x.dtype != F64 else model(x)
    return cross_entropy(
        logits.reshape(-1, CLASSES), y.reshape(-1), reduction="sum", ignore_index=IGNORE
    )


def _schedule(p: int, r: int) -> list[tuple[int, bool]]:
    """Rank ``r``'s micro-batches ``(b, is_last)`` with ``k = WINDOW / p``.

    Window ``w`` covers global micro-batches ``4w .. 4w+3`` in every world size:
    rank ``r`` runs ``4w + j*p + r`` at its micro-step ``j``. Micro-steps where rank 0
    is past the data are not run; a rank past it on a run micro-step gets padding.
    """
    steps = [
        w * WINDOW + j * p + r
        for w in range(math.ceil(M / WINDOW))
        for j in range(WINDOW // p)
        if w * WINDOW + j * p < M
    ]
    return [(b, i == len(steps) - 1) for i, b in enumerate(steps)]


def _reference(
    data: Batch, *, max_grad_norm: float | None = None
) -> tuple[list[torch.Tensor], list[bool]]:
    """Plain PyTorch: per window, sum of token losses / its tokens, one backward.

    A window without tokens has no loss to average and takes no step. Returns the
    final parameters and which windows stepped.
    """
    x, labels = data
    net = _net()
    opt = _sgd(net.parameters())
    stepped = []
    for w in range(math.ceil(M / WINDOW)):
        rows = slice(w * WINDOW * BS, min((w + 1) * WINDOW, M) * BS)
        total = int((labels[rows] != IGNORE).sum())
        stepped.append(total > 0)
        if total == 0:
            continue
        opt.zero_grad()
        torch.autograd.backward(_summed_loss(net, x[rows], labels[rows]) / total)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
        opt.step()
    return [p.detach().clone() for p in net.parameters()], stepped


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-12) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=tol, atol=tol)


# --- the loop under test, for any world size -----------------------------------------


class _CountAllReduce:
    """Count ``torch.distributed.all_reduce`` calls (the window's item count)."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig: Callable[..., Any] = dist.all_reduce

    def __enter__(self) -> _CountAllReduce:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *_: object) -> None:
        dist.all_reduce = self._orig


def _train(
    ctx: DistributedContext,
    model: nn.Module,
    *,
    data: Batch,
    max_grad_norm: float | None = None,
    sync_each_batch: bool = False,
    scaler: torch.amp.GradScaler | None = None,
    tensor_counts: bool = False,
) -> dict[str, Any]:
    """Run rank ``ctx.process_index``'s schedule; return its params and trace."""
    p, r = ctx.num_processes, ctx.process_index
    opt = _sgd(model.parameters())
    grad = GradState(accumulation_steps=WINDOW // p, sync_each_batch=sync_each_batch)
    trace = []
    with _CountAllReduce() as counter:
        for b, last in _schedule(p, r):
            x, y = _micro(data, b)
            n = int((y != IGNORE).sum())
            before = counter.calls
            summed: list[torch.Tensor] = []
            ddp_sync: list[bool] = []

            def loss_fn() -> torch.Tensor:
                if isinstance(model, DistributedDataParallel):
                    ddp_sync.append(model.require_backward_grad_sync)
                summed.append(_summed_loss(model, x, y))
                return summed[-1]

            loss, grad = accumulate_step(
                ctx, grad, model, opt, loss_fn,
                end_of_dataloader=last, max_grad_norm=max_grad_norm, scaler=scaler,
                num_items=(y != IGNORE).sum() if tensor_counts else n,
            )  # fmt: skip
            trace.append(
                {
                    "synced": grad.sync_gradients,
                    "window_items": grad.window_items,
                    "skipped": grad.step_was_skipped,
                    "all_reduces": counter.calls - before,
                    # DDP's gradient all-reduce runs in this micro-step's backward
                    "ddp_sync": ddp_sync[0] if ddp_sync else None,
                    # the micro-batch's mean per item; its summed loss for n == 0
                    "loss_ok": torch.equal(loss, summed[0].detach() / max(n, 1)),
                }
            )
    return {
        "params": [_full(q) for q in model.parameters()],
        "trace": trace,
        "grad": grad,
    }


def _wrapped(wrap: str) -> nn.Module:
    net = _net()
    if wrap == "ddp":
        return DistributedDataParallel(net)
    fully_shard(net[0])
    fully_shard(net[2])
    fully_shard(net)
    return net


def _plain_module_refusal(ctx: DistributedContext) -> tuple[str, bool]:
    """The error for an unwrapped model, and whether it came before any backward."""
    net = _net()
    opt = _sgd(net.parameters())
    x, y = _micro(_corpus(), 0)
    try:
        accumulate_step(
            ctx, GradState(accumulation_steps=2), net, opt,
            lambda: _summed_loss(net, x, y), num_items=1,
        )  # fmt: skip
    except ValueError as err:
        return str(err), all(q.grad is None for q in net.parameters())
    return "no error", False


def _scenarios(ctx: DistributedContext, names: list[str]) -> dict[str, Any]:
    data = _corpus()
    runs: dict[str, Callable[[], Any]] = {
        "ddp": lambda: _train(ctx, _wrapped("ddp"), data=data),
        "fsdp": lambda: _train(ctx, _wrapped("fsdp"), data=data, tensor_counts=True),
        "ddp_clip": lambda: _train(ctx, _wrapped("ddp"), data=data, max_grad_norm=0.3),
        "fsdp_clip": lambda: _train(
            ctx, _wrapped("fsdp"), data=data, max_grad_norm=0.3
        ),
        "ddp_each_batch": lambda: _train(
            ctx, _wrapped("ddp"), data=data, sync_each_batch=True
        ),
        "plain_refused": lambda: _plain_module_refusal(ctx),
    }
    return {name: runs[name]() for name in names}


TWO = ["ddp", "fsdp", "ddp_clip", "fsdp_clip", "ddp_each_batch", "plain_refused"]
FOUR = ["ddp", "fsdp"]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, 2, TWO, start_method="forkserver")


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, 4, FOUR, start_method="forkserver")


def _check_run(
    result: dict[str, Any],
    p: int,
    max_grad_norm: float | None,
    *,
    ddp: bool = False,
    each_batch: bool = False,
) -> None:
    want, stepped = _reference(_corpus(), max_grad_norm=max_grad_norm)
    _close(result["params"], want)
    trace = result["trace"]
    assert [row["skipped"] for row in trace if row["synced"]] == [
        not s for s in stepped
    ]
    assert result["grad"].optimizer_steps == sum(stepped) == 3
    assert result["grad"].window_items is None
    # One all-reduce of the count per window (none with one process), none between.
    assert [row["all_reduces"] for row in trace] == [
        int(row["synced"] and p > 1) for row in trace
    ]
    assert all(row["loss_ok"] for row in trace)
    if ddp:
        assert [row["ddp_sync"] for row in trace] == [
            row["synced"] or each_batch for row in trace
        ]


# --- one process, k=4, against the reference -----------------------------------------


def test_one_process_k4_equals_the_reference_on_the_global_windows() -> None:
    result = _train(ONE, _net(), data=_corpus())
    _check_run(result, 1, None)
    counts = [row["window_items"] for row in result["trace"]]
    x, labels = _corpus()
    per_batch = [int((labels[b * BS : (b + 1) * BS] != IGNORE).sum()) for b in range(M)]
    assert counts[:3] == [per_batch[0], per_batch[0], per_batch[0] + per_batch[2]]
    assert counts[3] is None and counts[7] is None  # windows closed (and reset)


def test_one_process_with_clipping_and_tensor_counts() -> None:
    result = _train(ONE, _net(), data=_corpus(), max_grad_norm=0.3, tensor_counts=True)
    _check_run(result, 1, 0.3)


def test_a_scaler_on_float64_gives_the_unscaled_run_bit_for_bit() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled = _train(ONE, _net(), data=_corpus(), scaler=scaler, max_grad_norm=0.3)
    plain = _train(ONE, _net(), data=_corpus(), max_grad_norm=0.3)
    for a, b in zip(scaled["params"], plain["params"], strict=True):
        assert torch.equal(a, b)
    _check_run(scaled, 1, 0.3)


def test_fp16_autocast_with_scaler_matches_a_plain_fp16_loop() -> None:
    ctx = DistributedContext(mixed_precision="fp16")
    data = _corpus(dtype=torch.float32)
    model = _net(dtype=torch.float32)
    # Summed-loss gradients are larger than mean-loss ones by the item count: a
    # scale that fits both loops here, so that the scaler skips no step in either.
    scaler = build_grad_scaler(ctx, GradScalerKwargs(init_scale=16.0))
    assert scaler is not None
    got = _train(ctx, model, data=data, scaler=scaler)
    # Plain PyTorch, knowing each window's token count in advance.
    net = _net(dtype=torch.float32)
    opt = _sgd(net.parameters())
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    x, labels = data
    for w in range(math.ceil(M / WINDOW)):
        batches = range(w * WINDOW, min((w + 1) * WINDOW, M))
        rows = slice(batches[0] * BS, (batches[-1] + 1) * BS)
        total = int((labels[rows] != IGNORE).sum())
        if total == 0:
            continue
        for b in batches:
            xb, yb = _micro(data, b)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _summed_loss(net, xb, yb)
            torch.autograd.backward(ref_scaler.scale(loss / total))
        ref_scaler.step(opt)
        ref_scaler.update()
        opt.zero_grad()
    want = [q.detach() for q in net.parameters()]
    for got_param, want_param in zip(got["params"], want, strict=True):
        # fp16 backward rounds scale * g and scale * g / total differently.
        torch.testing.assert_close(got_param, want_param, rtol=2e-3, atol=2e-4)
    assert got["grad"].optimizer_steps == 3
    assert scaler.get_scale() == ref_scaler.get_scale() == 16.0


def test_an_overflow_skips_the_step_and_closes_the_window() -> None:
    ctx = DistributedContext(mixed_precision="fp16")
    net = _net(dtype=torch.float32)
    opt = _sgd(net.parameters())
    scaler = build_grad_scaler(ctx)
    assert scaler is not None
    before = [q.detach().clone() for q in net.parameters()]
    x, y = _micro(_corpus(dtype=torch.float32), 0)
    grad = GradState(accumulation_steps=2)
    _, grad = accumulate_step(
        ctx, grad, net, opt, lambda: _summed_loss(net, x, y) * float("inf"),
        scaler=scaler, num_items=3,
    )  # fmt: skip
    _, grad = accumulate_step(
        ctx, grad, net, opt, lambda: _summed_loss(net, x, y), scaler=scaler, num_items=2
    )
    assert grad.step_was_skipped and grad.optimizer_steps == 0
    assert grad.window_items is None and grad.sync_gradients
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert all(q.grad is None for q in net.parameters())


def test_a_window_without_items_takes_no_step_and_zeroes_the_gradients() -> None:
    net = _net()
    opt = _sgd(net.parameters())
    before = copy.deepcopy(net)
    x, y = _micro(_corpus(), M)  # padding only
    grad = GradState(accumulation_steps=2)
    for n_step in range(2):
        loss, grad = accumulate_step(
            ONE, grad, net, opt, lambda: _summed_loss(net, x, y), num_items=0
        )
        assert loss.item() == 0.0  # the summed loss itself: no 0/0
        assert grad.sync_gradients is (n_step == 1)
    assert grad.step_was_skipped and grad.optimizer_steps == 0
    assert all(q.grad is None for q in net.parameters())
    for a, b in zip(before.parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.state == {} or all(not s for s in opt.state.values())


# --- Hypothesis: item counts at one process ----------------------------------------


def _token_batches(counts: list[int], seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, 3, generator=gen, dtype=F64),
            torch.randint(0, CLASSES, (n,), generator=gen),
        )
        for n in counts
    ]


@settings(max_examples=40)
@given(
    counts=st.lists(st.integers(0, 4), min_size=1, max_size=9),
    k=st.integers(1, 4),
    as_tensor=st.booleans(),
    seed=st.integers(0, 3),
)
def test_hypothesis_one_process_equals_a_hand_written_reference(
    counts: list[int], k: int, as_tensor: bool, seed: int
) -> None:
    batches = _token_batches(counts, seed)
    net = _net()
    opt = _sgd(net.parameters())
    grad = GradState(accumulation_steps=k)
    open_items = []
    for j, (x, y) in enumerate(batches):
        n = torch.tensor(len(y)) if as_tensor else len(y)
        _, grad = accumulate_step(
            ONE, grad, net, opt, lambda: cross_entropy(net(x), y, reduction="sum"),
            num_items=n, end_of_dataloader=j == len(batches) - 1,
        )  # fmt: skip
        open_items.append(grad.window_items)
    # The reference: windows of k micro-batches, the last one short.
    ref = _net()
    ref_opt = _sgd(ref.parameters())
    want_items: list[int | None] = []
    steps = 0
    for start in range(0, len(batches), k):
        window = batches[start : start + k]
        running = 0
        for _, y in window[:-1]:
            running += len(y)
            want_items.append(running)
        want_items.append(None)
        total = sum(len(y) for _, y in window)
        if total == 0:
            continue
        xs = torch.cat([x for x, _ in window])
        ys = torch.cat([y for _, y in window])
        ref_opt.zero_grad()
        torch.autograd.backward(cross_entropy(ref(xs), ys, reduction="sum") / total)
        ref_opt.step()
        steps += 1
    assert open_items == want_items
    assert grad.optimizer_steps == steps
    _close(
        [q.detach() for q in net.parameters()], [q.detach() for q in ref.parameters()]
    )


# --- refused input ------------------------------------------------------------------


def _one_step(
    grad: GradState, num_items: object, net: nn.Module | None = None
) -> tuple[nn.Module, tuple[torch.Tensor, GradState]]:
    net = _net() if net is None else net
    opt = _sgd(net.parameters())
    x, y = _micro(_corpus(), 0)
    result = accumulate_step(
        ONE, grad, net, opt, lambda: _summed_loss(net, x, y),
        num_items=num_items,  # type: ignore[arg-type]
    )  # fmt: skip
    return net, result


@pytest.mark.parametrize(
    ("num_items", "error", "match"),
    [
        (-1, ValueError, r">= 0 .*; got -1\."),
        (torch.tensor(-2), ValueError, r">= 0 .*; got -2\."),
        (
            2.0,
            TypeError,
            r"an int or a 0-dim integer tensor .*got 2\.0 \(float\)",
        ),
        (True, TypeError, r"integer tensor .*got True \(bool\)"),
        (
            torch.tensor(2.0),
            TypeError,
            r"got tensor\(shape=\(\), dtype=torch.float32\) \(Tensor\)\. Count items with an integer dtype",
        ),
        (torch.tensor(True), TypeError, r"dtype=torch.bool\) \(Tensor\)\. Count items"),
        (
            torch.tensor([1, 2]),
            ValueError,
            r"got tensor\(shape=\(2,\), dtype=torch.int64\)\. Sum it to one count",
        ),
        ("3", TypeError, r"got '3' \(str\)"),
    ],
)
def test_bad_num_items_are_refused_before_any_gradient(
    num_items: object, error: type[Exception], match: str
) -> None:
    net = _net()
    with pytest.raises(error, match=r"^accumulate_step: num_items must be .*" + match):
        _one_step(GradState(accumulation_steps=2), num_items, net)
    assert all(q.grad is None for q in net.parameters())  # checked before the forward
    with pytest.raises(
        error, match=r"^advance_grad_state: num_items must be .*" + match
    ):
        advance_grad_state(GradState(accumulation_steps=2), num_items=num_items)  # type: ignore[arg-type]


def test_integral_counts_of_other_types_are_accepted() -> None:
    assert check_num_items("f", np.int64(5)) == 5
    assert check_num_items("f", torch.tensor(4, dtype=torch.int32)) == 4
    net, (loss, grad) = _one_step(GradState(accumulation_steps=2), np.int64(5))
    assert grad.window_items == 5
    assert all(q.grad is not None for q in net.parameters())


def test_mixing_num_items_and_mean_losses_in_one_window_is_an_error() -> None:
    token_window = GradState(
        accumulation_steps=3, micro_step=1, sync_gradients=False, window_items=4
    )
    mean_window = GradState(accumulation_steps=3, micro_step=1, sync_gradients=False)
    with pytest.raises(
        ValueError,
        match=r"^accumulate_step: num_items=None, but the open accumulation window is "
        r"token-weighted \(window_items=4 after 1 micro-steps\); pass num_items=",
    ):
        _one_step(token_window, None)
    with pytest.raises(
        ValueError,
        match=r"^accumulate_step: num_items was given, but the open accumulation "
        r"window \(micro_step=1\) was started with mean losses",
    ):
        _one_step(mean_window, 2)
    with pytest.raises(ValueError, match=r"^advance_grad_state: num_items=None, but"):
        advance_grad_state(token_window)
    with pytest.raises(ValueError, match=r"^advance_grad_state: num_items was given"):
        advance_grad_state(mean_window, num_items=1)
    # Between windows either kind may start the next one.
    closed = advance_grad_state(
        advance_grad_state(token_window, num_items=1), num_items=0
    )
    assert closed.window_items is None and closed.micro_step == 0
    _, (_, after) = _one_step(closed, None)
    assert after.window_items is None and after.micro_step == 1


def test_advance_grad_state_adds_up_the_window_items() -> None:
    grad = GradState(accumulation_steps=3)
    seen = []
    for n in (2, 0, 5, 1):
        grad = advance_grad_state(grad, num_items=n, end_of_dataloader=n == 1)
        seen.append(grad.window_items)
    assert seen == [2, 2, None, None]


# --- GradState.window_items: validation, dicts and checkpoints ------------------------


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (
            {"window_items": 3},
            ValueError,
            r"window_items \(3\) counts the items of an open window, so micro_step must be > 0; got micro_step=0\. Pass window_items=None\.",
        ),
        (
            {
                "accumulation_steps": 2,
                "micro_step": 1,
                "sync_gradients": False,
                "window_items": -1,
            },
            ValueError,
            r"window_items must be >= 0 or None; got -1\.",
        ),
        (
            {
                "accumulation_steps": 2,
                "micro_step": 1,
                "sync_gradients": False,
                "window_items": 1.0,
            },
            TypeError,
            r"window_items must be an int or None; got 1\.0 \(float\)",
        ),
        (
            {
                "accumulation_steps": 2,
                "micro_step": 1,
                "sync_gradients": False,
                "window_items": True,
            },
            TypeError,
            r"window_items must be an int or None; got True \(bool\)",
        ),
    ],
)
def test_grad_state_validates_window_items(
    fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"^GradState: " + match):
        GradState(**fields)


@given(k=st.integers(2, 64), data=st.data())
def test_grad_state_with_window_items_round_trips(k: int, data: st.DataObject) -> None:
    micro = data.draw(st.integers(1, k - 1))
    items = data.draw(st.integers(0, 10**12))
    state = GradState(
        accumulation_steps=k, micro_step=micro, sync_gradients=False, window_items=items
    )
    assert GradState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_a_dict_from_before_window_items_reads_as_none() -> None:
    old = GradState(accumulation_steps=4, optimizer_steps=7).to_dict()
    del old["window_items"]
    assert GradState.from_dict(old) == GradState(
        accumulation_steps=4, optimizer_steps=7
    )


def test_checkpoints_after_a_token_weighted_window_and_refuses_an_open_one(
    tmp_path: Path,
) -> None:
    net = _net()
    opt = _sgd(net.parameters())
    x, y = _micro(_corpus(), 0)
    grad = GradState(accumulation_steps=2)
    _, grad = accumulate_step(
        ONE, grad, net, opt, lambda: _summed_loss(net, x, y), num_items=3
    )
    with pytest.raises(ValueError, match=r"open accumulation window \(micro_step=1 of"):
        save_checkpoint(ONE, tmp_path / "open", models=net, grad=grad)
    _, grad = accumulate_step(
        ONE, grad, net, opt, lambda: _summed_loss(net, x, y), num_items=1
    )
    path = save_checkpoint(
        ONE, tmp_path / "closed", models=net, optimizers=opt, grad=grad
    )
    loaded = load_checkpoint(
        ONE, path, models=_net(1), optimizers=_sgd(_net(1).parameters())
    )
    assert loaded.grad == grad and grad.optimizer_steps == 1


# --- two and four processes, DDP and FSDP2 -------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", ["ddp", "fsdp", "ddp_clip", "fsdp_clip", "ddp_each_batch"]
)
def test_two_processes_k2_equal_the_reference(
    two_ranks: list[dict[str, Any]], name: str
) -> None:
    for rank in two_ranks:
        _check_run(
            rank[name],
            2,
            0.3 if name.endswith("clip") else None,
            ddp=name.startswith("ddp"),
            each_batch=name == "ddp_each_batch",
        )


@pytest.mark.distributed
def test_two_processes_refuse_a_model_no_ddp_or_fsdp_averages(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in two_ranks:
        message, before_any_backward = rank["plain_refused"]
        assert before_any_backward  # refused at the window's first micro-step
        assert message.startswith(
            "accumulate_step: num_items= with 2 processes needs every trained model's "
            "gradients averaged over the ranks, but model 0 is a plain Sequential"
        )


@pytest.mark.distributed
@pytest.mark.parametrize("name", FOUR)
def test_four_processes_k1_equal_the_reference(
    four_ranks: list[dict[str, Any]], name: str
) -> None:
    for rank in four_ranks:
        _check_run(rank[name], 4, None, ddp=name == "ddp")
