"""save_model / load_model: Hugging Face layout, shards, tied weights, atomicity, FSDP2.

Single-process exports run in the test process; DDP and FSDP2 exports run on 2 real
gloo ranks and must write the same tensors as one process.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

import funcaccel.checkpoint._export_dir
import funcaccel.checkpoint._export_files
from funcaccel.checkpoint import load_model
from funcaccel.checkpoint import save_model
from funcaccel.context import DistributedContext
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks

ONE = DistributedContext()
Tensors = dict[str, torch.Tensor]


class _LM(nn.Module):
    """A tiny language model whose output layer shares the embedding's weight."""

    def __init__(self, vocab: int = 11, width: int = 6, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(
            self.norm(self.body(self.embed_tokens(tokens)))
        )
        return out


def _files(directory: Path) -> Tensors:
    """Every tensor of every safetensors file in ``directory``."""
    found: Tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def _expected(model: nn.Module) -> Tensors:
    """The model's state dict as an export holds it: the tied duplicate dropped."""
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def _same(a: Tensors, b: Tensors) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_small_model_is_one_file_holding_its_state_dict(tmp_path: Path) -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    out = save_model(ONE, net, tmp_path / "out")
    assert out == tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert _same(load_file(out / "model.safetensors"), net.state_dict())
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", framework="pt") as file:
        assert file.metadata() == {"format": "pt"}  # transformers checks it


def test_a_model_above_max_shard_size_writes_shards_and_an_index(
    tmp_path: Path,
) -> None:
    model = _LM(vocab=40, width=8)
    # embed 40x8 floats = 1280 bytes, body 288, norm 64, lm_head tied: 1632 in all.
    out = save_model(ONE, model, tmp_path / "out", max_shard_size=1000)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 1632}
    assert index["weight_map"] == {
        "embed_tokens.weight": "model-00001-of-00002.safetensors",
        "body.weight": "model-00002-of-00002.safetensors",
        "body.bias": "model-00002-of-00002.safetensors",
        "norm.weight": "model-00002-of-00002.safetensors",
        "norm.bias": "model-00002-of-00002.safetensors",
    }
    for name in set(index["weight_map"].values()):
        assert set(load_file(out / name)) == {
            k for k, v in index["weight_map"].items() if v == name
        }
    assert _same(_files(out), _expected(model))


def test_a_file_is_closed_when_the_next_tensor_would_overflow_it(
    tmp_path: Path,
) -> None:
    # embed 1280 bytes (alone: above the limit), body 256 + 32, norm 32 + 32.
    out = save_model(ONE, _LM(vocab=40, width=8), tmp_path / "out", max_shard_size=300)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = {k: v[6:11] for k, v in index["weight_map"].items()}
    assert files == {
        "embed_tokens.weight": "00001",
        "body.weight": "00002",
        "body.bias": "00002",
        "norm.weight": "00003",
        "norm.bias": "00003",
    }


def test_tied_weights_are_written_once_and_load_ties_both(tmp_path: Path) -> None:
    model = _LM()
    out = save_model(ONE, model, tmp_path / "out")
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    fresh = _LM(seed=1)
    loaded = load_model(ONE, fresh, out)
    assert "lm_head.weight" not in loaded and "embed_tokens.weight" in loaded
    assert fresh.lm_head.weight is fresh.embed_tokens.weight
    assert _same(fresh.state_dict(), model.state_dict())


def test_views_of_one_storage_are_written_as_separate_tensors(tmp_path: Path) -> None:
    class Halves(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            whole = torch.arange(8.0)
            self.register_buffer("low", whole[:4])
            self.register_buffer("high", whole[4:])

    out = save_model(ONE, Halves(), tmp_path / "out")
    assert _same(
        _files(out), {"low": torch.arange(4.0), "high": torch.arange(4.0, 8.0)}
    )


def test_pytorch_model_bin_with_safe_serialization_false(tmp_path: Path) -> None:
    model = _LM()
    out = save_model(ONE, model, tmp_path / "out", safe_serialization=False)
    assert sorted(p.name for p in out.iterdir()) == ["pytorch_model.bin"]
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert _same(state, _expected(model))
    fresh = _LM(seed=1)
    load_model(ONE, fresh, out)
    assert _same(fresh.state_dict(), model.state_dict())
    # Sharded .bin files get their index too.
    model = _LM(vocab=40, width=8)
    sharded = save_model(
        ONE, model, tmp_path / "bin", max_shard_size="1KB", safe_serialization=False
    )
    assert (sharded / "pytorch_model.bin.index.json").is_file()
    assert (sharded / "pytorch_model-00002-of-00002.bin").is_file()


@pytest.mark.parametrize(
    ("size", "expected"),
    [(123, 123), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("10KB", 10_000),
     ("2GiB", 2 * 2**30), ("3MiB", 3 * 2**20), ("1kib", 1024), ("8Mb", 10**6)],
)  # fmt: skip
def test_max_shard_size_reads_as_transformers_reads_it(
    size: int | str, expected: int
) -> None:
    from funcaccel.checkpoint._export_plan import parse_shard_size

    assert parse_shard_size(size, caller="save_model") == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_shard_size": "5XB"}, ValueError, r"save_model: max_shard_size must be an int \(bytes\) or a size like '5GB'.*got '5XB'"),
        ({"max_shard_size": "1.5GB"}, ValueError, r"got '1.5GB'"),
        ({"max_shard_size": 0}, ValueError, r"save_model: max_shard_size must be at least 1 byte; got 0"),
        ({"max_shard_size": -5}, ValueError, r"at least 1 byte; got -5"),
        ({"max_shard_size": "0MB"}, ValueError, r"at least 1 byte; got '0MB'"),
        ({"max_shard_size": True}, TypeError, r"max_shard_size must be an int \(bytes\) or a str like '5GB'; got True \(bool\)"),
        ({"max_shard_size": 1.5}, TypeError, r"got 1.5 \(float\)"),
        ({"safe_serialization": "yes"}, TypeError, r"save_model: safe_serialization must be a bool; got 'yes'"),
    ],
)  # fmt: skip
def test_save_model_rejects_bad_arguments(
    tmp_path: Path, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        save_model(ONE, nn.Linear(1, 1), tmp_path / "out", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_save_and_load_reject_what_is_not_a_model_or_context(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"save_model: model must be a torch.nn.Module"):
        save_model(ONE, {"w": torch.ones(1)}, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"load_model: ctx must be a DistributedContext"
    ):
        load_model(None, nn.Linear(1, 1), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"load_model: .* holds no exported model"):
        load_model(ONE, nn.Linear(1, 1), tmp_path)


def test_load_names_every_missing_unexpected_and_misshapen_key(tmp_path: Path) -> None:
    out = save_model(ONE, _LM(width=6), tmp_path / "out")

    class Other(_LM):
        def __init__(self) -> None:
            super().__init__(width=5)
            del self.norm
            self.extra = nn.Linear(1, 1)

    fresh = Other()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError) as raised:
        load_model(ONE, fresh, out)
    message = str(raised.value)
    assert message.startswith(f"load_model: the export in {out} does not fit the model")
    assert (
        "missing keys (in the model, not in the export): extra.weight, extra.bias"
        in message
    )
    assert (
        "unexpected keys (in the export, not in the model): norm.bias, norm.weight"
        in message
    )
    assert "embed_tokens.weight: saved [11, 6], model [11, 5]" in message
    assert "body.weight: saved [6, 6], model [5, 5]" in message
    assert _same(fresh.state_dict(), before)  # nothing was loaded


def test_an_index_naming_a_file_outside_the_export_is_refused(tmp_path: Path) -> None:
    out = save_model(ONE, _LM(vocab=40, width=8), tmp_path / "out", max_shard_size=1000)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["body.bias"] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"names '../../etc/passwd', which is not a plain relative path",
    ):
        load_model(ONE, _LM(vocab=40, width=8), out)
    index["weight_map"]["body.bias"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"maps 'body.bias' to model-00001-of-00002.safetensors, which does not hold it",
    ):
        load_model(ONE, _LM(vocab=40, width=8), out)


def test_a_new_export_keeps_other_files_and_drops_stale_shards(tmp_path: Path) -> None:
    model = _LM(vocab=40, width=8)
    out = save_model(ONE, model, tmp_path / "out", max_shard_size=1000)
    (out / "config.json").write_text("{}")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "vocab.txt").write_text("a b")
    save_model(ONE, model, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer",
    ]
    assert (out / "tokenizer" / "vocab.txt").read_text() == "a b"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left


def test_a_write_failing_after_the_first_shard_leaves_the_previous_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _LM(vocab=40, width=8, seed=0)
    out = save_model(ONE, first, tmp_path / "out", max_shard_size=1000)
    original = funcaccel.checkpoint._export_files.write_shard
    written: list[Path] = []

    def failing(tensors: Tensors, path: Path, *, safe: bool, durable: bool) -> None:
        if written:
            raise OSError("disk full (simulated)")
        original(tensors, path, safe=safe, durable=durable)
        written.append(path)

    monkeypatch.setattr(funcaccel.checkpoint._export_files, "write_shard", failing)
    with pytest.raises(
        RuntimeError,
        match=r"save_model: the export was not written .* rank 0: writing .*model-00002-of-00002.safetensors failed: disk full",
    ):
        save_model(ONE, _LM(vocab=40, width=8, seed=1), out, max_shard_size=1000)
    assert written and written[0].parent.name == ".out.export.tmp"
    assert _same(_files(out), _expected(first))
    fresh = _LM(vocab=40, width=8, seed=2)
    load_model(ONE, fresh, out)
    assert _same(fresh.state_dict(), first.state_dict())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("exchange", [True, False])
def test_durable_fsyncs_every_file_and_directory_and_the_default_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, safe: bool, exchange: bool
) -> None:
    model = _LM(vocab=40, width=8)
    out = save_model(
        ONE, model, tmp_path / "out", max_shard_size=1000, safe_serialization=safe
    )
    if not exchange:
        monkeypatch.setattr(
            funcaccel.checkpoint._export_dir, "_exchange", lambda a, b: False
        )
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    save_model(ONE, model, out, max_shard_size=1000, safe_serialization=safe)
    assert synced == []  # the default: atomic against a kill, no waiting for the disk
    save_model(
        ONE, model, out, max_shard_size=1000, safe_serialization=safe, durable=True
    )
    names = sorted(p.name for p in out.iterdir())
    assert len(names) > 2  # several shards and the index
    temporary = tmp_path / ".out.export.tmp"
    # Every file while still in the temporary directory, then that directory, then
    # the parent after the swap (a rename is durable only once its directory is).
    assert sorted(synced[: len(names)]) == sorted(str(temporary / n) for n in names)
    assert synced[len(names) :] == [str(temporary), str(tmp_path)]
    assert _same(_files(out) if safe else {}, _expected(model) if safe else {})
    fresh = _LM(vocab=40, width=8, seed=3)
    load_model(ONE, fresh, out)
    assert _same(fresh.state_dict(), model.state_dict())
    with pytest.raises(
        TypeError, match=r"save_model: durable must be a bool; got 'yes'"
    ):
        save_model(ONE, model, out, durable="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_kill_during_the_swap_leaves_an_export_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    first, second = _LM(seed=0), _LM(seed=1)
    out = save_model(ONE, first, tmp_path / "out")
    if not exchange:  # the two-rename fallback (no renameat2)
        monkeypatch.setattr(
            funcaccel.checkpoint._export_dir, "_exchange", lambda a, b: False
        )
    renames: list[tuple[object, ...]] = []
    real_rename = os.rename

    def dying_rename(*args: object) -> None:
        renames.append(args)
        if len(renames) == 2:  # between parking the old export and moving in the new
            raise KeyboardInterrupt
        real_rename(*args)  # type: ignore[arg-type, unused-ignore]

    monkeypatch.setattr(os, "rename", dying_rename)
    if exchange:
        save_model(ONE, second, out)  # one atomic exchange, no rename to die in
        expected = second
    else:
        with pytest.raises(KeyboardInterrupt):
            save_model(ONE, second, out)
        assert not out.exists() and (tmp_path / ".out.export.old").is_dir()
        expected = first
    monkeypatch.setattr(os, "rename", real_rename)
    fresh = _LM(seed=2)
    load_model(ONE, fresh, out)  # reads the parked previous export
    assert _same(fresh.state_dict(), expected.state_dict())
    save_model(ONE, second, out)  # puts it back first, then replaces it
    assert _same(_files(out), _expected(second))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)
def test_transformers_from_pretrained_reads_a_sharded_export(tmp_path: Path) -> None:
    import transformers  # type: ignore[import-not-found, unused-ignore]

    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=8
    )
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    config.save_pretrained(tmp_path)
    save_model(ONE, model, tmp_path, max_shard_size=2000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    loaded: nn.Module = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert _same(loaded.state_dict(), model.state_dict())
    tokens = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(0))
    model.eval()
    loaded.eval()
    with torch.no_grad():  # the same logits, bit for bit
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


# --- DDP and FSDP2 on 2 gloo processes ------------------------------------------


def _trained(ctx: DistributedContext, how: str) -> nn.Module:
    model: nn.Module = _LM(vocab=40, width=8)
    if how == "ddp":
        model = wrap_model(ctx, model)
    elif how == "fsdp":
        model = wrap_model(ctx, model, fsdp=FSDPOptions())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(
        0
    )  # the same batch on every rank: the same weights as one process
    tokens = torch.randint(0, 40, (4, 5))
    model(tokens).square().mean().backward()
    opt.step()
    return model


def _full_state(model: nn.Module) -> Tensors:
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v
        for k, v in unwrap_model(model).state_dict().items()
    }


def _export_worker(ctx: DistributedContext, how: str, out: Path) -> Tensors:
    model = _trained(ctx, how)
    assert save_model(ctx, model, out, max_shard_size=1000) == out
    fresh: nn.Module = _LM(vocab=40, width=8, seed=5)
    if how == "fsdp":
        fresh = wrap_model(ctx, fresh, fsdp=FSDPOptions())
    else:
        fresh = wrap_model(ctx, fresh)  # DDP
    load_model(ctx, fresh, out)
    after = _full_state(fresh)
    assert _same(after, _full_state(model))
    return after


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_exports_hold_what_one_process_writes(
    tmp_path: Path, how: str
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks (launch's OMP_NUM_THREADS=1): same sums
    try:
        reference = save_model(
            ONE, _trained(ONE, "plain"), tmp_path / "one", max_shard_size=1000
        )
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "dist"
    results = run_ranks(_export_worker, 2, how, out, start_method="forkserver")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in reference.iterdir()
    )
    assert (out / "model.safetensors.index.json").read_text() == (
        reference / "model.safetensors.index.json"
    ).read_text()
    for path in reference.glob("*.safetensors"):
        assert _same(load_file(out / path.name), load_file(path)), path.name
    one = _LM(vocab=40, width=8, seed=5)
    load_model(ONE, one, out)
    for result in results:
        assert _same(result, one.state_dict())
