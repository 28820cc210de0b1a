"""The transformers example: one process and torchrun, stop and resume, the export.

The one-process runs call the script's functions in this process (transformers
is imported once); the torchrun run starts the script as a user does.

The example trains a Llama built from a config with token-weighted accumulation,
FSDP2 over its decoder blocks and asynchronous checkpoints, then exports it with
``save_model``; ``from_pretrained`` must read the export back with the trained
model's logits, bit for bit. Sizes here are tiny: 48 sentences in batches of 4
are 12 micro-batches an epoch on one process (windows of 5, 5 and a short 2) and
6 per rank on two (windows of 5 and 1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.testing import run_ranks
from tests._scripts import REPO
from tests._scripts import Finished
from tests._scripts import run_script

pytest.importorskip("transformers")

SCRIPT = REPO / "examples" / "train_causal_lm.py"
TINY: list[object] = [
    "--sentences", "48", "--batch-size", "4", "--accumulation-steps", "5",
    "--epochs", "2", "--hidden", "32",
]  # fmt: skip
EPOCH_LINE = (
    r"^epoch (\d)/2: loss (\d+\.\d{4}) per token, lr \S+, [\d,]+ tok/s, "
    r"[\d.]+ samples/s, \S+ TFLOP/s/device(, MFU [\d.]+%)?$"
)


def _finished(args: list[object], *, processes: int = 1) -> Finished:
    done = run_script(SCRIPT, *args, processes=processes)
    assert done.status == 0, done.stdout + done.stderr
    return done


def _value(out: str, key: str) -> str:
    found: list[str] = re.findall(rf"^{key}: (.+)$", out, flags=re.MULTILINE)
    assert len(found) == 1, out
    return found[0]


def _assert_trained(out: str, steps: int, run_dir: Path) -> None:
    epochs = re.findall(EPOCH_LINE, out, flags=re.MULTILINE)
    assert [e for e, _, _ in epochs] == ["1", "2"], out
    assert all(0 < float(loss) < 10 for _, loss, _ in epochs), out
    assert int(_value(out, "optimizer_steps")) == steps
    assert 0 < float(_value(out, "eval_loss")) < 10
    assert _value(out, "from_pretrained") == "identical logits"
    assert _value(out, "model").startswith(f"{run_dir / 'model'} ")
    assert re.fullmatch(r"param_sha256: [0-9a-f]{64}", out.strip().splitlines()[-1])
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    # Each window logs the tokens every rank scored in it (Throughput, padding
    # excluded): over both epochs, twice each training sentence's tokens after
    # the first, counted here from the text (BOS + characters + EOS, minus one).
    texts = _example().sentences(48 + 64, seed=0)[:48]
    assert sum(r["tokens"] for r in logged) == 2 * sum(len(t) + 1 for t in texts)
    assert all(r["tokens_per_second"] > 0 < r["tflops_per_device"] for r in logged)
    assert all(("mfu" in r) == bool(epochs[0][2]) for r in logged)


def _probe(vocab_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(
        3, vocab_size, (3, 9), generator=torch.Generator().manual_seed(0)
    )
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Tiny models in this process: more threads only fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_one_process_trains_and_exports_what_from_pretrained_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers
    from safetensors.torch import load_file

    # The script's main() with its command line, in this process (a subprocess
    # would pay for importing transformers again; torchrun runs it below).
    run_dir = tmp_path / "run"
    argv = [*TINY, "--mixed-precision", "no", "--run-dir", run_dir]
    argv += ["--checkpoint-dir", tmp_path / "ckpt", "--save-every", "2"]
    with _one_thread():
        _example().main([str(arg) for arg in argv])
    _assert_trained(capsys.readouterr().out, 2 * 3, run_dir)
    assert (tmp_path / "ckpt" / "latest").exists()
    # The export on its own: config, weights (the tied head written once), vocab.
    out = run_dir / "model"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "vocab.json",
    ]  # fmt: skip
    weights = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    vocab = json.loads((out / "vocab.json").read_text())
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.vocab_size == len(vocab) and config.num_hidden_layers == 2
    # from_pretrained and a model built from the config and filled from the file
    # agree, logit for logit.
    loaded: torch.nn.Module = transformers.AutoModelForCausalLM.from_pretrained(out)
    rebuilt: torch.nn.Module = transformers.LlamaForCausalLM(config)
    loaded.eval()
    rebuilt.eval()
    embedding = weights["model.embed_tokens.weight"]
    rebuilt.load_state_dict({**weights, "lm_head.weight": embedding})  # strict
    probe = _probe(len(vocab))
    with torch.no_grad():
        assert torch.equal(loaded(**probe).logits, rebuilt(**probe).logits)
    assert torch.equal(loaded.state_dict()["lm_head.weight"], embedding)


@pytest.mark.distributed
def test_two_processes_under_torchrun_with_bf16_and_fsdp2(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = _finished(
        [*TINY, "--run-dir", run_dir, "--checkpoint-dir", tmp_path / "ckpt",
         "--save-every", "1", "--peak-flops", "1e12"],
        processes=2,
    )  # fmt: skip
    _assert_trained(done.stdout, 2 * 2, run_dir)
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    assert (tmp_path / "ckpt" / latest / "dcp").is_dir()  # FSDP2: sharded state


def _example() -> ModuleType:
    """The example script as a module (registered: its dataclasses need that)."""
    name = "examples_train_causal_lm"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _whole_stopped_resumed(ctx: DistributedContext, tmp_path: Path) -> list[Any]:
    """Train once unbroken, then stopped mid-epoch and resumed (each rank)."""
    example = _example()

    def run(*extra: object) -> Any:
        argv = [*TINY, "--mixed-precision", "no", "--save-every", "2"]
        return example.train(ctx, example.parse_args([*argv, *map(str, extra)]))

    with _one_thread():
        whole = run("--run-dir", tmp_path / "w", "--checkpoint-dir", tmp_path / "cw")
        cut = ["--checkpoint-dir", tmp_path / "cut"]
        stop = 4 if ctx.num_processes == 1 else 3  # the first window of epoch 2
        stopped = run("--run-dir", tmp_path / "s", *cut, "--stop-after", stop)
        resumed = run("--run-dir", tmp_path / "r", *cut, "--resume")
    return [whole, stopped, resumed]


@pytest.mark.parametrize(
    "world_size", [1, pytest.param(2, marks=pytest.mark.distributed)]
)
def test_a_stopped_and_resumed_run_ends_like_an_unbroken_one(
    tmp_path: Path, world_size: int
) -> None:
    # FSDP2 over the decoder blocks and (2 ranks) DCP checkpoints, the rest written
    # in the background; the stop is in the middle of epoch 2.
    if world_size == 1:  # in this process: the example's train() needs no group
        results = [_whole_stopped_resumed(DistributedContext(), tmp_path)]
    else:
        results = run_ranks(
            _whole_stopped_resumed, 2, tmp_path, start_method="forkserver"
        )
    for whole, stopped, resumed in results:
        assert stopped is None
        assert isinstance(whole, str) and resumed == whole


def test_a_streamed_packed_run_counts_every_token_and_resumes_like_an_unbroken_one(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --streaming reads the sentences as a datasets stream of the JSON Lines files
    # the script writes; --pack packs them into rows of --seq-len tokens. 48
    # sentences make 9 batches of 4 rows an epoch: windows of 5 and 4, so the stop
    # after 3 steps is inside epoch 2 and the resume loads the stream's position.
    pytest.importorskip("datasets")
    # datasets' streaming imports scipy.io, whose threadpoolctl sets this at import
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "True")
    example = _example()

    def run(*extra: object) -> Any:
        argv = [*TINY, "--mixed-precision", "no", "--save-every", "2"]
        argv += ["--streaming", "--pack", "--seq-len", "64"]
        args = example.parse_args([*map(str, argv), *map(str, extra)])
        return example.train(DistributedContext(), args)

    with _one_thread():
        whole = run("--run-dir", tmp_path / "w", "--checkpoint-dir", tmp_path / "cw")
        cut = ["--checkpoint-dir", tmp_path / "cut"]
        stopped = run("--run-dir", tmp_path / "s", *cut, "--stop-after", 3)
        resumed = run("--run-dir", tmp_path / "r", *cut, "--resume")
    assert stopped is None and isinstance(whole, str) and resumed == whole
    out = capsys.readouterr().out
    assert re.search(
        r"^resumed from \S+ at LoaderState\(epoch=1, .*stream_state=", out, re.M
    )
    # Every token after a sentence's first is predicted once per epoch, and the
    # windows' num_items (count_targets of the packed labels) count exactly those.
    records = (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in records if '"loss"' in line]
    texts = example.sentences(48 + 64, seed=0)[:48]
    assert sum(r["tokens"] for r in logged) == 2 * sum(len(t) + 1 for t in texts)


@pytest.mark.slow
@pytest.mark.filterwarnings(
    # dynamo reads .grad of the non-leaf tensors it traces, and torch warns
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
)
def test_compiled_and_checkpointed_blocks_train_bit_for_bit_like_eager(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--compile aot_eager --activation-checkpointing: the plain run's parameters."""
    small = [
        "--sentences", "16", "--batch-size", "4", "--accumulation-steps", "2",
        "--epochs", "1", "--hidden", "32", "--mixed-precision", "no",
    ]  # fmt: skip
    fast = ["--compile", "aot_eager", "--activation-checkpointing"]
    outs = []
    with _one_thread():
        for extra in ([], fast):
            run_dir = tmp_path / f"run{len(extra)}"
            _example().main([str(a) for a in [*small, *extra, "--run-dir", run_dir]])
            outs.append(capsys.readouterr().out)
    plain, compiled = outs
    assert "compile_report" not in plain
    # Two decoder blocks sharing their graphs (recompiled as the padded length
    # and the grad mode change), none broken in pieces.
    report = _value(compiled, "compile_report")
    found = re.fullmatch(
        r"2 blocks, (\d+) graphs, \d+ recompiles, 0 graph breaks", report
    )
    assert found is not None and int(found.group(1)) >= 2, report
    assert _value(compiled, "param_sha256") == _value(plain, "param_sha256")


def _pipeline_reference(argv: list[object]) -> list[str]:
    """``--pp``'s chain trained in one process by accumulate_step: its epoch lines."""
    example = _example()
    args = example.parse_args([*map(str, argv)])
    ctx = DistributedContext()
    loader, model = example.pipeline_parts(ctx, args, None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    grad, lines = GradState(accumulation_steps=args.accumulation_steps), []
    for epoch in range(args.epochs):
        total, tokens = 0.0, 0
        for batch in iter_batches(loader, LoaderState(epoch=epoch)):
            ids, labels = batch.data
            n = int((labels[:, 1:] != -100).sum())

            def loss_fn(ids: torch.Tensor = ids, labels: torch.Tensor = labels) -> Any:
                return example.summed_token_loss(model(ids), labels)

            loss, grad = accumulate_step(
                ctx, grad, model, opt, loss_fn, num_items=n,
                end_of_dataloader=batch.is_last, max_grad_norm=args.max_grad_norm,
            )  # fmt: skip
            total, tokens = total + float(loss) * n, tokens + n
        lines.append(f"pp epoch {epoch + 1}/2: loss {total / tokens:.4f} per token")
    return lines


@pytest.mark.distributed
def test_two_processes_as_a_two_stage_pipeline_match_one_process() -> None:
    argv: list[object] = [*TINY, "--pp", "2", "--mixed-precision", "no"]
    done = _finished(argv, processes=2)
    got = re.findall(r"^pp epoch .*$", done.stdout, flags=re.MULTILINE)
    # The 1F1B pipeline's token-weighted windows equal one process's, epoch by epoch.
    with _one_thread():
        assert got == _pipeline_reference(argv), done.stdout
    assert _value(done.stdout, "optimizer_steps") == "6"
