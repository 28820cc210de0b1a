"""The per-rank part of a checkpoint: ``rank_objects=``, ``rank_extra=``, ``rank_map=``.

A nanoGPT-style loop (no loader: each rank samples its own batches from its own
generator and prefetches the next batch) is stopped, saved and resumed on 2 ranks,
with DDP and FSDP2, synchronous and asynchronous saves, and must end bit for bit
(float64) where the uninterrupted loop ends. The same checkpoint is refused on 1 and
3 ranks unless ``rank_map`` says which part each rank takes. Damaged parts are in
``test_checkpoint_untrusted.py``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import PendingCheckpoint
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import read_checkpoint_meta
from funcaccel.checkpoint import save_checkpoint
from funcaccel.checkpoint import save_checkpoint_async
from funcaccel.context import DistributedContext
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks

ONE = DistributedContext()
WINDOW = 2
SAVE_AT = 2  # optimizer steps before the save
TOTAL = 4  # optimizer steps of a whole run
OTHER_WORLD = (
    "load_checkpoint: the checkpoint holds a per-rank part (rank_objects, "
    "rank_extra) from each rank of world size 2, but this load runs on world size "
)
Batch = tuple[torch.Tensor, torch.Tensor]


class _Stream:
    """A rank's own random stream, ``Stateful`` through its generator's state."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.gen.set_state(state["state"])


def _sample(stream: _Stream) -> Batch:
    x = torch.randn(3, 3, generator=stream.gen, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def _model(ctx: DistributedContext, fsdp: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    return wrap_model(ctx, net, fsdp=FSDPOptions() if fsdp else None)


def _params(model: nn.Module) -> list[torch.Tensor]:
    values = [p.detach() for p in unwrap_model(model).parameters()]
    return [v.full_tensor() if isinstance(v, DTensor) else v.clone() for v in values]


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    out: torch.Tensor = model(x)
    return (out - y).square().mean()


def _train(
    ctx: DistributedContext,
    root: Path,
    *,
    fsdp: bool,
    save: str = "",
    resume: Path | None = None,
) -> tuple[list[torch.Tensor], Path | None]:
    """Train to ``TOTAL`` steps; save after ``SAVE_AT`` ("sync"/"async"), or resume."""
    model = _model(ctx, fsdp, seed=0 if resume is None else 5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    stream = _Stream(100 + ctx.process_index)
    grad = GradState(accumulation_steps=WINDOW)
    if resume is not None:
        stream = _Stream(999)  # a resumed rank must get its own stream back
        loaded = load_checkpoint(
            ctx, resume, models=model, optimizers=opt, rank_objects={"data": stream}
        )
        assert loaded.grad is not None and loaded.rank_extra is not None
        assert loaded.rank_part == ctx.process_index
        grad, batch = loaded.grad, loaded.rank_extra["next"]
    else:
        batch = _sample(stream)  # prefetched before the loop, as nanoGPT does
    path: Path | None = None
    pending: PendingCheckpoint | None = None
    while grad.optimizer_steps < TOTAL:
        loss_fn = functools.partial(_loss, model, batch)
        batch = _sample(stream)  # the next batch, fetched while this one trains
        _, grad = accumulate_step(ctx, grad, model, opt, loss_fn)
        if save and grad.sync_gradients and grad.optimizer_steps == SAVE_AT:
            kwargs: dict[str, Any] = {
                "models": model,
                "optimizers": opt,
                "grad": grad,
                "rank_objects": {"data": stream},
                "rank_extra": {"next": batch, "rank": ctx.process_index},
            }
            if save == "sync":
                path = save_checkpoint(ctx, root, **kwargs)
            else:
                pending = save_checkpoint_async(ctx, root, **kwargs)
    if pending is not None:
        path = pending.wait()
    return _params(model), path


def _two_ranks(ctx: DistributedContext, root: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for fsdp in (False, True):
        kind = "fsdp" if fsdp else "ddp"
        out[kind], _ = _train(ctx, root / "unused", fsdp=fsdp)
        for save in ("sync", "async"):
            name = f"{kind}-{save}"
            params, path = _train(ctx, root / name, fsdp=fsdp, save=save)
            assert path is not None
            out[f"{name} saving"], out[f"{name} path"] = params, path
            out[f"{name} resumed"], _ = _train(
                ctx, root / "unused", fsdp=fsdp, resume=path
            )
    return out


def _load_parts(ctx: DistributedContext, path: Path, rank_map: Any) -> dict[str, Any]:
    """Load ``path``'s parts as ``rank_map`` says; the outcome, or the error."""
    model = _model(ctx, False, seed=1)
    stream = _Stream(7)
    untouched = stream.gen.get_state()
    try:
        loaded = load_checkpoint(
            ctx,
            path,
            models=model,
            optimizers=torch.optim.AdamW(model.parameters()),
            rank_objects={"data": stream},
            rank_map=rank_map,
        )
    except ValueError as error:
        return {"error": str(error)}
    state = stream.gen.get_state()
    return {
        "part": loaded.rank_part,
        "extra": loaded.rank_extra,
        "untouched": torch.equal(state, untouched),
        "state": state,
    }


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.distributed
def test_per_rank_state_resumes_bit_for_bit_and_only_on_its_world_size(
    tmp_path: Path,
) -> None:
    runs = run_ranks(_two_ranks, 2, tmp_path, start_method="forkserver")
    for rank, run in enumerate(runs):
        for kind in ("ddp", "fsdp"):
            for save in ("sync", "async"):
                name = f"{kind}-{save}"
                assert _same(run[f"{name} saving"], run[kind]), (rank, name)
                assert _same(run[f"{name} resumed"], run[kind]), (rank, name)
    path = runs[0]["ddp-sync path"]
    meta = read_checkpoint_meta(path)
    assert meta.rank_part and meta.rank_objects == ("data",)
    for name in ("rank_part_0.pt", "rank_part_1.pt"):
        assert meta.files[name].sha256 is not None
    assert read_checkpoint_meta(runs[0]["fsdp-async path"]).state_format == "dcp"
    saved = [torch.load(path / f"rank_part_{r}.pt", weights_only=True) for r in (0, 1)]

    # One process: refused by default, rank 1's part on request, none with "drop".
    refused = _load_parts(ONE, path, None)["error"]
    assert refused.startswith(OTHER_WORLD + "1,") and refused.endswith("rank_map=[0].")
    took = _load_parts(ONE, path, [1])
    assert took["part"] == 1 and took["extra"]["rank"] == 1
    assert torch.equal(took["state"], saved[1]["objects"]["data"]["state"])
    dropped = _load_parts(ONE, path, "drop")
    assert (dropped["part"], dropped["extra"], dropped["untouched"]) == (
        None,
        None,
        True,
    )

    # Three processes: refused on every rank; a map gives ranks 0 and 1 their parts.
    refusals = run_ranks(_load_parts, 3, path, None, start_method="forkserver")
    assert all(r["error"].startswith(OTHER_WORLD + "3,") for r in refusals)
    assert refusals[0]["error"].endswith("rank_map=[0, 1, None].")
    mapped = run_ranks(_load_parts, 3, path, [0, 1, None], start_method="forkserver")
    for rank in (0, 1):
        assert mapped[rank]["part"] == rank and mapped[rank]["extra"]["rank"] == rank
        assert torch.equal(
            mapped[rank]["state"], saved[rank]["objects"]["data"]["state"]
        )
        assert torch.equal(
            mapped[rank]["extra"]["next"][0], saved[rank]["extra"]["next"][0]
        )
    assert (mapped[2]["part"], mapped[2]["extra"], mapped[2]["untouched"]) == (
        None,
        None,
        True,
    )


# --- one process ----------------------------------------------------------------


def test_rank_part_round_trips_objects_and_extra(tmp_path: Path) -> None:
    stream = _Stream(3)
    batch = _sample(stream)
    extra = {"next": batch, "seen": [1, 2], "note": None}
    path = save_checkpoint(
        ONE, tmp_path, rank_objects={"data": stream}, rank_extra=extra
    )
    expected = _sample(stream)
    meta = read_checkpoint_meta(path, verify=True)
    assert meta.rank_part and meta.rank_objects == ("data",)
    assert set(meta.files) == {"rank_part_0.pt", "rng_rank_0.pt"}
    fresh = _Stream(4)
    loaded = load_checkpoint(ONE, path, rank_objects={"data": fresh})
    assert loaded.rank_part == 0 and loaded.rank_extra is not None
    assert torch.equal(loaded.rank_extra["next"][0], batch[0])
    assert isinstance(loaded.rank_extra["next"], tuple)
    assert loaded.rank_extra["seen"] == [1, 2] and loaded.rank_extra["note"] is None
    assert all(torch.equal(a, b) for a, b in zip(_sample(fresh), expected, strict=True))


def test_rank_extra_alone_is_a_part_and_no_part_keeps_the_old_manifest(
    tmp_path: Path,
) -> None:
    alone = save_checkpoint(ONE, tmp_path / "a", rank_extra={})
    assert read_checkpoint_meta(alone).rank_part
    assert load_checkpoint(ONE, alone).rank_extra == {}
    plain = save_checkpoint(ONE, tmp_path / "b", rank_objects={})
    manifest = json.loads((plain / "manifest.json").read_text())
    assert "rank_part" not in manifest and "rank_objects" not in manifest
    loaded = load_checkpoint(ONE, plain)
    assert (loaded.rank_part, loaded.rank_extra) == (None, None)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"rank_extra": {"x": {1, 2}}},
            TypeError,
            r"^save_checkpoint: rank_extra\['x'\] must be tensors and plain values .*got \{1, 2\} \(set\)\. Pass a plain tensor",
        ),
        (
            {"rank_extra": [1]},
            TypeError,
            r"^save_checkpoint: rank_extra must be a dict with str keys or None; got \[1\] \(list\)",
        ),
        (
            {"rank_extra": {"p": nn.Parameter(torch.ones(1))}},
            TypeError,
            r"rank_extra\['p'\] must be tensors and plain values .*\(Parameter\)",
        ),
        (
            {"rank_objects": {"g": 3}},
            TypeError,
            r"^save_checkpoint: rank_objects\['g'\] must be an object with state_dict",
        ),
        (
            {"rank_objects": {"a/b": _Stream(0)}},
            ValueError,
            r"^save_checkpoint: rank_objects keys name files .*got 'a/b'",
        ),
    ],
)
def test_save_rejects_bad_per_rank_arguments(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        save_checkpoint(ONE, tmp_path, **kwargs)
    assert not (tmp_path / "latest").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"rank_map": "keep"},
            ValueError,
            r"^load_checkpoint: rank_map must be None, 'drop', or a sequence .*got 'keep'",
        ),
        (
            {"rank_map": 0},
            TypeError,
            r"^load_checkpoint: rank_map must be None, 'drop'",
        ),
        (
            {"rank_map": [0, 1], "rank_objects": {"data": _Stream(0)}},
            ValueError,
            r"^load_checkpoint: rank_map must be a sequence of 1 entries, one per loading rank; got \[0, 1\]",
        ),
        (
            {"rank_map": [1], "rank_objects": {"data": _Stream(0)}},
            ValueError,
            r"^load_checkpoint: rank_map must be saved ranks in \[0, 1\) or None; got \[1\]\. The checkpoint was saved on world size 1",
        ),
        (
            {},
            ValueError,
            r"^load_checkpoint: .* holds rank_objects=\['data'\], but rank_objects=\[\] was passed",
        ),
        (
            {"rank_objects": {"other": _Stream(0)}},
            ValueError,
            r"holds rank_objects=\['data'\], but rank_objects=\['other'\] was passed",
        ),
    ],
)
def test_load_rejects_bad_per_rank_arguments(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    path = save_checkpoint(ONE, tmp_path, rank_objects={"data": _Stream(1)})
    with pytest.raises(error, match=match):
        load_checkpoint(ONE, path, **kwargs)


def test_rank_objects_for_a_checkpoint_without_a_part_are_refused(
    tmp_path: Path,
) -> None:
    path = save_checkpoint(ONE, tmp_path)
    with pytest.raises(
        ValueError, match=r"holds rank_objects=\[\], but rank_objects=\['data'\]"
    ):
        load_checkpoint(ONE, path, rank_objects={"data": _Stream(0)})
    assert load_checkpoint(ONE, path, rank_map="drop").rank_part is None
