"""save_checkpoint / load_checkpoint / latest_checkpoint: contents, atomicity, errors.

Single-process behaviour runs in the test process; DDP and FSDP2 checkpoints run on
real gloo ranks, and a save killed with SIGKILL at several points runs in a worker
process that kills itself. Exact resumption of training is in ``test_resume.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

import funcaccel.checkpoint._layout
from funcaccel.accumulate import GradState
from funcaccel.checkpoint import SCHEMA_VERSION
from funcaccel.checkpoint import CheckpointMeta
from funcaccel.checkpoint import FileEntry
from funcaccel.checkpoint import latest_checkpoint
from funcaccel.checkpoint import list_checkpoints
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import read_checkpoint_meta
from funcaccel.checkpoint import save_checkpoint
from funcaccel.context import DistributedContext
from funcaccel.launch import LaunchError
from funcaccel.loader import LoaderState
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.rng import capture_rng_state
from funcaccel.rng import restore_rng_state
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

ONE = DistributedContext()
# The generators a CPU-context checkpoint restores on this machine.
RESTORED = (
    "python",
    "torch",
    *(("cuda",) if torch.cuda.is_available() else ()),
    "numpy",
)
Tensors = dict[str, torch.Tensor]


class _Net(nn.Module):
    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(3, hidden)
        self.second = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(torch.tanh(self.first(x)))
        return out


class _Counter:
    """A user object checkpointed through ``objects``."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


class _Objects:
    """A model, optimizer, scheduler, scaler and counter, trained ``steps`` steps."""

    def __init__(self, steps: int = 0, *, seed: int = 0, hidden: int = 6) -> None:
        torch.manual_seed(seed)
        self.model = _Net(hidden)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        self.counter = _Counter()
        for _ in range(steps):
            self.model(torch.randn(4, 3)).square().mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.sched.step()
            self.counter.count += 1

    def kwargs(self) -> dict[str, Any]:
        return {
            "models": self.model,
            "optimizers": [self.opt],
            "schedulers": [self.sched],
            "scaler": self.scaler,
            "objects": {"counter": self.counter},
        }


def _flat(state: object, prefix: str = "") -> dict[str, object]:
    """Flatten nested state dicts so two can be compared entry by entry."""
    if isinstance(state, dict):
        out: dict[str, object] = {}
        for key, value in state.items():
            out.update(_flat(value, f"{prefix}/{key}"))
        return out
    if isinstance(state, (list, tuple)):
        return _flat(dict(enumerate(state)), prefix)
    return {prefix: state}


def _same_state(a: object, b: object) -> bool:
    flat_a, flat_b = _flat(a), _flat(b)
    if flat_a.keys() != flat_b.keys():
        return False
    for key, left in flat_a.items():
        right = flat_b[key]
        if isinstance(left, torch.Tensor):
            if not (isinstance(right, torch.Tensor) and torch.equal(left, right)):
                return False
        elif left != right:
            return False
    return True


def _draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), random.random(), float(np.random.rand())


# --- one process: contents, numbering, pruning ------------------------------------


def test_load_restores_every_object_value_and_rng(tmp_path: Path) -> None:
    saved = _Objects(steps=3)
    grad = GradState(accumulation_steps=4, optimizer_steps=3)
    loader = LoaderState(epoch=1, global_batches=5, global_batch_size=8)
    path = save_checkpoint(
        ONE, tmp_path, **saved.kwargs(), grad=grad, loader=loader, extra={"step": 3}
    )
    expected = _draws()
    fresh = _Objects(steps=0, seed=1)
    loaded = load_checkpoint(ONE, path, **fresh.kwargs())
    assert _draws() == expected
    assert loaded.rng_restored == RESTORED
    assert (loaded.path, loaded.grad, loaded.loader) == (path, grad, loader)
    assert loaded.extra == {"step": 3} and loaded.meta.world_size == 1
    for name in ("model", "opt", "sched", "scaler", "counter"):
        ours, theirs = getattr(saved, name), getattr(fresh, name)
        assert _same_state(ours.state_dict(), theirs.state_dict()), name


def test_save_reads_the_rng_without_advancing_it(tmp_path: Path) -> None:
    net = _Net()
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expected = _draws()
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    save_checkpoint(ONE, tmp_path, models=net)
    assert _draws() == expected


def test_restore_rng_false_and_save_rng_false_leave_generators_alone(
    tmp_path: Path,
) -> None:
    path = save_checkpoint(ONE, tmp_path, models=_Net())
    net = _Net()
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    loaded = load_checkpoint(ONE, path, models=net, restore_rng=False)
    assert loaded.rng_restored == () and torch.equal(torch.rand(1), expected)
    bare = save_checkpoint(ONE, tmp_path, models=_Net(), save_rng=False)
    assert not any(p.name.startswith("rng_") for p in bare.iterdir())
    assert load_checkpoint(ONE, bare, models=_Net()).rng_restored == ()


def test_checkpoints_are_numbered_and_latest_names_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert latest_checkpoint(root) is None and list_checkpoints(root) == []
    paths = [save_checkpoint(ONE, root, extra={"i": i}) for i in range(3)]
    assert [p.name for p in paths] == [f"checkpoint-00000{i}" for i in (1, 2, 3)]
    assert list_checkpoints(root) == paths
    assert latest_checkpoint(root) == paths[-1]
    assert (root / "latest").read_text() == "checkpoint-000003\n"
    assert sorted(p.name for p in root.iterdir()) == [p.name for p in paths] + [
        "latest"
    ]


def test_keep_last_keeps_the_newest_and_numbering_continues(tmp_path: Path) -> None:
    for step in range(5):
        save_checkpoint(ONE, tmp_path, extra={"step": step}, keep_last=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["checkpoint-000004", "checkpoint-000005"]
    assert read_checkpoint_meta(tmp_path / names[0]).extra == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == [*names, "latest"]


def test_a_failed_deletion_of_old_checkpoints_is_reported_after_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(ONE, tmp_path, extra={"n": 1})

    def refuse(path: object) -> None:
        raise OSError(f"cannot remove {path} (simulated)")

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with pytest.raises(
        RuntimeError,
        match=r"checkpoint-000002 is written and current, but deleting older ones failed; rank 0: cannot remove",
    ):
        save_checkpoint(ONE, tmp_path, extra={"n": 2}, keep_last=1)
    monkeypatch.undo()
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and read_checkpoint_meta(latest).extra == {"n": 2}
    assert list_checkpoints(tmp_path) == [latest]  # the old one was renamed away
    save_checkpoint(ONE, tmp_path, keep_last=1)  # and is cleaned up next time
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000003", "latest"]


def test_latest_falls_back_to_the_newest_complete_without_a_pointer(
    tmp_path: Path,
) -> None:
    save_checkpoint(ONE, tmp_path)
    newest = save_checkpoint(ONE, tmp_path)
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == newest


def test_latest_pointer_to_a_missing_checkpoint_is_an_error(tmp_path: Path) -> None:
    save_checkpoint(ONE, tmp_path)
    (tmp_path / "latest").write_text("checkpoint-000009\n")
    with pytest.raises(ValueError, match=r"names 'checkpoint-000009', which is not"):
        latest_checkpoint(tmp_path)


def test_leftover_temporary_dir_is_ignored_then_removed(tmp_path: Path) -> None:
    first = save_checkpoint(ONE, tmp_path, models=_Net())
    # What a save killed mid-way leaves: a temporary dir with a truncated file.
    leftover = tmp_path / ".checkpoint-000002.tmp"
    leftover.mkdir()
    (leftover / "model_0.pt").write_bytes((first / "model_0.pt").read_bytes()[:50])
    assert latest_checkpoint(tmp_path) == first
    assert list_checkpoints(tmp_path) == [first]
    second = save_checkpoint(ONE, tmp_path, models=_Net())
    assert second.name == "checkpoint-000002" and not leftover.exists()
    assert load_checkpoint(ONE, second, models=_Net()).meta.models == 1


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    path = save_checkpoint(ONE, tmp_path, **_Objects(steps=1).kwargs())
    meta = read_checkpoint_meta(path, verify=True)
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert (
        set(meta.files)
        == on_disk
        == {
            "model_0.pt",
            "optimizer_0.pt",
            "scheduler_0.pt",
            "scaler.pt",
            "object_counter.pt",
            "rng_rank_0.pt",
        }
    )
    for name, entry in meta.files.items():
        assert entry.size == (path / name).stat().st_size
        assert entry.sha256 == funcaccel.checkpoint._layout.sha256_of(path / name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_optimizer_and_rng_round_trip(tmp_path: Path) -> None:
    device = torch.device("cuda", 0)
    ctx = DistributedContext(device=device)
    torch.manual_seed(0)
    model = _Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3, device=device)).square().mean().backward()
    opt.step()
    path = save_checkpoint(ctx, tmp_path, models=model, optimizers=opt)
    expected = torch.rand(2, device=device)
    fresh = _Net().to(device)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    loaded = load_checkpoint(ctx, path, models=fresh, optimizers=fresh_opt)
    assert loaded.rng_restored == ("python", "torch", "cuda", "numpy")
    assert torch.equal(torch.rand(2, device=device), expected)
    assert all(p.device == device for p in fresh.parameters())
    state = fresh_opt.state_dict()["state"]
    assert all(s["exp_avg"].device == device for s in state.values())
    assert _same_state(fresh.state_dict(), model.state_dict())
    assert _same_state(fresh_opt.state_dict(), opt.state_dict())


# --- one process: refused input ----------------------------------------------------


def test_save_refuses_an_open_accumulation_window(tmp_path: Path) -> None:
    grad = GradState(accumulation_steps=4, micro_step=1, sync_gradients=False)
    with pytest.raises(ValueError, match=r"open accumulation window \(micro_step=1 of"):
        save_checkpoint(ONE, tmp_path, models=_Net(), grad=grad)
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"models": "net"},
            TypeError,
            r"models must be an nn.Module or a sequence of them; got 'net'",
        ),
        (
            {"optimizers": [1]},
            TypeError,
            r"optimizers must be a torch.optim.Optimizer or",
        ),
        (
            {"schedulers": [object()]},
            TypeError,
            r"schedulers must be an object with state_dict",
        ),
        ({"scaler": 1.0}, TypeError, r"scaler must be a torch.amp.GradScaler"),
        ({"objects": [1]}, TypeError, r"objects must be a mapping"),
        (
            {"objects": {"a/b": _Counter()}},
            ValueError,
            r"objects keys name files .*; got 'a/b'",
        ),
        (
            {"objects": {"c": object()}},
            TypeError,
            r"objects\['c'\] must be an object with state_dict\(\)/load_state_dict\(\)",
        ),
        ({"grad": {"micro_step": 0}}, TypeError, r"grad must be a GradState"),
        ({"loader": 3}, TypeError, r"loader must be a LoaderState or None; got 3"),
        ({"extra": {"t": (1, 2)}}, TypeError, r"extra\['t'\] must be JSON"),
        ({"extra": {"x": float("nan")}}, TypeError, r"extra\['x'\] must be JSON"),
        ({"extra": {1: 2}}, TypeError, r"extra must be JSON"),
        ({"extra": [1]}, TypeError, r"extra must be a dict of JSON values"),
        ({"keep_last": 0}, ValueError, r"keep_last must be an int >= 1 or None; got 0"),
        ({"save_rng": 1}, TypeError, r"save_rng must be a bool; got 1"),
    ],
)
def test_save_rejects_bad_arguments(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match="save_checkpoint: " + match):
        save_checkpoint(ONE, tmp_path, **kwargs)
    assert list_checkpoints(tmp_path) == []


def test_save_and_load_reject_a_context_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"save_checkpoint: ctx must be a Distr"):
        save_checkpoint("ctx", tmp_path)  # type: ignore[arg-type]
    two = rank_ctx(2)
    with pytest.raises(RuntimeError, match=r"load_checkpoint: ctx has num_processes=2"):
        load_checkpoint(two, tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"models": []}, r"holds models=1, but models=0 was passed"),
        ({"models": [_Net(), _Net()]}, r"holds models=1, but models=2"),
        ({"models": _Net(), "scaler": torch.amp.GradScaler("cpu")}, r"scaler=0"),
        ({"models": _Net(), "objects": {"n": _Counter()}}, r"objects=\[\]"),
        ({"models": _Net(hidden=5)}, r"model_0.pt does not fit models\[0\]"),
    ],
)
def test_load_rejects_objects_that_do_not_match(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    path = save_checkpoint(ONE, tmp_path, models=_Net())
    with pytest.raises(ValueError, match="load_checkpoint: .*" + match):
        load_checkpoint(ONE, path, **kwargs)


def test_extra_accepts_numpy_scalars_as_python_numbers(tmp_path: Path) -> None:
    extra = {
        "step": np.int64(3),
        "loss": np.float32(0.5),
        "mean": np.float64(0.25),
        "done": np.bool_(True),
        "nested": [np.int32(-1), {"u8": np.uint8(7)}],
    }
    path = save_checkpoint(ONE, tmp_path, models=nn.Linear(1, 1), extra=extra)
    loaded = load_checkpoint(ONE, path, models=nn.Linear(1, 1)).extra
    assert loaded == {
        "step": 3, "loss": 0.5, "mean": 0.25, "done": True, "nested": [-1, {"u8": 7}]
    }  # fmt: skip
    leaves = [loaded["step"], loaded["loss"], loaded["mean"], loaded["done"]]
    assert [type(v) for v in leaves] == [int, float, float, bool]
    assert type(loaded["nested"][1]["u8"]) is int


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ((1, 2), r"\(tuple\)\. Convert the tuple to a list\.$"),
        (np.float64("nan"), r"\. Store a finite number"),
        (
            np.arange(3),
            r"\(ndarray\)\. Convert it with \.item\(\) \(one value\) or \.tolist\(\)\.$",
        ),
        ({1, 2}, r"\. Convert the set to a sorted list\.$"),
    ],
)
def test_extra_refusal_gives_a_hint_that_fits(
    tmp_path: Path, value: object, hint: str
) -> None:
    with pytest.raises(
        TypeError, match=r"save_checkpoint: extra\['v'\] must be JSON.*" + hint
    ):
        save_checkpoint(ONE, tmp_path, models=nn.Linear(1, 1), extra={"v": value})


class _Wide(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(layers))


def test_load_names_every_mismatched_key_with_both_shapes(tmp_path: Path) -> None:
    path = save_checkpoint(ONE, tmp_path, models=nn.Linear(2, 1))
    with pytest.raises(ValueError) as caught:
        load_checkpoint(ONE, path, models=nn.Linear(2, 3))
    message = str(caught.value)
    assert "shape mismatch: weight (checkpoint (1, 2), model (3, 2)), " in message
    assert "bias (checkpoint (1,), model (3,))" in message
    assert "Error(s) in loading" not in message
    # Keys on one side only are named too, a few of each and then a count.
    path = save_checkpoint(ONE, tmp_path / "wide", models=_Wide(8))
    with pytest.raises(
        ValueError,
        match=r"\(not in the model: layers\.2\.weight, layers\.2\.bias, "
        r"layers\.3\.weight, layers\.3\.bias and 8 more\); pass the same models",
    ):
        load_checkpoint(ONE, path, models=_Wide(2))


def _truncate(path: Path) -> None:
    data = (path / "model_0.pt").read_bytes()
    (path / "model_0.pt").write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray((path / "model_0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "model_0.pt").write_bytes(bytes(data))


def _edit_manifest(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        manifest = json.loads((path / "manifest.json").read_text())
        change(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))

    return damage


def _truncate_and_fix_manifest(path: Path) -> None:
    """A manifest that agrees with a truncated file: only torch.load can notice."""
    _truncate(path)
    size = (path / "model_0.pt").stat().st_size
    _edit_manifest(
        lambda m: m["files"].update({"model_0.pt": {"size": size, "sha256": None}})
    )(path)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: (p / "manifest.json").unlink(), r"manifest.json is missing, so"),
        (lambda p: (p / "manifest.json").write_text("{"), r"is not a valid manifest"),
        (
            _edit_manifest(lambda m: m.update(schema_version=2)),
            r"schema_version is 2, but this funcaccel reads version 1",
        ),
        (_edit_manifest(lambda m: m.pop("format")), r"not a funcaccel checkpoint"),
        (_edit_manifest(lambda m: m.pop("extra")), r"missing keys \['extra'\]"),
        (
            _edit_manifest(lambda m: m.update(models="1")),
            r"models must be an int; got '1' \(str\)",
        ),
        (_truncate, r"model_0.pt has \d+ bytes but the manifest records \d+"),
        (_flip_byte, r"model_0.pt does not match the SHA-256"),
        (lambda p: (p / "rng_rank_0.pt").unlink(), r"rng_rank_0.pt is missing"),
        (
            _truncate_and_fix_manifest,
            r"model_0.pt cannot be read .*truncated, damaged or crafted",
        ),
    ],
)
def test_damaged_checkpoints_get_errors_naming_the_file(
    tmp_path: Path, damage: Callable[[Path], object], match: str
) -> None:
    path = save_checkpoint(ONE, tmp_path, models=_Net())
    damage(path)
    with pytest.raises(ValueError, match=r"load_checkpoint: .*" + match):
        load_checkpoint(ONE, path, models=_Net())


# --- a save killed with SIGKILL --------------------------------------------------


def _save_then_die(ctx: DistributedContext, root: Path, point: str) -> None:
    del ctx  # one process: ONE (its group of one is not used)
    save_checkpoint(ONE, root, models=_Net(), extra={"which": "first"})
    if point == "file":
        original = funcaccel.checkpoint._layout.write_torch_file

        def dying_write(obj: object, path: Path) -> tuple[int, str]:
            original(obj, path)
            path.write_bytes(path.read_bytes()[:64])  # the kill cut the file short
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        funcaccel.checkpoint._layout.write_torch_file = dying_write
    else:
        name = "rename" if point == "rename" else "replace"

        def die(*args: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        setattr(os, name, die)
    # keep_last=1 would delete checkpoint 1, but only once checkpoint 2 is current.
    save_checkpoint(ONE, root, models=_Net(), extra={"which": "second"}, keep_last=1)


@pytest.mark.distributed
@pytest.mark.parametrize("point", ["file", "rename", "replace"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(
    tmp_path: Path, point: str
) -> None:
    root = tmp_path / "run"
    with pytest.raises(LaunchError, match="rank 0 of 1 was killed by signal 9"):
        run_ranks(_save_then_die, 1, root, point, start_method="forkserver")
    latest = latest_checkpoint(root)
    assert latest is not None and latest.name == "checkpoint-000001"
    loaded = load_checkpoint(ONE, latest, models=_Net())
    assert loaded.extra == {"which": "first"}
    # Killed before the rename: only a temporary dir is left; after it, a complete
    # checkpoint 2 exists but "latest" was never moved to it.
    completed = [p.name for p in list_checkpoints(root)]
    if point == "replace":
        assert completed == ["checkpoint-000001", "checkpoint-000002"]
    else:
        assert completed == ["checkpoint-000001"]
        assert (root / ".checkpoint-000002.tmp").is_dir()
    after = save_checkpoint(ONE, root, models=_Net())
    assert latest_checkpoint(root) == after
    assert not any(p.name.endswith(".tmp") for p in root.iterdir())


# --- records and RNG ---------------------------------------------------------------


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=12,
)


@st.composite
def _grad_states(draw: st.DrawFn) -> GradState:
    """Any state a run can reach (``GradState``'s invariants hold by construction)."""
    k = draw(st.integers(1, 6))
    micro = draw(st.integers(0, k - 1))
    with_dataloader = draw(st.booleans())
    return GradState(
        accumulation_steps=k,
        micro_step=micro,
        sync_gradients=micro == 0,
        end_of_dataloader=draw(st.booleans()) and (micro == 0 or not with_dataloader),
        step_was_skipped=micro == 0 and draw(st.booleans()),
        optimizer_steps=draw(st.integers(0, 10**6)),
        sync_with_dataloader=with_dataloader,
        sync_each_batch=draw(st.booleans()),
    )


_file_entries = st.builds(
    FileEntry,
    size=st.integers(0, 2**40),
    sha256=st.none() | st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
)
# Plain relative paths (what a manifest may list): no "..", ".", empty part or "/" lead.
_member_names = st.lists(
    st.text(
        string.ascii_letters + string.digits + "._-", min_size=1, max_size=6
    ).filter(lambda part: part not in (".", "..")),
    min_size=1,
    max_size=3,
).map("/".join)
_names = st.lists(st.text(string.ascii_letters, min_size=1), max_size=3).map(tuple)
# A per-rank part, or none (then no per-rank object names).
_rank_parts = st.just((False, ())) | st.tuples(st.just(True), _names)
_metas = st.builds(
    lambda part, **fields: CheckpointMeta(
        rank_part=part[0], rank_objects=part[1], **fields
    ),
    _rank_parts,
    world_size=st.integers(1, 64),
    state_format=st.sampled_from(["torch", "dcp"]),
    models=st.integers(0, 4),
    optimizers=st.integers(0, 4),
    schedulers=st.integers(0, 4),
    scaler=st.booleans(),
    objects=_names,
    rng=st.booleans(),
    grad=st.none() | _grad_states(),
    loader=st.none()
    | st.builds(
        LoaderState,
        epoch=st.integers(0, 100),
        global_batches=st.integers(0, 10**6),
        global_batch_size=st.integers(0, 4096),
    ),
    extra=st.dictionaries(st.text(max_size=5), _json, max_size=4),
    files=st.dictionaries(_member_names, _file_entries, max_size=4),
)


@given(_metas)
def test_checkpoint_meta_round_trips_through_json(meta: CheckpointMeta) -> None:
    text = json.dumps(meta.to_dict(), allow_nan=False)
    assert CheckpointMeta.from_dict(json.loads(text)) == meta
    assert meta.schema_version == SCHEMA_VERSION


@given(st.dictionaries(st.text(max_size=5), _json, max_size=4))
def test_checkpoint_meta_copies_extra(extra: dict[str, Any]) -> None:
    meta = CheckpointMeta(world_size=1, extra=extra)
    assert meta.extra == extra and meta.extra is not extra
    extra["added later"] = 1
    assert "added later" not in meta.extra


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"size": -1}, r"FileEntry: size must be an int >= 0; got -1"),
        ({"size": 1, "sha256": "ABC"}, r"64 lowercase hex digits or None; got 'ABC'"),
    ],
)
def test_file_entry_rejects_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FileEntry(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, r"world_size \(0\) must be >= 1"),
        ({"models": True}, TypeError, r"models must be an int; got True \(bool\)"),
        (
            {"state_format": "zip"},
            ValueError,
            r"state_format must be one of 'torch', 'dcp', 'deepspeed'; got 'zip'",
        ),
        ({"objects": ["a"]}, TypeError, r"objects must be a tuple of str"),
        (
            {"files": {"a": 3}},
            TypeError,
            r"files must be a mapping of str to FileEntry; got \{'a': 3\} \(dict\)",
        ),
        ({"scaler": 1}, TypeError, r"scaler must be a bool; got 1"),
    ],
)
def test_checkpoint_meta_rejects_bad_fields(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match="CheckpointMeta: " + match):
        CheckpointMeta(**{"world_size": 1, **kwargs})


def test_rng_state_survives_a_weights_only_round_trip(tmp_path: Path) -> None:
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    expected = _draws()
    _draws()
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert restore_rng_state(state, caller="t") == RESTORED
    assert _draws() == expected


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"dice": 1}, r"the RNG state has unknown generators \['dice'\]"),
        ({"torch": torch.zeros(3)}, r"the saved 'torch' RNG state is malformed"),
        ({"python": [1, 2]}, r"the saved 'python' RNG state is malformed"),
        ({"numpy": {"key": 3}}, r"the saved 'numpy' RNG state is malformed"),
    ],
)
def test_malformed_rng_state_is_rejected(state: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match="t: " + match):
        restore_rng_state(state, caller="t")


# --- DDP on two ranks ---------------------------------------------------------------


class _FailsOnRankZero(_Counter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def state_dict(self) -> dict[str, int]:
        if self.rank == 0:
            raise RuntimeError("disk full (simulated)")
        return super().state_dict()


def _ddp_worker(
    ctx: DistributedContext, root: Path, guard: float | None
) -> dict[str, Any]:
    ctx = dataclasses.replace(ctx, collective_timeout=guard)
    torch.manual_seed(0)
    model = wrap_model(ctx, _Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(10 + ctx.process_index)  # ranks see different data and RNG
    model(torch.randn(4, 3)).square().mean().backward()
    opt.step()
    random.seed(ctx.process_index)
    np.random.seed(ctx.process_index)
    path = save_checkpoint(ctx, root, models=model, optimizers=opt, extra={"n": 2})
    expected = _draws()
    try:
        bad = {"bad": _FailsOnRankZero(ctx.process_index)}
        save_checkpoint(ctx, root, models=model, optimizers=opt, objects=bad)
        failure = ""
    except RuntimeError as error:
        failure = str(error)
    torch.manual_seed(99)
    fresh = wrap_model(ctx, _Net())
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    latest = latest_checkpoint(root)
    loaded = load_checkpoint(ctx, path, models=fresh, optimizers=fresh_opt)
    return {
        "path": path,
        "latest": latest,
        "failure": failure,
        "expected": expected,
        "restored": _draws(),
        "rng_restored": loaded.rng_restored,
        "params": {
            k: v.detach().clone() for k, v in unwrap_model(model).state_dict().items()
        },
        "loaded": {
            k: v.detach().clone() for k, v in unwrap_model(fresh).state_dict().items()
        },
        "momentum": [s["momentum_buffer"] for s in opt.state_dict()["state"].values()],
        "loaded_momentum": [
            s["momentum_buffer"] for s in fresh_opt.state_dict()["state"].values()
        ],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("guard", [None, 60.0], ids=["unguarded", "guarded"])
def test_ddp_checkpoint_writes_the_model_once_and_each_rank_its_rng(
    tmp_path: Path, guard: float | None
) -> None:
    root = tmp_path / "run"
    results = run_ranks(_ddp_worker, 2, root, guard, start_method="forkserver")
    path = results[0]["path"]
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "model_0.pt",
        "optimizer_0.pt",
        "rng_rank_0.pt",
        "rng_rank_1.pt",
    ]
    for rank, result in enumerate(results):
        assert result["path"] == path and result["latest"] == path
        # The failed save raised on every rank and left "latest" where it was.
        assert "rank 0: writing into" in result["failure"]
        assert "disk full (simulated)" in result["failure"]
        assert result["restored"] == result["expected"], rank
        assert result["rng_restored"] == RESTORED
        assert _same_state(result["loaded"], result["params"])
        assert _same_state(result["loaded_momentum"], result["momentum"])
    assert results[0]["expected"] != results[1]["expected"]
    assert list_checkpoints(root) == [path]
    # 2 -> 1: one process loads the DDP checkpoint and rank 0's RNG states.
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loaded = load_checkpoint(ONE, path, models=model, optimizers=opt)
    assert loaded.meta.world_size == 2 and loaded.extra == {"n": 2}
    assert _draws() == results[0]["expected"]
    assert _same_state(model.state_dict(), results[0]["params"])


# --- FSDP2 through DCP: 2 -> 2, 2 -> 3, 2 -> 1 ----------------------------------


def _full(value: object) -> object:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _fsdp_state(
    model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[Tensors, dict[str, dict[str, object]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    optim = {
        names[id(p)]: {k: _full(v) for k, v in opt.state[p].items()}
        for group in opt.param_groups
        for p in group["params"]
    }
    return {k: v for k, v in params.items() if isinstance(v, torch.Tensor)}, optim


def _fsdp_model(
    ctx: DistributedContext, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = _Net(hidden=7)
    model = wrap_model(ctx, net, fsdp=FSDPOptions()) if ctx.num_processes > 1 else net
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _fsdp_save(
    ctx: DistributedContext, root: Path, torch_format: Path
) -> dict[str, Any]:
    model, opt = _fsdp_model(ctx, 0)
    torch.manual_seed(ctx.process_index)
    for _ in range(2):
        model(torch.randn(4, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    grad = GradState(optimizer_steps=2)
    path = save_checkpoint(ctx, root, models=model, optimizers=opt, grad=grad)
    try:
        load_checkpoint(ctx, torch_format, models=model)
        refused = ""
    except ValueError as error:
        refused = str(error)
    params, optim = _fsdp_state(model, opt)
    return {"path": path, "params": params, "optim": optim, "refused": refused}


def _fsdp_load(ctx: DistributedContext, path: Path) -> dict[str, Any]:
    model, opt = _fsdp_model(ctx, 1)
    loaded = load_checkpoint(ctx, path, models=model, optimizers=opt)
    params, optim = _fsdp_state(model, opt)
    return {"params": params, "optim": optim, "grad": loaded.grad}


@pytest.mark.distributed
def test_fsdp_checkpoint_is_sharded_and_loads_on_2_3_and_1_processes(
    tmp_path: Path,
) -> None:
    whole = save_checkpoint(ONE, tmp_path / "whole", models=_Net(hidden=7))
    saved = run_ranks(
        _fsdp_save, 2, tmp_path / "run", whole, start_method="forkserver"
    )[0]
    path = saved["path"]
    assert (
        "holds whole (unsharded) state dicts, but models[0] is sharded"
        in saved["refused"]
    )
    meta = read_checkpoint_meta(path)
    assert meta.state_format == "dcp" and meta.grad == GradState(optimizer_steps=2)
    assert {n for n in meta.files if n.startswith("dcp/")} == {
        "dcp/.metadata",
        "dcp/__0_0.distcp",
        "dcp/__1_0.distcp",
    }
    assert not (path / "model_0.pt").exists()
    for world in (2, 3):
        for rank, result in enumerate(
            run_ranks(_fsdp_load, world, path, start_method="forkserver")
        ):
            assert _same_state(result["params"], saved["params"]), (world, rank)
            assert _same_state(result["optim"], saved["optim"]), (world, rank)
    model, opt = _fsdp_model(ONE, 1)
    load_checkpoint(ONE, path, models=model, optimizers=opt)
    params, optim = _fsdp_state(model, opt)
    assert _same_state(params, saved["params"]) and _same_state(optim, saved["optim"])
