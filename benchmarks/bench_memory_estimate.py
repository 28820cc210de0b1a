r"""``estimate_memory`` against real gloo runs: held model state and the peak, per rank.

For each layout (DDP, FSDP2, HSDP 2 x 2, FSDP2 x TP 2 x 2) and world size (2, 4)
the script first estimates rank 0's memory with ``estimate_memory`` in this
process (fake process group, fake tensors), then runs the same training step for
real on that many gloo processes (``run_ranks``): the same model (an MLP of
``--blocks`` blocks ``hidden -> 2*hidden -> hidden``, about 21M float32
parameters at the defaults), the same ``wrap_model`` call, AdamW, two optimizer
steps of ``--accumulation`` micro-batches through ``accumulate_step``. Each rank
reports

* **held**: the bytes of its parameters, gradients and AdamW state, counted
  tensor by tensor (a ``DTensor`` by its local shard) after the last step;
* **RSS rise**: the rank's peak resident memory (``ru_maxrss``) above its value
  before the model was built, with glibc's mmap threshold fixed at 128 KiB (as
  ``bench_mesh_memory.py`` does): what the process really took, allocator,
  gloo buffers and all, on top of the tensors;
* **peak (tracker)**: the peak torch's memory tracker saw on the real run
  (``FSDPMemTracker`` for an FSDP2 model, ``MemTracker`` otherwise): the live
  tensors' storage, the measure the estimate predicts. It includes DDP's
  gradient buckets, nothing is added for them: the one flat bucket DDP builds at
  construction is seen when the first all-reduce runs on it, and the buckets
  DDP rebuilds in the second iteration's forward are allocated under the
  tracker (two optimizer steps are run, so the peak is taken after the rebuild).

``--models mlp llama`` adds a tiny Llama (transformers ``LlamaForCausalLM`` from
a small ``LlamaConfig``, float32, built here, nothing downloaded; batch of
``--batch-size`` sequences of ``--seq-len`` token ids, its own loss) at DDP and
FSDP2 on 2 ranks and FSDP2 x TP 2 x 2 (the decoder layers as FSDP2 units; q, k,
v, gate and up projections column-wise, o and down row-wise), measured the
same way.

``--timeline`` prints, after each row, its real run's rank 0 phase by phase
(forward, backward, optimizer step, zero_grad of each micro-step): the peak
RSS within the phase and the RSS at its end, the file pages, torch's tracker
and its parts. It showed where DDP's buckets are (Linux only; the marks reset
the kernel's peak, so the RSS rise is then the highest of the phases' peaks).

The noise-control row repeats the first real run: its difference from the first
is the run-to-run spread of the measurement. ``--png FILE`` draws the bar chart
of estimated against measured peaks from this run's rows, or, with
``--chart-from FILE ...``, from the table rows recorded in those files (the
script's saved output, or benchmarks/README.md) without running anything.

    PYTHONPATH=. python benchmarks/bench_memory_estimate.py
    PYTHONPATH=. python benchmarks/bench_memory_estimate.py --models llama
    PYTHONPATH=. python benchmarks/bench_memory_estimate.py --layouts ddp \
        --worlds 2 --timeline
    PYTHONPATH=. python benchmarks/bench_memory_estimate.py \
        --chart-from benchmarks/README.md --png docs/planning_memory.png
"""

from __future__ import annotations

import argparse
import os
import re
import resource
from pathlib import Path
from typing import Any

import torch
from torch import nn

from funcaccel import DistributedContext
from funcaccel import FSDPOptions
from funcaccel import GradState
from funcaccel import accumulate_step
from funcaccel import build_mesh
from funcaccel import wrap_model
from funcaccel.flops import output_loss
from funcaccel.planning import estimate_memory
from funcaccel.testing import run_ranks

MiB = 2**20
LAYOUTS = ("ddp", "fsdp", "hsdp", "fsdp_tp")
LLAMA_ROWS = (("ddp", 2), ("fsdp", 2), ("fsdp_tp", 4))
NOISE = "fsdp again (noise control)"
ROW = re.compile(r"(tiny llama, )?(ddp|fsdp|hsdp|fsdp_tp), \d+ ranks")


def _net(args: argparse.Namespace) -> nn.Sequential:
    h = args.hidden
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(h, 2 * h), nn.ReLU(), nn.Linear(2 * h, h))
            for _ in range(args.blocks)
        )
    )


def _llama(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.llama_vocab,
        hidden_size=args.llama_hidden,
        intermediate_size=args.llama_hidden * 8 // 3,
        num_hidden_layers=args.llama_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq_len,
    )  # float32: the default dtype
    return LlamaForCausalLM(config)


def _llama_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, args.llama_vocab, (args.batch_size, args.seq_len))
    return {"input_ids": ids, "labels": ids}


def _llama_plan(layers: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(layers):
        at = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"{at}.{name}"] = ColwiseParallel()
        plan[f"{at}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{at}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{at}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{at}.mlp.down_proj"] = RowwiseParallel()
    return plan


def _llama_options(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    """The sizes and wrap_model options of the tiny Llama's layouts."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    fsdp = FSDPOptions(shard_modules=(LlamaDecoderLayer,))
    if layout == "ddp":
        return {}
    if layout == "fsdp":
        return {"fsdp": fsdp}
    return {"fsdp": fsdp, "tp": 2, "tp_plan": _llama_plan(args.llama_layers)}


def _plan(blocks: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan: dict[str, Any] = {}
    for b in range(blocks):
        plan[f"{b}.0"] = ColwiseParallel()
        plan[f"{b}.2"] = RowwiseParallel()
    return plan


def _options(layout: str, world: int, blocks: int) -> dict[str, Any]:
    """The sizes and wrap_model options of a layout at ``world`` ranks."""
    fsdp = FSDPOptions(shard_modules=(nn.Sequential,))
    if layout == "ddp":
        return {}
    if layout == "fsdp":
        return {"fsdp": fsdp}
    if layout == "hsdp":
        return {"fsdp": fsdp, "dp_replicate": 2}
    return {"fsdp": fsdp, "tp": 2, "tp_plan": _plan(blocks)}


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _forward(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def _reset(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.reset_parameters()


def _proc_status() -> dict[str, int]:
    """This process's resident memory (bytes): now, its peak, of it file pages."""
    found: dict[str, int] = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile"):
                found[key] = int(value.split()[0]) * 1024
    return found


def _timeline_marker(
    tracker: Any, base: int, rows: list[str], highest: list[int]
) -> Any:
    """A function that closes the phase ending now and opens the next.

    Each call appends a Markdown row to ``rows``: the phase's name, the peak
    RSS within it and the RSS at its end (above ``base``), the file pages
    among them, the tracker's live bytes and their parts (MiB). Linux only: the
    peak is reset through ``/proc/self/clear_refs`` at each call, which resets
    ``ru_maxrss`` too, so ``highest[0]`` keeps the highest peak seen.
    """

    def mark(phase: str) -> None:
        now = _proc_status()
        highest[0] = max(highest[0], now["VmHWM"])
        parts: dict[str, float] = {}
        for device in tracker.get_tracker_snapshot("current").values():
            for part, size in device.items():
                name = str(getattr(part, "value", part))  # torch's enum's name
                parts[name] = parts.get(name, 0.0) + size / MiB
        total = parts.pop("Total", 0.0)
        named = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if v >= 0.05)
        rows.append(
            f"| {phase} | {(now['VmHWM'] - base) / MiB:.1f} | "
            f"{(now['VmRSS'] - base) / MiB:.1f} | {now['RssFile'] / MiB:.1f} | "
            f"{total:.1f} | {named} |"
        )
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to VmRSS

    return mark


def _real(
    ctx: DistributedContext, layout: str, args: argparse.Namespace, llama: bool
) -> dict[str, Any]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = _proc_status()["VmRSS"] if args.timeline else 0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if llama:
        options = _llama_options(layout, args)
    else:
        options = _options(layout, ctx.num_processes, args.blocks)
    mesh = None
    if "tp" in options or "dp_replicate" in options or "fsdp" in options:
        mesh = build_mesh(
            ctx,
            dp_replicate=options.get("dp_replicate", 1),
            dp_shard=-1,
            tp=options.get("tp", 1),
        )
    if llama:  # built here: its rotary buffers are computed at construction
        net: nn.Module = _llama(args)
        batch: Any = _llama_batch(args)
        inputs: tuple[torch.Tensor, ...] = (batch["input_ids"],)
    else:
        with torch.device("meta"):
            net = _net(args)
        batch = torch.randn(args.batch_size, args.hidden)
        inputs = (batch,)
    model = wrap_model(
        ctx,
        net,
        fsdp=options.get("fsdp"),
        mesh=mesh,
        tp_plan=options.get("tp_plan"),
        init_fn=None if llama else _reset,
    )
    opt = _adamw(list(model.parameters()))
    if layout == "ddp":
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker: Any = MemTracker()
        tracker.track_external(model, opt)
    else:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs(inputs)
    rows: list[str] = []
    highest = [0]
    mark = _timeline_marker(tracker, base, rows, highest) if args.timeline else None
    at = ["built, wrapped, before the first step"]

    def loss_fn() -> torch.Tensor:
        loss = output_loss(_forward(model, batch))
        if mark is not None:
            mark(f"{at[0]}: forward")
        return loss

    if mark is not None:
        mark(at[0])
        opt.register_step_pre_hook(lambda *_: mark(f"{at[0]}: backward"))
        opt.register_step_post_hook(lambda *_: mark(f"{at[0]}: optimizer step"))
    grad = GradState(accumulation_steps=args.accumulation)
    with tracker:
        for _ in range(2 * args.accumulation):
            at[0] = (
                f"window {grad.optimizer_steps + 1}, micro-step {grad.micro_step + 1}"
            )
            step_before = grad.optimizer_steps
            _, grad = accumulate_step(ctx, grad, model, opt, loss_fn)
            if mark is not None:
                stepped = grad.optimizer_steps > step_before
                mark(f"{at[0]}: {'zero_grad' if stepped else 'backward'}")
            tracker.reset_mod_stats()  # one forward's module stats; the peak stays
    peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    params = list(model.parameters())
    held = sum(_local_bytes(p) for p in params)
    held += sum(_local_bytes(p) for p in params if p.requires_grad)  # one gradient each
    held += sum(
        _local_bytes(v)
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if args.timeline:  # the marks reset ru_maxrss; the RSS before was VmRSS
        rss = highest[0] - base
    return {"held": held, "peak": int(peak), "rss": rss, "timeline": rows}


def _estimate(
    layout: str, world: int, args: argparse.Namespace, llama: bool
) -> dict[str, int]:
    if llama:
        options = _llama_options(layout, args)
        model_fn: Any = lambda: _llama(args)  # noqa: E731
        batch: Any = _llama_batch(args)
    else:
        options = _options(layout, world, args.blocks)
        model_fn = lambda: _net(args)  # noqa: E731
        batch = torch.zeros(args.batch_size, args.hidden)
    estimate = estimate_memory(
        model_fn,
        batch,
        optimizer_fn=_adamw,
        world_size=world,
        accumulation_steps=args.accumulation,
        **options,
    )
    rank = estimate.ranks[0]
    return {"held": rank.model_state, "peak": rank.peak}


def _row(name: str, est: dict[str, int], real: dict[str, Any]) -> str:
    def gap(a: int, b: int) -> str:
        return f"{100 * (a - b) / b:.2f}"

    return (
        f"| {name} | {est['held'] / MiB:.3f} | {real['held'] / MiB:.3f} | "
        f"{gap(est['held'], real['held'])} | {est['peak'] / MiB:.3f} | "
        f"{real['peak'] / MiB:.3f} | {gap(est['peak'], real['peak'])} | "
        f"{real['rss'] / MiB:.3f} | {gap(est['peak'], real['rss'])} |"
    )


def _print_timeline(name: str, rows: list[str]) -> None:
    print(f"\n{name}, rank 0, MiB above its RSS before the model was built:\n")
    print(
        "| phase (ended) | peak RSS in it | RSS at its end | file pages "
        "(total) | tracker | tracker's parts |"
    )
    print("|---|---:|---:|---:|---:|---|")
    print("\n".join(rows), end="\n\n", flush=True)


def _bars() -> dict[str, list[float]]:
    return {
        "estimate_memory": [],
        "real run, torch's tracker": [],
        "real run, RSS rise": [],
    }


def _recorded(paths: list[str]) -> tuple[list[str], dict[str, list[float]]]:
    """The chart's labels and bars from the table rows this script printed.

    ``paths`` hold its output (saved, or copied into benchmarks/README.md): each
    row named like ``ddp, 2 ranks`` or ``tiny llama, fsdp, 2 ranks`` gives the
    estimated peak, the tracked peak and the RSS rise (columns 5, 6 and 8); the
    noise-control row, other tables and a row seen before are left out.
    """
    labels: list[str] = []
    bars = _bars()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) != 9 or not ROW.fullmatch(cells[0]) or cells[0] in labels:
                continue
            labels.append(cells[0])
            for bar, column in zip(bars.values(), (4, 5, 7), strict=True):
                bar.append(float(cells[column]))
    if not labels:
        raise SystemExit(f"--chart-from: no table rows of this script in {paths}")
    return labels, bars


def _png(path: str, labels: list[str], bars: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1 + 0.9 * len(labels), 3.4), dpi=80)
    width = 0.8 / len(bars)
    for k, (label, values) in enumerate(bars.items()):
        at = [i - 0.4 + width * (k + 0.5) for i in range(len(labels))]
        ax.bar(at, values, width, label=label)
    ax.set_xticks(list(range(len(labels))), labels, rotation=25, fontsize=8, ha="right")
    ax.set_ylabel("peak per rank (MiB)")
    ax.set_ylim(0, 1.2 * max(max(values) for values in bars.values()))
    ax.legend(fontsize=8, ncols=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--png", default=None, help="write the bar chart here")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print each real run's rank 0 phase by phase (RSS and the tracker)",
    )
    parser.add_argument(
        "--chart-from",
        nargs="+",
        default=None,
        help="draw --png from the table rows recorded in these files; run nothing",
    )
    parser.add_argument(
        "--models", nargs="+", choices=("mlp", "llama"), default=["mlp"]
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--llama-hidden", type=int, default=256)
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--llama-vocab", type=int, default=8000)
    args = parser.parse_args()
    if args.chart_from is not None:
        if args.png is None:
            parser.error("--chart-from draws a chart: give --png FILE")
        _png(args.png, *_recorded(args.chart_from))
        print(f"bar chart: {args.png}")
        return
    # glibc keeps freed blocks under its (rising) mmap threshold in the heap, so
    # RSS would show the allocator's high-water mark; a fixed threshold returns
    # every block over 128 KiB on free. Set before the ranks' fork server starts.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    if "mlp" in args.models:
        params = sum(p.numel() for p in _net(args).parameters())
        print(
            f"MLP of {args.blocks} blocks {args.hidden}->{2 * args.hidden}->"
            f"{args.hidden}: {params / 1e6:.1f}M float32 parameters"
        )
    if "llama" in args.models:
        params = sum(p.numel() for p in _llama(args).parameters())
        print(
            f"tiny Llama ({args.llama_layers} layers, hidden {args.llama_hidden}, "
            f"vocabulary {args.llama_vocab}): {params / 1e6:.1f}M float32 "
            f"parameters, sequences of {args.seq_len} tokens"
        )
    print(
        f"AdamW, batch {args.batch_size}, accumulation {args.accumulation}; rank 0, MiB"
    )
    print()
    print(
        "| layout | held est. | held real | held diff % | peak est. | peak real "
        "| peak diff % | RSS rise real | peak est. vs RSS rise % |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    labels: list[str] = []
    bars = _bars()
    runs: list[tuple[str, int, bool]] = []
    if "mlp" in args.models:
        runs += [
            (layout, world, False)
            for world in args.worlds
            for layout in args.layouts
            if layout in ("ddp", "fsdp") or world == 4  # 2 x 2 meshes
        ]
    if "llama" in args.models:
        runs += [
            (layout, world, True)
            for layout, world in LLAMA_ROWS
            if layout in args.layouts
        ]
    for layout, world, llama in runs:
        est = _estimate(layout, world, args, llama)
        real = run_ranks(
            _real, world, layout, args, llama, timeout_s=600,
            start_method="forkserver",
        )[0]  # fmt: skip
        name = f"{'tiny llama, ' if llama else ''}{layout}, {world} ranks"
        print(_row(name, est, real), flush=True)
        if args.timeline:
            _print_timeline(name, real["timeline"])
        labels.append(name)
        for bar, value in zip(
            bars.values(), (est["peak"], real["peak"], real["rss"]), strict=True
        ):
            bar.append(value / MiB)
        if not llama and layout == "fsdp" and world == args.worlds[0]:
            again = run_ranks(
                _real, world, layout, args, False, timeout_s=600,
                start_method="forkserver",
            )[0]  # fmt: skip
            print(_row(f"{NOISE}, {world} ranks", est, again), flush=True)
    if args.png is not None:
        _png(args.png, labels, bars)
        print(f"\nbar chart: {args.png}")


if __name__ == "__main__":
    main()
