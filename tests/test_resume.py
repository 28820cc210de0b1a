"""Stopping, checkpointing and resuming training ends exactly where a run that never stopped does.

One training loop (``_train``) is run three ways on fresh processes: uninterrupted
(the reference), uninterrupted while saving a checkpoint after several optimizer
steps ``k``, and resumed from each of those checkpoints. Training uses a shuffled
loader, dropout, gradient accumulation (``k`` includes steps that end a short window
at an epoch end), AdamW and a StepLR schedule. Every sample id a rank sees is logged
as ``(epoch, id)``, so the tests check both the final parameters (``torch.equal``)
and that each sample is seen exactly as often as without the interruption.
Checkpoints are only taken at window boundaries: ``save_checkpoint`` refuses an open
window (tested in ``test_checkpoint.py``), so a loop saves when ``grad.sync_gradients``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from torch.utils.data import Dataset

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import latest_checkpoint
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import save_checkpoint
from funcaccel.context import DistributedContext
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.scheduler import maybe_step_scheduler
from funcaccel.testing import run_ranks
from tests._scripts import REPO
from tests._scripts import script_env

SCRIPT = REPO / "tests" / "scripts" / "elastic_train.py"
SAMPLES = 22
BATCH = 2
WINDOW = 2
EPOCHS = 2
Seen = list[tuple[int, int]]


class _Samples(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is its id, 4 features and a target, all a function of ``i``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(index))
        return index, x, (2 * x[:1] - x[1:2]).tanh()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 1)
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """What one rank of one run returns."""

    params: list[torch.Tensor]
    seen: Seen
    marks: dict[int, int]  # optimizer step -> len(seen) when it was saved
    grad: GradState
    last_lr: list[float]


def _params(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for param in unwrap_model(model).parameters():
        value = param.detach()
        out.append(value.full_tensor() if isinstance(value, DTensor) else value.clone())
    return out


def _train(
    ctx: DistributedContext,
    root: Path,
    *,
    save_at: tuple[int, ...] = (),
    resume: Path | None = None,
    fsdp: bool = False,
) -> _Run:
    torch.set_num_threads(1)  # tiny tensors; avoids oversubscribing shared cores
    model = wrap_model(
        ctx, _net(), fsdp=FSDPOptions() if fsdp and ctx.num_processes > 1 else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    data = DataLoader(_Samples(), batch_size=BATCH, shuffle=True)
    loader = shard_loader(ctx, data, seed=11)
    grad, state = GradState(accumulation_steps=WINDOW), LoaderState()
    # Ranks draw different dropout masks; a resumed rank must get its own back.
    torch.manual_seed(100 + ctx.process_index)
    random.seed(100 + ctx.process_index)
    np.random.seed(100 + ctx.process_index)
    if resume is not None:
        loaded = load_checkpoint(
            ctx, resume, models=model, optimizers=opt, schedulers=sched
        )
        assert loaded.grad is not None and loaded.loader is not None
        grad, state = loaded.grad, loaded.loader
    seen: Seen = []
    marks: dict[int, int] = {}
    while state.epoch < EPOCHS:
        for batch in iter_batches(loader, state):
            ids, x, y = batch.data
            seen += [(batch.epoch, i) for i in ids.tolist()]
            _, grad = accumulate_step(
                ctx,
                grad,
                model,
                opt,
                functools.partial(_loss, model, x, y),
                end_of_dataloader=batch.is_last,
            )
            maybe_step_scheduler(ctx, sched, grad, loader=loader)
            state = batch.state
            step = grad.optimizer_steps
            if grad.sync_gradients and step in save_at and step not in marks:
                save_checkpoint(
                    ctx,
                    root / f"step{step}",
                    models=model,
                    optimizers=opt,
                    schedulers=sched,
                    grad=grad,
                    loader=state,
                )
                marks[step] = len(seen)
    return _Run(
        _params(model), seen, marks, grad, [float(lr) for lr in sched.get_last_lr()]
    )


def _run(world: int, root: Path, **options: Any) -> list[_Run]:
    """Run ``_train`` on ``world`` fresh processes (for one: ``DistributedContext()``)."""
    train = functools.partial(_train, **options)
    return run_ranks(train, world, root, start_method="forkserver")


def _assert_same_params(a: _Run, b: _Run) -> None:
    assert len(a.params) == len(b.params)
    for left, right in zip(a.params, b.params, strict=True):
        assert torch.equal(left, right)


def _epoch(seen: Seen, epoch: int) -> list[int]:
    return [i for e, i in seen if e == epoch]


# --- same world size: bit-for-bit -------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "fsdp", "steps"),
    [
        # One process: 11 batches and 6 windows per epoch (the 6th is 1 batch),
        # so step 6 ends epoch 0 and steps 1, 5 and 8 are mid-epoch.
        (1, False, (1, 5, 6, 8)),
        # Two DDP ranks: 6 batches and 3 windows per rank per epoch.
        (2, False, (1, 3, 4)),
        (2, True, (4,)),
    ],
    ids=["one-process", "ddp", "fsdp"],
)
def test_resumed_training_matches_an_uninterrupted_run_bit_for_bit(
    tmp_path: Path, world: int, fsdp: bool, steps: tuple[int, ...]
) -> None:
    root = tmp_path / "checkpoints"
    reference = _run(world, root / "unused", fsdp=fsdp)
    saving = _run(world, root, fsdp=fsdp, save_at=steps)
    for rank in range(world):
        _assert_same_params(saving[rank], reference[rank])  # saving changes nothing
        assert saving[rank].seen == reference[rank].seen
        assert sorted(saving[rank].marks) == list(steps)
    for step in steps:
        path = latest_checkpoint(root / f"step{step}")
        assert path is not None
        resumed = _run(world, root / "unused", fsdp=fsdp, resume=path)
        for rank in range(world):
            ours, theirs = resumed[rank], reference[rank]
            _assert_same_params(ours, theirs)
            assert (ours.grad, ours.last_lr) == (theirs.grad, theirs.last_lr)
            before = saving[rank].seen[: saving[rank].marks[step]]
            assert before + ours.seen == theirs.seen, (step, rank)


# --- another world size: no sample skipped or repeated ---------------------------


@pytest.mark.distributed
def test_a_checkpoint_from_two_processes_resumes_on_one_and_back(
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints"
    one = _run(1, root / "one", save_at=(5,))[0]
    two = _run(2, root / "two", save_at=(2,))
    order = [_epoch(one.seen, e) for e in range(EPOCHS)]  # the global order
    assert all(sorted(o) == list(range(SAMPLES)) for o in order)

    # 2 -> 1 after 2 steps: 4 global batches of 4 samples were consumed.
    path = latest_checkpoint(root / "two" / "step2")
    assert path is not None
    after = _run(1, root / "unused", resume=path)[0]
    before = [i for run in two for i in _epoch(run.seen[: run.marks[2]], 0)]
    assert Counter(before) == Counter(order[0][:16])
    assert _epoch(after.seen, 0) == order[0][16:]
    assert _epoch(after.seen, 1) == order[1]

    # 1 -> 2 after 5 steps: 10 batches of 2 samples were consumed; two ranks
    # continue with the last global batch (2 samples, looped back to fill it).
    path = latest_checkpoint(root / "one" / "step5")
    assert path is not None
    resumed = _run(2, root / "unused", resume=path)
    assert _epoch(one.seen[: one.marks[5]], 0) == order[0][:20]
    for rank in range(2):
        rest = _epoch(two[rank].seen, 0)[(20 // 4) * BATCH :]
        assert _epoch(resumed[rank].seen, 0) == rest
        assert _epoch(resumed[rank].seen, 1) == _epoch(two[rank].seen, 1)
    tail = [i for run in resumed for i in _epoch(run.seen, 0)]
    assert Counter(tail) == Counter(order[0][20:] + order[0][:2])


# --- torchrun: a worker killed with SIGKILL, the group restarted -------------------


def _start_torchrun(workdir: Path, *extra: str, restarts: int) -> subprocess.Popen[str]:
    """Start the script on 2 processes under torchrun, in its own process group."""
    env = script_env()
    # torch 2.13's standalone rendezvous shares one TCPStore across restarts, so
    # the restarted group can read the killed group's gloo addresses and fail to
    # connect; a store per attempt avoids that.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        str(SCRIPT),
        "--checkpoints",
        str(workdir / "checkpoints"),
        "--out",
        str(workdir / "out"),
        "--save-every",
        "3",
        *extra,
    ]
    workdir.mkdir(parents=True)
    with (workdir / "log").open("w") as log:
        return subprocess.Popen(
            command,
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def _finish_torchrun(
    process: subprocess.Popen[str], workdir: Path
) -> tuple[str, dict[int, Any]]:
    """Wait for a torchrun job; return rank 0's printed digest and each rank's report."""
    try:
        process.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers
        process.wait()
        raise
    output = (workdir / "log").read_text()
    assert process.returncode == 0, output
    digests = re.findall(r"^param_sha256=([0-9a-f]{64})$", output, re.MULTILINE)
    assert len(digests) == 1, output
    reports = {
        int(path.stem.split("_rank")[1]): {
            "attempt": int(path.stem.split("_")[0].removeprefix("attempt")),
            **json.loads(path.read_text()),
        }
        for path in (workdir / "out").glob("attempt*_rank*.json")
    }
    return digests[0], reports


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_restart_after_a_killed_worker_ends_as_if_never_killed(
    tmp_path: Path,
) -> None:
    # 40 samples, batch 2, 2 ranks, windows of 2: 5 optimizer steps per epoch.
    # Checkpoints at steps 3 and 6; rank 1 dies at step 8, mid-epoch 1, so the
    # restarted group resumes from step 6 and redoes steps 7 and 8.
    marker = tmp_path / "kill.marker"
    kill = ("--kill-at-step", "8", "--kill-marker", str(marker))
    # Both jobs run at once; standalone rendezvous gives each its own free port.
    killed_job = _start_torchrun(tmp_path / "killed", *kill, restarts=1)
    clean_job = _start_torchrun(tmp_path / "clean", restarts=0)
    try:
        killed, after = _finish_torchrun(killed_job, tmp_path / "killed")
        clean, reference = _finish_torchrun(clean_job, tmp_path / "clean")
    finally:
        for job in (killed_job, clean_job):
            if job.poll() is None:  # the other job failed: do not leave this one
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    assert marker.exists()
    assert killed == clean
    assert sorted(after) == sorted(reference) == [0, 1]
    for rank in (0, 1):
        assert after[rank]["attempt"] == 1 and reference[rank]["attempt"] == 0
        assert after[rank]["resumed_from"] == "checkpoint-000002"
        assert reference[rank]["resumed_from"] is None
        rest = after[rank]["seen"]
        # The rest of epoch 1 after 2 of its 10 global batches: 8 batches of 2.
        assert len(rest) == 16 and {e for e, _ in rest} == {1}
        assert reference[rank]["seen"][-16:] == rest
        assert after[rank]["param_sha256"] == reference[rank]["param_sha256"] == clean
    kept = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert kept == ["checkpoint-000002", "checkpoint-000003", "latest"]
