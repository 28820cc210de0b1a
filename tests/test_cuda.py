"""Every CUDA path of funcaccel, each checked against plain PyTorch or a known value.

Skipped without CUDA; ``benchmarks/gpu_check.sh`` runs this file and the CUDA tests
that live with their modules (pinned-memory loading and the CUDA RNG sync of
``shard_loader`` over gloo in ``tests/test_loader.py``, a CUDA checkpoint with its
RNG in ``tests/test_checkpoint.py``, ``wrap_model`` and optimizer state on one GPU
in ``tests/test_model.py``, the GPU per local rank in ``tests/test_context.py``, the
profiler's default CUDA activity in ``tests/test_profiler.py``).

One GPU fixes what can run. NCCL refuses two ranks on one device, so NCCL runs
in a real group of world size 1 (``file://`` rendezvous in ``tmp_path``). A
``DistributedContext`` of one process must be ``DistributedType.NO`` (``MULTI_GPU``
with ``num_processes=1`` is refused), so funcaccel sends nothing through that
group itself: the NCCL test checks what ``build_context`` gives there and the
collective guard's store, and DeepSpeed's ZeRO engine (which needs a group at
any world size) trains through it. Everything that needs two ranks (DDP, FSDP2,
``gather_for_metrics``, the count all-reduce of a token-weighted window, the
collective guard, the barrier) runs on two gloo processes that share ``cuda:0``,
each the local rank 0 of its own one-GPU node (the layout of
``torchrun --nnodes 2 --nproc_per_node 1``). gloo moves CUDA tensors itself;
what funcaccel sends through ``comm_device`` (counts, RNG states) goes through
the CPU there, so the NCCL forms of those (on the GPU) need two GPUs and are
not run here.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d
from torch.nn.functional import cross_entropy
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from funcaccel._primitives import comm_device
from funcaccel._typing import MixedPrecision
from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.batch_size import find_executable_batch_size
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import save_checkpoint_async
from funcaccel.collectives import gather
from funcaccel.collectives import gather_for_metrics
from funcaccel.collectives import reduce
from funcaccel.collectives import wait_for_everyone
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.context import build_context
from funcaccel.context import close_context
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.kwargs import ProfileKwargs
from funcaccel.launch import launch
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.mixed_precision import autocast_ctx
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.model import DeepSpeedOptions
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.profiler import build_profiler
from funcaccel.rng import capture_rng_state
from funcaccel.rng import restore_rng_state
from funcaccel.seeding import set_seed
from funcaccel.testing import run_ranks
from tests.fixtures import Indexed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA0 = torch.device("cuda", 0)
K = 2  # accumulation steps
STEPS = 6  # micro-batches; the 4th has an infinite loss (a scaler skip under fp16)


def _cuda_ctx(precision: MixedPrecision) -> DistributedContext:
    return DistributedContext(device=CUDA0, mixed_precision=precision)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).cuda()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 8, generator=gen).cuda(),
            torch.randn(4, 1, generator=gen).cuda(),
        )
        for _ in range(STEPS)
    ]


def _loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor, i: int) -> torch.Tensor:
    loss = mse_loss(net(x), y)
    return loss * float("inf") if i == 3 else loss


def _plain(
    precision: MixedPrecision, max_grad_norm: float | None = None
) -> tuple[nn.Module, list[float]]:
    """The loop in plain PyTorch: autocast, GradScaler by hand, step every K."""
    net, dtype = _net(), torch.float16 if precision == "fp16" else torch.bfloat16
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=4.0, enabled=precision == "fp16")
    scales = []
    for i, (x, y) in enumerate(_data()):
        with torch.autocast("cuda", dtype=dtype):
            loss = _loss(net, x, y, i)
        torch.autograd.backward(scaler.scale(loss / K))
        if (i + 1) % K == 0:
            if max_grad_norm is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale() if precision == "fp16" else 1.0)
    return net, scales


def _ours(
    precision: MixedPrecision, max_grad_norm: float | None = None
) -> tuple[nn.Module, list[GradState], list[float]]:
    ctx, net = _cuda_ctx(precision), _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = build_grad_scaler(ctx, GradScalerKwargs(init_scale=4.0))
    grad, states, scales = GradState(accumulation_steps=K), [], []

    def loss_fn(x: torch.Tensor, y: torch.Tensor, i: int) -> Callable[[], torch.Tensor]:
        return lambda: _loss(net, x, y, i)

    for i, (x, y) in enumerate(_data()):
        _, grad = accumulate_step(
            ctx,
            grad,
            net,
            opt,
            loss_fn(x, y, i),
            scaler=scaler,
            max_grad_norm=max_grad_norm,
        )
        if grad.sync_gradients:
            states.append(grad)
            scales.append(scaler.get_scale() if scaler is not None else 1.0)
    return net, states, scales


def test_fp16_with_grad_scaler_matches_plain_pytorch_and_reports_the_skip() -> None:
    want, want_scales = _plain("fp16")
    got, states, scales = _ours("fp16")
    assert [s.step_was_skipped for s in states] == [False, True, False]
    assert states[-1].optimizer_steps == 2
    assert scales == want_scales == [4.0, 2.0, 2.0]
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert a.device.type == "cuda"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fp16_clipping_unscales_first_as_plain_pytorch_does() -> None:
    want, want_scales = _plain("fp16", max_grad_norm=0.05)
    got, states, scales = _ours("fp16", max_grad_norm=0.05)
    unclipped, _, _ = _ours("fp16")
    assert [s.step_was_skipped for s in states] == [False, True, False]
    assert scales == want_scales == [4.0, 2.0, 2.0]
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    pairs = zip(got.parameters(), unclipped.parameters(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)  # the clip did change a step


def _loss_fn(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], torch.Tensor]:
    return lambda: mse_loss(net(x), y)


def test_bf16_autocast_matches_plain_pytorch() -> None:
    # An infinite loss under bf16 (no scaler) makes every parameter non-finite in
    # both loops alike, so use the first three micro-batches only: they sync once.
    ctx = _cuda_ctx("bf16")
    with autocast_ctx(ctx):
        out = _net()(torch.ones(2, 8, device="cuda"))
    assert out.dtype == torch.bfloat16
    want, got = _net(), _net()
    opt_want = torch.optim.SGD(want.parameters(), lr=0.1)
    opt_got = torch.optim.SGD(got.parameters(), lr=0.1)
    grad = GradState(accumulation_steps=K)
    for i, (x, y) in enumerate(_data()[:3]):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = mse_loss(want(x), y)
        torch.autograd.backward(loss / K)
        if (i + 1) % K == 0:
            opt_want.step()
            opt_want.zero_grad(set_to_none=True)
        _, grad = accumulate_step(ctx, grad, got, opt_got, _loss_fn(got, x, y))
    assert grad.optimizer_steps == 1 and grad.micro_step == 1
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def _trace(path: Path) -> tuple[set[str], set[str]]:
    """The ``step*`` labels and the event categories of a Chrome trace."""
    events = json.loads(path.read_text())["traceEvents"]
    names = {str(event.get("name", "")) for event in events}
    categories = {str(event.get("cat", "")).lower() for event in events}
    return {name for name in names if name.startswith("step")}, categories


def test_profiler_records_gpu_kernels(tmp_path: Path) -> None:
    ctx = _cuda_ctx("no")
    with build_profiler(ctx, ProfileKwargs(output_trace_dir=tmp_path)):
        x = torch.ones(64, 64, device="cuda")
        (x @ x).sum().item()
    trace = json.loads((tmp_path / "profile_0.json").read_text())
    categories = {str(event.get("cat", "")).lower() for event in trace["traceEvents"]}
    assert "kernel" in categories


@pytest.mark.filterwarnings(
    "ignore:Warning. Profiler clears events at the end of each cycle"
)
def test_profiler_schedule_files_hold_the_gpu_kernels_of_their_window(
    tmp_path: Path,
) -> None:
    # The shape of tests/test_profiler.py's window cut short, on the GPU.
    schedule = {"wait": 1, "warmup": 1, "active": 2}
    kwargs = ProfileKwargs(schedule_option=schedule, output_trace_dir=tmp_path)
    x = torch.ones(64, 64, device="cuda")
    with build_profiler(_cuda_ctx("no"), kwargs) as prof:
        for i in range(7):  # a window at steps 2-3, then step 6 opens the next
            with torch.profiler.record_function(f"step{i}"):
                (x @ x).sum().item()
            prof.step()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["profile_0.json", "profile_0_cycle0.json"]
    for name, steps in (
        ("profile_0_cycle0.json", {"step2", "step3"}),
        ("profile_0.json", {"step6"}),
    ):
        labels, categories = _trace(tmp_path / name)
        assert labels == steps, name
        assert "kernel" in categories, name


# --- one process: seeding, RNG states, checkpoints, batch-size search ------------


def test_set_seed_seeds_the_cuda_generator_and_adds_the_rank_when_asked() -> None:
    assert set_seed(_cuda_ctx("no"), 123) == 123
    got = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(123)
    assert torch.equal(got, torch.rand(3, device="cuda"))
    rank_1 = DistributedContext(
        num_processes=2,
        process_index=1,
        device=CUDA0,
        distributed_type=DistributedType.MULTI_GPU,
    )
    assert set_seed(rank_1, 123, device_specific=True) == 124
    assert torch.cuda.initial_seed() == 124
    got = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(124)
    assert torch.equal(got, torch.rand(3, device="cuda"))


def test_a_cuda_rng_state_saved_with_more_gpus_restores_the_gpus_present() -> None:
    torch.cuda.manual_seed_all(5)
    state = capture_rng_state()
    saved = state["cuda"]
    assert isinstance(saved, list) and len(saved) == torch.cuda.device_count()
    expected = torch.rand(3, device="cuda")
    torch.cuda.manual_seed_all(6)
    # As written on a machine with one GPU more than this one.
    restored = restore_rng_state({**state, "cuda": [*saved, saved[0]]}, caller="test")
    assert "cuda" in restored
    assert torch.equal(torch.rand(3, device="cuda"), expected)


def _staged_in_pinned_memory(storage: torch.UntypedStorage) -> bool:
    return torch.empty(0, dtype=torch.uint8).set_(storage).is_pinned()


def test_an_async_checkpoint_stages_cuda_tensors_in_pinned_memory(
    tmp_path: Path,
) -> None:
    ctx, net, data = _cuda_ctx("no"), _net(), _data()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)

    def train(i: int) -> None:
        torch.autograd.backward(mse_loss(net(data[i][0]), data[i][1]))
        opt.step()  # waits for the background copy of Adam's CPU `step` tensors
        opt.zero_grad()

    train(0)
    model_state = {k: v.clone() for k, v in net.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    tensors = [*net.parameters(), *(v for s in opt.state.values() for v in s.values())]
    on_gpu = {t.untyped_storage().data_ptr() for t in tensors if t.is_cuda}
    first = save_checkpoint_async(ctx, tmp_path, models=net, optimizers=opt)
    memory = {b.data_ptr() for b in first._buffers}
    pinned = [_staged_in_pinned_memory(b) for b in first._buffers]
    # 4 parameters and 8 moments (and Adam's steps, if this torch's Adam is fused).
    assert len(on_gpu) >= 12 and sum(pinned) == len(on_gpu)
    train(1)
    train(2)
    fresh = _net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    load_checkpoint(ctx, first.wait(), models=fresh, optimizers=fresh_opt)
    assert all(p.device == CUDA0 for p in fresh.parameters())
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model_state.items())
    loaded = fresh_opt.state_dict()["state"]
    for index, state in opt_state["state"].items():
        assert loaded[index]["exp_avg"].device == CUDA0
        assert all(torch.equal(loaded[index][k], v) for k, v in state.items())
    # The next save stages into the same (pinned) memory.
    second = save_checkpoint_async(
        ctx, tmp_path, models=net, optimizers=opt, pending=first
    )
    assert {b.data_ptr() for b in second._buffers} == memory
    assert second.wait() == tmp_path / "checkpoint-000002"


def test_find_executable_batch_size_empties_the_cuda_cache_before_a_retry() -> None:
    block = 256 * 2**20
    torch.cuda.empty_cache()  # the block below gets a segment of its own
    at_start: list[int] = []
    after_free: list[int] = []

    def attempt(batch_size: int) -> int:
        at_start.append(torch.cuda.memory_reserved())
        if batch_size > 8:
            big = torch.empty(block, dtype=torch.uint8, device="cuda")
            del big  # back in torch's caching allocator: still reserved
            after_free.append(torch.cuda.memory_reserved())
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return batch_size

    assert find_executable_batch_size(_cuda_ctx("no"), attempt, 10) == (8, 8)
    assert len(at_start) == 3 and len(after_free) == 2  # tried 10, 9 and 8
    for before_retry, cached in zip(at_start[1:], after_free, strict=True):
        assert before_retry <= cached - block


def test_build_context_puts_one_process_on_the_gpu_it_names() -> None:
    count, before = torch.cuda.device_count(), torch.cuda.current_device()
    last = torch.device("cuda", count - 1)
    try:
        ctx = build_context(environ={}, device=f"cuda:{count - 1}")
        assert ctx.device == last and torch.cuda.current_device() == count - 1
        assert torch.ones(1, device=ctx.device).device == last
    finally:
        torch.cuda.set_device(before)
    with pytest.raises(ValueError, match=rf"one of the {count} visible GPU\(s\)"):
        build_context(environ={}, device=f"cuda:{count}")


# --- NCCL: a group of one process ----------------------------------------------


def _nccl_group(tmp_path: Path) -> None:
    """Start this rank's NCCL group (``launch`` with ``backend=None`` started none)."""
    torch.cuda.set_device(CUDA0)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp_path}/rendezvous",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        device_id=CUDA0,
    )


def _nccl_of_one(tmp_path: Path) -> dict[str, Any]:
    _nccl_group(tmp_path)
    try:
        ctx = build_context(environ={"WORLD_SIZE": "1"}, mixed_precision="bf16")
        x = torch.arange(4.0, device=CUDA0)
        dist.all_reduce(x)  # plain PyTorch: NCCL itself works on this GPU
        store = c10d._get_default_store()  # the collective guard's store
        out: dict[str, Any] = {
            "backend": dist.get_backend(),
            "ctx": (str(ctx.device), ctx.distributed_type.value, ctx.backend),
            "mixed_precision": ctx.mixed_precision,
            "comm_device": str(comm_device(ctx)),
            "all_reduce": x.tolist(),
            "store": [store.add("probe/count", 1), store.add("probe/count", 1)],
        }
        close_context(ctx)  # one process: the caller's group is left alone
        out["initialised_after_close"] = dist.is_initialized()
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_build_context_on_a_gpu_with_a_one_process_nccl_group(tmp_path: Path) -> None:
    [got] = launch(
        _nccl_of_one,
        tmp_path,
        num_processes=1,
        backend=None,  # the worker starts its NCCL group of one
        start_method="forkserver",
        timeout_s=120,
    )
    assert got == {
        "backend": "nccl",
        "ctx": ("cuda:0", "NO", None),  # one process: NO, never MULTI_GPU
        "mixed_precision": "bf16",
        "comm_device": "cpu",  # one process: nothing is sent
        "all_reduce": [0.0, 1.0, 2.0, 3.0],
        "store": [1, 2],
        "initialised_after_close": True,
    }


# --- token-weighted windows: DDP and FSDP2 (2 gloo ranks), ZeRO-2 (NCCL) ------------
# The shapes of tests/test_num_items.py, smaller: sequences of 3 tokens, some of
# them padding, summed cross-entropy, windows of 4 global micro-batches.

IGNORE = -100
SEQS = 2  # sequences per micro-batch
WINDOW = 4  # global micro-batches per window: k=2 on 2 ranks, k=4 on one
MICRO = 8  # global micro-batches: two windows
F64 = torch.float64


def _token_net() -> nn.Sequential:
    gen = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(F64)
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=F64) * 0.7)
    return net


def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """``MICRO * SEQS`` sequences; 0-3 tokens of each labelled, the rest padding."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO * SEQS, 3, 3, generator=gen, dtype=F64)
    labels = torch.randint(0, 3, (MICRO * SEQS, 3), generator=gen)
    lengths = torch.randint(0, 4, (MICRO * SEQS,), generator=gen)
    lengths[:: WINDOW * SEQS] = 3  # every window holds items
    labels[torch.arange(3) >= lengths[:, None]] = IGNORE
    return x, labels


def _summed(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).reshape(-1, 3)
    return cross_entropy(logits, y.reshape(-1), reduction="sum", ignore_index=IGNORE)


def _sgd(params: Any) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _token_reference(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Plain PyTorch: per window, the sum of its token losses / its tokens."""
    net = _token_net().to(device=device, dtype=dtype)
    opt = _sgd(net.parameters())
    x, labels = _corpus()
    x, labels = x.to(device=device, dtype=dtype), labels.to(device)
    for w in range(MICRO // WINDOW):
        rows = slice(w * WINDOW * SEQS, (w + 1) * WINDOW * SEQS)
        total = int((labels[rows] != IGNORE).sum())
        opt.zero_grad()
        torch.autograd.backward(_summed(net, x[rows], labels[rows]) / total)
        opt.step()
    return [p.detach().cpu() for p in net.parameters()]


def _on_gpu(
    ctx: DistributedContext, timeout: float | None = None
) -> DistributedContext:
    """``run_ranks``'s gloo rank moved onto ``cuda:0``, as local rank 0 of its node."""
    torch.cuda.set_device(CUDA0)
    return dataclasses.replace(
        ctx,
        device=CUDA0,
        distributed_type=DistributedType.MULTI_GPU,
        local_process_index=0,
        collective_timeout=timeout,
    )


def _token_windows(ctx: DistributedContext, how: str) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    ctx = _on_gpu(ctx)
    fsdp = FSDPOptions(shard_modules=(nn.Linear,)) if how == "fsdp" else None
    model = wrap_model(ctx, _token_net(), fsdp=fsdp)
    opt = _sgd(model.parameters())
    x, labels = (t.to(CUDA0) for t in _corpus())
    grad = GradState(accumulation_steps=WINDOW // 2)
    for w in range(MICRO // WINDOW):
        for j in range(WINDOW // 2):
            b = w * WINDOW + j * 2 + ctx.process_index  # rank r's j-th micro-batch
            rows = slice(b * SEQS, (b + 1) * SEQS)
            y = labels[rows]
            _, grad = accumulate_step(
                ctx, grad, model, opt, lambda: _summed(model, x[rows], y),
                end_of_dataloader=b >= MICRO - 2,
                num_items=(y != IGNORE).sum(),  # a count on the GPU
            )  # fmt: skip
    first = next(model.parameters())
    return {
        "ddp": isinstance(model, DistributedDataParallel),
        "ddp_device_ids": getattr(model, "device_ids", None),
        "fsdp": isinstance(model, FSDPModule),
        "first_local_shape": tuple(
            first.to_local().shape if isinstance(first, DTensor) else first.shape
        ),
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "params": [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for p in model.parameters()
        ],
        "steps": grad.optimizer_steps,
    }


def _check_token_windows(ranks: list[dict[str, Any]]) -> None:
    want = _token_reference(F64, torch.device("cpu"))
    for rank in ranks:
        assert rank["devices"] == ["cuda:0"] and rank["steps"] == 2
        # The count was all-reduced: the second window holds 5 items on rank 0
        # and 3 on rank 1, so a step with a rank's own count would differ.
        for got, expected in zip(rank["params"], want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.distributed
def test_ddp_on_the_gpu_token_weighted_windows_equal_plain_pytorch() -> None:
    ranks = run_ranks(_token_windows, 2, "ddp", start_method="forkserver")
    _check_token_windows(ranks)
    assert [(r["ddp"], r["ddp_device_ids"]) for r in ranks] == [(True, [0])] * 2


@pytest.mark.distributed
def test_fsdp2_on_the_gpu_token_weighted_windows_equal_plain_pytorch() -> None:
    ranks = run_ranks(_token_windows, 2, "fsdp", start_method="forkserver")
    _check_token_windows(ranks)
    assert [(r["ddp"], r["fsdp"]) for r in ranks] == [(False, True)] * 2
    # nn.Linear(3, 4).weight: 4 rows, 2 per rank.
    assert [r["first_local_shape"] for r in ranks] == [(2, 3), (2, 3)]


def _zero2_windows(tmp_path: Path) -> dict[str, Any]:
    try:
        importlib.import_module("deepspeed")
    except Exception as error:  # any failure to load it is the skip's reason
        return {
            "skip": f"deepspeed cannot be imported: {type(error).__name__}: {error}"
        }
    os.environ["LOCAL_RANK"] = "0"  # this worker's own environment; DeepSpeed reads it
    warnings.simplefilter("ignore")  # DeepSpeed's deprecation and log noise
    _nccl_group(tmp_path)
    try:
        ctx = DistributedContext(device=CUDA0)
        net = _token_net().float().to(CUDA0)
        opt = _sgd(net.parameters())
        grad = GradState(accumulation_steps=WINDOW)
        options = DeepSpeedOptions(zero_stage=2)
        engine = wrap_model(ctx, net, deepspeed=options, optimizers=opt, grad=grad)
        x, labels = _corpus()
        x, labels = x.float().to(CUDA0), labels.to(CUDA0)
        for b in range(MICRO):
            rows = slice(b * SEQS, (b + 1) * SEQS)
            y = labels[rows]
            _, grad = accumulate_step(
                ctx, grad, engine, opt, lambda: _summed(engine, x[rows], y),
                end_of_dataloader=b == MICRO - 1, num_items=int((y != IGNORE).sum()),
            )  # fmt: skip
        return {
            "params": [p.detach().cpu() for p in unwrap_model(engine).parameters()],
            "steps": grad.optimizer_steps,
            "reference": _token_reference(torch.float32, CUDA0),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="the deepspeed extra is not installed",
)
def test_deepspeed_zero2_on_the_gpu_token_windows_equal_plain_pytorch(
    tmp_path: Path,
) -> None:
    [got] = launch(
        _zero2_windows,
        tmp_path,
        num_processes=1,
        backend=None,  # the worker starts its NCCL group of one
        start_method="forkserver",
        timeout_s=120,
    )
    if "skip" in got:
        pytest.skip(got["skip"])
    assert got["steps"] == 2
    for ours, want in zip(got["params"], got["reference"], strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)


# --- collectives on the GPU: gather_for_metrics, the guard, the barrier ------------


def _collectives(ctx: DistributedContext, tmp_path: Path) -> dict[str, Any]:
    ctx = _on_gpu(ctx, timeout=60.0)  # every call below passes the guard first
    loader = shard_loader(ctx, DataLoader(Indexed(10), batch_size=3))
    gathered = []
    for batch in iter_batches(loader):
        data = {"index": batch.data, "square": batch.data.double() ** 2}
        gathered.append(gather_for_metrics(ctx, data, batch=batch))
    marker = tmp_path / "rank-0-reached-the-barrier"
    if ctx.is_main_process:
        time.sleep(0.5)  # rank 1 is at the barrier by now
        marker.touch()
    wait_for_everyone(ctx)
    after_barrier = marker.exists()
    try:
        if ctx.is_main_process:
            gather(ctx, torch.ones(1, device=CUDA0))
        else:
            reduce(ctx, torch.ones(1, device=CUDA0))
        mismatch = "no error"
    except RuntimeError as error:
        mismatch = str(error)
    return {
        "index": torch.cat([g["index"] for g in gathered]).tolist(),
        "square": torch.cat([g["square"] for g in gathered]).cpu(),
        "devices": sorted({str(t.device) for g in gathered for t in g.values()}),
        "after_barrier": after_barrier,
        "mismatch": mismatch,
    }


@pytest.mark.distributed
def test_gather_for_metrics_guard_and_barrier_with_cuda_tensors(
    tmp_path: Path,
) -> None:
    # 10 samples, batch 3: rank 0 reads [0, 1, 2], [6, 7, 8] and rank 1 [3, 4, 5],
    # [9, 0, 1]; the last global batch has 4 real samples (remainder=4).
    ranks = run_ranks(_collectives, 2, tmp_path, start_method="forkserver")
    for rank, got in enumerate(ranks):
        assert got["index"] == list(range(10))
        assert torch.equal(got["square"], torch.arange(10, dtype=F64) ** 2)
        assert got["devices"] == ["cuda:0"]
        assert got["after_barrier"]
        caller = "gather" if rank == 0 else "reduce"
        assert got["mismatch"].startswith(
            f"{caller}: a collective call, but the ranks reached different "
            "collectives (rank 0: gather, rank 1: reduce)"
        )


class _Block(nn.Module):
    """A compiled unit: its forward is ours (dynamo skips torch.nn's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.linear(x))


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block(), nn.Linear(64, 1)).cuda()


def test_compiled_blocks_under_bf16_on_the_gpu_match_eager_and_are_reported() -> None:
    # Inductor on CUDA with bf16 autocast from accumulate_step: the compiled blocks
    # run (graphs in the report, no break) and train as the eager model does,
    # within bf16 round-off.
    from funcaccel.model import CompileOptions
    from funcaccel.model import compile_blocks
    from funcaccel.model import compile_report

    torch._dynamo.reset()
    ctx = _cuda_ctx("bf16")
    eager, compiled = _blocks(), _blocks()
    compile_blocks(compiled, CompileOptions(blocks=(_Block,)))
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 64, generator=gen), torch.randn(8, 1, generator=gen))]
    data = [(x.cuda(), y.cuda()) for x, y in data * 4]
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    for name, model in (("eager", eager), ("compiled", compiled)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        grad = GradState(accumulation_steps=2)
        for x, y in data:
            loss, grad = accumulate_step(ctx, grad, model, opt, _loss_fn(model, x, y))
            losses[name].append(loss.item())
    torch.testing.assert_close(
        losses["compiled"], losses["eager"], rtol=2e-2, atol=2e-2
    )
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    report = compile_report(compiled)
    assert report.graphs >= 2 and report.graph_breaks == 0, report


def test_estimate_memory_on_fake_tensors_predicts_the_gpu_peak() -> None:
    # One process, AdamW, accumulation 2: the estimate (computed on the CPU, fake
    # tensors) within 15 % of torch.cuda.max_memory_allocated over a real step.
    from funcaccel.planning import estimate_memory

    width, batch = 1024, torch.zeros(64, 1024)

    def model_fn() -> nn.Module:
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))

    def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3)

    estimate = estimate_memory(
        model_fn, batch, world_size=1, optimizer_fn=adamw, accumulation_steps=2
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = model_fn().cuda()
    opt = adamw(list(model.parameters()))
    ctx = _cuda_ctx("no")
    grad = GradState(accumulation_steps=2)
    x = batch.cuda()
    for _ in range(4):
        _, grad = accumulate_step(ctx, grad, model, opt, lambda: model(x).sum())
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    planned = estimate.ranks[0].peak
    assert abs(planned - measured) <= 0.15 * measured, (planned, measured)
