"""Train a small causal language model from transformers with funcaccel.

One process:        python examples/train_causal_lm.py
Two processes:      torchrun --standalone --nproc_per_node 2 examples/train_causal_lm.py
Resume after a stop: the same command with --resume and the same --checkpoint-dir.
A packed stream:    python examples/train_causal_lm.py --streaming --pack

Needs transformers (``pip install 'funcaccel[lm]'``); nothing is downloaded. The
model is a Llama built from a config (``--hidden`` wide, ``--layers`` decoder
blocks, tied input and output embeddings), the tokenizer a character-level one
over a synthetic corpus of sentences of varying length that the script generates
from a fixed seed. Each batch is padded to its longest sentence, with
``labels = -100`` on the padding.

What it shows: token-weighted gradient accumulation (``accumulate_step(...,
num_items=n)`` with the model's summed loss, ``num_items_in_batch=1``), so every
token of a window counts the same whatever the padding, the window size or the
rank it landed on; bf16 autocast (``--mixed-precision no`` turns it off); FSDP2
with the decoder block class as the sharded unit; ``--compile [BACKEND]`` and
``--activation-checkpointing`` compile / checkpoint each decoder block in place
before sharding (the compile report is printed after training); asynchronous checkpoints every
``--save-every`` optimizer steps, the handle threaded into the next save; resume
with ``--resume``; throughput as a value (``measure_throughput`` at each optimizer
step: the tokens every rank scored, padding excluded, samples, ``count_flops``
FLOPs; tokens/s, TFLOP/s per device and, with ``--peak-flops``, MFU), logged to
the tracker and shown on the progress line; and a final ``save_model`` export (safetensors, plus
``config.json`` and the character vocabulary) that
``AutoModelForCausalLM.from_pretrained`` loads back, checked to give the trained
model's logits bit for bit. The main process prints one line per epoch, then
``optimizer_steps``, ``eval_loss``, the export's directory,
``from_pretrained: identical logits``, a greedy sample from the loaded export and,
last, ``param_sha256: <hex>``, a digest of the final parameters, so an
interrupted-and-resumed run can be checked against an uninterrupted one.

``--streaming`` writes the training sentences as JSON Lines files under the run
directory and reads them back as a streaming ``datasets.IterableDataset`` (``pip
install 'funcaccel[data]'``), whose position a checkpoint stores so that a resume
reads none of the sentences before it; ``--pack`` packs the sentences into rows of
``--seq-len`` tokens with ``pack_documents`` (labels never cross a sentence,
``num_items`` counts exactly the predicted tokens) instead of padding each batch
(docs/data.md).

``--pp 2`` (under torchrun, fp32: ``--mixed-precision no``) trains the model as a
two-stage pipeline instead (docs/pipeline.md): the Llama is read as a chain of
units (embeddings, one unit per decoder block, final norm and head; the input and
output embeddings untied, as they sit on different stages), every batch padded to
the corpus' longest sentence (a pipeline's shapes are fixed), and
``pipeline_step(..., num_items=n)`` applies the token-weighted window gradient. It
prints one line per epoch and ``optimizer_steps``; the evaluation, sample and
export of the whole model are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM
from transformers import LlamaConfig
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import funcaccel as fa
from funcaccel.checkpoint import save_checkpoint_async

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<s>", "</s>")
SUBJECTS = ("the cat", "a dog", "the old fox", "my neighbour", "a small bird", "we")
VERBS = ("sees", "chases", "likes", "finds", "paints", "follows")
OBJECTS = ("the moon", "a red ball", "the river", "two mice", "the garden gate")
ENDINGS = ("", " at night", " every day", " in the rain", " again and again")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=256, help="training set")
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="bf16")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--save-every", type=int, default=10, help="optimizer steps")
    parser.add_argument("--resume", action="store_true", help="from --checkpoint-dir")
    parser.add_argument("--stop-after", type=int, default=None, help="optimizer steps")
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="read the training sentences as a datasets stream of JSON Lines files "
        "the script writes under the run directory (a resume loads its position)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="compile each decoder block in place (default backend: inductor)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each decoder block's activations in backward",
    )
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (train_pipelined)"
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help="pack the sentences into rows of --seq-len tokens instead of padding",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="row length (--pack)")
    parser.add_argument(
        "--peak-flops",
        default=None,
        help="one device's peak FLOP/s (a number, or a name such as H100) for MFU",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="metrics and the exported model (default: runs/causal-lm-<time>)",
    )
    return parser.parse_args(argv)


def sentences(count: int, seed: int) -> list[str]:
    """A deterministic corpus: ``count`` sentences from a tiny grammar."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        clause = " ".join(parts) + rng.choice(ENDINGS)
        if rng.random() < 0.3:  # some long ones, so lengths vary from ~15 to ~70
            clause += " and " + " ".join([rng.choice(VERBS), rng.choice(OBJECTS)])
        out.append(clause + ".")
    return out


@dataclass(frozen=True)
class CharTokenizer:
    """Characters to ids: the specials first, then the corpus's characters, sorted."""

    vocab: tuple[str, ...]

    @classmethod
    def over(cls, texts: list[str]) -> CharTokenizer:
        return cls(SPECIALS + tuple(sorted(set("".join(texts)))))

    def encode(self, text: str) -> list[int]:
        index = {char: i for i, char in enumerate(self.vocab)}
        return [BOS, *(index[char] for char in text), EOS]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i >= len(SPECIALS))


class Sentences(Dataset[list[int]]):
    """Token ids of one sentence per item, of varying length."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[int]:
        return self.rows[index]


def collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Pad to the longest row: ``input_ids``, ``attention_mask``, ``labels``."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),  # no loss on the padding
    }


def collate_records(records: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """``collate`` for the stream's records (``{"input_ids": [...]}``)."""
    return collate([record["input_ids"] for record in records])


def collate_packed(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack packed rows: ``input_ids``, ``labels``, ``position_ids`` for the model.

    ``position_ids`` restart at every sentence; the segment ids are left out
    (this Llama takes no per-document mask, so attention spans the row).
    """
    keys = ("input_ids", "labels", "position_ids")
    return {key: torch.stack([row[key] for row in rows]) for key in keys}


def sentence_stream(
    ctx: fa.DistributedContext, rows: list[list[int]], data_dir: Path
) -> Any:
    """The token rows as a streaming ``datasets.IterableDataset`` of JSON Lines.

    The main process writes them into 4 files under ``data_dir``, in order; every
    rank then reads all the files as one stream (``pip install 'funcaccel[data]'``).
    """
    import datasets

    files = [data_dir / f"part{k}.jsonl" for k in range(4)]
    if ctx.is_main_process:
        data_dir.mkdir(parents=True, exist_ok=True)
        per = -(-len(rows) // len(files))
        for k, path in enumerate(files):
            part = rows[k * per : (k + 1) * per]
            path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in part))
    fa.wait_for_everyone(ctx)
    return datasets.load_dataset(
        "json",
        data_files=[str(f) for f in files],
        split="train",
        streaming=True,
        cache_dir=str(data_dir / "cache"),
    )


def training_loader(
    ctx: fa.DistributedContext,
    args: argparse.Namespace,
    rows: list[list[int]],
    data_dir: Path,
) -> tuple[fa.ShardedLoader, int]:
    """The training loader and how many batches an epoch gives each rank.

    Padded batches of shuffled sentences by default; ``--streaming`` reads them
    as a stream (in file order), ``--pack`` packs them into rows of
    ``--seq-len`` tokens (``pack_documents``). Streams and packed rows are read by
    every rank (``dispatch_batches=False``) and resume in O(1).
    """
    stream = sentence_stream(ctx, rows, data_dir) if args.streaming else None
    data: DataLoader[Any]
    if args.pack:
        documents: Any = rows if stream is None else stream
        field = None if stream is None else "input_ids"
        packed = fa.pack_documents(
            documents, seq_len=args.seq_len, pad_id=PAD, field=field
        )
        data = DataLoader(packed, batch_size=args.batch_size, collate_fn=collate_packed)
        count = sum(1 for _ in fa.pack_documents(rows, seq_len=args.seq_len))
    elif stream is not None:
        data = DataLoader(
            stream, batch_size=args.batch_size, collate_fn=collate_records
        )
        count = len(rows)
    else:
        sentences_ = Sentences(rows)
        data = DataLoader(
            sentences_, batch_size=args.batch_size, shuffle=True, collate_fn=collate
        )
        loader = fa.shard_loader(ctx, data, seed=args.seed)
        return loader, len(loader)
    loader = fa.shard_loader(ctx, data, dispatch_batches=False)
    assert loader.total_batch_size is not None
    return loader, -(-count // loader.total_batch_size)


def scored_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """How many labels the causal LM scores: position 0 predicts nothing."""
    return (batch["labels"][:, 1:] != -100).sum()


def build_model(
    ctx: fa.DistributedContext, args: argparse.Namespace, vocab_size: int
) -> LlamaForCausalLM:
    fa.set_seed(ctx, args.seed)  # the same initial weights on every rank
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        # The key-value cache is written inside each decoder block: a compiled
        # (fullgraph) or recomputed block must not carry it.
        use_cache=not (args.compile or args.activation_checkpointing),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=args.pp == 1,  # pipeline stages cannot share it
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    return LlamaForCausalLM(config)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters and buffers (a collective under FSDP2)."""
    state = fa.unwrap_model(model).state_dict()
    return {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in state.items()
    }


def param_digest(model: nn.Module) -> str:
    """SHA-256 over the full parameters' bytes, in state_dict order (collective)."""
    digest = hashlib.sha256()
    for name, tensor in full_state(model).items():
        digest.update(name.encode())
        data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def default_run_dir(ctx: fa.DistributedContext) -> Path:
    """``runs/causal-lm-<date>-<time>`` (a new one), chosen by the main process."""
    chosen = None
    if ctx.is_main_process:
        base = Path("runs") / time.strftime("causal-lm-%Y%m%d-%H%M%S")
        chosen, n = base, 1
        while chosen.exists():
            chosen, n = base.with_name(f"{base.name}-{n}"), n + 1
    return Path(fa.broadcast_object(ctx, str(chosen)))


@dataclass
class Window:
    """This rank's counts over a window or an epoch, from ``start`` (monotonic)."""

    start: float
    loss_sum: float = 0.0
    tokens: int = 0  # scored: the padding is not counted
    samples: int = 0
    flops: int = 0  # count_flops of each micro-batch

    def add(self, loss: torch.Tensor, tokens: int, samples: int, flops: int) -> None:
        self.loss_sum += loss.item() * tokens  # loss is the micro-batch's mean
        self.tokens += tokens
        self.samples += samples
        self.flops += flops

    def throughput(
        self, ctx: fa.DistributedContext, peak: float | str | None
    ) -> fa.Throughput:
        """Tokens/s, samples/s, TFLOP/s and MFU over every rank: a collective."""
        return fa.measure_throughput(
            ctx,
            seconds=max(time.monotonic() - self.start, 1e-9),
            tokens=self.tokens,
            samples=self.samples,
            flops=self.flops,
            peak_flops_per_device=peak,
        )


def flops_counter(model: nn.Module) -> Callable[[torch.Tensor], int]:
    """FLOPs of one forward and backward pass on a batch of ``input_ids`` (exact).

    A Llama's FLOPs per row of width ``w`` are ``a * w + b * w**2``: the
    projections grow with ``w``, attention with ``w**2``. ``count_flops`` on one
    row of width 8 and one of 16 gives ``a`` and ``b``; the padding counts, as
    the model computes on it.
    """

    def count(width: int) -> int:
        ids = torch.zeros((1, width), dtype=torch.long)
        return fa.count_flops(model, {"input_ids": ids, "labels": ids})

    f8, f16 = count(8), count(16)  # 8a + 64b and 16a + 256b
    b = Fraction(f16 - 2 * f8, 128)
    a = (f8 - 64 * b) / 8

    def flops(input_ids: torch.Tensor) -> int:
        rows, width = input_ids.shape
        return int(rows * (a * width + b * width * width))

    return flops


def evaluate(
    ctx: fa.DistributedContext, model: nn.Module, loader: fa.ShardedLoader
) -> float:
    """The held-out loss per token over every rank, each sentence counted once."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), fa.autocast_ctx(ctx):
        for batch in fa.iter_batches(loader):
            inputs = batch.data
            logits = model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
            ).logits.float()
            labels = inputs["labels"][:, 1:]  # position t predicts token t + 1
            losses = F.cross_entropy(
                logits[:, :-1].transpose(1, 2), labels, reduction="none"
            )  # ignore_index=-100 (the padding) gives 0 there
            per_row = torch.stack([losses.sum(1), (labels != -100).sum(1)], dim=1)
            # gather_for_metrics drops the rows that even out the last batch.
            totals += fa.gather_for_metrics(ctx, per_row.double(), batch=batch).sum(0)
    model.train()
    return float(totals[0] / totals[1])


def greedy_sample(model: nn.Module, tok: CharTokenizer, prompt: str) -> str:
    """Continue ``prompt`` greedily until ``</s>`` (plain model, one process)."""
    ids = tok.encode(prompt)[:-1]
    with torch.no_grad():
        for _ in range(60):
            logits = model(input_ids=torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].argmax()))
            if ids[-1] == EOS:
                break
    return tok.decode(ids)


def export(
    ctx: fa.DistributedContext,
    model: nn.Module,
    config: LlamaConfig,
    tok: CharTokenizer,
    out: Path,
) -> None:
    """Write the model for Hugging Face; check from_pretrained gives its logits."""
    fa.save_model(ctx, model, out)
    if ctx.is_main_process:  # save_model keeps the other files of the directory
        config.save_pretrained(out)
        (out / "vocab.json").write_text(json.dumps(tok.vocab))
    probe = collate([tok.encode(s) for s in sentences(4, seed=12345)])
    model.eval()
    with torch.no_grad():  # every rank: an FSDP2 forward is a collective
        trained = model(**probe).logits
    model.train()
    fa.wait_for_everyone(ctx)  # config.json is written
    if not ctx.is_main_process:
        return
    loaded: nn.Module = AutoModelForCausalLM.from_pretrained(out)
    loaded.eval()
    with torch.no_grad():
        logits = loaded(**probe).logits
    if torch.equal(logits, trained):
        print("from_pretrained: identical logits")
    else:
        gap = (logits - trained).abs().max().item()
        print(f"from_pretrained: logits differ (max abs difference {gap:.3e})")
    print(f"sample: {greedy_sample(loaded, tok, 'the cat')}")


def _peak(text: str | None) -> float | str | None:
    """``--peak-flops``: a number of FLOP/s, a device name, or ``None``."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text  # a name; Throughput looks it up (and names the known ones)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = fa.build_context(mixed_precision=args.mixed_precision, cpu=True)
    try:
        train(ctx, args)
    finally:
        fa.close_context(ctx)


def train(ctx: fa.DistributedContext, args: argparse.Namespace) -> str | None:
    """Train, export and print the results (on the main process).

    Returns:
        The final parameters' digest, or ``None`` for a run stopped early.
    """
    if args.pp > 1:
        train_pipelined(ctx, args)
        return None
    texts = sentences(args.sentences + 64, seed=args.seed)
    tok = CharTokenizer.over([*SUBJECTS, *VERBS, *OBJECTS, *ENDINGS, " and ."])
    encoded = [tok.encode(text) for text in texts]
    eval_rows = Sentences(encoded[args.sentences :])
    run_dir = args.run_dir if args.run_dir is not None else default_run_dir(ctx)
    loader, per_epoch = training_loader(
        ctx, args, encoded[: args.sentences], run_dir / "corpus"
    )
    eval_loader = fa.shard_loader(
        ctx, DataLoader(eval_rows, batch_size=16, collate_fn=collate)
    )
    net = build_model(ctx, args, len(tok.vocab))
    flops_of = flops_counter(net)  # before sharding: count_flops wants it whole
    peak = _peak(args.peak_flops)
    fsdp = fa.FSDPOptions(shard_modules=(LlamaDecoderLayer,))
    blocks = (LlamaDecoderLayer,)
    model = fa.wrap_model(
        ctx,
        net,
        fsdp=fsdp,
        # Checkpointing, then in-place compilation, per block, before FSDP2.
        compile=fa.CompileOptions(blocks=blocks, backend=args.compile)
        if args.compile
        else None,
        activation_checkpointing=fa.ActivationCheckpointOptions(blocks=blocks)
        if args.activation_checkpointing
        else None,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * -(-per_epoch // args.accumulation_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(  # linear decay, counted per rank
        optimizer, lambda s: max(0.0, 1.0 - s / (steps * ctx.num_processes))
    )
    grad = fa.GradState(accumulation_steps=args.accumulation_steps)
    start = fa.LoaderState()
    if args.resume:
        if args.checkpoint_dir is None:
            raise SystemExit("train_causal_lm: --resume needs --checkpoint-dir DIR")
        latest = fa.latest_checkpoint(args.checkpoint_dir)
        if latest is not None:
            loaded = fa.load_checkpoint(
                ctx, latest, models=model, optimizers=optimizer, schedulers=scheduler
            )
            grad = loaded.grad or grad
            start = loaded.loader or start
            fa.print_main(ctx, f"resumed from {latest.name} at {start}")
        else:
            fa.print_main(ctx, f"nothing to resume in {args.checkpoint_dir}: starting")

    trackers: list[fa.Tracker] = [fa.JSONLTracker(run_dir / "metrics.jsonl")]
    fa.store_config(ctx, trackers, {k: str(v) for k, v in vars(args).items()})
    pending: fa.PendingCheckpoint | None = None
    stopped = False
    for epoch in range(start.epoch, args.epochs):
        fresh = fa.LoaderState(epoch=epoch)
        state = start if epoch == start.epoch else fresh
        meter = Window(start=time.monotonic())
        window = Window(start=time.monotonic())
        rates: fa.Throughput | None = None  # the last window's, on the progress line
        batches = fa.progress(
            ctx,
            fa.iter_batches(loader, state),
            total=per_epoch if state == fresh else None,
            desc=f"epoch {epoch + 1}/{args.epochs}",
            every=max(1, per_epoch // 4),
            throughput=lambda: rates,
        )
        for batch in batches:
            inputs = batch.data
            n = scored_tokens(inputs)
            # The model's loss with num_items_in_batch=1 is the summed token loss;
            # accumulate_step divides the window's gradient by its token count
            # over all ranks, and returns this micro-batch's mean per token.
            loss, grad = fa.accumulate_step(
                ctx,
                grad,
                model,
                optimizer,
                lambda: model(**inputs, num_items_in_batch=1).loss,
                num_items=n,
                end_of_dataloader=batch.is_last,
                max_grad_norm=args.max_grad_norm,
            )
            fa.maybe_step_scheduler(ctx, scheduler, grad, loader=loader)
            rows, flops = len(inputs["input_ids"]), flops_of(inputs["input_ids"])
            meter.add(loss, int(n), rows, flops)
            window.add(loss, int(n), rows, flops)
            if not grad.sync_gradients:
                continue
            step = grad.optimizer_steps
            rates = window.throughput(ctx, peak)  # every rank: a collective
            fa.log_metrics(
                ctx,
                trackers,
                {
                    "loss": window.loss_sum / max(window.tokens, 1),  # rank 0's share
                    "tokens": rates.tokens or 0,  # every rank's, padding excluded
                    "lr": float(scheduler.get_last_lr()[0]),
                    **rates.metrics(),
                },
                step=step,
            )
            window = Window(start=time.monotonic())
            stopped = args.stop_after is not None and step >= args.stop_after
            if args.checkpoint_dir is not None and (
                step % args.save_every == 0 or stopped
            ):
                # Returns once the state is staged; the files are written in the
                # background while training goes on. The next save completes it.
                pending = save_checkpoint_async(
                    ctx,
                    args.checkpoint_dir,
                    models=model,
                    optimizers=optimizer,
                    schedulers=scheduler,
                    grad=grad,
                    loader=batch.state,
                    keep_last=2,
                    pending=pending,
                )
            if stopped:
                break
        if stopped:
            break
        rate = meter.throughput(ctx, peak)
        loss_sum = fa.reduce(ctx, torch.tensor(meter.loss_sum, dtype=torch.float64))
        epoch_loss = float(loss_sum) / max(rate.tokens or 0, 1)
        fa.print_main(
            ctx,
            f"epoch {epoch + 1}/{args.epochs}: loss {epoch_loss:.4f} per token, "
            f"lr {float(scheduler.get_last_lr()[0]):.2e}, {rate.describe()}",
        )
        fa.log_metrics(
            ctx, trackers, {"epoch_loss": epoch_loss}, step=grad.optimizer_steps
        )
    if pending is not None:
        pending.wait()  # the last checkpoint is complete and `latest` names it
    if stopped:
        fa.finish_trackers(ctx, trackers)
        fa.print_main(ctx, f"stopped after {grad.optimizer_steps} optimizer steps")
        fa.print_main(ctx, f"checkpoints: {args.checkpoint_dir} (resume with --resume)")
        return None
    eval_loss = evaluate(ctx, model, eval_loader)
    fa.log_metrics(ctx, trackers, {"eval_loss": eval_loss}, step=grad.optimizer_steps)
    fa.finish_trackers(ctx, trackers)
    fa.print_main(ctx, f"optimizer_steps: {grad.optimizer_steps}")
    fa.print_main(ctx, f"eval_loss: {eval_loss:.4f}")
    if args.compile:  # what was compiled, and that no block broke in pieces
        report = fa.compile_report(model)
        fa.print_main(
            ctx,
            f"compile_report: {len(report.blocks)} blocks, {report.graphs} graphs, "
            f"{report.recompiles} recompiles, {report.graph_breaks} graph breaks",
        )
    fa.print_main(ctx, f"metrics written to {run_dir / 'metrics.jsonl'}")
    out = run_dir / "model"
    export(ctx, model, net.config, tok, out)
    fa.print_main(ctx, f"model: {out} (AutoModelForCausalLM.from_pretrained loads it)")
    digest = param_digest(model)
    fa.print_main(ctx, f"param_sha256: {digest}")
    return digest


class LlamaEmbed(nn.Module):
    """The first unit of the chain: token ids to hidden states."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out


class LlamaBlock(nn.Module):
    """One decoder block, computing its own rotary positions (causal attention)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = [rotary]  # no parameters; kept out of the state dict

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows, width = hidden.shape[:2]
        positions = torch.arange(width, device=hidden.device).expand(rows, -1)
        cos_sin = self.rotary[0](hidden, positions)
        # No mask: causal attention, and the padding sits after every token.
        out = self.layer(hidden, position_ids=positions, position_embeddings=cos_sin)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result


class LlamaHead(nn.Module):
    """The last unit: final norm, then the output projection to logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(hidden))
        return out


class LlamaChain(nn.Module):
    """The Llama as ``embed, layers.0 .. layers.{n-1}, head``: the same forward."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.embed = LlamaEmbed(model.model.embed_tokens)
        self.layers = nn.ModuleList(
            LlamaBlock(layer, model.model.rotary_emb) for layer in model.model.layers
        )
        self.head = LlamaHead(model.model.norm, model.lm_head)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        out: torch.Tensor = self.head(hidden)
        return out


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t + 1; the padding (-100) adds nothing."""
    return F.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], reduction="sum"
    )


def pipeline_parts(
    ctx: fa.DistributedContext,
    args: argparse.Namespace,
    mesh: fa.ParallelMesh | None,
) -> tuple[fa.ShardedLoader, nn.Module]:
    """``--pp``'s loader (fixed-width batches) and the model as a chain of units."""
    texts = sentences(args.sentences, seed=args.seed)
    tok = CharTokenizer.over([*SUBJECTS, *VERBS, *OBJECTS, *ENDINGS, " and ."])
    rows = [tok.encode(text) for text in texts]
    width = max(len(row) for row in rows)

    def fixed(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        padded = collate([*batch, [PAD] * width])  # every batch padded to `width`
        return padded["input_ids"][:-1], padded["labels"][:-1]

    data = DataLoader(
        Sentences(rows), batch_size=args.batch_size, shuffle=True,
        drop_last=True, collate_fn=fixed,
    )  # fmt: skip
    loader = fa.shard_loader(ctx, data, seed=args.seed, mesh=mesh)
    return loader, LlamaChain(build_model(ctx, args, len(tok.vocab)))


def train_pipelined(ctx: fa.DistributedContext, args: argparse.Namespace) -> None:
    """``--pp N``: train the chain as an N-stage pipeline, token-weighted."""
    if args.mixed_precision != "no" or args.streaming or args.pack:
        raise SystemExit(
            "train_causal_lm: --pp runs in fp32 on padded sentences: pass "
            "--mixed-precision no, without --streaming / --pack"
        )
    mesh = fa.build_mesh(ctx, pp=args.pp)
    loader, chain = pipeline_parts(ctx, args, mesh)
    fsdp = fa.FSDPOptions() if mesh.dp_shard > 1 else None
    options = fa.PipelineOptions(microbatches=2, schedule="1f1b")
    pipe = fa.wrap_model(ctx, chain, mesh=mesh, pipeline=options, fsdp=fsdp)
    assert isinstance(pipe, fa.Pipeline)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    grad = fa.GradState(accumulation_steps=args.accumulation_steps)
    for epoch in range(args.epochs):
        total, tokens = 0.0, 0
        for batch in fa.iter_batches(loader, fa.LoaderState(epoch=epoch)):
            input_ids, labels = batch.data
            n = int((labels[:, 1:] != -100).sum())
            loss, grad = fa.pipeline_step(
                ctx, grad, pipe, optimizer, (input_ids, labels), summed_token_loss,
                num_items=n, end_of_dataloader=batch.is_last,
                max_grad_norm=args.max_grad_norm,
            )  # fmt: skip
            total, tokens = total + float(loss) * n, tokens + n
        fa.print_main(
            ctx,
            f"pp epoch {epoch + 1}/{args.epochs}: loss {total / tokens:.4f} per token",
        )
    fa.print_main(ctx, f"optimizer_steps: {grad.optimizer_steps}")


if __name__ == "__main__":
    main()
