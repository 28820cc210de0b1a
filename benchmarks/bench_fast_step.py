"""The fast step on CPU: compiled blocks, activation checkpointing, accumulation traffic.

A tiny transformer of our own (``--blocks`` pre-norm blocks of width ``--dim``:
causal self-attention through ``scaled_dot_product_attention`` and a 4x MLP;
``--batch`` sequences of ``--seq`` tokens as float inputs, mean squared error to a
random target) trains with windows of ``--k`` micro-steps. Four tables:

1. **One process, step time**: plain PyTorch eager (the reference: forward,
   ``backward(loss / k)``, a step per window, written here), the same again
   (noise control), ``accumulate_step`` on the eager model, and on the model
   with every block compiled in place by inductor
   (``wrap_model(..., compile=CompileOptions(blocks=[Block]))``). Median and
   minimum time per window after one warm-up window, whose time (the
   compilation, for the compiled row) is shown apart, and the final loss.
2. **Activation memory** (one process, eager): the peak bytes of activations
   and of all tensors during one micro-step's forward and backward, from
   torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, which
   counts live tensors by kind on CPU too), without checkpointing, full, every
   2nd block and selective (matrix products kept), and the window time of each.
3. **FSDP2 on 2 gloo processes**: eager vs compiled blocks, per-window time
   (max over ranks, median over windows) and the compile window.
4. **Accumulation communication on HSDP 2x2 (4 gloo processes)**, one row per
   ``FSDPOptions.accumulation_comm``: bytes each rank sends into collectives per
   window, by kind (all-gather; reductions, which on gloo are all-reduces: the
   reduce-scatter and HSDP's replica all-reduce), counted by a dispatch mode
   over the ``c10d`` ops; the gradient bytes a rank holds between two
   micro-steps of an open window (its sharded ``.grad`` plus FSDP2's
   unsharded accumulation buffers and partial reductions); the peak of all its
   tensors during an open window's 2nd micro-step (torch's ``MemTracker``);
   window time. The
   ``defer_all`` row runs twice (noise control).

    PYTHONPATH=. python benchmarks/bench_fast_step.py
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from funcaccel import ActivationCheckpointOptions
from funcaccel import CompileOptions
from funcaccel import DistributedContext
from funcaccel import FSDPOptions
from funcaccel import GradState
from funcaccel import accumulate_step
from funcaccel import apply_activation_checkpointing
from funcaccel import build_mesh
from funcaccel import compile_report
from funcaccel import wrap_model
from funcaccel.testing import run_ranks

MiB = 2**20
POLICIES = ("defer_all", "reduce_scatter_each_step", "defer_replica_all_reduce")


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return out


class Net(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[Block(args.dim, args.heads) for _ in range(args.blocks)]
        )
        self.head = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x)
        # Rows of tokens: the head's output is then a fresh tensor, not a view
        # (FSDP2 warns about a root returning a view).
        out: torch.Tensor = self.head(h.reshape(-1, h.shape[-1]))
        return out


def _data(args: argparse.Namespace, rank: int = 0) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(100 + rank)
    shape = (args.batch, args.seq, args.dim)
    return [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(args.k)
    ]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y.reshape(-1, y.shape[-1]))


def _plain_window(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], k: int
) -> float:
    total = 0.0
    for batch in data:
        loss = _loss(model, batch)
        torch.autograd.backward(loss / k)
        total += loss.item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total / k


def _funcaccel_window(
    ctx: DistributedContext,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[Any],
    k: int,
    between: Callable[[], None] | None = None,
) -> float:
    grad = GradState(accumulation_steps=k)
    total = 0.0
    for i, batch in enumerate(data):
        loss, grad = accumulate_step(
            ctx, grad, model, opt, functools.partial(_loss, model, batch)
        )
        total += loss.item()
        if between is not None and i == 0:
            between()
    return total / k


def _time_windows(
    runs: dict[str, Callable[[], float]], windows: int
) -> dict[str, tuple[float, list[float], float]]:
    """Time the ``runs`` round-robin: name -> (first window s, later windows s, loss).

    The first window (compilation included) is timed by the wall clock.

    Each round runs one window of every variant in turn, so a change in the
    machine's load reaches them all alike; the clock is this process's CPU time
    (``time.process_time``: every thread of the process, none of the others').
    """
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {name: [] for name in runs}
    loss: dict[str, float] = {}
    for name, run in runs.items():
        # Wall time: inductor compiles in worker processes, whose CPU time
        # process_time would not see.
        start = time.perf_counter()
        loss[name] = run()
        first[name] = time.perf_counter() - start
    for _ in range(windows):
        for name, run in runs.items():
            start = time.process_time()
            loss[name] = run()
            times[name].append(time.process_time() - start)
    return {name: (first[name], times[name], loss[name]) for name in runs}


def _one_process(args: argparse.Namespace) -> list[str]:
    ctx = DistributedContext()
    data = _data(args)
    torch.manual_seed(0)
    base = Net(args)
    runs: dict[str, Callable[[], float]] = {}
    compiled: nn.Module = base
    for name in (
        "plain PyTorch eager",
        "plain PyTorch eager again (noise control)",
        "funcaccel eager",
        f"funcaccel compiled blocks ({args.backend})",
    ):
        model: nn.Module = copy.deepcopy(base)
        if "compiled" in name:
            options = CompileOptions(blocks=[Block], backend=args.backend)
            model = wrap_model(ctx, model, compile=options)
            compiled = model
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if name.startswith("plain"):
            runs[name] = functools.partial(_plain_window, model, opt, data, args.k)
        else:
            runs[name] = functools.partial(
                _funcaccel_window, ctx, model, opt, data, args.k
            )
    rows = _time_windows(runs, args.repeats)
    report = compile_report(compiled)
    ref = statistics.median(rows["plain PyTorch eager"][1])
    lines = [
        f"One process, {args.blocks} blocks of width {args.dim}, {args.batch} x "
        f"{args.seq} tokens, windows of {args.k}, {args.repeats} timed windows",
        "",
        "| variant | median CPU ms / window | min CPU ms / window | median / plain eager "
        "| first window wall s | loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, (first, times, loss) in rows.items():
        med = statistics.median(times)
        lines.append(
            f"| {name} | {med * 1e3:.3f} | {min(times) * 1e3:.3f} | {med / ref:.3f}× "
            f"| {first:.3f} | {loss:.6f} |"
        )
    lines += [
        "",
        f"compile_report: {report.graphs} graphs, {report.recompiles} recompiles, "
        f"{report.graph_breaks} graph breaks, blocks {list(report.blocks)}",
    ]
    return lines


def _peak_memory(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """(peak activation bytes, peak total bytes) of one forward and backward."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        torch.autograd.backward(_loss(model, batch))
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    activations = next(v for k, v in peak.items() if str(k).endswith("ACT"))
    return int(activations), int(peak["Total"])


def _activation_memory(args: argparse.Namespace) -> list[str]:
    ctx = DistributedContext()
    data = _data(args)
    torch.manual_seed(0)
    base = Net(args)
    variants: dict[str, ActivationCheckpointOptions | None] = {
        "no checkpointing": None,
        "full, every block": ActivationCheckpointOptions(blocks=[Block]),
        "full, every 2nd block": ActivationCheckpointOptions(blocks=[Block], every_n=2),
        "selective (matrix products kept)": ActivationCheckpointOptions(
            blocks=[Block], mode="selective"
        ),
    }
    lines = [
        "Activation memory, one process, eager (torch's MemTracker: peak bytes "
        "of activations and of everything, one micro-step's forward and backward)",
        "",
        "| checkpointing | peak activations MiB | activations / none | peak total MiB "
        "| median CPU ms / window | time / none |",
        "|---|---|---|---|---|---|",
    ]
    memory: dict[str, tuple[int, int]] = {}
    runs: dict[str, Callable[[], float]] = {}
    for name, options in variants.items():
        model = copy.deepcopy(base)
        if options is not None:
            apply_activation_checkpointing(model, options)
        memory[name] = _peak_memory(model, data[0])
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        runs[name] = functools.partial(_funcaccel_window, ctx, model, opt, data, args.k)
    timed = _time_windows(runs, args.repeats)
    ref_bytes = memory["no checkpointing"][0]
    ref_time = statistics.median(timed["no checkpointing"][1])
    for name in variants:
        saved, total = memory[name]
        med = statistics.median(timed[name][1])
        lines.append(
            f"| {name} | {saved / MiB:.3f} | {saved / ref_bytes:.3f}× "
            f"| {total / MiB:.3f} | {med * 1e3:.3f} | {med / ref_time:.3f}× |"
        )
    return lines


def _fsdp_rank(
    ctx: DistributedContext, args: argparse.Namespace, compiled: bool
) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Net(args)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    options = CompileOptions(blocks=[Block], backend=args.backend) if compiled else None
    fsdp = FSDPOptions(shard_modules=[Block])
    model = wrap_model(ctx, net, fsdp=fsdp, optimizers=opt, compile=options)
    data = _data(args, ctx.process_index)
    run = functools.partial(_funcaccel_window, ctx, model, opt, data, args.k)
    first, times, loss = _time_windows({"": run}, args.repeats)[""]
    graphs = compile_report(model).graphs
    return {"first": first, "times": times, "loss": loss, "graphs": graphs}


def _fsdp_two(args: argparse.Namespace) -> list[str]:
    lines = [
        "FSDP2 on 2 gloo processes (one torch thread each), blocks as units",
        "",
        "| variant | median CPU ms / window (max rank) | median / eager "
        "| first window wall s | graphs (rank 0) | loss (rank 0) |",
        "|---|---|---|---|---|---|",
    ]
    ref = 0.0
    for compiled in (False, True):
        ranks = run_ranks(
            _fsdp_rank, 2, args, compiled, timeout_s=900, start_method="forkserver"
        )
        per_window = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)]
        med = statistics.median(per_window)
        ref = ref or med
        first = max(r["first"] for r in ranks)
        name = f"compiled blocks ({args.backend})" if compiled else "eager"
        lines.append(
            f"| {name} | {med * 1e3:.3f} | {med / ref:.3f}× | {first:.3f} "
            f"| {ranks[0]['graphs']} | {ranks[0]['loss']:.6f} |"
        )
    return lines


class _CommBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sum the bytes of the tensors handed to c10d collectives, by kind."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.bytes: dict[str, int] = {"all-gather": 0, "reduction": 0}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        name = str(func)
        if name.startswith("c10d."):
            tensors = [
                a
                for a in torch.utils._pytree.tree_leaves(args)
                if isinstance(a, torch.Tensor)
            ]
            if "allgather" in name:
                # The input is this rank's shard (the output is the gathered whole).
                self.bytes["all-gather"] += tensors[-1].nbytes if tensors else 0
            elif "reduce" in name:
                self.bytes["reduction"] += sum(t.nbytes for t in tensors[:1])
        return func(*args, **(kwargs or {}))


def _held_grad_bytes(model: nn.Module) -> int:
    held = 0
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        for group in state_of()._fsdp_param_groups:
            partial = getattr(group, "_partial_reduce_output", None)
            held += partial.nbytes if isinstance(partial, torch.Tensor) else 0
            for param in group.fsdp_params:
                acc = getattr(param, "unsharded_accumulated_grad", None)
                held += acc.nbytes if isinstance(acc, torch.Tensor) else 0
                # defer_all: the unsharded gradient, kept between backwards.
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    held += unsharded.grad.nbytes
                grad = param.sharded_param.grad
                held += grad.to_local().nbytes if grad is not None else 0
    return held


def _policy_rank(
    ctx: DistributedContext, args: argparse.Namespace, policy: str
) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Net(args)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    mesh = build_mesh(ctx, dp_replicate=2, dp_shard=2)
    fsdp = FSDPOptions(shard_modules=[Block], accumulation_comm=policy)  # type: ignore[arg-type]
    model = wrap_model(ctx, net, mesh=mesh, fsdp=fsdp, optimizers=opt)
    data = _data(args, ctx.process_index)
    held: list[int] = []
    run = functools.partial(
        _funcaccel_window,
        ctx,
        model,
        opt,
        data,
        args.k,
        lambda: held.append(_held_grad_bytes(model)),
    )
    _, times, loss = _time_windows({"": run}, args.repeats)[""]
    with _CommBytes() as counter:
        run()
    return {
        "times": times,
        "bytes": counter.bytes,
        "held": max(held),
        "peak": _fsdp_peak(ctx, model, opt, data),
        "loss": loss,
    }


def _fsdp_peak(
    ctx: DistributedContext,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[Any],
) -> int:
    """This rank's peak tensor bytes during the 2nd micro-step of a window.

    The window is open then (k >= 3), after a micro-step's gradients were kept;
    torch's ``MemTracker`` follows one forward and backward (it refuses more).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    grad = GradState(accumulation_steps=len(data))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    for i, batch in enumerate(data):
        step = functools.partial(_loss, model, batch)
        if i == 1:
            with tracker:
                _, grad = accumulate_step(ctx, grad, model, opt, step)
        else:
            _, grad = accumulate_step(ctx, grad, model, opt, step)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _policies(args: argparse.Namespace) -> list[str]:
    lines = [
        "Accumulation communication, HSDP 2 x 2 on 4 gloo processes, windows of "
        f"{args.k} (bytes per rank and window)",
        "",
        "| accumulation_comm | all-gather MiB | reductions MiB | held grads MiB | "
        "peak MiB (rank 0) | median CPU ms / window (max rank) | time / defer_all "
        "| loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref = 0.0
    for name in (
        *POLICIES[:1],
        *POLICIES,
    ):
        ranks = run_ranks(
            _policy_rank, 4, args, name, timeout_s=900, start_method="forkserver"
        )
        per_window = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)]
        med = statistics.median(per_window)
        ref = ref or med
        r0 = ranks[0]
        label = name if ref != med or name != "defer_all" else name
        lines.append(
            f"| {label} | {r0['bytes']['all-gather'] / MiB:.3f} | "
            f"{r0['bytes']['reduction'] / MiB:.3f} | {r0['held'] / MiB:.3f} | "
            f"{r0['peak'] / MiB:.3f} | "
            f"{med * 1e3:.3f} | {med / ref:.3f}× | {r0['loss']:.6f} |"
        )
    # The first row is the reference, the second the same policy again.
    lines[4] = lines[4].replace("| defer_all |", "| defer_all (reference) |", 1)
    lines[5] = lines[5].replace(
        "| defer_all |", "| defer_all again (noise control) |", 1
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend of the blocks"
    )
    parser.add_argument(
        "--tables", default="1234", help="which tables to run (digits 1-4)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = {
        "1": _one_process,
        "2": _activation_memory,
        "3": _fsdp_two,
        "4": _policies,
    }
    print(f"torch {torch.__version__}, CPU, one torch thread per process\n")
    for key in args.tables:
        print("\n".join(sections[key](args)), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
