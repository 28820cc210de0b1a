"""Per-rank memory of DDP, FSDP2 and HSDP, with the model built whole or on ``meta``.

Every variant runs in fresh gloo processes (forked from a server that has only
imported torch and funcaccel, so no variant inherits another's memory): each
rank builds a ~21M-parameter float32 MLP (1024-2048-2048-2048-2048-2048-1024), wraps
it, builds Adam and runs ``--steps`` training steps on its own batch, then reports

* its peak process memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: RSS on
  CPU), and the RSS after the imports and the process group, before the model;
* the bytes of model state it holds: its (local) parameters, gradients and Adam
  state (``DTensor``s counted by their local shard).

Variants: plain PyTorch DDP (``DistributedDataParallel`` by hand, the reference),
the same again (noise control), and funcaccel's ``wrap_model`` with DDP, FSDP2
(every ``nn.Linear`` its own unit) and, at 4 processes, HSDP (2 x 2 mesh; at 2
processes HSDP would be DDP or FSDP2), each with the model built whole and built
on ``meta`` (``wrap_model`` then materialises only each rank's shard). Ratios are
against plain DDP's peak in the same run. The loss after the last step is shown:
whole and meta rows of one layout must agree (the same initial values).

**The allocator.** glibc raises its mmap threshold each time a large block is
freed (up to 32 MiB), so FSDP2's per-layer gather buffers (16 MiB here), once
freed, are served from the heap and kept there: RSS then measures the allocator's
high-water mark, not the live tensors, and sharding seems to cost memory. By default
the workers run with ``MALLOC_MMAP_THRESHOLD_=131072`` (a fixed threshold: every
block over 128 KiB is mapped and returned on free), which applies to every variant
alike; ``--glibc-default`` keeps glibc's dynamic threshold to show the difference.

With ``--cuda`` rank r runs on ``cuda:r`` with NCCL and also reports
``torch.cuda.max_memory_allocated`` (the GPU figure; the RSS columns stay).

    PYTHONPATH=. python benchmarks/bench_mesh_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch import nn
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel

from funcaccel import DistributedContext
from funcaccel import FSDPOptions
from funcaccel import InitProcessGroupKwargs
from funcaccel import build_context
from funcaccel import build_mesh
from funcaccel import close_context
from funcaccel import wrap_model

MiB = 2**20
REFERENCE = "plain PyTorch DDP"
NOISE = "plain PyTorch DDP again (noise control)"
VARIANTS = ("ddp", "ddp_meta", "fsdp", "fsdp_meta", "hsdp", "hsdp_meta")


def _build(args: argparse.Namespace) -> nn.Module:
    h = args.hidden
    layers: list[nn.Module] = [nn.Linear(h // 2, h), nn.ReLU()]
    for _ in range(args.layers):
        layers += [nn.Linear(h, h), nn.ReLU()]
    layers.append(nn.Linear(h, h // 2))
    return nn.Sequential(*layers)


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _model(
    ctx: DistributedContext, variant: str, args: argparse.Namespace
) -> nn.Module:
    torch.manual_seed(0)
    if variant.endswith("_meta"):
        with torch.device("meta"):
            net = _build(args)
    else:
        net = _build(args).to(ctx.device)
    if variant in (REFERENCE, NOISE):
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(net, device_ids=ids)
    layout = variant.removesuffix("_meta")
    if layout == "ddp":
        return wrap_model(ctx, net)
    fsdp = FSDPOptions(shard_modules=(nn.Linear,))
    if layout == "fsdp":
        return wrap_model(ctx, net, fsdp=fsdp)
    mesh = build_mesh(ctx, dp_replicate=2)  # 2 x (world / 2)
    return wrap_model(ctx, net, fsdp=fsdp, mesh=mesh)


def _run(
    ctx: DistributedContext, variant: str, args: argparse.Namespace
) -> dict[str, Any]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    model = _model(ctx, variant, args)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + ctx.process_index)
    x = torch.randn(args.batch_size, args.hidden // 2, generator=gen).to(ctx.device)
    y = torch.randn(args.batch_size, args.hidden // 2, generator=gen).to(ctx.device)
    loss = torch.zeros(())
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=False)
        loss = mse_loss(model(x), y)
        torch.autograd.backward(loss)
        opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    params = list(model.parameters())
    state = {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params),
        "adam": sum(
            _local_bytes(v)
            for s in opt.state.values()
            for k, v in s.items()
            if k != "step" and isinstance(v, torch.Tensor)
        ),
    }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "before": before,
        "peak": peak,
        # On a GPU: the most memory the caching allocator handed out at once.
        "cuda_peak": torch.cuda.max_memory_allocated(ctx.device) if cuda else None,
        "state": state,
        "loss": total.item() / ctx.num_processes,
    }


def worker(
    rank: int, world: int, tmp: str, variant: str, args: argparse.Namespace
) -> None:
    """One rank of one variant: build the group, run, write its figures."""
    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    init = InitProcessGroupKwargs(init_method=f"file://{tmp}/rendezvous")
    # --cuda: rank r on cuda:r with NCCL (build_context's choice for a GPU).
    ctx = build_context(cpu=not args.cuda, init_kwargs=init, environ=env)
    try:
        result = _run(ctx, variant, args)
    finally:
        close_context(ctx)
    Path(tmp, f"rank_{rank}.json").write_text(json.dumps(result))


def _spawn(world: int, variant: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        # A fork server that has imported torch and funcaccel once: every variant
        # still gets fresh processes, without paying the imports each time.
        context = torch.multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(
            ["torch", "torch.distributed", "torch.distributed.fsdp", "funcaccel"]
        )
        processes = [
            context.Process(target=worker, args=(rank, world, tmp, variant, args))
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        codes = [process.exitcode for process in processes]
        if any(codes):
            raise SystemExit(
                f"bench_mesh_memory: {variant} workers exited with {codes}"
            )
        return [
            json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(world)
        ]


def _table(world: int, runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    reference = max(r["peak"] for r in runs[REFERENCE])
    cuda = runs[REFERENCE][0]["cuda_peak"] is not None
    gpu_head, gpu_rule = (
        (" GPU peak MiB (max rank) | GPU peak / plain DDP |", "---|---|")
        if cuda
        else ("", "")
    )
    lines = [
        f"{world} processes",
        "",
        "| variant | peak RSS MiB (max rank) | RSS before the model MiB | peak - before MiB "
        f"| params MiB | grads MiB | Adam MiB | peak / plain DDP |{gpu_head} loss |",
        f"|---|---|---|---|---|---|---|---|{gpu_rule}---|",
    ]
    for name, ranks in runs.items():
        worst = max(ranks, key=lambda r: r["peak"])
        state = worst["state"]
        gpu = ""
        if cuda:
            top = max(r["cuda_peak"] for r in ranks)
            gpu = f" {top / MiB:.1f} | {top / max(r['cuda_peak'] for r in runs[REFERENCE]):.3f}× |"
        lines.append(
            f"| {name} | {worst['peak'] / MiB:.1f} | {worst['before'] / MiB:.1f} | "
            f"{(worst['peak'] - worst['before']) / MiB:.1f} | "
            f"{state['parameters'] / MiB:.1f} | {state['gradients'] / MiB:.1f} | "
            f"{state['adam'] / MiB:.1f} | {worst['peak'] / reference:.3f}× |{gpu} "
            f"{ranks[0]['loss']:.6f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="process counts, e.g. 2,4")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"a subset of {','.join(VARIANTS)}",
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4, help="hidden x hidden layers")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--cuda",
        action="store_true",
        help="rank r on cuda:r with NCCL; adds torch.cuda.max_memory_allocated per rank",
    )
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="keep glibc's dynamic mmap threshold (freed gather buffers stay in RSS)",
    )
    args = parser.parse_args()
    if not args.glibc_default:
        # Read by glibc when each process starts: the fork server and its workers.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    worlds = [int(w) for w in args.worlds.split(",")]
    chosen = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.cuda and torch.cuda.device_count() < max(worlds):
        parser.error(
            f"--cuda needs {max(worlds)} GPUs; {torch.cuda.device_count()} visible"
        )
    numel = sum(p.numel() for p in _build(args).parameters())
    print(
        f"MLP of {numel / 1e6:.1f}M float32 parameters ({numel * 4 / MiB:.0f} MiB), "
        f"Adam, {args.steps} steps of batch {args.batch_size}, "
        f"{'NCCL on GPUs' if args.cuda else 'gloo'}, 1 thread per rank, "
        f"malloc: {'glibc default' if args.glibc_default else 'MALLOC_MMAP_THRESHOLD_=131072'}"
    )
    for world in worlds:
        runs: dict[str, list[dict[str, Any]]] = {}
        for variant in (REFERENCE, NOISE, *chosen):
            if variant.startswith("hsdp") and (world < 4 or world % 2):
                continue
            runs[variant] = _spawn(world, variant, args)
        print()
        print("\n".join(_table(world, runs)))


if __name__ == "__main__":
    main()
